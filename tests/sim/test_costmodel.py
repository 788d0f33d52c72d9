from __future__ import annotations

from itertools import pairwise

import pytest
from pydantic import ValidationError

from agentkv.sim.costmodel import (
    PRESETS,
    PUBLISHED_POINTS,
    CostModel,
    PublishedPoint,
    published_value_s,
    reused_tokens_for,
)

CALIBRATED = ["qwen3-32b-p5en", "glm-5-fp8-p5en"]


@pytest.mark.parametrize(
    "point", PUBLISHED_POINTS, ids=lambda p: f"{p.preset}-{p.measurement}-{p.prompt_tokens}"
)
def test_preset_reproduces_published_point_within_15_percent(point: PublishedPoint) -> None:
    model = published_value_s(PRESETS[point.preset], point)
    assert model == pytest.approx(point.seconds, rel=0.15)


def test_every_published_number_is_in_the_table() -> None:
    table = {(p.preset, p.measurement, p.prompt_tokens): p.seconds * 1000 for p in PUBLISHED_POINTS}
    assert table == {
        ("qwen3-32b-p5en", "ttft_recompute", 2048): pytest.approx(158),
        ("qwen3-32b-p5en", "ttft_recompute", 24576): pytest.approx(778),
        ("qwen3-32b-p5en", "ttft_reuse", 2048): pytest.approx(122),
        ("qwen3-32b-p5en", "ttft_reuse", 24576): pytest.approx(460),
        ("qwen3-32b-p5en", "kv_transfer", 2048): pytest.approx(29),
        ("qwen3-32b-p5en", "kv_transfer", 24576): pytest.approx(130),
        ("glm-5-fp8-p5en", "ttft_recompute", 2048): pytest.approx(500),
        ("glm-5-fp8-p5en", "ttft_recompute", 20480): pytest.approx(2334),
        ("glm-5-fp8-p5en", "ttft_reuse", 2048): pytest.approx(358),
        ("glm-5-fp8-p5en", "ttft_reuse", 20480): pytest.approx(702),
    }


@pytest.mark.parametrize("name", CALIBRATED)
def test_kv_transfer_stays_in_the_published_range(name: str) -> None:
    cost = PRESETS[name]
    assert cost.transfer_s(2048) == pytest.approx(0.029, rel=0.15)
    assert cost.transfer_s(24576) == pytest.approx(0.130, rel=0.15)
    for tokens in range(2048, 24576 + 1, 512):
        assert 0.029 * 0.85 <= cost.transfer_s(tokens) <= 0.130 * 1.15


@pytest.mark.parametrize("name", CALIBRATED)
def test_reuse_beats_recompute(name: str) -> None:
    cost = PRESETS[name]
    for n in (2048, 8192, 24576):
        assert cost.ttft_s(n, reused_tokens_for(n)) < cost.ttft_s(n, 0)


def test_reuse_scenario_adds_a_tenth() -> None:
    assert reused_tokens_for(2048) == 2048 - 204
    assert reused_tokens_for(0) == 0


def test_ttft_is_the_sum_of_its_steps() -> None:
    cost = PRESETS["qwen3-32b-p5en"]
    n, reused = 10_000, 9_000
    assert cost.ttft_s(n, reused) == pytest.approx(
        cost.overhead_s
        + cost.prefill_s(n - reused, reused)
        + cost.transfer_s(reused)
        + cost.transfer_s(n)
        + cost.decode_s(1, n)
    )
    assert cost.ttft_s(n, 0) == pytest.approx(
        cost.overhead_s + cost.prefill_s(n, 0) + cost.transfer_s(n) + cost.decode_s(1, n)
    )


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_monotonic(name: str) -> None:
    cost = PRESETS[name]
    sizes = [0, 1, 15, 16, 17, 100, 1000, 5000, 30000]
    for a, b in pairwise(sizes):
        assert cost.prefill_s(a, 100) <= cost.prefill_s(b, 100)
        assert cost.prefill_s(100, a) <= cost.prefill_s(100, b)
        assert cost.transfer_s(a) <= cost.transfer_s(b)
        assert cost.decode_s(a, 100) <= cost.decode_s(b, 100)
        assert cost.decode_s(10, a) <= cost.decode_s(10, b)
        assert cost.ttft_s(b, 0) >= cost.ttft_s(a, 0)


@pytest.mark.parametrize("name", ["laptop", *CALIBRATED])
def test_nonzero_presets_take_visible_time(name: str) -> None:
    cost = PRESETS[name]
    assert cost.prefill_s(2048, 0) > 0.01
    assert cost.decode_s(1, 0) > 0.001
    assert cost.transfer_s(2048) > 0.001
    assert cost.prefill_s(1000, 20_000) > cost.prefill_s(1000, 0)  # attention grows with context
    assert cost.decode_s(1, 20_000) > cost.decode_s(1, 0)


def test_zero_preset_is_free() -> None:
    zero = PRESETS["zero"]
    assert zero == CostModel()
    assert zero.ttft_s(24576, 20000) == 0.0
    assert zero.prefill_s(5000, 5000) == zero.decode_s(100, 5000) == zero.transfer_s(5000) == 0.0


def test_nothing_costs_nothing() -> None:
    cost = PRESETS["qwen3-32b-p5en"]
    assert cost.transfer_s(0) == 0.0
    assert cost.prefill_s(0, 10_000) == 0.0
    assert cost.decode_s(0, 10_000) == 0.0


def test_transfer_moves_whole_blocks_and_converts_block_sizes_by_tokens() -> None:
    cost = CostModel(transfer_s_base=1.0, transfer_s_per_block=0.5, block_size=16)
    assert cost.transfer_s(1) == cost.transfer_s(16) == 1.5
    assert cost.transfer_s(17) == 2.0
    assert cost.transfer_s(64, block_size=64) == cost.transfer_s(64) == 3.0
    assert cost.transfer_s(65, block_size=64) == 5.0  # two 64-token blocks = 8 of 16


def test_prefill_and_decode_formulas() -> None:
    cost = CostModel(
        prefill_s_per_token=1.0,
        prefill_s_per_token_ctx=0.5,
        decode_s_per_token=2.0,
        decode_s_per_token_ctx=0.25,
    )
    # token i of 2 new ones attends over 10 + i + 1 tokens: 11 + 12 pairs
    assert cost.prefill_s(2, 10) == 2 * 1.0 + 0.5 * 23
    # step j of 3 attends over 10 + j tokens: 10 + 11 + 12
    assert cost.decode_s(3, 10) == 3 * 2.0 + 0.25 * 33


def test_rejects_bad_input() -> None:
    cost = PRESETS["laptop"]
    with pytest.raises(ValueError):
        cost.prefill_s(-1, 0)
    with pytest.raises(ValueError):
        cost.transfer_s(-5)
    with pytest.raises(ValueError):
        cost.transfer_s(5, block_size=0)
    with pytest.raises(ValueError):
        cost.ttft_s(100, 101)
    with pytest.raises(ValidationError):
        CostModel(overhead_s=-1.0)
    with pytest.raises(ValidationError):
        CostModel.model_validate({"overhead_ms": 1.0})
    with pytest.raises(ValidationError):
        cost.overhead_s = 1.0
