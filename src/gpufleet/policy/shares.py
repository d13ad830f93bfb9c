"""Placement of GPU shares (``Resources.gpu_fraction``): where a part of one GPU goes.

A share lands on a node whose GPUs are shared (``NodeState.gpu_sharing`` not ``none``), on
a GPU that holds only shares and has room for it, or else on one of the node's free GPUs,
which it then takes out of the whole-GPU pool (a GPU holds whole-GPU work or shares, never
both). Best fit, in this order:

1. the fullest shared GPU of the fleet that has room (ties: node id, then the GPU), so
   that shares pack and shared GPUs fill up before another whole GPU is split;
2. else a free GPU of the shareable node with the fewest free GPUs (ties: node id), so the
   nodes with the most free GPUs stay whole for whole-GPU jobs.

Within a node, the store's reservation (``store.allocate._take_share``) picks the GPU by
the same rule (the fullest with room, else the lowest free one), so the policy names only
the node and both agree on which GPU fills. :class:`ShareBook` keeps the fills of the
pass: the running shares of the snapshot plus the shares this pass placed, a GPU opened in
this pass being known by a position of its own (its index is the store's choice).

Pure: no I/O, no clock; ties broken by ids. The per-job scan is over the shareable nodes
only (a small part of a fleet in practice); an index by fill is left for when that grows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from gpufleet.domain.types import GPU_MILLI
from gpufleet.policy.snapshot import NodeState, RunningJob

__all__ = ["ShareBook", "SharePick", "fullest_with_room"]


def fullest_with_room(fills: Iterable[tuple[int, int]], milli: int) -> int | None:
    """The key of the fullest GPU of ``fills`` (``(key, thousandths held)``) with room for
    ``milli`` more (ties: the lowest key); None: none has room."""
    best: tuple[int, int] | None = None
    for key, used in fills:
        if used + milli <= GPU_MILLI and (best is None or (-used, key) < best):
            best = (-used, key)
    return best[1] if best is not None else None


@dataclass(frozen=True, slots=True)
class SharePick:
    """Where a share goes: ``node_id``, and ``gpu_key`` of a GPU already holding shares
    (None: a free GPU of the node, opened for shares)."""

    node_id: str
    gpu_key: int | None


@dataclass(slots=True)
class ShareBook:
    """The fills of the fleet's shared GPUs during one pass: node id -> GPU key ->
    thousandths held. Keys >= 0 are GPU indexes of running shares; a GPU opened in this pass
    gets a negative key (-1, -2, ...) of its own."""

    fills: dict[str, dict[int, int]] = field(default_factory=dict)
    _opened: int = 0

    @classmethod
    def of(cls, running: Iterable[RunningJob]) -> ShareBook:
        """The fills of the running shares (reservations RESERVED, CONFIRMED, stopping: a
        stopping share still holds its part until its release)."""
        fills: dict[str, dict[int, int]] = {}
        for r in running:
            if r.gpu_milli and r.gpu_index is not None:
                node = fills.setdefault(r.node_id, {})
                node[r.gpu_index] = node.get(r.gpu_index, 0) + r.gpu_milli
        return cls(fills)

    def best_shared(self, nodes: Iterable[NodeState], milli: int) -> SharePick | None:
        """Step 1: the fullest shared GPU with room for ``milli`` on one of ``nodes`` (the
        caller's eligible nodes); None when no shared GPU has room."""
        best: tuple[int, str, int] | None = None
        for n in nodes:
            node_fills = self.fills.get(n.node_id)
            if not node_fills:
                continue
            key = fullest_with_room(node_fills.items(), milli)
            if key is None:
                continue
            cand = (-node_fills[key], n.node_id, key)
            if best is None or cand < best:
                best = cand
        return SharePick(best[1], best[2]) if best is not None else None

    def add(self, pick: SharePick, milli: int) -> None:
        """Record a share placed by this pass (a GPU opened for it gets a key of its own)."""
        node = self.fills.setdefault(pick.node_id, {})
        key = pick.gpu_key
        if key is None:
            self._opened += 1
            key = -self._opened
        node[key] = node.get(key, 0) + milli
