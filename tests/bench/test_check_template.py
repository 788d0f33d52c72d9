"""``agentkv check-template`` on real templates (in-process, no server)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentkv.bench.template_check import check_template
from agentkv.chat import deepseek_tokenizer_path
from agentkv.cli import app

TEMPLATES_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "chat-templates"
if not TEMPLATES_DIR.is_dir():
    pytest.skip(
        f"the real chat templates are not checked out next to the repo ({TEMPLATES_DIR})",
        allow_module_level=True,
    )
runner = CliRunner()
DEEPSEEK = str(deepseek_tokenizer_path())


def invoke(*args: str) -> tuple[int, str]:
    r = runner.invoke(app, ["check-template", *args], terminal_width=200)
    return r.exit_code, r.output


def test_a_stable_template_is_stable_every_turn() -> None:
    code, out = invoke(str(TEMPLATES_DIR / "qwen3-coder.jinja"))
    assert code == 0, out
    assert out.count("prefix-stable") >= 10 and "drifts" not in out
    assert out.count("│ token-identical") == 10
    assert "qwen3-coder.jinja: prefix-stable in messages mode" in out


def test_qwen3_prunes_reasoning_at_the_next_user_message() -> None:
    code, out = invoke(str(TEMPLATES_DIR / "qwen3.jinja"))
    assert code == 0, out
    assert "reasoning-pruned" in out and "NOT prefix-stable" in out
    report = check_template(TEMPLATES_DIR / "qwen3.jinja")
    by_turn = {t.turn: t for t in report.turns}
    # inside the tool loop it holds; the next user message (after turn 2) prunes the
    # reasoning of message 2, the first answer
    assert by_turn[1].stable and by_turn[3].stable and by_turn[4].stable
    assert not by_turn[2].stable and by_turn[2].hazard == "reasoning-pruned"
    assert by_turn[2].message_index == 2 and by_turn[2].position
    assert all(t.exact for t in report.turns)
    assert by_turn[1].exact_is_fresh and not by_turn[2].exact_is_fresh


def test_hermes_look_ahead() -> None:
    report = check_template(TEMPLATES_DIR / "hermes-3-tool-use.jinja")
    hazards = {t.turn: t.hazard for t in report.turns}
    # a tool result renders another newline once the answer follows it (turns after results)
    assert hazards == {1: None, 2: "look-ahead", 3: None, 4: "look-ahead", 5: "look-ahead",
                       6: None, 7: "look-ahead", 8: None, 9: None, 10: "look-ahead"}  # fmt: skip
    assert all(t.exact for t in report.turns)


def test_gpt_oss_rewrites_return_and_drops_analysis() -> None:
    code, out = invoke(str(TEMPLATES_DIR / "gpt-oss.jinja"), "--tokenizer", DEEPSEEK)
    assert code == 0, out
    report = check_template(TEMPLATES_DIR / "gpt-oss.jinja", DEEPSEEK)
    by_turn = {t.turn: t for t in report.turns}
    # turn 8 answers without reasoning: its <|return|> comes back as <|end|>
    assert by_turn[8].hazard == "end-of-turn-rewritten" and "<|return|>" in by_turn[8].detail
    assert by_turn[2].hazard == "reasoning-pruned"  # the analysis channel, once final follows
    assert all(t.exact for t in report.turns), [t.detail for t in report.turns]


def test_mistral_moves_system_prompt_and_tools() -> None:
    report = check_template(TEMPLATES_DIR / "vllm-mistral.jinja", DEEPSEEK)
    assert report.turns[0].hazard == "moved-block" and report.turns[0].message_index == 1
    assert {t.hazard for t in report.turns} <= {"moved-block", "retokenized"}


def test_chat_template_kwargs_are_passed() -> None:
    code, out = invoke(
        str(TEMPLATES_DIR / "glm-4.7-flash.jinja"),
        "--chat-template-kwargs",
        '{"clear_thinking": false}',
    )
    assert code == 0, out
    assert "reasoning-pruned" not in out  # GLM-4.7 keeps reasoning with clear_thinking=false


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nope.jinja"], "No such file: nope.jinja"),
        ([str(TEMPLATES_DIR / "qwen3.jinja"), "--tokenizer", "nope.json"], "nope.json"),
        ([str(TEMPLATES_DIR / "deepseek-v3.1.jinja"), "--tokenizer", DEEPSEEK], "turn 1"),
        ([str(TEMPLATES_DIR / "kimi-k2-thinking.jinja")], "'append' of 'list' object is unsafe"),
        ([str(TEMPLATES_DIR / "qwen3.jinja"), "--chat-template-kwargs", "[1]"], "JSON object"),
    ],
    ids=["missing template", "missing tokenizer", "dict arguments", "sandbox", "bad kwargs"],
)
def test_errors_exit_2_without_a_traceback(args: list[str], message: str) -> None:
    code, out = invoke(*args)
    assert code == 2, out
    assert message in out and "Traceback" not in out
