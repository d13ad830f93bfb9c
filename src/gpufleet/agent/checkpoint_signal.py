"""The checkpoint handshake of a stop: a job tells its agent that its checkpoint is durable.

Every attempt gets ``$GPUFLEET_CHECKPOINT_DONE``: a path in its own work directory (owned by
the job's user; ``/gpufleet/work/...`` inside a container). On a stop with grace (preemption,
reclaim, cancel, timeout) the agent sends SIGTERM and then waits for the *first* of

* that file appearing (any kind of entry: the job creates it after its checkpoint is
  written, e.g. ``open(path, "w").close()``), or
* the end of the grace period,

and then kills what is left of the attempt (SIGKILL, verified gone, as after a grace). So a
victim that is safe stops at once and its GPUs go to the preemptor, instead of the platform
waiting out a grace sized for the slowest checkpoint; a job that exits on its own after its
checkpoint is unaffected.

The file must be written *after* the SIGTERM: the agent removes any earlier one just before
it sends the signal, so a stale file (a periodic checkpoint's, an earlier stop's) cannot cut
a later grace short. The agent only ever looks at the entry with ``lstat`` (never follows a
link) and removes it with ``unlink``; a job can only shorten its own grace with it.

Not durable across an agent restart: an adopted attempt being stopped is sent SIGTERM again
(its grace restarts) and must signal again.

What the handshake did goes into the completion report (:func:`summary`) and from there into
the attempt's events (``checkpoint_handshake``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpufleet.agent.runtime.base import RunHandle

if TYPE_CHECKING:
    from gpufleet.agent.assignment_log import RunRecord

logger = logging.getLogger("gpufleet.agent")

__all__ = ["after_poll", "before_poll", "signalled", "summary"]


def signalled(path: Path) -> bool:
    """Whether the job created its checkpoint-done entry at ``path`` (never follows a link;
    an unreadable parent counts as not signalled)."""
    try:
        os.lstat(path)
    except OSError:
        return False
    return True


def before_poll(rec: RunRecord, h: RunHandle, path: Path) -> None:
    """Before the runtime's poll: when this poll is about to send SIGTERM (a stop requested,
    none sent yet), remove a checkpoint-done entry left from before it."""
    if rec.stop_requested and h.term_sent_at is None:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            os.unlink(path)


def after_poll(rec: RunRecord, h: RunHandle, path: Path, now: float) -> None:
    """After the runtime's poll (the attempt still runs): note the job's checkpoint signal
    (``h.checkpoint_done_at``, monotonic seconds) once it appears during the grace; the next
    poll then kills what is left (``runtime.base.grace_over``)."""
    if (
        h.term_sent_at is None
        or h.checkpoint_done_at is not None
        or h.kill_sent_at is not None
        or h.main_exited
    ):
        return
    if signalled(path):
        h.checkpoint_done_at = now
        logger.info(
            "run %s: checkpoint signalled %.2f s after SIGTERM (grace %g s)",
            rec.run_id,
            now - h.term_sent_at,
            rec.stop_grace_s,
        )


def summary(rec: RunRecord, h: RunHandle) -> dict[str, Any]:
    """What the handshake did in a stop that sent SIGTERM (empty otherwise):

    ``signalled`` (bool): the job created the file before the grace ended (and while it ran);
    ``grace_s``: the stop's grace; ``signal_after_s``: SIGTERM to the signal (signalled only);
    ``saved_s``: the grace the stop did not wait because of the signal (``grace_s -
    signal_after_s``; 0 when the job was not killed for it: it ended by itself first). Seconds.
    """
    if h.term_sent_at is None:
        return {}
    out: dict[str, Any] = {
        "signalled": h.checkpoint_done_at is not None,
        "grace_s": rec.stop_grace_s,
    }
    if h.checkpoint_done_at is not None:
        after = max(0.0, h.checkpoint_done_at - h.term_sent_at)
        out["signal_after_s"] = round(after, 3)
        killed_for_it = h.kill_sent_at is not None and h.kill_sent_at >= h.checkpoint_done_at
        out["saved_s"] = round(max(0.0, rec.stop_grace_s - after), 3) if killed_for_it else 0.0
    return out
