"""plan_reuse: one rule per case (pure)."""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkv.router.request import checked_ids, int32_le
from agentkv.router.store import DIGEST_SIZE, StoredHandle, Taken
from agentkv.router.verify import (
    PromptHashes,
    block_digests,
    chain_hashes,
    hash_root,
    held_record,
    plan_reuse,
    verified_tokens,
)

BS = 4
HELD = list(range(100, 122))  # 22 tokens: 5 full blocks + 2
ROOT = hash_root("m", None)


def handle(
    epoch: int = 0, num: int = 22, held: list[int] = HELD, root: bytes = ROOT, req: str = "r"
) -> StoredHandle:
    record = held_record([], num, PromptHashes(held, BS, root))
    params = {
        "do_remote_decode": True,
        "remote_block_ids": [list(range(1, 7))],
        "remote_engine_id": "d",
        "remote_request_id": req,
        "remote_host": "h",
        "remote_port": 1,
        "remote_num_tokens": num,
        "remote_registration_generation": 3,
    }
    return StoredHandle(
        params, record.digests, record.tail, num, BS, epoch, "http://d", root, record.prefix
    )


def plan(
    prompt, h=None, age=0.0, epoch=0, threshold=4, can_pull=True, verify=True, root=ROOT, more=()
):
    candidates = [Taken(h if h is not None else handle(), age), *more]
    return plan_reuse(
        candidates,
        PromptHashes(prompt, BS, root),
        epoch=epoch,
        router_ttl_s=450,
        threshold=threshold,
        can_pull=can_pull,
        verify=verify,
    )


def wire(p):
    return p.params.to_wire()


def test_chain_hashes_depend_on_everything_before():
    a, b = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS), chain_hashes([0, 2, 3, 4, 5, 6, 7, 8], BS)
    assert a[0] != b[0] and a[1] != b[1]


def test_chain_hashes_depend_on_the_root():
    ids = [1, 2, 3, 4]
    assert chain_hashes(ids, BS, hash_root("m", "s1")) != chain_hashes(
        ids, BS, hash_root("m", "s2")
    )
    assert chain_hashes(ids, BS, hash_root("a", None)) != chain_hashes(
        ids, BS, hash_root("b", None)
    )


def digests(ids, root=ROOT):
    return block_digests(int32_le(ids), BS, root)


def test_block_digests_one_per_full_block_salted_by_the_root():
    a = digests([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(a) == 2 * DIGEST_SIZE
    assert digests([1, 2, 3, 4, 5, 6, 7, 0])[:DIGEST_SIZE] == a[:DIGEST_SIZE]
    assert digests([1, 2, 3, 4, 5, 6, 7, 0])[DIGEST_SIZE:] != a[DIGEST_SIZE:]
    assert digests([1, 2, 3, 4], hash_root("m", "s1")) != digests(
        [1, 2, 3, 4], hash_root("m", "s2")
    )
    assert digests([1, 2, 3, 4], hash_root("a", None)) != digests(
        [1, 2, 3, 4], hash_root("b", None)
    )


@given(
    st.lists(st.integers(0, 2**31 - 1), max_size=80),
    st.sampled_from([1, 4, 16]),
    st.binary(min_size=16, max_size=16),
)
def test_block_and_chain_hashes_are_their_wire_definitions(ids, bs, root):
    """The digests a stored handle and the prefix index keep, as written down: a router of
    another release, sharing Redis, computes the same bytes."""
    data, step = int32_le(ids), 4 * bs
    blocks = [data[i : i + step] for i in range(0, len(data) // step * step, step)]
    expected = b"".join(
        hashlib.blake2b(b, digest_size=DIGEST_SIZE, salt=root).digest() for b in blocks
    )
    assert block_digests(data, bs, root) == expected
    wide, parent, chain = array("q", ids).tobytes(), root, []
    for i in range(0, len(wide) - 8 * bs + 1, 8 * bs):
        parent = hashlib.blake2b(parent + wide[i : i + 8 * bs], digest_size=12).digest()
        chain.append(parent.hex())
    assert chain_hashes(ids, bs, root) == chain


def test_token_ids_hash_as_lists_do():
    ids = checked_ids(list(range(50)))
    assert ids is not None and ids.data == int32_le(range(50))
    assert PromptHashes(ids, BS, ROOT).upto(99) == digests(list(range(50)))


def test_prompt_hashes_extend_lazily_and_agree():
    prompt = list(range(50))
    lazy = PromptHashes(prompt, BS, ROOT)
    assert lazy.upto(3) == digests(prompt[:12])
    assert lazy.upto(12) == digests(prompt)
    assert lazy.upto(99) == digests(prompt)


def test_held_record_reuses_the_prompts_hashes():
    prompt, output = list(range(1, 31)), [7, 8, 9, 10, 11]  # 30 + 5 tokens held, less the last
    lazy = PromptHashes(prompt, BS, ROOT)
    lazy.upto(3)  # verification hashed part of it already
    hashes, tail, prefix = held_record(output, 34, lazy)
    held = [*prompt, *output][:34]
    assert hashes == digests(held[:32]) and tail == held[32:]
    assert prefix == PromptHashes(held, BS, ROOT).prefix_digest(32 * 4)
    short, tail, prefix = held_record(output, 10, PromptHashes(prompt, BS, ROOT))
    assert short == digests(prompt[:8]) and tail == prompt[8:10]
    assert prefix == PromptHashes(prompt[:8], BS, ROOT).prefix_digest(8 * 4)


def test_one_prefix_digest_verifies_every_block_and_a_miss_is_block_precise():
    """Issue 23: a handle whose blocks are all the prompt's is verified by one digest over their
    bytes (the prompt's per-block digests are then the handle's); any changed block fails it,
    and the blocks are then compared one by one."""
    h = handle()
    assert h.prefix_digest
    lazy = PromptHashes([*HELD, 7, 7], BS, ROOT)
    assert verified_tokens(h, lazy) == 22
    assert lazy.upto(5) == h.block_hashes  # adopted, not computed
    for i in range(5):
        prompt = list(HELD)
        prompt[i * BS + 2] += 1000
        assert verified_tokens(h, PromptHashes(prompt, BS, ROOT)) == i * BS
    bare = replace(h, prefix_digest=b"")  # a record without one: block by block
    assert verified_tokens(bare, PromptHashes([*HELD, 7], BS, ROOT)) == 22


def test_prefix_digest_continues_and_restarts():
    prompt = list(range(64))
    whole = PromptHashes(prompt, BS, ROOT)
    assert whole.prefix_digest(40) == PromptHashes(prompt, BS, ROOT).prefix_digest(40)
    assert whole.prefix_digest(200) == PromptHashes(prompt[:50], BS, ROOT).prefix_digest(200)
    assert whole.prefix_digest(40) == PromptHashes(prompt[:10], BS, ROOT).prefix_digest(40)
    assert whole.prefix_digest(40) != PromptHashes(prompt, BS, hash_root("x", None)).prefix_digest(
        40
    )


def test_a_changed_block_stops_verification_there():
    """Every block of the verified prefix is compared, not only the last."""
    h = handle()
    for i in range(5):
        prompt = list(HELD)
        prompt[i * BS + 1] += 1000
        assert verified_tokens(h, PromptHashes(prompt, BS, ROOT)) == i * BS


def test_extension_is_verified_in_full():
    p = plan([*HELD, 7, 7, 7])
    assert (p.decision, p.attached_tokens, p.verified_tokens, p.cause) == ("pull", 22, 22, None)
    assert wire(p)["remote_block_ids"] == [list(range(1, 7))]
    # unknown fields pass through whole (vLLM 0.33's registration generation)
    assert wire(p)["remote_registration_generation"] == 3
    assert wire(p)["do_remote_decode"] is True and wire(p)["do_remote_prefill"] is False


def test_tail_mismatch_trims_to_full_blocks():
    p = plan([*HELD[:21], 0, 9])
    assert (p.decision, p.attached_tokens, p.cause) == ("pull", 20, "drift")
    assert wire(p)["remote_block_ids"] == [list(range(1, 6))] and wire(p)["remote_num_tokens"] == 20


def test_rewrite_in_the_middle_trims_to_the_common_prefix():
    prompt = [*HELD[:9], 0, *HELD[10:], 5]
    p = plan(prompt)
    assert p.attached_tokens == 8 and wire(p)["remote_block_ids"] == [[1, 2]]


def test_shorter_prompt_never_reads_past_it():
    assert verified_tokens(handle(), PromptHashes(HELD[:10], BS, ROOT)) == 8
    assert plan(HELD[:10]).attached_tokens == 8


def test_too_little_left_of_the_same_epoch_is_kept_for_its_branch():
    p = plan([0, *HELD])
    assert p.decision == "stale" and p.params is None and p.taken is None


def test_too_little_left_after_a_rewrite_releases():
    p = plan([0, *HELD], h=handle(epoch=0), epoch=1)
    assert p.decision == "stale" and p.release and wire(p)["remote_num_tokens"] == 0
    assert p.cause == "rewrite" and p.taken is not None


def test_epoch_change_keeps_the_verified_prefix():
    # the epoch is a hint: a rewrite that kept the first 3 blocks still pulls them
    prompt = [*HELD[:12], 0, 0, 0, 0, 5]
    p = plan(prompt, h=handle(epoch=0), epoch=1)
    assert (p.decision, p.attached_tokens, p.verified_tokens, p.cause) == (
        "pull",
        12,
        12,
        "rewrite",
    )
    assert wire(p)["remote_block_ids"] == [[1, 2, 3]]


def test_a_handle_that_is_all_prefix_but_below_the_threshold_is_released():
    small = handle(num=6)
    p = plan([*HELD[:6], 1, 2, 3], h=small, threshold=8)
    assert p.decision == "recompute" and p.release and p.taken is not None


def test_another_salt_never_verifies():
    other = hash_root("m", "tenant-b")
    p = plan([*HELD, 1], root=other)
    assert p.verified_tokens == 0 and p.params is None
    assert verified_tokens(handle(), PromptHashes([*HELD, 1], BS, other)) == 0


def test_another_model_never_verifies():
    assert plan([*HELD, 1], root=hash_root("other-model", None)).verified_tokens == 0


def test_tiny_handle_under_another_salt_never_verifies_by_its_tail():
    tiny = handle(num=3)  # no full block: only the tail tokens
    assert verified_tokens(tiny, PromptHashes(HELD, BS, hash_root("m", "x"))) == 0
    assert verified_tokens(tiny, PromptHashes(HELD, BS, ROOT)) == 3


def test_branches_the_longest_verified_prefix_wins():
    a_hist = list(range(100, 140))
    b_hist = [*range(100, 108), *range(900, 932)]
    a, b = handle(held=a_hist, num=40, req="a"), handle(held=b_hist, num=40, req="b")
    for_b = plan([*b_hist, 1, 2], h=a, more=[Taken(b, 1.0)])
    assert for_b.taken is not None and for_b.taken.handle is b and for_b.attached_tokens == 40
    for_a = plan([*a_hist, 3], h=a, more=[Taken(b, 1.0)])
    assert for_a.taken is not None and for_a.taken.handle is a


def test_expired_candidates_are_set_aside():
    fresh = handle(req="fresh")
    p = plan([*HELD, 1], h=handle(req="old"), age=500, more=[Taken(fresh, 1.0)])
    assert p.decision == "pull" and p.taken is not None and p.taken.handle is fresh
    assert [t.handle.params["remote_request_id"] for t in p.expired] == ["old"]


@pytest.mark.parametrize(("age", "decision"), [(449.9, "pull"), (450.0, "expired")])
def test_router_ttl(age, decision):
    assert plan([*HELD, 1], age=age).decision == decision


def test_no_bidirectional_prefill_means_local():
    p = plan([*HELD, 1], can_pull=False)
    assert p.decision == "local" and p.params is None and p.taken is None


def test_miss():
    p = plan_reuse(
        [],
        PromptHashes(HELD, BS, ROOT),
        epoch=0,
        router_ttl_s=450,
        threshold=4,
        can_pull=True,
    )
    assert p.decision == "miss" and p.params is None


def test_unverified_policy_attaches_a_stale_handle_whole():
    p = plan([0, 0, 0], verify=False)
    assert p.decision == "pull" and p.attached_tokens == 22 and wire(p)["remote_num_tokens"] == 22
