"""``agentkv router`` on a chosen ASGI server, for the server comparison in router_overhead.py.

``python -m benchmarks._serve_router SERVER CONFIG`` with SERVER one of ``uvicorn-h11``
(asyncio loop, h11 parser: uvicorn without its optional accelerators), ``uvicorn`` (uvloop,
httptools) or ``granian`` (Rust HTTP server, one worker, uvloop). The app is the same factory
(``create_app``) on each.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def app() -> Any:
    """The ASGI factory granian imports (the config path in ``AGENTKV_ROUTER_CONFIG``)."""
    from agentkv.router import RouterConfig, create_app

    return create_app(RouterConfig.load(os.environ["AGENTKV_ROUTER_CONFIG"]))


def main(server: str, config: str) -> None:
    from agentkv.router import RouterConfig, create_app

    cfg = RouterConfig.load(config)
    if server == "granian":
        os.environ["AGENTKV_ROUTER_CONFIG"] = config
        argv = [
            *("--interface", "asgi", "--factory", "--workers", "1", "--loop", "uvloop"),
            *("--host", cfg.http.host, "--port", str(cfg.http.port), "--log-level", "warning"),
            "--no-ws",
            "benchmarks._serve_router:app",
        ]
        os.execvp(sys.executable, [sys.executable, "-m", "granian", *argv])
    import uvicorn

    fast = server == "uvicorn"
    uvicorn.run(
        create_app(cfg),
        host=cfg.http.host,
        port=cfg.http.port,
        log_level="warning",
        access_log=False,
        loop="uvloop" if fast else "asyncio",
        http="httptools" if fast else "h11",
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
