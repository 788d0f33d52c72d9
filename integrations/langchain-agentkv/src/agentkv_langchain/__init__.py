"""Deprecated alias of :mod:`langchain_agentkv` (the package was renamed with its distribution,
``agentkv-langchain`` -> ``langchain-agentkv``); removed in the next release."""

from __future__ import annotations

import sys
import warnings

warnings.warn(
    "agentkv_langchain is deprecated and will be removed in the next release: "
    "import langchain_agentkv instead (pip install langchain-agentkv)",
    DeprecationWarning,
    stacklevel=2,
)

from langchain_agentkv import *  # noqa: E402, F403
from langchain_agentkv import __all__ as __all__  # noqa: E402
from langchain_agentkv import __version__ as __version__  # noqa: E402
from langchain_agentkv import chat_models, stores  # noqa: E402

sys.modules[f"{__name__}.chat_models"] = chat_models
sys.modules[f"{__name__}.stores"] = stores
