"""Moved to :mod:`agentkv.chat.tokenizer` (kept while tests migrate)."""

from agentkv.chat.tokenizer import *  # noqa: F403
from agentkv.chat.tokenizer import ChatTokenizer as SimTokenizer  # noqa: F401
