"""Kubernetes manifests for a profile, for deployments past one machine.

:func:`k8s_manifests` builds the objects; :func:`render_k8s` writes them as multi-document YAML
(no YAML library needed: every string is emitted JSON-quoted, which YAML reads as is).

- One Deployment (one replica) and one Service per engine instance, so the router can address
  each instance on its own: it keeps a conversation on the P whose prefix cache knows it and on
  the D that holds its KV. Each pod requests ``nvidia.com/gpu`` = its tensor-parallel size (the
  device plugin picks the GPUs, so ``CUDA_VISIBLE_DEVICES`` is not set), plus ``k8s.resources``
  (e.g. EFA interfaces). ``VLLM_NIXL_SIDE_CHANNEL_HOST`` is the pod's IP (downward API), which
  P reaches directly to read D's KV.
- The router: a ConfigMap with its JSON configuration (the same one ``expand`` makes, with the
  Services as backends), a Deployment of ``router.replicas`` and a Service.
- Redis (Deployment + Service): the router's handle store, shared by its replicas.
"""

from __future__ import annotations

import json
from typing import Any

from agentkv.serve.expand import (
    ROUTER_CONFIG_FILE,
    Instance,
    engine_argv,
    engine_env,
    instances,
    kv_events_config,
    router_config,
    router_env,
)
from agentkv.serve.profile_model import Profile

__all__ = ["dump_yaml", "k8s_manifests", "render_k8s"]

_CONFIG_MOUNT = "/etc/agentkv"
_REDIS_PORT = 6379


def _labels(profile: Profile, component: str, instance: str | None = None) -> dict[str, str]:
    labels = {
        "app.kubernetes.io/name": "agentkv",
        "app.kubernetes.io/instance": profile.name,
        "app.kubernetes.io/component": component,
    }
    if instance is not None:
        labels["agentkv.io/engine"] = instance
    return labels


def _meta(name: str, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": labels}


def _service(
    name: str, namespace: str, labels: dict[str, str], selector: dict[str, str], ports: list[Any]
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(name, namespace, labels),
        "spec": {"selector": selector, "ports": ports},
    }


def _deployment(
    name: str,
    namespace: str,
    labels: dict[str, str],
    selector: dict[str, str],
    pod_spec: dict[str, Any],
    replicas: int = 1,
) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, namespace, labels),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def _probe(port: str, *, period_s: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": port},
        "periodSeconds": period_s,
        "failureThreshold": failures,
    }


def _base(profile: Profile) -> str:
    """The profile's name as a DNS label (Service names cannot hold dots)."""
    return profile.name.replace(".", "-")


def _engine_name(profile: Profile, inst: Instance) -> str:
    return f"{_base(profile)}-{inst.role}-{inst.index}"


def _engine_objects(profile: Profile, inst: Instance, namespace: str) -> list[dict[str, Any]]:
    name = _engine_name(profile, inst)
    labels = _labels(profile, inst.role, inst.name)
    selector = {"app.kubernetes.io/instance": profile.name, "agentkv.io/engine": inst.name}
    vllm = profile.engine == "vllm"
    argv = engine_argv(profile, inst, "0.0.0.0", launcher=["agentkv"])
    env: list[dict[str, Any]] = [
        {"name": k, "value": v} for k, v in engine_env(profile, inst, None).items()
    ]
    ports: list[dict[str, Any]] = [{"name": "http", "containerPort": inst.port}]
    events = kv_events_config(profile, inst, "0.0.0.0")
    if events is not None:  # the engine binds tcp://*:PORT; the router connects to the Service
        events_port = int(events["endpoint"].rsplit(":", 1)[1])
        ports.append({"name": "kv-events", "containerPort": events_port})
    if vllm:
        env.append(
            {
                "name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
                "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
            }
        )
        ports.append({"name": "nixl", "containerPort": inst.side_channel_port})
        if profile.k8s.hf_token_secret is not None:
            env.append(
                {
                    "name": "HF_TOKEN",
                    "valueFrom": {
                        "secretKeyRef": {"name": profile.k8s.hf_token_secret, "key": "token"}
                    },
                }
            )
    limits: dict[str, Any] = {}
    if profile.uses_gpus:
        limits["nvidia.com/gpu"] = profile.group(inst.role).tensor_parallel_size
    if vllm:
        limits.update(profile.k8s.resources)
    container: dict[str, Any] = {
        "name": "engine",
        "image": profile.k8s.vllm_image if vllm else profile.k8s.agentkv_image,
        "command": argv,
        "env": env,
        "ports": ports,
        # Loading a large model takes minutes: up to 60 min before the pod counts as failed.
        "startupProbe": _probe("http", period_s=10, failures=360 if vllm else 30),
        "readinessProbe": _probe("http", period_s=10, failures=3),
    }
    if limits:
        container["resources"] = {"limits": dict(limits), "requests": dict(limits)}
    pod: dict[str, Any] = {"containers": [container]}
    if vllm:
        container["volumeMounts"] = [{"name": "shm", "mountPath": "/dev/shm"}]
        pod["volumes"] = [
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": profile.k8s.shm_size}}
        ]
    if profile.k8s.node_selector:
        pod["nodeSelector"] = dict(profile.k8s.node_selector)
    service_ports = [
        {"name": p["name"], "port": p["containerPort"], "targetPort": p["name"]} for p in ports
    ]
    return [
        _deployment(name, namespace, labels, selector, pod),
        _service(name, namespace, labels, selector, service_ports),
    ]


def _redis_objects(profile: Profile, namespace: str) -> list[dict[str, Any]]:
    name = f"{_base(profile)}-redis"
    labels = _labels(profile, "redis")
    selector = {"app.kubernetes.io/instance": profile.name, "app.kubernetes.io/component": "redis"}
    pod = {
        "containers": [
            {
                "name": "redis",
                "image": profile.k8s.redis_image,
                # Handles live minutes (D's TTL): nothing worth persisting.
                "args": ["--save", "", "--appendonly", "no"],
                "ports": [{"name": "redis", "containerPort": _REDIS_PORT}],
                "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
            }
        ]
    }
    return [
        _deployment(name, namespace, labels, selector, pod),
        _service(
            name,
            namespace,
            labels,
            selector,
            [{"name": "redis", "port": _REDIS_PORT, "targetPort": "redis"}],
        ),
    ]


def _router_objects(
    profile: Profile, namespace: str, insts: list[Instance]
) -> list[dict[str, Any]]:
    name = f"{_base(profile)}-router"
    labels = _labels(profile, "router")
    selector = {
        "app.kubernetes.io/instance": profile.name,
        "app.kubernetes.io/component": "router",
    }
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    for inst in insts:
        urls[inst.role].append(f"http://{_engine_name(profile, inst)}:{inst.port}")
    config = router_config(
        profile,
        host="0.0.0.0",
        prefill_urls=urls["prefill"],
        decode_urls=urls["decode"],
        store=f"redis://{_base(profile)}-redis:{_REDIS_PORT}/0",
        prefill_kv_events=[
            kv_events_config(profile, inst, "0.0.0.0") for inst in insts if inst.role == "prefill"
        ],
        decode_kv_events=[
            kv_events_config(profile, inst, "0.0.0.0") for inst in insts if inst.role == "decode"
        ],
    )
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(f"{name}-config", namespace, labels),
        "data": {ROUTER_CONFIG_FILE: json.dumps(config, indent=2) + "\n"},
    }
    port = profile.router.http.port
    container: dict[str, Any] = {
        "name": "router",
        "image": profile.k8s.agentkv_image,
        "command": [
            "agentkv",
            "router",
            "--config",
            f"{_CONFIG_MOUNT}/{ROUTER_CONFIG_FILE}",
            "--host",
            "0.0.0.0",
            "--port",
            str(port),
        ],
        "ports": [{"name": "http", "containerPort": port}],
        "readinessProbe": _probe("http", period_s=5, failures=3),
        "volumeMounts": [{"name": "config", "mountPath": _CONFIG_MOUNT, "readOnly": True}],
    }
    env = router_env(profile)
    if env:
        container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    pod = {
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": f"{name}-config"}}],
    }
    return [
        config_map,
        _deployment(name, namespace, labels, selector, pod, replicas=profile.router.replicas),
        _service(
            name,
            namespace,
            labels,
            selector,
            [{"name": "http", "port": port, "targetPort": "http"}],
        ),
    ]


def k8s_manifests(profile: Profile, *, namespace: str = "default") -> list[dict[str, Any]]:
    """The Kubernetes objects for ``profile``: engines, Redis, then the router."""
    insts = instances(profile)
    objects: list[dict[str, Any]] = []
    for inst in insts:
        objects += _engine_objects(profile, inst, namespace)
    objects += _redis_objects(profile, namespace)
    objects += _router_objects(profile, namespace, insts)
    return objects


def render_k8s(profile: Profile, *, namespace: str = "default") -> str:
    """``k8s_manifests`` as one multi-document YAML text (``kubectl apply -f -``)."""
    head = (
        f"# agentkv profile {profile.name!r}: generated by "
        f"`agentkv profiles render {profile.name} --format k8s`\n"
    )
    docs = ["---\n" + dump_yaml(obj) for obj in k8s_manifests(profile, namespace=namespace)]
    return head + "".join(docs)


# -- YAML ------------------------------------------------------------------------------------


def dump_yaml(value: dict[str, Any]) -> str:
    """``value`` (dicts, lists, strings, numbers, booleans, None) as a YAML block document, in
    its own key order, multi-line strings (a ConfigMap's files) as ``|`` blocks where they read
    back unchanged (PyYAML quotes them otherwise)."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True  # an object used twice (labels) is written twice, not as &id001

    def text(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
        style = "|" if "\n" in data else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)

    Dumper.add_representer(str, text)
    out: str = yaml.dump(
        value,
        Dumper=Dumper,
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=True,
        width=100,
    )
    return out
