"""The turn core's decisions (:mod:`agentkv.router.turn`): :func:`turn_plan` and
:func:`remember_plan`."""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

from pydantic import ValidationError

from agentkv.protocol import KVTransferParams
from agentkv.protocol import kv_transfer as kvt
from agentkv.router.config import RouterConfig
from agentkv.router.identity import Resolved
from agentkv.router.paths import PATHS, Choice, DecodeBudget, TurnState, choose
from agentkv.router.receipt import Receipt
from agentkv.router.sse import Captured
from agentkv.router.store import StoredHandle, StoreKey, Taken
from agentkv.router.turn.actions import (
    KEEP_ON_DECODE,
    Action,
    Answered,
    Candidates,
    CpuHeld,
    Decode,
    DecodeFailed,
    DecodeRefused,
    Discard,
    End,
    Fail,
    Found,
    Identify,
    Kept,
    PickDecode,
    PickPrefill,
    Prefill,
    PrefillChoice,
    PrefillDone,
    PrefillRefused,
    PrefillTimedOut,
    PrefillUnreachable,
    Record,
    Release,
    RememberJob,
    Renew,
    Reserve,
    Resolve,
    Restore,
    Retry,
    Store,
    Take,
    Tokenize,
    Turn,
    TurnInput,
)
from agentkv.router.verify import PromptHashes, ReusePlan, hash_root, held_record, plan_reuse

__all__ = ["reachable", "remember_plan", "turn_plan"]

_LOCAL_HOSTS = {"", "localhost", "127.0.0.1", "0.0.0.0", "::1"}


@dataclass(frozen=True)
class _Prefilled:
    params: dict[str, Any]
    url: str
    receipt: Receipt
    sim_headers: Mapping[str, str]


# -- the turn ---------------------------------------------------------------------------------
def turn_plan(t: TurnInput, cfg: RouterConfig) -> Turn:
    """One turn, from the prompt's ids to D's first byte."""
    resolved: Resolved = yield Resolve()
    ids = resolved.ids if resolved.ids is not None else t.prompt_ids
    if ids is None:
        ids = yield Tokenize()
    refused = _check_context(len(ids), t.max_tokens, t.context_limit)
    if refused is not None:
        return refused
    if t.key is not None and t.lease_s is not None:
        yield Renew(t.key, t.lease_s)
    # the prompt is hashed once a turn: for verification, and again for what D will hold
    hashes = PromptHashes(ids, cfg.upstream.block_size, hash_root(t.model, t.cache_salt))
    plan, found = yield from _take_handle(t, cfg, hashes)
    remember = RememberJob(t.key, t.epoch, hashes, resolved.pending)
    tried: set[str] = set()
    holder = plan.taken.handle.decode_url if plan.taken else None
    choice, cpu_url = _choose(t, cfg, len(ids), plan, found), None
    if choice is None and cfg.paths.mode != "pull" and plan.taken is None and found is not None:
        choice, cpu_url = yield from _choose_cpu(t, cfg, ids, found)
    if choice is not None and choice.path in ("decode", "cpu"):
        end, plan, failed = yield from _decode_in_place(
            t, ids, plan, choice, remember, resolved, cpu_url
        )
        if end is not None:
            return end
        if failed:
            tried.add(failed)  # the P pass places the turn on another D
        choice = None
    for attempt in range(cfg.upstream.retries + 1):
        # a retry after D failed is a fresh P pass: P's own cache now holds the prompt
        pre, unspent = yield from _prefill(
            t, cfg, ids, plan if attempt == 0 else plan.without_handle()
        )
        if isinstance(pre, Fail):
            yield from _restore(t.key, unspent)
            return pre
        receipt = replace(pre.receipt, identity=resolved.outcome)
        if choice is not None:
            receipt = _estimated(receipt, choice)
        if attempt > 0:
            # P's events of the earlier pass may not have reached the index yet: what P found
            # in its own cache on this pass is not known, so the receipt says estimated
            receipt = replace(receipt, local=None)
        choice = None
        candidates = tuple(u for u in t.decode_urls if u not in tried) or t.decode_urls
        url = yield PickDecode(candidates, holder)
        if url is None:
            return Fail(503, "No healthy decode instance.")
        tried.add(url)
        out = yield Decode(url, pre.params, receipt, pre.url, pre.sim_headers, remember)
        if isinstance(out, DecodeFailed):
            yield Retry("decode_error")
            continue
        if isinstance(out, DecodeRefused):
            return Fail(out.status, body=out.body)
        return Answered(receipt, pre.url, url, ids)
    return Fail(502, "No decode instance answered.")


def _choose(
    t: TurnInput, cfg: RouterConfig, n: int, plan: ReusePlan, found: Found | None
) -> Choice | None:
    """The cost model's path for a turn whose verified handle P would read (None: config
    ``paths.mode = "pull"``, or no such handle). D's prefix cache holds the handle's verified full
    blocks (vLLM's prefix cache counts full blocks only). A D out of rotation is not a place to
    decode: its handle can only be read back."""
    if cfg.paths.mode == "pull" or plan.taken is None or plan.params is None or plan.release:
        return None
    url = plan.taken.handle.decode_url
    if found is None or url in found.unhealthy:
        return None
    in_flight = found.in_flight
    state = TurnState(
        n,
        handle_tokens=plan.attached_tokens,
        d_cached_tokens=min(plan.verified_tokens, n - 1)
        // cfg.upstream.block_size
        * cfg.upstream.block_size,
        d_in_flight_tokens=in_flight.get(url, 0),
        d_running_streams=found.running.get(url, 0),
        p_queued_tokens=found.p_queued_tokens,
        recompute_threshold=cfg.upstream.kv_recompute_threshold,
    )
    budget = DecodeBudget(cfg.paths.decode_max_new_tokens, cfg.paths.decode_tokens_in_flight)
    choice = choose(state, t.curves, budget)
    if (
        cfg.paths.mode == "decode"
        and "decode" in choice.estimates
        and "decode" not in choice.excluded
    ):
        # in place whenever D's budget allows it, whatever the estimates
        return replace(choice, path="decode", ttft_s=choice.estimates["decode"].ttft_s)
    return choice


def _choose_cpu(
    t: TurnInput, cfg: RouterConfig, ids: Sequence[int], found: Found
) -> Generator[Action, Any, tuple[Choice | None, str | None]]:
    """The cost model's path for a turn with no handle to read when a D's CPU tier holds a
    prefix of the prompt (its KV events, matched by the prompt's own ids): the D holding the
    most (ties: the least busy). D's GPU prefix cache is not known here (``g = 0``)."""
    held: Mapping[str, int] = yield CpuHeld(ids, t.cache_salt)
    held = {u: n for u, n in held.items() if n > 0 and u not in found.unhealthy}
    if not held:
        return None, None
    url = max(held, key=lambda u: (held[u], -found.in_flight.get(u, 0)))
    state = TurnState(
        len(ids),
        d_cpu_tokens=held[url],
        d_in_flight_tokens=found.in_flight.get(url, 0),
        d_running_streams=found.running.get(url, 0),
        p_queued_tokens=found.p_queued_tokens,
        recompute_threshold=cfg.upstream.kv_recompute_threshold,
    )
    budget = DecodeBudget(cfg.paths.decode_max_new_tokens, cfg.paths.decode_tokens_in_flight)
    choice = choose(state, t.curves, budget)
    if cfg.paths.mode == "decode" and "cpu" in choice.estimates and "cpu" not in choice.excluded:
        choice = replace(choice, path="cpu", ttft_s=choice.estimates["cpu"].ttft_s)
    return (choice, url) if choice.path == "cpu" else (None, None)


def _estimated(receipt: Receipt, choice: Choice) -> Receipt:
    """The receipt with the cost model's estimate of the path the turn took (when it estimated
    that one) and of the cheapest other path D's budget allowed."""
    taken = choice.estimates.get(receipt.decision)  # type: ignore[call-overload]
    if taken is None:
        return receipt
    others = [
        e
        for path, e in choice.estimates.items()
        if path != receipt.decision and path not in choice.excluded
    ]
    best = min(others, key=lambda e: (e.ttft_s, PATHS.index(e.path)), default=None)
    return replace(
        receipt,
        estimate_s=taken.ttft_s,
        runner_up=best.path if best else None,
        runner_up_s=best.ttft_s if best else None,
    )


def _decode_in_place(
    t: TurnInput,
    ids: Sequence[int],
    plan: ReusePlan,
    choice: Choice,
    remember: RememberJob,
    resolved: Resolved,
    cpu_url: str | None = None,
) -> Generator[Action, Any, tuple[End | None, ReusePlan, str | None]]:
    """The turn straight to a D (no P): ``decode``, the D that holds its verified handle, which
    prefills the new tokens from its own prefix cache; ``cpu``, the D at ``cpu_url`` whose CPU
    tier holds a prefix (no handle), which loads it and prefills the rest. Either way D keeps its
    blocks for a new handle (:data:`KEEP_ON_DECODE`). A taken handle is spent when D accepts
    (its blocks are superseded by D's new handle, so D is told to free them); until then it is
    unspent. Returns how the turn ended, or None and the plan the P pass goes on with: the
    handle still attached (D's budget is full, or D answered 5xx/429 and its KV is still
    readable) or released (D unreachable or silent past its deadline: a read from it would fail
    too); and the D that failed, if one did. Without a handle the P pass recomputes."""
    taken = plan.taken
    if choice.path == "cpu":
        assert cpu_url is not None
        url = cpu_url
    else:
        assert taken is not None
        url = taken.handle.decode_url
    new = choice.estimates[choice.path].computed_tokens
    if not (yield Reserve(url, new)):
        yield Retry("decode_budget")
        return None, plan, None
    receipt = _estimated(
        Receipt(choice.path, 0, plan.verified_tokens, None, plan.cause, resolved.outcome), choice
    )
    params = dict(KEEP_ON_DECODE)
    out = yield Decode(url, params, receipt, None, {}, remember, reserved=new)
    if isinstance(out, DecodeRefused):
        # D's own client error (P would refuse it too): passed on, the handle unspent
        yield from _restore(t.key, plan)
        return Fail(out.status, body=out.body), plan, None
    if isinstance(out, DecodeFailed):
        yield Retry("decode_in_place")
        if out.reason == "status" or taken is None:
            return None, plan, url
        return None, (yield from _lost(plan, "decode_failed")), url
    # D accepted: the handle is spent; D's new handle holds all of its verified blocks
    if taken is not None:
        yield Release(taken.handle, "superseded")
    return Answered(receipt, None, url, ids), plan.without_handle(), None


def _check_context(n: int, most: object, limit: int | None) -> Fail | None:
    """Refuse what the engines would (vLLM's messages): a prompt or ``max_tokens`` past the
    served context length. P alone would accept it and read D's blocks, and D's refusal would
    come after the conversation's handle was spent."""
    if limit is None:
        return None
    if n > limit:
        return Fail(
            400,
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"contains {n} input tokens, which exceeds this limit even without any output "
            "tokens. Please reduce the length of the input prompt.",
            param="input_tokens",
        )
    if isinstance(most, int) and n + most > limit:
        return Fail(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{most} output tokens and your prompt contains {n} input tokens, for a total of "
            f"{n + most} tokens. Please reduce the length of the input prompt or the number "
            "of requested output tokens.",
            param="max_tokens",
        )
    return None


def _readable(candidate: Taken, engines: Mapping[str, str | None]) -> bool | None:
    """Whether a stored handle's D is the engine that issued it: True, False (it is gone:
    another engine is behind the URL, or the URL left the configuration), or None (the D is
    not identified now: the handle waits)."""
    url = candidate.handle.decode_url
    if url not in engines:
        return False
    if engines[url] is None:
        return None
    return kvt.engine_id(candidate.handle.params) == engines[url]


def _take_handle(
    t: TurnInput, cfg: RouterConfig, hashes: PromptHashes
) -> Generator[Action, Any, tuple[ReusePlan, Found | None]]:
    """Choose and take a handle; a handle another replica took first is skipped. Also returns
    what the store and the driver said (None: no conversation)."""
    if t.key is None:
        return ReusePlan("miss", None, 0, 0, False), None
    found: Found = yield Candidates(t.key)
    candidates: list[Taken] = []
    for candidate in found.handles:
        readable = _readable(candidate, found.engines)
        if readable:
            candidates.append(candidate)
        elif readable is False:
            yield Discard(t.key, candidate.handle.id, "restarted")
    for _ in range(3):
        plan = plan_reuse(
            candidates,
            hashes,
            epoch=t.epoch,
            router_ttl_s=cfg.router_ttl_s,
            threshold=cfg.upstream.kv_recompute_threshold,
            can_pull=found.can_pull,
            verify=cfg.paths.reuse_policy == "verified",
        )
        for gone in plan.expired:
            yield Discard(t.key, gone.handle.id)
        if plan.taken is None:
            return plan, found
        releases = plan.decision if plan.release else None
        taken: Taken | None = yield Take(t.key, plan.taken.handle.id, releases)
        if taken is not None:
            return replace(plan, taken=taken), found
        candidates = [c for c in candidates if c.handle.id != plan.taken.handle.id]
    return ReusePlan("miss", None, 0, 0, False), found


def _restore(key: StoreKey | None, plan: ReusePlan) -> Generator[Action, Any, None]:
    """Put an unspent handle back (it keeps its age); a release-only plan's too."""
    if key is None or plan.taken is None:
        return
    displaced: list[StoredHandle] = yield Restore(key, plan.taken)
    for old in displaced:
        yield from _release_displaced(old, plan.taken.handle)


def _release_displaced(old: StoredHandle, mine: StoredHandle) -> Generator[Action, Any, None]:
    yield Release(old, "displaced" if old is not mine else "store_down")


def _lost(plan: ReusePlan, reason: str) -> Generator[Action, Any, ReusePlan]:
    """P failed with the handle attached: D still pins its blocks; free them, go on without."""
    if plan.taken is not None and not plan.release:
        yield Release(plan.taken.handle, reason)
    return plan.without_handle()


def _prefill(
    t: TurnInput, cfg: RouterConfig, ids: Sequence[int], plan: ReusePlan
) -> Generator[Action, Any, tuple[_Prefilled | Fail, ReusePlan]]:
    """Run P with ``plan``; on the way the plan loses a handle P may have started to read
    (released) and keeps one no P has seen. Returns P's result and what of the plan is unspent
    (the caller puts it back when the turn fails)."""
    n, threshold = len(ids), cfg.upstream.kv_recompute_threshold
    for _ in range(cfg.upstream.retries + 2):
        choice: PrefillChoice | None = yield PickPrefill(plan.params is not None, ids)
        if choice is None and plan.params is not None:
            # no P can read it: put it back for a later turn
            yield from _restore(t.key, plan)
            plan = plan.without_handle("local")
            continue
        if choice is None:
            return Fail(503, "No healthy prefill instance."), plan
        if _covered_locally(plan, n, choice.local, threshold):
            # P's own prefix cache already holds what this handle shares with the prompt, and
            # the handle holds more. After the client's rewrite that is history nobody reads
            # again: P only notifies D to free it. Otherwise it is another branch's history:
            # reading it would only spend it, so it stays for its branch.
            assert plan.params is not None
            if plan.cause == "rewrite":
                release = plan.params.release_only()
                plan = replace(plan, decision="local", params=release, release=True)
            else:
                yield from _restore(t.key, plan)
                plan = plan.without_handle("local")
        params = plan.params if plan.params is not None else KVTransferParams.for_prefill()
        reads = plan.params is not None and not plan.release
        attached = plan.params is not None
        out = yield Prefill(choice.url, ids, params.to_wire(), reads, attached)
        if isinstance(out, PrefillDone):
            # P accepted the request: the handle is spent, whatever follows
            spent = plan.without_handle()
            if not out.params:
                return Fail(502, "A prefill instance returned no kv_transfer_params."), spent
            receipt = _receipt(plan, n, choice.local, threshold)
            return _Prefilled(out.params, choice.url, receipt, out.sim_headers), spent
        if isinstance(out, PrefillTimedOut):
            yield Retry("deadline" if reads else "prefill_deadline")
            plan = yield from _lost(plan, "deadline")
        elif isinstance(out, PrefillUnreachable):
            # never reached P (or P died): the handle is unread, keep it attached elsewhere
            yield Retry("prefill_error")
        elif isinstance(out, PrefillRefused):
            return Fail(out.status, body=out.body), plan
        elif attached and out.status != 429:
            # 500 with a handle (kv_load_failure_policy "fail"): once more, without it
            yield Retry("handle_failed")
            plan = yield from _lost(plan, "prefill_failed")
        else:
            yield Retry("prefill_error")
    return Fail(503, "No prefill instance answered."), plan


def _p_reads(m: int, threshold: int) -> bool:
    """Whether P reads M tokens from D (vLLM skips reads below its recompute threshold)."""
    return m > 0 and not (threshold > 0 and m < threshold)


def _covered_locally(plan: ReusePlan, n: int, local: int | None, threshold: int) -> bool:
    """A partly verified handle whose verified part P holds itself (M below threshold)."""
    if plan.params is None or plan.release or plan.taken is None or local is None:
        return False
    if plan.verified_tokens >= plan.taken.handle.num_tokens:
        return False  # all of it is this prompt's: this turn's own handle supersedes it
    return not _p_reads(min(plan.attached_tokens, n) - local, threshold)


def _receipt(plan: ReusePlan, n: int, local: int | None, threshold: int) -> Receipt:
    """M = max(0, min(C, N) − L), zero when below P's threshold (P then only notifies D)."""
    if plan.params is None or plan.release:
        return Receipt(plan.decision, 0, plan.verified_tokens, local, plan.cause)
    offered = min(plan.attached_tokens, n)
    m = max(0, offered - (local or 0))
    if local is not None and not _p_reads(m, threshold):
        # P's own prefix cache covers what D offers: P reads nothing, D frees the blocks
        return Receipt("local", 0, plan.verified_tokens, local, plan.cause)
    return Receipt(plan.decision, m, plan.verified_tokens, local, plan.cause)


# -- what D's answer leaves behind ------------------------------------------------------------
def reachable(params: dict[str, Any], url: str, side_channel_host: str | None) -> dict[str, Any]:
    """A handle with an owner address its reader can reach (``url``: the owner engine's)."""
    host = side_channel_host
    if host is None and kvt.owner_host(params) in _LOCAL_HOSTS:
        url_host = urlsplit(url).hostname or ""
        host = url_host if url_host not in _LOCAL_HOSTS else None
    return kvt.with_owner_host(params, host) if host else dict(params)


def remember_plan(
    job: RememberJob,
    captured: Captured,
    url: str,
    side_channel_host: str | None,
) -> Generator[Action, Any, Kept]:
    """Keep D's new handle (the D at ``url``) with the hashes of the blocks it holds, under the
    conversation; released at once without one, and so are the handles it displaces."""
    if job.pending is not None:
        # before the client can see the end of the turn (and send the next one)
        message = captured.assistant_message()
        yield Record(job.pending, job.prompt.ids(), captured.output_ids, message)
    handle = captured.handle
    try:
        parsed = KVTransferParams.from_wire(handle) if handle else None
    except ValidationError:
        return "unknown"
    if handle is None or parsed is None or not parsed.has_blocks:
        return "none"
    yield Identify(url, kvt.engine_id(handle))
    num = parsed.num_tokens
    held = held_record(captured.output_ids, num, job.prompt)
    stored = StoredHandle(
        params=reachable(handle, url, side_channel_host),
        block_hashes=held.digests,
        tail_tokens=held.tail,
        num_tokens=num,
        block_size=job.prompt.block_size,
        epoch=job.epoch,
        decode_url=url,
        root=job.prompt.root,
        prefix_digest=held.prefix,
    )
    if job.key is None:
        yield Release(stored, "anonymous")
        return "released"
    displaced: list[StoredHandle] = yield Store(job.key, stored)
    for old in displaced:
        yield from _release_displaced(old, stored)
    return "stored"
