"""TOML reading on every supported Python: the standard ``tomllib`` from 3.11, ``tomli`` (the
``tomli`` dependency, ``python_version < '3.11'``) before."""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["tomllib"]
