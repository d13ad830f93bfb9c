"""A single-node reservation as ONE statement, where the database runs INSERT/UPDATE inside
WITH (PostgreSQL): the same steps, guards and rows as ``allocate.reserve``, sent in autocommit,
so a reservation is one round trip instead of BEGIN + 4 statements + COMMIT.

The statement, in lock order (job row, lease row, GPU rows, capacity row):

1. ``job``: the job row, locked (``FOR UPDATE``) only if it is still PENDING at the fencing
   epoch the pass saw, with no cancel requested and not held;
2. ``lease``: the leader lease row, share-locked only while ``(holder, epoch)`` holds it
   unexpired on the database clock (a takeover cannot commit until this statement has);
3. ``free``: with 1 and 2 found, the node's ``n`` lowest free GPU rows, locked
   (``FOR UPDATE``: a row another reserver claimed meanwhile is re-checked and skipped);
4. ``cap``: the conditional capacity UPDATE (``available >= n``, node HEALTHY), only when 3
   locked exactly ``n`` rows; RETURNING the database clock;
5. ``claim``, ``moved``, ``run``, ``res``, ``ev`` (and ``holds``): the GPU rows claimed, the
   job PENDING -> SCHEDULED with the new token, the JobRun, the Reservation and the
   transition's event, each only when the step before it happened.

Every write depends on the locks and checks before it, so a statement that fails a check
changes nothing; one that passes them cannot fail a later step except by an error, which
rolls the whole statement back. The final SELECT checks it anyway (all-or-nothing): when the
capacity row moved but any other write did not happen as a whole, it raises (an integer cast
of a message), and the statement rolls back.

One difference from the transaction of several statements: the whole statement reads one
snapshot, taken before it waits for the node's rows. A GPU freed by a release that committed
during that wait is not seen free, so the statement may find too few free GPUs where the
transaction (a fresh snapshot per statement) would find enough: the caller then runs that
transaction (``allocate.place``).
"""

from __future__ import annotations

from sqlalchemy import TextClause, text

from gpufleet.domain.states import JobStatus, Machine, NodeStatus, ReservationStatus, RunStatus
from gpufleet.domain.states import check_transition as _check

INCOMPLETE = "gpufleet: reservation incomplete"
"""The start of the error message of a statement whose all-or-nothing check failed."""

_J, _R = JobStatus, ReservationStatus
TRIGGER = _check(Machine.JOB, _J.PENDING, _J.SCHEDULED)

_SQL = f"""
WITH job AS MATERIALIZED (
    SELECT id FROM jobs
    WHERE id = :p_job AND status = '{_J.PENDING}' AND fencing_epoch = :p_seen
      AND NOT cancel_requested AND NOT held
    FOR UPDATE
), lease AS MATERIALIZED (
    SELECT epoch FROM leader_lease
    WHERE name = :p_lease_name AND holder = :p_holder AND epoch = :p_epoch
      AND expires_at > clock_timestamp()
    FOR SHARE
), free AS MATERIALIZED (
    SELECT gpu_index FROM node_gpus
    WHERE node_id = :p_node AND holder_run_id IS NULL
      AND EXISTS (SELECT 1 FROM job) AND EXISTS (SELECT 1 FROM lease)
    ORDER BY gpu_index LIMIT :p_n
    FOR UPDATE
), cap AS (
    UPDATE node_capacity SET available_gpus = available_gpus - :p_n, version = version + 1
    WHERE node_id = :p_node AND available_gpus >= :p_n
      AND EXISTS (SELECT 1 FROM nodes WHERE id = :p_node AND status = '{NodeStatus.HEALTHY}')
      AND (SELECT count(*) FROM free) = :p_n
    RETURNING clock_timestamp() AS now
), claim AS (
    UPDATE node_gpus SET holder_run_id = :p_run
    WHERE node_id = :p_node AND holder_run_id IS NULL
      AND gpu_index IN (SELECT gpu_index FROM free) AND EXISTS (SELECT 1 FROM cap)
    RETURNING gpu_index
), got AS MATERIALIZED (
    SELECT count(*) AS n,
        coalesce(json_agg(gpu_index ORDER BY gpu_index), CAST('[]' AS json)) AS ids,
        coalesce(string_agg(CAST(gpu_index AS text), ', ' ORDER BY gpu_index), '') AS txt
    FROM claim
), moved AS (
    UPDATE jobs SET status = '{_J.SCHEDULED}', fencing_epoch = :p_token,
        current_run_id = :p_run, attempts = :p_token, scheduled_at = (SELECT now FROM cap),
        pending_reason = NULL
    WHERE id = (SELECT id FROM job) AND status = '{_J.PENDING}' AND fencing_epoch = :p_seen
      AND (SELECT n FROM got) = :p_n
    RETURNING id
), run AS (
    INSERT INTO job_runs
        (id, job_id, attempt, node_id, status, token, gpu_ids, rank, gang_size, created_at,
         priority)
    SELECT :p_run, moved.id, :p_token, :p_node, '{RunStatus.ASSIGNED}', :p_token, got.ids,
        0, 1, cap.now, CAST(:p_prio AS VARCHAR(16))
    FROM moved, got, cap
    RETURNING id
), res AS (
    INSERT INTO reservations (id, run_id, job_id, node_id, gpu_ids, gpu_count, status, token,
        leader_epoch, lease_expires_at, created_at)
    SELECT :p_res, run.id, :p_job, :p_node, got.ids, :p_n, '{_R.RESERVED}', :p_token,
        :p_epoch, cap.now + make_interval(secs => :p_lease_s), cap.now
    FROM run, got, cap
    RETURNING id
), ev AS (
    INSERT INTO scheduling_events (at, kind, machine, entity_id, from_status, to_status,
        trigger, job_id, run_id, node_id, message)
    SELECT cap.now, 'transition', '{Machine.JOB.value}', :p_job, '{_J.PENDING}',
        '{_J.SCHEDULED}', '{TRIGGER}', :p_job, :p_run, :p_node, :p_head || got.txt || :p_tail
    FROM moved, got, cap
    RETURNING id
){{holds}}
SELECT
    (SELECT count(*) FROM job) AS job_ok,
    (SELECT count(*) FROM lease) AS lease_ok,
    (SELECT now FROM cap) AS now,
    (SELECT ids FROM got) AS gpu_ids,
    CASE
        WHEN NOT EXISTS (SELECT 1 FROM cap) OR (
            (SELECT n FROM got) = :p_n AND (SELECT count(*) FROM moved) = 1
            AND (SELECT count(*) FROM run) = 1 AND (SELECT count(*) FROM res) = 1
            AND (SELECT count(*) FROM ev) = 1
        ) THEN 1
        ELSE CAST(
            '{INCOMPLETE}: ' || (SELECT n FROM got) || ' of ' || :p_n || ' GPUs claimed, '
            || (SELECT count(*) FROM moved) || ' job rows moved' AS integer
        )
    END AS whole
"""

_HOLDS = """, holds AS (
    DELETE FROM gpu_holds WHERE job_id = (SELECT id FROM moved) RETURNING job_id
)"""

STATEMENTS: dict[bool, TextClause] = {
    holds: text(_SQL.replace("{holds}", _HOLDS if holds else "")) for holds in (False, True)
}
"""The statement without and with the deletion of the job's GPU holds (``holds``), built
once: SQLAlchemy compiles each once, and psycopg prepares it on the server after a few
executions."""
