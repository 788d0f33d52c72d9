"""Moved to :mod:`agentkv.bench.template_check`; this name stays for older imports."""

from __future__ import annotations

from agentkv.bench.template_check import *  # noqa: F403
from agentkv.bench.template_check import __all__ as __all__
