"""Which queue is served next: the team order of one pass.

Fair share (the default) serves, in order:
  1. teams under their guarantee on a GPU type their head job can use (tier 0) before teams
     at or above it (tier 1): guaranteed shares first (seed DD4);
  2. within a tier, the smallest weighted dominant share of the *current allocation* (DRF,
     Ghodsi et al., NSDI 2011): GPUs of each type, CPU and memory are separate resources, a
     team's dominant share is its largest share of any of them, divided by its weight;
  3. ties (typically teams that run nothing) by decayed usage in GPU-seconds over weight,
     then team id.

Why current allocation first and decayed usage second: DRF on the current allocation is what
makes the guarantee and the loan reclaimable *now* and is strategy-proof; decayed usage alone
would let a team that just finished a burst be starved for days after. Used as the
tie-break, it still prefers the team that consumed less lately when allocations are equal.
Both are charged in GPU-time (an 8-GPU job counts eight times a 1-GPU job).

Every placement updates the team's allocation, so progressive filling falls out of a heap:
pop the most under-served team, try its next job, push it back with its new key.
FIFO and strict-priority baselines use the same heap keyed by the head job only.
"""

from __future__ import annotations

from gpufleet.policy.config import Ordering, PolicyConfig
from gpufleet.policy.priority import queue_key
from gpufleet.policy.quota import TeamBook
from gpufleet.policy.snapshot import PendingJob

TeamKey = tuple[float, float, float, str, str]


class TeamOrder:
    """Computes the heap key of a team given its current head job."""

    def __init__(self, book: TeamBook, config: PolicyConfig, all_types: tuple[str, ...]):
        self._book = book
        self._cfg = config
        self._qkey = queue_key(config)
        self._all_types = all_types

    def key(self, team_id: str, head: PendingJob) -> TeamKey:
        if self._cfg.ordering is not Ordering.FAIR_SHARE:
            a, b, job_id = self._qkey(head)
            return (a, b, 0.0, job_id, team_id)
        book = self._book
        types = head.resources.gpu_types or self._all_types
        tier = 0.0 if book.under_guarantee(team_id, types) else 1.0
        ts = book.team(team_id)
        usage = ts.usage_gpu_s / max(ts.weight, 1e-9)
        return (tier, book.dominant_share(team_id), usage, team_id, "")
