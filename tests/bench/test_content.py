"""Hashed traces become token content: one word per token, equal hash ids equal words, and the
scripted conversation follows the trace's appends, strips and rewrites."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentkv.bench.content import WORDS, script_session, words_for
from agentkv.bench.traces import load_trace
from agentkv.chat.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def test_every_word_is_one_token_and_round_trips(tokenizer):
    assert len(WORDS) == len(set(WORDS)) == 512
    text = "".join(" " + w for w in WORDS)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(WORDS)
    assert tokenizer.decode(ids) == text


def test_words_follow_hash_ids_and_scale():
    ids = [11, 12, 13, 14]
    a = words_for("s", ids, 64, 1 / 16, 0, 256, fallback="x")
    assert a.count(" ") == 16  # 256 trace tokens at 1/16
    assert a == words_for("s", ids, 64, 1 / 16, 0, 256, fallback="x")  # deterministic
    # the same first two ids give the same first 8 words; a different third id changes the rest
    b = words_for("s", [11, 12, 99, 14], 64, 1 / 16, 0, 256, fallback="x")
    assert a.split()[:8] == b.split()[:8] and a.split()[8:12] != b.split()[8:12]
    # another namespace (another Claude Code session: ids are local) gives other words
    assert words_for("t", ids, 64, 1 / 16, 0, 256, fallback="x") != a
    # a range is the same words as the matching slice of the whole
    assert words_for("s", ids, 64, 1 / 16, 64, 192, fallback="x").split() == a.split()[4:12]
    assert words_for("s", ids, 64, 1 / 16, 5, 5, fallback="x").count(" ") == 1  # at least one


def test_script_follows_the_small_trace(small_trace: Path):
    a, b = load_trace(small_trace)
    turns = script_session(a, token_scale=1 / 8)
    assert [t.kind for t in turns] == ["first", "append", "strip", "rewrite", "append", "append"]
    first = turns[0]
    assert [m.role for m in first.add] == ["system", "user"]
    assert first.add[0].content.count(" ") == 1024 // 8  # the system + tool prompt
    assert first.add[1].content.count(" ") == (2048 - 1024) // 8
    # turn 1's answer has reasoning the next prompt does not repeat: scripted, then stripped
    assert turns[1].reasoning and turns[1].content
    assert turns[2].strip and not turns[2].reasoning
    # the rewrite keeps the system message (inside the 16 shared blocks) and replaces the rest
    assert turns[3].keep == 1 and [m.role for m in turns[3].add] == ["user"]
    assert turns[3].add[0].start == 1024 and turns[3].add[0].end == 1500
    # appends add the new tokens after the previous answer
    assert turns[1].add[0].start == 2048 + 128 and turns[1].add[0].end == 2432
    assert turns[4].gap_s == 500
    assert all(t.output_tokens >= 1 for t in turns)
    assert [t.kind for t in script_session(b, token_scale=1 / 8)] == ["first"] + ["append"] * 3


def test_answers_are_the_words_the_next_prompt_repeats(small_trace: Path):
    """Turn k's scripted answer is generated from turn k+1's hash ids at the positions the
    next prompt repeats it, so D holds exactly what the next turn resends."""
    _a, b = load_trace(small_trace)
    turns = script_session(b, token_scale=1 / 8)
    nxt = b.turns[1]
    expected = words_for(b.namespace, nxt.block_ids, 64, 1 / 8, 700, 750, fallback="o0", at_least=0)
    assert turns[0].content == expected
    assert turns[0].sim_script == {"content": expected}


def test_text_traces_keep_their_text(tmp_path: Path):
    path = tmp_path / "c.json"
    path.write_text(
        '[{"id": "c", "messages": [{"role": "user", "content": "hi"}, '
        '{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}, '
        '{"role": "assistant", "content": "sure"}]}]'
    )
    (s,) = load_trace(path)
    turns = script_session(s, token_scale=0.5)  # no effect on text
    assert turns[0].add[0].content == "hi" and turns[0].content == "hello"
    assert turns[1].add[0].content == "more" and turns[1].content == "sure"
