"""A turn decoded in place on real vLLM 0.33 (CPU): docs/paths.md reads in vLLM's source that a
request reaching D without a remote prefill is prefilled there from D's own prefix cache. Through
a router with ``paths.mode = "decode"`` on the real engines, a turn that adds a user message to
what D holds goes straight to that D: P reads nothing, D's prefix cache hits the history's full
blocks (its ``local_cache_hit`` counter), and the first token's top-5 logprobs equal a clean
recompute's (P, a fresh ``cache_salt``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests._support.vllm_scenarios import MODEL, SYSTEM, Stack, router_on, turn

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.timeout(900)]
HIT = "vllm:prompt_tokens_by_source_total[local_cache_hit]"
BLOCK = 32  # cpu-tiny's block size


@pytest.fixture(scope="module")
def decode_router(real: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from router_on(real, tmp_path_factory.mktemp("decode"), paths={"mode": "decode"})


def test_a_turn_decoded_in_place_hits_ds_prefix_cache_and_is_exact(real, decode_router):
    stack = Stack(decode_router, real.prefill, real.decode, True)
    with stack.client() as c:
        conv = c.conversation(model=MODEL, system=f"[decode-local] {SYSTEM}")
        conv.add_user("Question 0: explain P/D disaggregation.")
        first = turn(stack, conv, "decode-local", 1)
        stack.wait_decode_idle()
        conv.add_user("Question 1: and decode in place?")
        hit_before = stack.metrics(real.decode).get(HIT, 0.0)
        second = turn(stack, conv, "decode-local", 2)
        hit = stack.metrics(real.decode).get(HIT, 0.0) - hit_before
    stack.settle()
    print(f"decode-local: {first} | {second} | D's local_cache_hit +{hit:.0f}")
    # the first turn has no handle: P computes it (a cold engine's first request can run past
    # the prefill deadline and be computed again: "recompute")
    assert first.decision in ("miss", "recompute"), first
    assert second.decision == "decode", second
    assert second.pulled == 0, second  # P read nothing: it was not asked
    # D held the first prompt and its answer; vLLM hits full blocks only
    held = first.prompt_tokens + 72 - 1
    assert hit >= held // BLOCK * BLOCK - BLOCK, (hit, held)
    assert second.cached_tokens is not None and second.cached_tokens >= hit - BLOCK, second
    assert second.logprob_diff is not None and second.logprob_diff <= 1e-5, second
