"""One turn's decisions, sans-IO: which handle, which P and D, when a handle is spent, retries.

Whatever API a request came in on (:mod:`~agentkv.router.edge`), it is one turn here.
:func:`turn_plan` is a generator, in the manner of the SDK's ``_probe.render_plan``: it yields
**actions** (frozen dataclasses), is sent each one's **outcome**, and returns how the turn
ended: :class:`Answered` or :class:`Fail`. It does no I/O, awaits nothing and reads no clock;
:class:`~agentkv.router.pd.Router` is the driver that performs the actions (HTTP to the
engines, the handle store, metrics, logs, traces). :func:`remember_plan` is the same for what
D's answer leaves behind (its handle, the kept token identity).

The rules kept here, once:

* **The path** (config ``paths.mode``): the cost model (:func:`agentkv.router.paths.choose`) may
  send a turn straight to the D that holds its verified handle (``decode``: D prefills the new
  tokens from its own prefix cache, no P), within that D's budget (:class:`Reserve`). The
  handle is then spent when that D accepts the turn; D refusing puts it back, D failing sends
  the turn through P (with the handle after a 5xx/429, without it when D was unreachable).
  A turn with no handle to read goes the same way to the D whose CPU tier holds the longest
  prefix of the prompt (``cpu``: :class:`CpuHeld`, from D's KV events) when the cost model
  picks it; D failing sends it through P, which recomputes.
* **A handle is spent only when a P accepts the request that carries it** (P answers 200). Until
  then a handle taken from the store is :class:`Restore`\\ d when the turn fails (a P refusing it,
  no P answering); a read that passed its deadline or a 500 with the handle attached
  :class:`Release`\\ s it (D still pins its blocks) and P is tried again without it.
* A handle whose D is another engine now (restarted, or gone from the configuration) is
  :class:`Discard`\\ ed unread; one too old to read safely too; one another router replica took
  first is skipped for the next candidate.
* A D that fails before its first byte: another D, after a fresh P pass without the handle (the
  receipt's L is then unknown); all of them failing is a 502, none healthy a 503.

Actions the turn does not wait on (:class:`Release`, :class:`Discard`, :class:`Retry`,
:class:`Identify`) are answered with None; the driver may perform the first two in the
background.
"""

from __future__ import annotations

from agentkv.router.turn import actions
from agentkv.router.turn.actions import *  # noqa: F403  (the vocabulary, as actions.__all__ names it)
from agentkv.router.turn.core import reachable, remember_plan, turn_plan

__all__ = [*actions.__all__, "reachable", "remember_plan", "turn_plan"]
