"""Attempt lifecycle on the control plane (seed DD2, DD5, DD8), by phase:

* ``run_start``: delivery (AssignJob answered, a gang's MASTER_PORT) and the confirmed start;
* ``run_stop``: the durable stop request, a gang attempt stopped as one unit;
* ``run_completion``: the reported end, the manifest verified, committed once;
* ``run_settle``: what an ended attempt leaves behind, shared by completion and fencing
  (the team charged, the job's next status, a gang attempt's end).

Every write is guarded by ``run_id + token``; a stale token changes nothing about the job, and
capacity is returned only on the agent's word that the processes are gone.

This module only re-exports those modules' public names (``from gpufleet.services import
runs``; ``runs.complete_run``). Import from the phase module in new code; patch a name where
it is defined, not here.
"""

from __future__ import annotations

from gpufleet.services.run_completion import (
    NODE_FAULT_WINDOW_S,
    NODE_FAULTS_TO_CORDON,
    OOM_KILLED,
    CompletionResult,
    Outcome,
    Report,
    StopHandshake,
    Verified,
    complete_run,
    ended_at,
    verify_manifest,
)
from gpufleet.services.run_settle import (
    charge_usage,
    finish_gang_if_done,
    gang_cause,
    is_current,
    iso_utc,
    retry_delay_s,
)
from gpufleet.services.run_start import (
    Confirm,
    Confirmed,
    confirm_assignment,
    confirm_start,
    describe_phases,
    mark_delivered,
    record_master_port,
)
from gpufleet.services.run_stop import GANG_STOP, gang_members, request_stop, stop_gang

__all__ = [
    "GANG_STOP",
    "NODE_FAULTS_TO_CORDON",
    "NODE_FAULT_WINDOW_S",
    "OOM_KILLED",
    "CompletionResult",
    "Confirm",
    "Confirmed",
    "Outcome",
    "Report",
    "StopHandshake",
    "Verified",
    "charge_usage",
    "complete_run",
    "confirm_assignment",
    "confirm_start",
    "describe_phases",
    "ended_at",
    "finish_gang_if_done",
    "gang_cause",
    "gang_members",
    "is_current",
    "iso_utc",
    "mark_delivered",
    "record_master_port",
    "request_stop",
    "retry_delay_s",
    "stop_gang",
    "verify_manifest",
]
