"""The path cost model (agentkv.router.paths): which path wins, the runner-up, and the
estimates against the simulator's cost model they stand for."""

from __future__ import annotations

import dataclasses

import pytest

from agentkv.router.paths import (
    Curves,
    DecodeBudget,
    InFlight,
    Path,
    TurnState,
    choose,
    curves_from,
    load_curves,
)
from agentkv.sim.costmodel import PRESETS

K = 1024
H = 24 * K  # a 24k-token history


def state(new: int, **kw: int) -> TurnState:
    return TurnState(prompt_tokens=H + new, **kw)


def state4k(**kw: int) -> TurnState:
    """1,000 new tokens after a 4k-token history that D holds and its handle carries."""
    return TurnState(prompt_tokens=4 * K + 1000, handle_tokens=4 * K, d_cached_tokens=4 * K, **kw)


# (case, turn, winner, runner-up, paths left out)
CASES = [
    (
        "first turn: nothing anywhere",
        TurnState(2000),
        "recompute",
        None,
        {"pull", "local", "decode"},
    ),
    (
        "P's cache has all but the new message",
        state(100, p_cached_tokens=H),
        "local",
        "recompute",
        {"pull", "decode"},
    ),
    (
        "a handle, D's GPU gone: read back",
        state(2 * K, handle_tokens=H),
        "pull",
        "recompute",
        {"local", "decode"},
    ),
    (
        "128 new tokens on the D that holds 24k: decode in place",
        state(128, handle_tokens=H, p_cached_tokens=H - 2000, d_cached_tokens=H),
        "decode",
        "pull",
        set(),
    ),
    (
        "2k new tokens: at the largest new-token count, still decode",
        state(2 * K, handle_tokens=H, d_cached_tokens=H),
        "decode",
        "pull",
        {"local"},
    ),
    (
        "2k + 1 new tokens: over the largest count, read back",
        state(2 * K + 1, handle_tokens=H, d_cached_tokens=H),
        "pull",
        "recompute",
        {"decode", "local"},
    ),
    (
        "16k new tokens: read back",
        state(16 * K, handle_tokens=H, d_cached_tokens=H),
        "pull",
        "recompute",
        {"decode", "local"},
    ),
    (
        "D busy: 7,000 prompt tokens in flight + 1,500 > 8,192",
        state(1500, handle_tokens=H, d_cached_tokens=H, d_in_flight_tokens=7000),
        "pull",
        "recompute",
        {"decode", "local"},
    ),
    (
        "handle expired, D's CPU tier holds the history",
        state(128, d_cpu_tokens=H),
        "cpu",
        "recompute",
        {"pull", "local", "decode"},
    ),
    (
        "D's GPU holds half, its CPU tier the rest",
        state(128, d_cached_tokens=H // 2, d_cpu_tokens=H),
        "cpu",
        "recompute",
        {"pull", "local", "decode"},
    ),
    (
        "read back below kv_recompute_threshold: P's cache instead",
        state(200, handle_tokens=H, p_cached_tokens=H - 48),
        "local",
        "recompute",
        {"pull", "decode"},
    ),
    (
        "P's cache covers the handle: nothing to read",
        state(200, handle_tokens=H - 512, p_cached_tokens=H),
        "local",
        "recompute",
        {"pull", "decode"},
    ),
]


@pytest.mark.parametrize(
    ("turn", "winner", "runner_up", "left_out"),
    [pytest.param(*c[1:], id=c[0]) for c in CASES],
)
def test_the_cheapest_path_within_the_budget_wins(
    turn: TurnState, winner: Path, runner_up: Path | None, left_out: set[str]
) -> None:
    choice = choose(turn)
    assert (choice.path, choice.runner_up) == (winner, runner_up)
    assert set(choice.excluded) - {"cpu"} == left_out - {"cpu"}
    assert choice.ttft_s == choice.estimates[choice.path].ttft_s
    if runner_up is not None:
        assert choice.runner_up_ttft_s == choice.estimates[runner_up].ttft_s
        assert choice.runner_up_ttft_s is not None and choice.runner_up_ttft_s >= choice.ttft_s
    else:
        assert choice.runner_up_ttft_s is None


def test_without_a_cpu_tier_there_is_no_cpu_path() -> None:
    curves = Curves(cpu_load_s_per_token=None)
    choice = choose(state(128, d_cpu_tokens=H), curves)
    assert choice.path == "recompute" and choice.excluded["cpu"] == "D has no CPU tier"


def test_a_wider_budget_lets_decode_take_a_16k_turn() -> None:
    turn = state(16 * K, handle_tokens=H, d_cached_tokens=H)
    choice = choose(turn, budget=DecodeBudget(max_new_tokens=32 * K, tokens_in_flight=32 * K))
    assert (choice.path, choice.runner_up) == ("decode", "pull")
    # its streams' steps grow by one full chunk's compute: 8,192 x 22 µs
    assert choice.estimates["decode"].d_itl_added_s == pytest.approx(8192 * 2.2e-5)


@pytest.mark.parametrize("preset", ["qwen3-32b-p5en", "glm-5-fp8-p5en", "laptop"])
@pytest.mark.parametrize("n", [2 * K, 8 * K, 24 * K])
def test_estimates_are_the_simulators_costs(preset: str, n: int) -> None:
    """With curves from a preset, each path's estimate is what the simulator's cost model says
    that turn costs (prompts in whole blocks; D holds nothing, so D reads the whole prompt)."""
    cost = PRESETS[preset]
    curves = curves_from(
        {
            "overhead_s": cost.overhead_s,
            "transfer_s_base": cost.transfer_s_base,
            "transfer_s_per_token": cost.transfer_s_per_block / cost.block_size,
            "prefill_p_s_per_token": cost.prefill_s_per_token,
            "prefill_p_s_per_token_ctx": cost.prefill_s_per_token_ctx,
            "prefill_d_s_per_token": cost.prefill_s_per_token,
            "prefill_d_s_per_token_ctx": cost.prefill_s_per_token_ctx,
            "decode_s_per_token": cost.decode_s_per_token,
            "decode_s_per_token_ctx": cost.decode_s_per_token_ctx,
            "slowdown_s_per_prefill_token": cost.decode_slowdown_s_per_prefill_token,
            "cpu_load_s_per_token": cost.cpu_load_s_per_token,
        }
    )
    reused = n - n // 10 // 16 * 16
    got = choose(TurnState(n, handle_tokens=reused), curves).estimates
    assert got["recompute"].ttft_s == pytest.approx(cost.ttft_s(n, 0))
    assert got["pull"].ttft_s == pytest.approx(cost.ttft_s(n, reused))
    # on D: overhead + D's prefill of the new tokens over what it holds
    got = choose(TurnState(n, d_cached_tokens=reused, d_cpu_tokens=n - 16), curves).estimates
    assert got["decode"].ttft_s == pytest.approx(
        cost.overhead_s + cost.prefill_s(n - reused, reused)
    )
    assert got["cpu"].ttft_s == pytest.approx(
        cost.overhead_s + cost.cpu_load_s(n - 16 - reused) + cost.prefill_s(16, n - 16)
    )


def test_defaults_are_the_qwen3_32b_p5en_preset() -> None:
    cost, curves = PRESETS["qwen3-32b-p5en"], Curves()
    assert curves.transfer_s_per_token * cost.block_size == pytest.approx(cost.transfer_s_per_block)
    assert (curves.prefill_p_s_per_token, curves.slowdown_s_per_prefill_token) == (
        cost.prefill_s_per_token,
        cost.decode_slowdown_s_per_prefill_token,
    )
    assert curves.cpu_load_s_per_token == pytest.approx(cost.cpu_load_s_per_token)


def test_curves_from_a_cost_file() -> None:
    curves = curves_from({"cost_model": {}, "curves": {"prefill_d_s_per_token": 3e-5}})
    assert curves.prefill_d_s_per_token == 3e-5 and curves.overhead_s == Curves().overhead_s
    assert curves_from({}, cpu_tier=False).cpu_load_s_per_token is None
    for bad in ({"nope": 1}, {"overhead_s": -1}, {"overhead_s": "1"}, {"overhead_s": True}):
        with pytest.raises(ValueError):
            curves_from(bad)


@pytest.mark.parametrize("kw", [{"prompt_tokens": 0}, {"prompt_tokens": 10, "handle_tokens": -1}])
def test_a_turn_state_is_checked(kw: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        TurnState(**kw)


def test_cached_counts_leave_the_last_token_to_compute() -> None:
    choice = choose(TurnState(4096, p_cached_tokens=4096, d_cached_tokens=4096))
    assert choice.estimates["local"].computed_tokens == 1
    assert choice.estimates["decode"].computed_tokens == 1
    assert dataclasses.replace(choice.estimates["decode"]).transferred_tokens == 0


def test_in_flight_counts_each_d_within_its_budget_and_gives_back_once() -> None:
    budget = DecodeBudget(max_new_tokens=32, tokens_in_flight=48)
    f = InFlight()
    assert not f.reserve("d1", 33, budget)  # more new tokens than one turn may bring
    assert f.reserve("d1", 30, budget) and f.reserve("d2", 30, budget)
    assert not f.reserve("d1", 30, budget)  # 60 > 48 on d1
    back = f.give_back("d1", 30)
    back()
    back()  # a second call gives back nothing more
    assert f.snapshot() == {"d2": 30}
    assert f.reserve("d1", 30, budget) and f.reserve("d1", 18, budget)
    assert f.snapshot() == {"d1": 48, "d2": 30}


def test_load_curves_reads_a_calibrate_cost_file(tmp_path) -> None:
    path = tmp_path / "costs.json"
    path.write_text('{"cost_model": {}, "curves": {"prefill_d_s_per_token": 4e-5}}')
    assert load_curves(str(path)).prefill_d_s_per_token == 4e-5
    assert load_curves(None) == Curves()
    path.write_text("[1]")
    for bad in (str(path), str(tmp_path / "missing.json")):
        with pytest.raises(ValueError, match=r"paths\.costs"):
            load_curves(bad)


# D's and P's load on a turn of 1,000 new tokens after 4k: (case, turn, winner, decode left out)
LOAD = [
    ("idle: decode in place (84 ms against pull's 158)", state4k(), "decode", False),
    (
        "40 streams on D: their delay is the budget's, not the TTFT's: decode",
        state4k(d_running_streams=40),
        "decode",
        False,
    ),
    (
        "D prefilling 3k tokens: decode still first (89 ms)",
        state4k(d_in_flight_tokens=3000),
        "decode",
        False,
    ),
    (
        "D prefilling 6k: within budget, but pull's first token comes sooner (158 against 159 ms)",
        state4k(d_in_flight_tokens=6 * K),
        "pull",
        False,
    ),
    (
        "D prefilling 7,193: 1,000 more would pass its 8,192 in flight: pull",
        state4k(d_in_flight_tokens=7193),
        "pull",
        True,
    ),
    (
        "D prefilling 7,000, P 8k: decode (177 against 338 ms)",
        state4k(d_in_flight_tokens=7000, p_queued_tokens=8 * K),
        "decode",
        False,
    ),
    (
        "D prefilling 7,193, P 8k: the budget binds, pull however slow",
        state4k(d_in_flight_tokens=7193, p_queued_tokens=8 * K),
        "pull",
        True,
    ),
]


@pytest.mark.parametrize(
    ("turn", "winner", "over_budget"), [pytest.param(*c[1:], id=c[0]) for c in LOAD]
)
def test_the_fastest_first_token_within_ds_budget_wins(
    turn: TurnState, winner: Path, over_budget: bool
) -> None:
    choice = choose(turn)
    assert choice.path == winner
    assert ("decode" in choice.excluded) == over_budget
    allowed = sorted((e.ttft_s, p) for p, e in choice.estimates.items() if p not in choice.excluded)
    assert (choice.ttft_s, choice.path) == allowed[0]
    assert (choice.runner_up_ttft_s, choice.runner_up) == allowed[1]
    if over_budget:  # the fastest estimate was the decode the budget ruled out
        assert choice.estimates["decode"].ttft_s < choice.estimates["recompute"].ttft_s


@pytest.mark.parametrize(
    ("field", "value", "path", "ttft_added", "streams_delay"),
    [
        # every P path waits for P's queue, at P's prefill per token
        ("p_queued_tokens", 5000, "pull", 5000 * 2.2e-5, 0.0),
        ("p_queued_tokens", 5000, "recompute", 5000 * 2.2e-5, 0.0),
        ("p_queued_tokens", 5000, "decode", 0.0, 0.0),
        # a decode-side path waits for D's prompt tokens in flight, less the overhead it
        # overlaps: 3,000 x 22 µs - 61 ms
        ("d_in_flight_tokens", 3000, "decode", 3000 * 2.2e-5 - 0.061, 0.0),
        # a P path's D step waits for what is left of D's queue when the KV arrives: 8,000
        # tokens (176 ms) outlast P's part of this turn (142.5 ms)
        ("d_in_flight_tokens", 3000, "pull", 0.0, 0.0),
        ("d_in_flight_tokens", 8000, "pull", 8000 * 2.2e-5 - 0.1425, 0.0),
        # its 1,000 new tokens delay each of D's 3 streams by 1,000 x 22 µs: reported, not TTFT
        ("d_running_streams", 3, "decode", 0.0, 3 * 1000 * 2.2e-5),
        ("d_running_streams", 3, "pull", 0.0, 0.0),
    ],
)
def test_each_load_term(
    field: str, value: int, path: Path, ttft_added: float, streams_delay: float
) -> None:
    idle = choose(state4k()).estimates[path]
    busy = choose(state4k(**{field: value})).estimates[path]
    assert busy.ttft_s - idle.ttft_s == pytest.approx(ttft_added, abs=5e-4)
    assert busy.d_streams_delay_s == pytest.approx(streams_delay)
