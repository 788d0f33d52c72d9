"""Moved to :mod:`agentkv.chat.template` (kept while tests migrate)."""

from agentkv.chat.template import *  # noqa: F403
