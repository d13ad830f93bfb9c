"""When this agent last heard the control plane, and the rule that follows from it.

The agent's knowledge of the leader epoch is the fast path of fencing (a deposed leader's
AssignJob carries an older epoch and is refused), but it holds only while that knowledge is
recent. An agent that was frozen, partitioned or restarted may not know that a new leader
took over and fenced its work, and a deposed leader's AssignJob delayed in the network can
arrive just then. So:

* every answered RegisterNode/Heartbeat counts as contact, from the moment its request was
  *sent* (the epoch in the answer was true at some point after that);
* the controller tells the agent its contact timeout at registration
  (``RegisterNodeResponse.contact_timeout_s`` = min(leader lease, fence timeout)): no new
  leader can have fenced anything on a node heard from more recently than that;
* before starting any new assignment, an agent silent for longer (or not registered yet in
  this process) sends a heartbeat at once, waiting at most ``ASK_LIMIT_S``, and learns the
  current epoch; when no controller answers it refuses the assignment (UNAVAILABLE: nothing
  was logged or started; the leader re-sends it).

A controller older than the field sends 0: only the "registered in this process" rule holds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

ASK_LIMIT_S = 3.0
"""How long an assignment waits at most for the heartbeat that renews contact (seconds)."""


class OutOfTouch(RuntimeError):
    """No controller answered: the agent does not know the current leader epoch."""


class Contact:
    """The time of the last answer from the control plane (``time.monotonic``, which keeps
    counting while the process is stopped) and the timeout the controller named.

    Args:
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._heard_at: float | None = None
        self.timeout_s = 0.0
        """Seconds of silence after which new work waits for contact; 0 = unknown."""
        self.ask: Callable[[float], None] | None = None
        """Renews contact within the given seconds (a heartbeat); raises on failure. Set by
        the wiring (``ControllerLink.renew_contact``)."""

    def now(self) -> float:
        return self._clock()

    def heard(self, sent_at: float, timeout_s: float | None = None) -> None:
        """An answer came to a request sent at ``sent_at`` (this clock); ``timeout_s``: the
        contact timeout it named, if it names one (registration)."""
        with self._lock:
            if self._heard_at is None or sent_at > self._heard_at:
                self._heard_at = sent_at
            if timeout_s is not None:
                self.timeout_s = max(0.0, timeout_s)

    def silent_for_s(self) -> float | None:
        """Seconds since the last contact, or None when there was none in this process."""
        with self._lock:
            heard = self._heard_at
        return None if heard is None else max(0.0, self._clock() - heard)

    def out_of_touch(self) -> bool:
        """True when new work must wait for contact: none yet in this process, or silence
        longer than the contact timeout."""
        silent = self.silent_for_s()
        if silent is None:
            return True
        return self.timeout_s > 0 and silent > self.timeout_s

    def ensure(self, limit_s: float = ASK_LIMIT_S) -> None:
        """Return at once when in touch; else renew contact (``ask``) within ``limit_s``.

        Raises:
            OutOfTouch: still out of touch (no controller answered, or nothing can ask);
                the message says for how long and why nothing starts.
        """
        if not self.out_of_touch():
            return
        error = ""
        if self.ask is not None:
            try:
                self.ask(limit_s)
            except Exception as exc:  # grpc.RpcError or a timeout: say what it was
                error = _describe(exc)
        if not self.out_of_touch():
            return
        silent = self.silent_for_s()
        since = (
            "has not heard a controller since it started"
            if silent is None
            else f"has heard no controller for {silent:.1f} s (contact timeout"
            f" {self.timeout_s:g} s)"
        )
        raise OutOfTouch(
            f"the agent {since} and none answered within {limit_s:g} s"
            f"{f' ({error})' if error else ''}: a new leader may have fenced this work;"
            " nothing is started until a controller tells the current leader epoch"
        )


def _describe(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    if callable(code):
        try:
            return str(code().name)
        except Exception:  # a fake error without a real code
            return type(exc).__name__
    return str(exc) or type(exc).__name__
