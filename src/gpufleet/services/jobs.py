"""Submit, read, list and cancel jobs (seed Phase 1 and Phase 4), by phase:

* ``job_admission``: the checks a submit passes (the job fits the fleet, the team's limit of
  unfinished jobs, its run-time settings), each read cached per process;
* ``job_submit``: the spec's stored form and idempotency hash, ``submit_job``;
* ``job_queries``: one job, a page of jobs, a pending job's queue position, its events;
* ``job_cancel``: cancellation.

This module only re-exports those modules' public functions and classes (``from
gpufleet.services import jobs``; ``jobs.submit_job``). Import from the phase module in new
code. The caches' TTLs and the admission constants are deliberately not re-exported: patch
them on ``job_admission``, where the code that reads them lives (a patch here would miss it;
without the name, it fails instead).
"""

from __future__ import annotations

from gpufleet.services.job_admission import (
    NodeShape,
    apply_runtime_limits,
    check_fits_fleet,
    check_outstanding_limit,
    check_runtime_limit,
    forget_fleet_shapes,
    forget_outstanding_counts,
    gang_shape,
    team_runtime_limits,
)
from gpufleet.services.job_cancel import cancel_job, cancel_job_outcome
from gpufleet.services.job_queries import (
    get_job,
    is_job_id,
    iso,
    job_events,
    list_jobs,
    queue_position,
    run_times,
    unverified_processes,
)
from gpufleet.services.job_submit import (
    SubmitControl,
    Submitted,
    payload_sha256,
    spec_to_dict,
    submit_job,
)

__all__ = [
    "NodeShape",
    "SubmitControl",
    "Submitted",
    "apply_runtime_limits",
    "cancel_job",
    "cancel_job_outcome",
    "check_fits_fleet",
    "check_outstanding_limit",
    "check_runtime_limit",
    "forget_fleet_shapes",
    "forget_outstanding_counts",
    "gang_shape",
    "get_job",
    "is_job_id",
    "iso",
    "job_events",
    "list_jobs",
    "payload_sha256",
    "queue_position",
    "run_times",
    "spec_to_dict",
    "submit_job",
    "team_runtime_limits",
    "unverified_processes",
]
