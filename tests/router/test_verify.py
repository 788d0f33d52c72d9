"""plan_reuse: one rule per case (pure)."""

from __future__ import annotations

import pytest

from agentkv.router.store import StoredHandle
from agentkv.router.verify import chain_hashes, held_record, plan_reuse, verified_tokens

BS = 4
HELD = list(range(100, 122))  # 22 tokens: 5 full blocks + 2


def handle(epoch: int = 0, num: int = 22) -> StoredHandle:
    hashes, tail = held_record(HELD, num, BS)
    params = {
        "do_remote_decode": True,
        "remote_block_ids": [list(range(1, 7))],
        "remote_engine_id": "d",
        "remote_request_id": "r",
        "remote_host": "h",
        "remote_port": 1,
        "remote_num_tokens": num,
    }
    return StoredHandle(params, hashes, tail, num, BS, epoch, "http://d")


def plan(prompt, h=None, age=0.0, epoch=0, threshold=4, can_pull=True, verify=True):
    return plan_reuse(
        h if h is not None else handle(),
        age,
        prompt,
        epoch=epoch,
        router_ttl_s=450,
        threshold=threshold,
        can_pull=can_pull,
        verify=verify,
    )


def test_chain_hashes_depend_on_everything_before():
    a, b = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS), chain_hashes([0, 2, 3, 4, 5, 6, 7, 8], BS)
    assert a[0] != b[0] and a[1] != b[1]


def test_extension_is_verified_in_full():
    p = plan([*HELD, 7, 7, 7])
    assert (p.decision, p.reused_tokens, p.verified_tokens) == ("pull", 22, 22)
    assert p.params["remote_block_ids"] == [list(range(1, 7))]


def test_tail_mismatch_trims_to_full_blocks():
    p = plan([*HELD[:21], 0, 9])
    assert (p.decision, p.reused_tokens) == ("pull", 20)
    assert (
        p.params["remote_block_ids"] == [list(range(1, 6))] and p.params["remote_num_tokens"] == 20
    )


def test_rewrite_in_the_middle_trims_to_the_common_prefix():
    prompt = [*HELD[:9], 0, *HELD[10:], 5]
    p = plan(prompt)
    assert p.reused_tokens == 8 and p.params["remote_block_ids"] == [[1, 2]]


def test_shorter_prompt_never_reads_past_it():
    assert verified_tokens(handle(), HELD[:10]) == 8
    assert plan(HELD[:10]).reused_tokens == 8


def test_too_little_left_releases():
    p = plan([0, *HELD])
    assert p.decision == "stale" and p.release and p.params["remote_num_tokens"] == 0


def test_epoch_change_releases_without_verifying():
    p = plan([*HELD, 1], h=handle(epoch=0), epoch=1)
    assert p.decision == "stale" and p.release and p.verified_tokens == 0


@pytest.mark.parametrize(("age", "decision"), [(449.9, "pull"), (450.0, "expired")])
def test_router_ttl(age, decision):
    assert plan([*HELD, 1], age=age).decision == decision


def test_no_bidirectional_prefill_means_local():
    p = plan([*HELD, 1], can_pull=False)
    assert p.decision == "local" and p.params is None


def test_miss():
    p = plan_reuse(None, 0.0, HELD, epoch=0, router_ttl_s=450, threshold=4, can_pull=True)
    assert p.decision == "miss" and p.params is None


def test_unverified_policy_attaches_a_stale_handle_whole():
    p = plan([0, 0, 0], verify=False)
    assert p.decision == "pull" and p.reused_tokens == 22 and p.params["remote_num_tokens"] == 22
