"""Deprecated alias of :mod:`llama_index.llms.agentkv` (the package was renamed with its
distribution, ``agentkv-llamaindex`` -> ``llama-index-llms-agentkv``); removed in the next
release."""

from __future__ import annotations

import sys
import warnings

warnings.warn(
    "agentkv_llamaindex is deprecated and will be removed in the next release: "
    "import llama_index.llms.agentkv instead (pip install llama-index-llms-agentkv)",
    DeprecationWarning,
    stacklevel=2,
)

from llama_index.llms.agentkv import *  # noqa: E402, F403
from llama_index.llms.agentkv import __all__ as __all__  # noqa: E402
from llama_index.llms.agentkv import __version__ as __version__  # noqa: E402
from llama_index.llms.agentkv import base  # noqa: E402

sys.modules[f"{__name__}.llms"] = base
llms = base
