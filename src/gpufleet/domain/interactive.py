"""Interactive jobs (``gpufleet submit --interactive``): the holder command and its activity file.

An interactive job's command is :data:`HOLD_SCRIPT`, a small ``sh`` loop that keeps the
allocation until no exec/shell session has been active for its idle timeout, then exits 0
(like Slurm's ``salloc``). The activity signal is one file per attempt, written by the agent
(:mod:`gpufleet.agent.execsession`) in the attempt's work directory, its path in the job's
``$GPUFLEET_EXEC_ACTIVITY``:

* its content is the number of exec sessions open into the attempt (``"0\\n"`` once the last
  ended), rewritten when a session starts and ends;
* its modification time is the last activity: a session's start, every
  :data:`HEARTBEAT_S` seconds while one is open, and its end.

The holder counts the attempt as active while the file says a session is open and the agent
rewrote it less than :data:`STALE_S` seconds ago (an agent that died with sessions open
leaves a count that no longer means anything); otherwise it is idle since the file's time
(or since the holder started, whichever is later), and the holder exits 0 once that idle time
reaches the timeout. The job's ``max_runtime_s`` bounds it as any job's.
"""

from __future__ import annotations

ACTIVITY_NAME = ".gpufleet-exec-activity"
"""The activity file's name, in the attempt's work directory."""

ACTIVITY_ENV = "GPUFLEET_EXEC_ACTIVITY"
"""The job's variable holding the activity file's path."""

HEARTBEAT_S = 10.0
"""Seconds between the agent's rewrites of the activity file while a session is open."""

STALE_S = 60.0
"""A file saying sessions are open but not rewritten for this long (seconds) is idle."""

DEFAULT_IDLE_TIMEOUT_S = 1800.0
"""``--idle-timeout`` default: 30 minutes."""

MAX_IDLE_TIMEOUT_S = 7 * 86400.0
"""The longest ``--idle-timeout`` (a week; ``--time`` bounds the job anyway)."""

HOLD_SCRIPT = r"""f="${GPUFLEET_EXEC_ACTIVITY:-}"; idle="$1"; stale="$2"
start=$(date +%s)
echo "interactive job: holding the allocation until no session for ${idle}s"
while :; do
  now=$(date +%s); last=$start; open=0
  if [ -n "$f" ] && [ -f "$f" ]; then
    m=$(stat -c %Y "$f" 2>/dev/null) && [ "$m" -gt "$last" ] && last=$m
    read -r open < "$f" 2>/dev/null || open=0
    case "$open" in ''|*[!0-9]*) open=0 ;; esac
  fi
  if [ "$open" -gt 0 ] && [ $((now - last)) -lt "$stale" ]; then :
  elif [ $((now - last)) -ge "$idle" ]; then
    echo "interactive job: no session for ${idle}s; releasing the allocation"; exit 0
  fi
  sleep 1
done
"""
"""The holder (``sh -c HOLD_SCRIPT gpufleet-hold IDLE_S STALE_S``): POSIX sh, ``date``,
``stat -c`` and ``sleep`` (coreutils or busybox); checks once a second."""

HOLD_ARGV0 = "gpufleet-hold"


def holder_command(idle_timeout_s: float) -> list[str]:
    """The job command of an interactive job idling out after ``idle_timeout_s`` seconds
    (rounded up to whole seconds, at least 1)."""
    idle = max(1, int(-(-idle_timeout_s // 1)))
    return ["/bin/sh", "-c", HOLD_SCRIPT, HOLD_ARGV0, str(idle), str(int(STALE_S))]


def is_holder(command: list[str]) -> bool:
    """Whether ``command`` is an interactive job's holder."""
    return len(command) >= 4 and command[2] == HOLD_SCRIPT and command[3] == HOLD_ARGV0
