"""Is ``import agentkv`` vllm-agentkv's? The check agentkv's framework adapters run first.

agentkv is published as ``vllm-agentkv`` (import name ``agentkv``). PyPI's ``agentkv`` is an
unrelated project whose import package is also ``agentkv``; with it installed, ``import agentkv``
runs that project's code, where agentkv's own checks cannot run. So this module lives beside the
``agentkv`` package, not in it (vllm-agentkv installs both; standard library only), and each
adapter in ``integrations/`` calls :func:`require_vllm_agentkv` before it imports ``agentkv``. It
checks, from the installed metadata, that the distribution ``vllm-agentkv`` is installed and that
the module ``agentkv`` resolves to its files: its RECORD (the file and its hash), its editable
checkout (PEP 610 ``direct_url.json``), or a vllm-agentkv source tree next to the module.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import json
import re
from pathlib import Path
from urllib.parse import unquote, urlparse

DISTRIBUTION = "vllm-agentkv"

__all__ = ["DISTRIBUTION", "require_vllm_agentkv"]


def require_vllm_agentkv(adapter: str) -> None:
    """Raise ImportError, naming the fix, unless ``import agentkv`` will be vllm-agentkv."""
    spec = importlib.util.find_spec("agentkv")
    origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    if origin is not None and _source_tree(origin):
        return  # a checkout of vllm-agentkv on sys.path (PYTHONPATH, python -m pytest)
    try:
        dist: importlib.metadata.Distribution | None = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is None:
        problem = f"the distribution {DISTRIBUTION} is not installed"
    elif origin is None:
        problem = "no module 'agentkv' can be imported"
    else:
        mismatch = _mismatch(dist, origin)
        if mismatch is None:
            return
        problem = f"'import agentkv' finds {origin}, {mismatch}"
    others = importlib.metadata.distributions(name="agentkv")
    found = list(dict.fromkeys(f"{d.metadata['Name']} {d.version}" for d in others))
    if found:
        problem += f", and {', '.join(found)} is installed"
    uninstall = "agentkv vllm-agentkv" if dist is not None else "agentkv"
    raise ImportError(
        f"{adapter} needs {DISTRIBUTION} (import name 'agentkv': the KV-reuse SDK for vLLM), but "
        f"{problem}. PyPI's 'agentkv' is an unrelated project with the same import name. "
        f"Fix: pip uninstall {uninstall} && pip install {DISTRIBUTION}"
    )


def _mismatch(dist: importlib.metadata.Distribution, origin: Path) -> str | None:
    """None when ``origin`` is the ``agentkv/__init__.py`` that ``dist`` installed, else why not."""
    for file in dist.files or ():
        if file.as_posix() != "agentkv/__init__.py":
            continue
        if Path(str(dist.locate_file(file))).resolve() != origin:
            continue
        if file.hash is None or file.hash.mode != "sha256":
            return None
        digest = hashlib.sha256(origin.read_bytes()).digest()
        if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() == file.hash.value:
            return None
        return f"overwritten since {DISTRIBUTION} {dist.version} installed it"
    direct = dist.read_text("direct_url.json")
    if direct:
        info = json.loads(direct)
        url = urlparse(str(info.get("url", "")))
        if info.get("dir_info", {}).get("editable") and url.scheme == "file":
            root = Path(unquote(url.path)).resolve()
            if origin.is_relative_to(root):
                return None
    return f"not the files of {DISTRIBUTION} {dist.version}"


def _source_tree(origin: Path) -> bool:
    pyproject = origin.parent.parent / "pyproject.toml"
    if origin.name != "__init__.py" or not pyproject.is_file():
        return False
    text = pyproject.read_text(encoding="utf-8", errors="replace")
    return re.search(rf'^name\s*=\s*"{re.escape(DISTRIBUTION)}"', text, re.MULTILINE) is not None
