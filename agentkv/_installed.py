"""Which distribution ``import agentkv`` belongs to.

This project is ``vllm-agentkv`` on PyPI (import name and CLI ``agentkv``). PyPI's ``agentkv`` is
an unrelated project ("The SQLite of agent memory") whose import package is also ``agentkv``:
installed next to this one, whichever was installed last owns ``agentkv/__init__.py``, and
uninstalling either deletes files the other needs. When this ``__init__`` runs it can still see
such a neighbour in the installed metadata and say so; the adapters in ``integrations/`` check the
other way round (that ``agentkv`` resolves to ``vllm-agentkv``) before they import it.
"""

from __future__ import annotations

import importlib.metadata
import warnings

__all__ = ["DISTRIBUTION", "FIX", "ForeignDistributionWarning", "foreign_distributions", "warn"]

DISTRIBUTION = "vllm-agentkv"
"""This project's name on PyPI."""

FIX = "pip uninstall agentkv vllm-agentkv && pip install vllm-agentkv"
"""Removes both (they share files), then installs this project alone."""

_OUR_SUMMARY = "Fast, verified multi-turn KV reuse"
"""How this project's own summary starts (it was named ``agentkv`` before 0.1.0 shipped)."""


class ForeignDistributionWarning(UserWarning):
    """A distribution named ``agentkv`` is installed next to ``vllm-agentkv``."""


def foreign_distributions() -> list[str]:
    """One line per distribution named ``agentkv`` on ``sys.path``, saying what it is."""
    lines = []
    for dist in importlib.metadata.distributions(name="agentkv"):
        version = dist.metadata["Version"] or "?"
        summary = dist.metadata["Summary"] or ""
        if summary.startswith(_OUR_SUMMARY):
            lines.append(f"agentkv {version}, this project under its former name")
        else:
            lines.append(f"agentkv {version}, an unrelated project ({summary or 'no summary'})")
    return list(dict.fromkeys(lines))  # a folder can be on sys.path twice


def warn() -> None:
    """Warn once per import when a distribution named ``agentkv`` is installed."""
    found = foreign_distributions()
    if found:
        warnings.warn(
            f"the distribution {'; '.join(found)}, is installed next to {DISTRIBUTION} (this "
            "agentkv: the KV-reuse SDK, router and simulator for vLLM) and also provides the "
            "import package 'agentkv': only one of them can be imported, and uninstalling one "
            f"removes files of the other. Fix: {FIX}",
            ForeignDistributionWarning,
            stacklevel=2,
        )
