"""What the tests share: process stacks (simulators, routers, Redis), real chat templates and
tools, clocks, OpenTelemetry readers, recording proxies and the vLLM tier's scenarios.

Imported normally (``from tests._support.stack import stack``): pytest runs with
``--import-mode=importlib`` and the project folder on ``pythonpath`` (pyproject.toml).
"""
