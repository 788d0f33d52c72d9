"""agentkv: fast, verified multi-turn KV reuse for AI agents on self-hosted vLLM."""

from __future__ import annotations

from agentkv.__version__ import __version__

__all__ = ["__version__"]
