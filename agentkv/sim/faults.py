"""Fault knobs: make the simulated engine fail the way real ones do.

Set them in-process (``app.state.sim.faults``), with ``POST /_sim/faults`` (JSON with any of
the fields below), or ``agentkv sim --fail-next N ...``:

* ``fail_next`` / ``fail_status`` / ``fail_message``: the next N generation requests answer
  with that HTTP status in OpenAI's error shape;
* ``delay_s``: extra seconds before every generation request starts (not scaled);
* ``cut_stream_after``: streamed responses stop abruptly after this many tokens (the connection
  is dropped, no ``[DONE]``); ``None`` disables;
* ``health_status``: what ``GET /health`` answers (200 when healthy);
* ``exit_after_s``: the process exits (status 1, no cleanup, like a crash) this many seconds
  after the knob is set — only honoured with ``POST /_sim/faults``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Faults"]


class Faults(BaseModel):
    """The fault knobs of one instance (mutable)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    fail_next: int = Field(0, ge=0)
    fail_status: int = Field(500, ge=400, le=599)
    fail_message: str = "Injected fault"
    delay_s: float = Field(0.0, ge=0.0)
    cut_stream_after: int | None = Field(None, ge=0)
    health_status: int = Field(200, ge=200, le=599)
    exit_after_s: float | None = Field(None, ge=0.0)

    def take_failure(self) -> bool:
        """Whether this request should fail (consumes one of ``fail_next``)."""
        if self.fail_next > 0:
            self.fail_next -= 1
            return True
        return False
