"""Kubernetes rendering: GPUs per instance, Services, the router on Redis via a ConfigMap."""

from __future__ import annotations

import json

import pytest

from agentkv.router.config import RouterConfig
from agentkv.serve import builtin_profiles, load_profile, render_k8s
from agentkv.serve.k8s import dump_yaml, k8s_manifests

yaml = pytest.importorskip("yaml")


def by_kind(objects, kind):
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def container(deployment):
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize("name", sorted(builtin_profiles()))
def test_yaml_reads_back_as_the_manifests(name):
    profile = load_profile(name, environ={})
    text = render_k8s(profile, namespace="agents")
    assert text.startswith("# agentkv profile")
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    assert docs == k8s_manifests(profile, namespace="agents")
    assert all(d["metadata"]["namespace"] == "agents" for d in docs)


def test_one_deployment_and_service_per_engine_with_gpu_requests():
    objects = k8s_manifests(load_profile("llama-3.1-8b-2p4d"))
    deployments = by_kind(objects, "Deployment")
    services = by_kind(objects, "Service")
    engines = [f"llama-3-1-8b-2p4d-prefill-{i}" for i in range(2)] + [
        f"llama-3-1-8b-2p4d-decode-{i}" for i in range(4)
    ]
    assert set(engines) <= set(deployments) and set(engines) <= set(services)
    for name in engines:
        d = deployments[name]
        assert d["spec"]["replicas"] == 1
        c = container(d)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
        env = {e["name"]: e for e in c["env"]}
        assert "CUDA_VISIBLE_DEVICES" not in env  # the device plugin assigns GPUs
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == (
            "status.podIP"
        )
        assert c["command"][:2] == ["vllm", "serve"]
        assert c["command"][c["command"].index("--host") + 1] == "0.0.0.0"
        selector = d["spec"]["selector"]["matchLabels"]
        assert services[name]["spec"]["selector"] == selector
        assert selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()


def test_tensor_parallel_and_extra_resources():
    objects = k8s_manifests(load_profile("glm-5-fp8-1p1d"))
    for d in by_kind(objects, "Deployment").values():
        c = container(d)
        if c["name"] != "engine":
            assert "resources" not in c
            continue
        assert c["resources"]["limits"] == {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 16}
        assert d["spec"]["template"]["spec"]["nodeSelector"] == {
            "node.kubernetes.io/instance-type": "p5en.48xlarge"
        }


def test_router_uses_redis_through_a_configmap():
    profile = load_profile("qwen3-32b-1p1d")
    objects = k8s_manifests(profile)
    deployments = by_kind(objects, "Deployment")
    services = by_kind(objects, "Service")
    (config_map,) = by_kind(objects, "ConfigMap").values()
    assert "qwen3-32b-1p1d-redis" in deployments and "qwen3-32b-1p1d-redis" in services
    assert services["qwen3-32b-1p1d-redis"]["spec"]["ports"][0]["port"] == 6379
    config = json.loads(config_map["data"]["router.json"])
    cfg = RouterConfig.model_validate(config)
    assert cfg.store.backend == "redis://qwen3-32b-1p1d-redis:6379/0"
    assert cfg.http.host == "0.0.0.0" and cfg.http.port == 8000
    assert [b.url for b in cfg.upstream.prefill] == ["http://qwen3-32b-1p1d-prefill-0:8100"]
    assert [b.url for b in cfg.upstream.decode] == ["http://qwen3-32b-1p1d-decode-0:8200"]
    assert cfg.upstream.block_size == profile.block_size
    assert cfg.router_ttl_s == profile.router_ttl_s
    router = deployments["qwen3-32b-1p1d-router"]
    c = container(router)
    assert c["command"][:4] == ["agentkv", "router", "--config", "/etc/agentkv/router.json"]
    volumes = router["spec"]["template"]["spec"]["volumes"]
    assert volumes == [{"name": "config", "configMap": {"name": config_map["metadata"]["name"]}}]
    assert services["qwen3-32b-1p1d-router"]["spec"]["ports"][0]["port"] == 8000


def test_sim_engines_run_agentkv_without_gpus():
    objects = k8s_manifests(load_profile("local"))
    d = by_kind(objects, "Deployment")["local-prefill-0"]
    c = container(d)
    assert c["image"].startswith("agentkv:")
    assert c["command"][:4] == ["agentkv", "sim", "--role", "prefill"]
    assert "resources" not in c


def test_cpu_profile_requests_no_gpus():
    objects = k8s_manifests(load_profile("cpu-tiny", environ={}))
    for d in by_kind(objects, "Deployment").values():
        assert "nvidia.com/gpu" not in json.dumps(d)


def test_yaml_writer_round_trips_awkward_values():
    value = {
        "plain": "text",
        "quotes": 'say "hi"\\n',
        "words": ["yes", "no", "null", "on", "1", "0x10", "", " lead", "a: b", "#c"],
        "numbers": [0, -1, 2.5, True, False, None],
        "nested": [{"a": [1, [2, 3]], "b": {}}, [], {}],
        "block": "line one\n  indented\n\nlast\n",
        "no newline at end": "x\ny",
        "yes": "key that YAML 1.1 reads as a boolean",
        "unicode": "héllo ✓",
    }
    assert yaml.safe_load(dump_yaml(value)) == value


def test_prefill_pods_publish_kv_events_the_router_connects_to():
    """In a cluster the engines listen on every interface: P binds ``tcp://*:PORT`` (its
    Service exposes the port) and the router connects to each P's Service name."""
    objects = k8s_manifests(load_profile("llama-3.1-8b-2p4d"))
    deployments = by_kind(objects, "Deployment")
    services = by_kind(objects, "Service")
    for i in range(2):
        name = f"llama-3-1-8b-2p4d-prefill-{i}"
        argv = container(deployments[name])["command"]
        events = json.loads(argv[argv.index("--kv-events-config") + 1])
        assert events["endpoint"] == f"tcp://*:{5800 + i}" and events["topic"] == "kv"
        ports = {p["name"]: p["port"] for p in services[name]["spec"]["ports"]}
        assert ports["kv-events"] == 5800 + i
    for i in range(4):
        argv = container(deployments[f"llama-3-1-8b-2p4d-decode-{i}"])["command"]
        assert "--kv-events-config" not in argv
    (config_map,) = by_kind(objects, "ConfigMap").values()
    cfg = RouterConfig.model_validate(json.loads(config_map["data"]["router.json"]))
    for i, backend in enumerate(cfg.upstream.prefill):
        assert backend.kv_events is not None and backend.kv_events.endpoint == f"tcp://*:{5800 + i}"
        assert backend.host == f"llama-3-1-8b-2p4d-prefill-{i}"
