"""`agentkv profiles render --format json|argv`: what a profile expands to, as text."""

from __future__ import annotations

import json
import shlex
from typing import Any

from agentkv.serve.expand import Deployment, ProcessSpec

__all__ = ["command_line", "deployment_json"]


def deployment_json(deployment: Deployment) -> str:
    """Each process (name, role, argv, env, port, health URL), the router config and the base
    URL, as indented JSON."""
    data: dict[str, Any] = {
        "processes": [
            {
                "name": s.name,
                "role": s.role,
                "argv": s.argv,
                "env": s.env,
                "port": s.port,
                "health_url": s.health_url,
            }
            for s in deployment.processes
        ],
        "router_config": deployment.router_config,
        "base_url": deployment.base_url,
    }
    return json.dumps(data, indent=2)


def command_line(spec: ProcessSpec) -> str:
    """The process's environment and argv as one shell line."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(spec.env.items()))
    return f"{env + ' ' if env else ''}{shlex.join(spec.argv)}"
