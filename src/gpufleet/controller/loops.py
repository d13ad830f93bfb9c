"""Compatibility re-exports of the leader-only loops, which now live one module per loop.

* :mod:`gpufleet.controller.leadership`: :class:`Leadership`, this controller's lease view;
* :mod:`gpufleet.controller.scheduler`: :class:`Scheduler` (the pass), :class:`PassStats`,
  :func:`reason_json`;
* :mod:`gpufleet.controller.dispatch`: AssignJob after commit (:func:`gang_env`, ...);
* :mod:`gpufleet.controller.stops`: :class:`StopDriver`, :func:`send_stop`,
  :func:`record_never_started`;
* :mod:`gpufleet.controller.reconciler`: :class:`Reconciler`.

Import from those modules. A name patched here (``monkeypatch.setattr``) does not reach the
code that reads it: patch the module that owns it.
"""

from gpufleet.controller.dispatch import AssignmentDispatch, gang_env, host_of, spec_env
from gpufleet.controller.leadership import Leadership
from gpufleet.controller.reconciler import Reconciler
from gpufleet.controller.scheduler import (
    ESTIMATE_SLACK_S,
    PREDICTION_REFRESH_S,
    REASONS_REFRESH_S,
    PassStats,
    Scheduler,
    reason_json,
)
from gpufleet.controller.stops import (
    STOP_RETRY_BASE_S,
    STOP_RETRY_CAP_S,
    STOP_VERIFY_EXTRA_S,
    StopDriver,
    record_never_started,
    send_stop,
    stop_backoff_s,
)

__all__ = [
    "ESTIMATE_SLACK_S",
    "PREDICTION_REFRESH_S",
    "REASONS_REFRESH_S",
    "STOP_RETRY_BASE_S",
    "STOP_RETRY_CAP_S",
    "STOP_VERIFY_EXTRA_S",
    "AssignmentDispatch",
    "Leadership",
    "PassStats",
    "Reconciler",
    "Scheduler",
    "StopDriver",
    "gang_env",
    "host_of",
    "reason_json",
    "record_never_started",
    "send_stop",
    "spec_env",
    "stop_backoff_s",
]
