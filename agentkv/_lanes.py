"""The lane table of :mod:`agentkv.pool`: keys, their lanes, which lane a call takes (no I/O)."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from openai.types.chat import ChatCompletion

import agentkv
from agentkv._history import fingerprint

__all__ = [
    "THREAD_STATE_VERSION",
    "AnyConversation",
    "Kind",
    "Lane",
    "LaneTable",
    "Turn",
    "take_messages",
]

Kind = Literal["new", "same", "append", "rewrite"]
AnyConversation = agentkv.Conversation | agentkv.AsyncConversation
THREAD_STATE_VERSION = 1


def _tools_key(tools: Sequence[Mapping[str, Any]] | None) -> str:
    return json.dumps(list(tools or []), sort_keys=True)


@dataclass
class Lane:
    """One agentkv conversation of a key."""

    id: str
    conversation: AnyConversation
    tools_key: str
    prints: list[tuple[Any, ...]]
    """Fingerprints of the conversation's history (what a framework would send back)."""
    busy: bool = False
    used: float = field(default_factory=time.monotonic)


@dataclass
class _Thread:
    key: str
    lanes: list[Lane] = field(default_factory=list)
    created: int = 0


@dataclass
class Turn:
    """What a pool's ``run`` did: the lane, how the messages were taken, the answer."""

    lane: Lane
    kind: Kind
    completion: ChatCompletion | None = None
    receipt: agentkv.TurnReceipt | None = None

    @property
    def conversation_id(self) -> str:
        return self.lane.id


class LaneTable:
    """The keys, their lanes and the LRU bound: which lane a call takes (thread-safe, no I/O).

    A lane's conversation may be on either client; :class:`SyncPool` and :class:`AsyncPool`
    move it over (by its state) when a call on the other one takes the lane.
    """

    def __init__(self, *, max_keys: int = 1024, max_lanes: int = 4) -> None:
        if max_keys < 1 or max_lanes < 1:
            raise ValueError("max_keys and max_lanes must be at least 1")
        self.max_keys = max_keys
        self.max_lanes = max_lanes
        self._threads: OrderedDict[str, _Thread] = OrderedDict()
        self.lock = threading.RLock()

    def __contains__(self, key: str) -> bool:
        return key in self._threads

    def conversations(self, key: str) -> list[AnyConversation]:
        with self.lock:
            thread = self._threads.get(key)
            return [lane.conversation for lane in thread.lanes] if thread else []

    def checkout(
        self,
        key: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        new: Callable[[str], AnyConversation],
    ) -> Turn:
        """The lane for this call, marked busy; ``new(lane_id)`` makes a new lane's
        conversation."""
        if not messages:
            raise agentkv.ConversationError("No messages to send.", conversation_id=key)
        prints = [fingerprint(m) for m in messages]
        tools_key = _tools_key(tools)
        with self.lock:
            thread = self._threads.get(key)
            if thread is None:
                thread = self._threads[key] = _Thread(key)
                self._evict_keys()
            self._threads.move_to_end(key)
            free = [ln for ln in thread.lanes if not ln.busy and ln.tools_key == tools_key]
            extends = [ln for ln in free if prints[: len(ln.prints)] == ln.prints]
            seen = set(prints)
            kept = [
                ln
                for ln in free
                if ln.prints and (ln.prints[0] == prints[0] or ln.prints[-1] in seen)
            ]
            if extends:
                lane = max(extends, key=lambda ln: (len(ln.prints), ln.used))
                kind: Kind = "same" if len(lane.prints) == len(prints) else "append"
            elif kept:
                lane, kind = max(kept, key=lambda ln: ln.used), "rewrite"
            else:
                lane, kind = self._new_lane(thread, tools_key, new), "new"
            lane.busy = True
            lane.used = time.monotonic()
            return Turn(lane, kind)

    def _new_lane(
        self, thread: _Thread, tools_key: str, new: Callable[[str], AnyConversation]
    ) -> Lane:
        taken = {ln.id for ln in thread.lanes}
        lane_id = thread.key
        while lane_id in taken:
            thread.created += 1
            lane_id = f"{thread.key}#{thread.created}"
        lane = Lane(lane_id, new(lane_id), tools_key, [])
        thread.lanes.append(lane)
        free = [ln for ln in thread.lanes if not ln.busy and ln is not lane]
        while len(thread.lanes) > self.max_lanes and free:
            oldest = min(free, key=lambda ln: ln.used)
            free.remove(oldest)
            thread.lanes.remove(oldest)
        return lane

    def release(self, lane: Lane) -> None:
        with self.lock:
            lane.busy = False

    def _evict_keys(self) -> None:
        while len(self._threads) > self.max_keys:
            for key, thread in self._threads.items():
                if not any(ln.busy for ln in thread.lanes):
                    del self._threads[key]
                    break
            else:
                return

    def to_state(self, key: str) -> dict[str, Any] | None:
        with self.lock:
            thread = self._threads.get(key)
            if thread is None:
                return None
            lanes = [(ln.id, ln.conversation) for ln in thread.lanes]
            created = thread.created
        return {
            "version": THREAD_STATE_VERSION,
            "key": key,
            "created": created,
            "lanes": [{"id": i, "state": c.to_state()} for i, c in lanes],
        }

    def from_state(
        self, state: Mapping[str, Any], resume: Callable[[Mapping[str, Any]], AnyConversation]
    ) -> None:
        """Take over a key's conversations saved by :meth:`to_state` (``resume`` makes each)."""
        if not isinstance(state, Mapping) or state.get("version") != THREAD_STATE_VERSION:
            raise agentkv.StateError(
                f"Not an agentkv thread state of version {THREAD_STATE_VERSION}."
            )
        key = str(state["key"])
        thread = _Thread(key, created=int(state.get("created", 0)))
        for item in state.get("lanes") or []:
            saved = item["state"]
            tools = saved.get("tools")
            prints = [fingerprint(m) for m in saved.get("messages") or []]
            lane = Lane(str(item["id"]), resume(saved), _tools_key(tools), prints, used=0.0)
            thread.lanes.append(lane)
        with self.lock:
            old = self._threads.get(key)
            if old is not None and any(ln.busy for ln in old.lanes):
                return  # a turn is running on the copy in memory: it is the newer one
            self._threads[key] = thread
            self._threads.move_to_end(key)
            self._evict_keys()


def take_messages(turn: Turn, conv: AnyConversation, messages: Sequence[Mapping[str, Any]]) -> Kind:
    """Hand the framework's messages to the lane's conversation: how they were taken."""
    try:
        kind = cast(Kind, conv.sync(messages))
    except agentkv.ConversationError:
        # The messages cannot extend this history as they are (a tool result whose call id
        # the framework changed, a history that starts with a tool result): take them as a
        # new history instead.
        conv.rewrite(messages, reason="sync")
        kind = "rewrite"
    if turn.kind == "new" and kind != "rewrite":
        kind = "new"
    elif kind == "same" and messages[-1].get("role") == "assistant":
        # The framework resends the history up to the model's own last answer: nothing new
        # to send, so the history is taken as it is (a new epoch, the router releases the
        # old handle).
        conv.rewrite(messages, reason="resend")
        kind = "rewrite"
    turn.lane.prints = [fingerprint(m) for m in messages]
    return kind
