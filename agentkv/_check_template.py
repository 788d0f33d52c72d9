"""Moved to :mod:`agentkv.bench.template_check`; this name stays for older imports."""

from __future__ import annotations

from agentkv.bench.template_check import (
    SYSTEM,
    TOOLS,
    CheckError,
    TemplateReport,
    TurnCheck,
    check_template,
    generated_part,
    scripted_turns,
)

__all__ = [
    "SYSTEM",
    "TOOLS",
    "CheckError",
    "TemplateReport",
    "TurnCheck",
    "check_template",
    "generated_part",
    "scripted_turns",
]
