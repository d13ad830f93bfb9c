"""Placement: filter nodes that can hold a job, then pick one (best fit by default).

The index groups schedulable nodes by GPU type and keeps each group sorted by free GPU count,
so finding the best-fit node is a bisect plus a short walk instead of a scan of every node.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpufleet.domain.types import Resources
from gpufleet.policy.config import Placement
from gpufleet.policy.snapshot import NodeState


@dataclass(slots=True)
class _FreeNode:
    """Mutable free capacity of one node during a cycle (the snapshot itself stays frozen)."""

    node: NodeState
    free_gpus: int
    cpu_free: float
    memory_free_mb: int


def _node_accepts(node: NodeState, res: Resources, selector: Mapping[str, str]) -> bool:
    """Static filter: type, per-GPU memory, total size and labels (ignores current free)."""
    if res.gpu_types and node.gpu_type not in res.gpu_types:
        return False
    if node.gpu_memory_mb < res.gpu_memory_mb or node.total_gpus < res.gpu_count:
        return False
    if res.cpu and node.cpu_total and node.cpu_total < res.cpu:
        return False
    if res.memory_mb and node.memory_total_mb and node.memory_total_mb < res.memory_mb:
        return False
    return all(node.labels.get(k) == v for k, v in selector.items())


class FreeIndex:
    """Free capacity of schedulable nodes, by GPU type, sorted by (free GPUs, node_id).

    ``take`` updates the index as the cycle places jobs, so later placements in the same cycle
    see the GPUs already given away.
    """

    def __init__(self, nodes: Iterable[NodeState]) -> None:
        self._by_type: dict[str, list[tuple[int, str]]] = {}
        self._free: dict[str, _FreeNode] = {}
        self._all: list[NodeState] = []
        for n in nodes:
            self._all.append(n)
            if not n.schedulable or n.free_gpus <= 0:
                continue
            self._free[n.node_id] = _FreeNode(n, n.free_gpus, n.cpu_free, n.memory_free_mb)
            self._by_type.setdefault(n.gpu_type, []).append((n.free_gpus, n.node_id))
        for keys in self._by_type.values():
            keys.sort()

    def ever_fits(self, res: Resources, selector: Mapping[str, str]) -> bool:
        """Whether any node of the fleet (schedulable or not, busy or idle) could hold it."""
        return any(_node_accepts(n, res, selector) for n in self._all)

    def largest_free_block(self, res: Resources) -> int:
        types = res.gpu_types or tuple(self._by_type)
        return max((self._by_type[t][-1][0] for t in types if self._by_type.get(t)), default=0)

    def find(self, res: Resources, selector: Mapping[str, str], how: Placement) -> str | None:
        """Return the node to place ``res`` on, or None. Tries acceptable GPU types in order of
        preference; within a type, best fit = fewest free GPUs that still fit, ties by node_id;
        spread = most free GPUs first."""
        types = res.gpu_types or tuple(sorted(self._by_type))
        for gpu_type in types:
            keys = self._by_type.get(gpu_type)
            if not keys:
                continue
            start = bisect.bisect_left(keys, (res.gpu_count, ""))
            candidates = keys[start:] if how is Placement.BEST_FIT else reversed(keys[start:])
            for _, node_id in candidates:
                fn = self._free[node_id]
                if fn.cpu_free < res.cpu and fn.node.cpu_total:
                    continue
                if fn.memory_free_mb < res.memory_mb and fn.node.memory_total_mb:
                    continue
                if _node_accepts(fn.node, res, selector):
                    return node_id
        return None

    def take(self, node_id: str, res: Resources) -> None:
        """Mark ``res`` as used on ``node_id`` (within this cycle)."""
        fn = self._free[node_id]
        keys = self._by_type[fn.node.gpu_type]
        keys.pop(bisect.bisect_left(keys, (fn.free_gpus, node_id)))
        fn.free_gpus -= res.gpu_count
        fn.cpu_free -= res.cpu
        fn.memory_free_mb -= res.memory_mb
        if fn.free_gpus > 0:
            bisect.insort(keys, (fn.free_gpus, node_id))
        else:
            del self._free[node_id]
