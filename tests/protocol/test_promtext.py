"""Reading /metrics text: prometheus_client's parser behind the tests' and the router's reads."""

from __future__ import annotations

from agentkv.protocol import Metric
from agentkv.protocol.promtext import parse_metrics
from agentkv.router.retention import kv_usage
from agentkv.sim.metrics import SimMetrics

PAGE = """\
# HELP agentkv_router_turns_total Turns.
# TYPE agentkv_router_turns_total counter
agentkv_router_turns_total{source="pull",tenant="a"} 2.0
agentkv_router_turns_total{source="pull",tenant="b"} 3.0
agentkv_router_turns_total{source="prefill",tenant="a"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
vllm:kv_cache_usage_perc_other 0.99
"""


def test_samples_are_summed_over_the_labels_but_one() -> None:
    parsed = parse_metrics(PAGE)
    assert parsed["agentkv_router_turns_total[pull]"] == 5.0
    assert parsed["agentkv_router_turns_total[prefill]"] == 1.0
    assert parsed["vllm:kv_cache_usage_perc"] == 1.0
    assert parse_metrics(PAGE, by="tenant")["agentkv_router_turns_total[a]"] == 3.0


def test_kv_usage_is_the_largest_sample_of_its_gauge_only() -> None:
    assert kv_usage(PAGE) == 0.75
    assert kv_usage("# nothing here\n") is None
    assert kv_usage(f"{Metric.KV_CACHE_USAGE_PERC}{{engine=0}} x\n") is None  # not Prometheus


def test_the_simulators_page_reads_back() -> None:
    metrics = SimMetrics("m")
    metrics.kv_usage.set(0.5)
    page = metrics.render().decode()
    assert kv_usage(page) == 0.5
    assert parse_metrics(page)[Metric.KV_CACHE_USAGE_PERC] == 0.5
