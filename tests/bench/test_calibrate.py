"""Fitting the cost model, and `agentkv calibrate` against the shared simulated deployment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentkv.bench.calibrate import Measurement, fit_cost_model, nnls
from agentkv.bench.deploy import Stack
from agentkv.cli import app
from agentkv.router.paths import curves_from
from agentkv.sim import SimConfig, create_app
from agentkv.sim.costmodel import PRESETS, load_cost_file
from agentkv.sim.launch import start_sims


def test_nnls_recovers_and_clips():
    rows = [[1.0, x, x * x] for x in (1.0, 2.0, 3.0, 5.0, 8.0)]
    truth = [0.5, 2.0, 0.25]
    y = [sum(a * b for a, b in zip(r, truth, strict=True)) for r in rows]
    assert nnls(rows, y) == pytest.approx(truth)
    # a fit that wants a negative slope gets zero instead
    assert nnls([[1.0, x] for x in (1.0, 2.0, 3.0)], [3.0, 2.0, 1.0])[1] == 0.0


def _synthetic(truth, bs=16):
    out = []
    for n in (512, 1024, 2048, 4096, 8192):
        out.append(Measurement("recompute", n, 0, truth.ttft_s(n, 0)))
        r = n - 65
        local = r // bs * bs
        seconds = (
            truth.overhead_s
            + truth.prefill_s(n - r, r)
            + truth.transfer_s(r)
            + truth.transfer_s(n - local)
            + truth.decode_s(1, n)
        )
        out.append(Measurement("pull", n, r, seconds))
        out.append(Measurement("decode", n + 12, 0, truth.decode_s(1, n + 12)))
        out.append(Measurement("slowdown", n, 0, truth.interference_s(n)))
    return out


@pytest.mark.parametrize("preset", ["qwen3-32b-p5en", "glm-5-fp8-p5en", "laptop"])
def test_fit_recovers_a_preset_exactly(preset):
    truth = PRESETS[preset]
    fit = fit_cost_model(_synthetic(truth), 16, truth.kv_bytes_per_token)
    for name, value in truth.model_dump().items():
        if name == "cpu_load_s_per_token":  # not measured
            continue
        assert getattr(fit, name) == pytest.approx(value, rel=1e-6, abs=1e-12), name


def test_cost_file_feeds_the_simulator(tmp_path: Path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"cost_model": PRESETS["glm-5-fp8-p5en"].model_dump(), "x": 1}))
    assert load_cost_file(path) == PRESETS["glm-5-fp8-p5en"]
    app_ = create_app(SimConfig(costs=str(path), preset="zero"))
    assert app_.state.sim.engine.cost == PRESETS["glm-5-fp8-p5en"]
    toml = tmp_path / "costs.toml"
    toml.write_text("prefill_s_per_token = 0.001\noverhead_s = 0.01\n")
    assert load_cost_file(toml).prefill_s_per_token == 0.001
    bad = tmp_path / "bad.json"
    bad.write_text('{"prefill_s_per_token": -1}')
    with pytest.raises(ValueError, match="prefill_s_per_token"):
        load_cost_file(bad)
    r = CliRunner().invoke(app, ["sim", "--costs", str(bad)])
    assert r.exit_code == 2 and "prefill_s_per_token" in r.output


@pytest.mark.e2e
def test_calibrate_recovers_the_deployments_costs(stack: Stack, tmp_path: Path):
    """Against the router and simulator processes (laptop preset), timed by the simulator's
    modelled TTFT: the fitted model predicts the preset's TTFTs."""
    out = tmp_path / "costs.json"
    args = ["calibrate", "--endpoint", stack.base_url, "--out", str(out), "--timing", "model"]
    args += ["--contexts", "256,512,1024,2048", "--repeats", "1", "--decode-tokens", "8"]
    r = CliRunner().invoke(app, args, terminal_width=200)
    assert r.exit_code == 0, r.output
    fitted = load_cost_file(out)
    truth = PRESETS["laptop"]
    for n in (300, 1500, 2048):
        assert fitted.ttft_s(n, 0) == pytest.approx(truth.ttft_s(n, 0), rel=0.02)
        assert fitted.ttft_s(n, n - n // 10) == pytest.approx(
            truth.ttft_s(n, n - n // 10), rel=0.02
        )
    data = json.loads(out.read_text())
    assert {m["kind"] for m in data["measurements"]} == {"recompute", "pull", "decode"}
    assert "wrote" in r.output and "pull" in r.output


@pytest.mark.e2e
def test_calibrate_on_the_wall_clock_runs(stack: Stack, tmp_path: Path):
    """The default clock: the deployment runs 200 times faster than its costs, so the numbers
    are small; the command still measures, fits and writes a valid cost file."""
    out = tmp_path / "costs.json"
    args = ["calibrate", "--endpoint", stack.base_url, "--out", str(out)]
    args += ["--contexts", "256,512,1024", "--repeats", "2", "--decode-tokens", "6"]
    r = CliRunner().invoke(app, args, terminal_width=200)
    assert r.exit_code == 0, r.output
    assert load_cost_file(out).overhead_s >= 0


@pytest.mark.e2e
def test_calibrate_measures_prefill_on_d_and_its_slowdown(stack: Stack, tmp_path: Path) -> None:
    """With --decode-url (a D simulator at full speed, laptop costs): prefill on D from its
    modelled TTFT, and the slowdown of D's stream on the wall clock; the cost file's curves are
    what the path cost model reads."""
    (d,) = start_sims([["--role", "decode", "--preset", "laptop", "--time-scale", "1"]])
    try:
        out = tmp_path / "costs.json"
        args = ["calibrate", "--endpoint", stack.base_url, "--out", str(out), "--timing", "model"]
        args += ["--contexts", "256,512,1024,2048", "--repeats", "1", "--decode-tokens", "8"]
        args += ["--decode-url", d.url, "--decode-contexts", "1024,2048,4096"]
        r = CliRunner().invoke(app, args, terminal_width=200)
    finally:
        d.stop()
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    kinds = {m["kind"] for m in data["measurements"]}
    assert {"decode_prefill", "slowdown"} <= kinds
    truth = PRESETS["laptop"]
    curves = curves_from(data)
    assert curves.prefill_d_s_per_token == pytest.approx(truth.prefill_s_per_token, rel=0.05)
    assert curves.slowdown_s_per_prefill_token == pytest.approx(
        truth.decode_slowdown_s_per_prefill_token, rel=0.35
    )
    assert curves.transfer_s_per_token == pytest.approx(truth.transfer_s_per_block / 16, rel=0.05)
    assert curves.prefill_p_s_per_token == pytest.approx(truth.prefill_s_per_token, rel=0.05)
    fitted = load_cost_file(out)
    assert fitted.decode_slowdown_s_per_prefill_token == curves.slowdown_s_per_prefill_token


def test_calibrate_names_an_unreachable_endpoint(tmp_path: Path):
    r = CliRunner().invoke(
        app, ["calibrate", "--endpoint", "http://127.0.0.1:9/v1", "--out", str(tmp_path / "c")]
    )
    assert r.exit_code == 1 and "127.0.0.1:9" in r.output
