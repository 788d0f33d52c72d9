"""Evidence for retention decisions: replay real agent traces, plan TTLs and thresholds, and
calibrate the simulator's cost model against a live deployment.

* :mod:`agentkv.bench.traces`: Claude Code, Mooncake and vLLM multi-turn traces as sessions of
  turns, and how each turn's prompt relates to the previous one;
* :mod:`agentkv.bench.content`: hashed traces as token content and scripted conversations;
* :mod:`agentkv.bench.replay` (driving sessions), :mod:`agentkv.bench.replay_records` (what each
  turn records) and :mod:`agentkv.bench.runner`: ``agentkv bench replay``;
  :mod:`agentkv.bench.wire`, :mod:`agentkv.bench.wire_codecs` and
  :mod:`agentkv.bench.replay_raw`: its raw HTTP clients (``--client chat|messages|responses``);
* :mod:`agentkv.bench.report` and :mod:`agentkv.bench.plots`: summaries, files, figures;
* :mod:`agentkv.bench.plan`: ``agentkv plan``;
* :mod:`agentkv.bench.calibrate`: ``agentkv calibrate``; :mod:`agentkv.bench.curves`:
  ``agentkv bench curves``;
* :mod:`agentkv.bench.deploy`: a profile started for a benchmark, on a compressed clock.

Everything here uses agentkv's public surfaces: the SDK, HTTP, the cost model and ``serve``.
Needs the ``bench`` extra (``pip install "vllm-agentkv[bench]"``).
"""

from __future__ import annotations
