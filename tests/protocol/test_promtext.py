"""Reading /metrics text: prometheus_client's parser behind the tests' and the router's reads."""

from __future__ import annotations

import pytest

from agentkv.protocol import Metric
from agentkv.protocol.promtext import histogram_buckets, histogram_quantile, parse_metrics
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


def test_histogram_quantile_is_prometheus_s() -> None:
    """Buckets from an instance's own histogram (two engines' series summed); quantiles
    interpolate within the bucket the rank falls in, as Prometheus's ``histogram_quantile``."""
    metrics = [SimMetrics("m", engine) for engine in ("0", "1")]
    for step in (0.015, 0.015, 0.015, 0.015, 0.015, 0.015, 0.015, 0.015, 0.019, 0.3):
        metrics[0].inter_token.observe(step)
    metrics[1].inter_token.observe(0.015)
    page = "".join(m.render().decode() for m in metrics)
    buckets = histogram_buckets(page, Metric.SIM_MODEL_INTER_TOKEN_SECONDS)
    assert buckets[float("inf")] == 11 and buckets[0.015] == 9
    # rank 5.5 of 9 in (0.0125, 0.015]
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.0125 + 0.0025 * 5.5 / 9)
    # rank 9.9: the 10th observation, in (0.018, 0.019]
    assert histogram_quantile(buckets, 0.9) == pytest.approx(0.018 + 0.001 * 0.9)
    assert histogram_quantile(buckets, 0.99) == pytest.approx(0.2 + 0.1 * 0.89)
    assert histogram_quantile({}, 0.5) is None
    assert histogram_quantile({0.1: 0, float("inf"): 0}, 0.5) is None
    assert histogram_quantile({0.1: 0, float("inf"): 2}, 0.5) == 0.1  # beyond the last bound
