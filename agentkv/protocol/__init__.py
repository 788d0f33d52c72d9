"""The wire contract: names and models shared by the SDK, the router and the simulator.

Pure data, no I/O; imports nothing else from ``agentkv``.
"""

from __future__ import annotations

from agentkv.protocol.errors import ErrorInfo as ErrorInfo
from agentkv.protocol.errors import ErrorResponse as ErrorResponse
from agentkv.protocol.errors import error_body as error_body
from agentkv.protocol.errors import error_type_for as error_type_for
from agentkv.protocol.kv_transfer import PULL_FIELDS as PULL_FIELDS
from agentkv.protocol.kv_transfer import KVTransferParams as KVTransferParams
from agentkv.protocol.names import *  # noqa: F403
from agentkv.protocol.names import __all__ as _names_all

__all__ = sorted(
    [
        "PULL_FIELDS",
        "ErrorInfo",
        "ErrorResponse",
        "KVTransferParams",
        "error_body",
        "error_type_for",
        *_names_all,
    ]
)
