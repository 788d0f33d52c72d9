"""``agentkv serve``'s pure half: launch profiles, their expansion into exact processes, runtime
checks and Kubernetes rendering.

``load_profile("local")`` (or a TOML file) gives a validated :class:`Profile`;
``expand(profile)`` gives the :class:`Deployment` (every process's argv and environment, and the
router's configuration); ``check_runtime(profile)`` lists what this machine lacks;
``render_k8s(profile)`` writes Kubernetes manifests. Needs the ``serve`` extra.
"""

from __future__ import annotations

from agentkv.serve.checks import check_runtime
from agentkv.serve.expand import Deployment, ProcessSpec, expand
from agentkv.serve.k8s import render_k8s
from agentkv.serve.profile_model import Profile
from agentkv.serve.profiles import ProfileError, builtin_profiles, load_profile

__all__ = [
    "Deployment",
    "ProcessSpec",
    "Profile",
    "ProfileError",
    "builtin_profiles",
    "check_runtime",
    "expand",
    "load_profile",
    "render_k8s",
]
