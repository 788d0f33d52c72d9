"""Profiles: built-ins load, user files are accepted, and bad profiles are refused by name."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from agentkv.router.config import RouterConfig
from agentkv.serve import Profile, ProfileError, builtin_profiles, load_profile, profile_tables
from agentkv.serve.profile_router import RouterSettings
from agentkv.serve.profiles import unresolved_placeholders

BUILTINS = {
    "local",
    "cpu-tiny",
    "qwen3-32b-1p1d",
    "qwen3-32b-1p1d-bench",
    "qwen3-32b-1p1d-offload",
    "glm-5-fp8-1p1d",
    "llama-3.1-8b-2p4d",
    "gpt-oss-120b-1p1d",
}

MINIMAL = """
name = "mine"
engine = "vllm"
model = "org/model"
served_model_name = "m"
"""


def write(tmp_path: Path, text: str, name: str = "p.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def refused(tmp_path: Path, text: str) -> str:
    with pytest.raises(ProfileError) as info:
        load_profile(write(tmp_path, text))
    return str(info.value)


def test_builtins_ship_as_package_data_and_load():
    found = builtin_profiles()
    assert set(found) == BUILTINS
    for name, path in found.items():
        assert path.suffix == ".toml" and path.is_file()
        assert path.parent.name == "profiles" and path.parent.parent.name == "serve"
        profile = load_profile(name, environ={})
        assert profile.name == name
        assert profile.description


def test_local_profile_is_simulated_loopback_on_8000():
    p = load_profile("local")
    assert p.engine == "sim"
    assert (p.prefill.count, p.decode.count) == (1, 1)
    assert p.router.http.port == 8000
    assert p.sim_settings.preset == "laptop"
    assert p.sim_settings.time_scale == 1
    assert p.gpus_needed == 0


def test_local_toml_documents_every_key():
    text = builtin_profiles()["local"].read_text()
    documented = set(re.findall(r"^#?\s*([a-z0-9_]+)\s*=", text, flags=re.M))
    documented |= {
        t.split(".")[-1] for t in re.findall(r"^#?\s*\[([a-z0-9_.]+)\]", text, flags=re.M)
    }
    for model in (
        Profile,
        profile_tables.NixlSettings,
        profile_tables.PrefillGroup,
        profile_tables.DecodeGroup,
        profile_tables.OffloadSettings,
        RouterSettings,
        profile_tables.SimSettings,
        profile_tables.Hardware,
        profile_tables.K8sSettings,
    ):
        missing = set(model.model_fields) - documented
        assert not missing, (model.__name__, missing)


def test_cpu_tiny_model_comes_from_the_environment():
    unset = load_profile("cpu-tiny", environ={})
    assert unset.model == "${AGENTKV_CPU_TINY_MODEL}"
    assert sorted(unresolved_placeholders(unset)) == ["AGENTKV_CPU_TINY_MODEL", "AGENTKV_VLLM_BIN"]
    env = {"AGENTKV_CPU_TINY_MODEL": "/m/tiny", "AGENTKV_VLLM_BIN": "/venv/bin/vllm"}
    p = load_profile("cpu-tiny", environ=env)
    assert p.model == "/m/tiny" and p.vllm_command == ["/venv/bin/vllm", "serve"]
    assert unresolved_placeholders(p) == []
    assert (p.engine, p.device, p.compat, p.served_model_name) == ("vllm", "cpu", "0.33", "tiny")
    assert (p.block_size, p.dtype, p.max_model_len) == (32, "float32", 4096)
    assert p.decoder_kv_blocks_ttl_s == 30 and p.router_ttl_s == 20
    assert p.gpus_needed == 0


def test_variants_extend_their_base():
    base = load_profile("qwen3-32b-1p1d")
    offload = load_profile("qwen3-32b-1p1d-offload")
    bench = load_profile("qwen3-32b-1p1d-bench")
    assert offload.model == bench.model == base.model
    assert offload.decode.offload is not None
    assert offload.decode.offload.offload_prompt_only is False
    assert base.decode.offload is None
    assert bench.prefill.prefix_caching is False and bench.decode.prefix_caching is True
    assert bench.nixl.backends == ["LIBFABRIC"]


def test_user_file_is_accepted_with_defaults(tmp_path):
    p = load_profile(write(tmp_path, MINIMAL))
    assert p.name == "mine"
    assert (p.block_size, p.decoder_kv_blocks_ttl_s, p.kv_recompute_threshold) == (16, 480, 64)
    assert (p.prefill.base_port, p.decode.base_port, p.router.http.port) == (8100, 8200, 8000)
    assert p.nixl.backends == ["UCX"]


def test_name_defaults_to_the_file_stem(tmp_path):
    text = MINIMAL.replace('name = "mine"\n', "")
    assert load_profile(write(tmp_path, text, "from-stem.toml")).name == "from-stem"


def test_extends_a_builtin_and_overrides_key_by_key(tmp_path):
    path = write(
        tmp_path,
        """
        extends = "local"
        name = "fast-local"
        [router.http]
        port = 9000
        [sim]
        time_scale = 0
        """,
    )
    p = load_profile(path)
    assert (p.name, p.router.http.port, p.sim_settings.time_scale) == ("fast-local", 9000, 0)
    assert p.sim_settings.preset == "laptop"  # merged, not replaced
    assert p.router.retention.ttl_margin_s == 30


def test_extends_a_relative_file_and_refuses_loops(tmp_path):
    write(tmp_path, MINIMAL, "base.toml")
    p = load_profile(write(tmp_path, 'extends = "base.toml"\nname = "child"\nblock_size = 32\n'))
    assert (p.name, p.model, p.block_size) == ("child", "org/model", 32)
    write(tmp_path, 'extends = "b.toml"\n', "a.toml")
    write(tmp_path, 'extends = "a.toml"\n', "b.toml")
    with pytest.raises(ProfileError, match="loops"):
        load_profile(tmp_path / "a.toml")


def test_placeholders_are_filled_where_set(tmp_path):
    path = write(tmp_path, MINIMAL.replace("org/model", "${MODEL_DIR}/m"))
    assert load_profile(path, environ={"MODEL_DIR": "/data"}).model == "/data/m"
    assert load_profile(path, environ={}).model == "${MODEL_DIR}/m"


def test_unknown_profile_name(tmp_path):
    with pytest.raises(ProfileError, match=r"unknown profile 'nope'.*local"):
        load_profile("nope")
    with pytest.raises(ProfileError, match="not a file"):
        load_profile(str(tmp_path / "missing.toml"))


def test_invalid_toml_is_a_profile_error(tmp_path):
    assert "invalid TOML" in refused(tmp_path, "name = \n")


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ("colour = 'red'\n", "colour"),
        ("[prefill]\ncuont = 2\n", "prefill.cuont"),
        ("[prefill]\noffload = { cpu_gib = 1 }\n", "prefill.offload"),
        ("[decode.offload]\ncpu_gib = 1\nprompt_only = false\n", "decode.offload.prompt_only"),
        ("[router]\nttl = 3\n", "router.ttl"),
        ("[router.upstream]\nretires = 3\n", "router.upstream.retires"),
        ("[nixl]\nbackend = ['UCX']\n", "nixl.backend"),
        ("[k8s]\nimage = 'x'\n", "k8s.image"),
    ],
)
def test_unknown_keys_are_named(tmp_path, extra, key):
    assert f"unknown key '{key}'" in refused(tmp_path, MINIMAL + extra)


def test_missing_keys_are_named(tmp_path):
    message = refused(tmp_path, 'name = "x"\nengine = "vllm"\n')
    assert "missing key 'model'" in message and "missing key 'served_model_name'" in message


def test_ttl_order(tmp_path):
    message = refused(tmp_path, MINIMAL + "decoder_kv_blocks_ttl_s = 30\n")  # margin 30
    assert "TTL order" in message and "router.retention.ttl_margin_s (30)" in message
    message = refused(tmp_path, MINIMAL + "[router.retention]\nttl_margin_s = 4\n")
    assert "TTL order" in message and "5 s" in message
    ok = load_profile(write(tmp_path, MINIMAL + "decoder_kv_blocks_ttl_s = 60\n"))
    assert ok.router_ttl_s == 30


def test_block_size_mismatch(tmp_path):
    message = refused(tmp_path, MINIMAL + "extra_args = ['--block-size', '32']\n")
    assert "block-size mismatch" in message and "block_size (now 16)" in message
    message = refused(tmp_path, MINIMAL + "[decode]\nextra_args = ['--block-size=32']\n")
    assert "block-size mismatch" in message and "decode.extra_args" in message
    message = refused(tmp_path, MINIMAL + "[decode.offload]\ncpu_gib = 8\nblock_size = 24\n")
    assert "block-size mismatch" in message
    cpu = MINIMAL + "device = 'cpu'\nblock_size = 16\n"
    assert "multiple of 32" in refused(tmp_path, cpu)


def test_flags_and_env_the_profile_owns(tmp_path):
    message = refused(
        tmp_path, MINIMAL + "extra_args = ['--port', '9', '--kv-transfer-config.x']\n"
    )
    assert "--port is set by the profile" in message
    assert "--kv-transfer-config is set by the profile" in message
    sim = MINIMAL.replace('"vllm"', '"sim"') + "extra_args = ['--time-scale', '0']\n"
    assert "use sim.time_scale" in refused(tmp_path, sim)
    message = refused(tmp_path, MINIMAL + "[prefill.env]\nCUDA_VISIBLE_DEVICES = '3'\n")
    assert "prefill.env: CUDA_VISIBLE_DEVICES is set per instance" in message


def test_port_collisions(tmp_path):
    message = refused(tmp_path, MINIMAL + "[prefill]\ncount = 2\n[decode]\nbase_port = 8101\n")
    assert "port 8101 is used by both prefill-1 (HTTP) and decode-0 (HTTP)" in message
    message = refused(tmp_path, MINIMAL + "[decode]\nside_channel_base_port = 5600\n")
    assert "prefill-0 (NIXL side channel) and decode-0 (NIXL side channel)" in message
    assert "router (HTTP)" in refused(tmp_path, MINIMAL + "[router.http]\nport = 8200\n")
    assert "outside" in refused(tmp_path, MINIMAL + "[decode]\ncount = 2\nbase_port = 65535\n")
    # Simulator engines have no NIXL side channel: those ports are not claimed.
    sim = MINIMAL.replace('"vllm"', '"sim"') + "[decode]\nside_channel_base_port = 5600\n"
    assert load_profile(write(tmp_path, sim)).engine == "sim"


def test_impossible_hardware_and_engine_combinations(tmp_path):
    message = refused(tmp_path, MINIMAL + "[prefill]\ntensor_parallel_size = 16\n")
    assert "prefill.tensor_parallel_size (16) is more than hardware.gpus_per_node (8)" in message
    cpu = MINIMAL + "device = 'cpu'\nblock_size = 32\n"
    assert "must be 1 with device" in refused(
        tmp_path, cpu + "[decode]\ntensor_parallel_size = 2\n"
    )
    assert "not the CPU backend" in refused(tmp_path, cpu + "[decode.offload]\ncpu_gib = 1\n")
    sim = MINIMAL.replace('"vllm"', '"sim"')
    assert "needs engine = 'vllm'" in refused(tmp_path, sim + "[decode.offload]\ncpu_gib = 1\n")
    assert "only apply to engine = 'sim'" in refused(tmp_path, MINIMAL + "[sim]\npreset = 'zero'\n")
    assert "not a cost model preset" in refused(tmp_path, sim + "[sim]\npreset = 'warp'\n")


def test_the_router_table_is_the_routers_configuration(tmp_path):
    p = load_profile(write(tmp_path, MINIMAL + "[router.upstream]\nprefill_deadline_s = 12\n"))
    assert p.router.upstream.prefill_deadline_s == 12
    assert isinstance(p.router, RouterConfig)
    message = refused(tmp_path, MINIMAL + "[router.upstream]\nblock_size = 32\n")
    assert "router.upstream.block_size is set by the profile itself" in message
    message = refused(tmp_path, MINIMAL + "[router.retention]\ndecoder_kv_blocks_ttl_s = 9\n")
    assert "router.retention.decoder_kv_blocks_ttl_s is set by the profile itself" in message


def test_old_router_keys_map_with_a_warning_and_win_over_the_parents(tmp_path):
    old = MINIMAL + "[router]\nport = 9000\nstore = 'memory'\n[router.options]\nretries = 5\n"
    with pytest.warns(DeprecationWarning) as caught:
        p = load_profile(write(tmp_path, old))
    said = " ".join(str(w.message) for w in caught)
    assert "'router.options' is deprecated" in said
    assert "'port' is deprecated: use 'http.port'" in said
    assert (p.router.http.port, p.router.store.backend, p.router.upstream.retries) == (
        9000,
        "memory",
        5,
    )
    child = write(tmp_path, 'extends = "local"\nname = "c"\n[router]\nport = 9100\n', "c.toml")
    with pytest.warns(DeprecationWarning, match="use 'http.port'"):
        assert load_profile(child).router.http.port == 9100  # local.toml has [router.http]


def test_name_must_be_a_dns_friendly_slug(tmp_path):
    assert "name 'My Profile'" in refused(tmp_path, MINIMAL.replace('"mine"', '"My Profile"'))


def test_every_problem_is_reported_at_once(tmp_path):
    text = MINIMAL + "decoder_kv_blocks_ttl_s = 10\nextra_args = ['--block-size', '8']\n"
    message = refused(tmp_path, text)
    assert "TTL order" in message and "block-size mismatch" in message


def test_kv_events_ports_and_flag(tmp_path):
    on = MINIMAL + "[prefill]\ncount = 2\nkv_events_base_port = 5800\n"
    assert load_profile(write(tmp_path, on)).prefill.kv_events_base_port == 5800
    message = refused(tmp_path, on + "[decode]\nside_channel_base_port = 5801\n")
    assert "port 5801 is used by both decode-0 (NIXL side channel) and prefill-1 (KV" in message
    twice = refused(tmp_path, on + "extra_args = ['--kv-events-config', '{}']\n")
    assert "prefill.extra_args: --kv-events-config is set by the profile" in twice
