"""Moved to :mod:`agentkv.protocol.promtext`; this name stays for older imports."""

from __future__ import annotations

from agentkv.protocol.promtext import parse_metrics

__all__ = ["parse_metrics"]
