"""The fleet's node shapes and the free capacity a driver keeps across passes.

``node_accepts`` is the static filter of a request (type, per-GPU memory, size, CPU, memory,
labels). Nodes with equal shapes (``shape_key``) accept the same jobs, so static questions
("could this ever fit", "which nodes could hold it") are answered per distinct shape
(``ShapeGroups``, ``Accepting``), not per node. ``FleetIndex`` keeps the free lists by GPU
type and these static facts (``_Static``) across passes for a driver that owns the node
states; a pass's ``placement.FreeIndex`` copies what it changes.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence

from gpufleet.domain.types import Resources
from gpufleet.policy.snapshot import NodeState

SelectorKey = tuple[tuple[str, str], ...]


def selector_key(selector: Mapping[str, str]) -> SelectorKey:
    return tuple(sorted(selector.items())) if selector else ()


def node_accepts(node: NodeState, res: Resources, selector: Mapping[str, str]) -> bool:
    """Static filter: type, per-GPU memory, size, CPU, memory and labels (ignores free)."""
    if res.gpu_types and node.gpu_type not in res.gpu_types:
        return False
    if node.gpu_memory_mb < res.gpu_memory_mb or node.total_gpus < res.gpu_count:
        return False
    if res.cpu and node.cpu_total and node.cpu_total < res.cpu:
        return False
    if res.memory_mb and node.memory_total_mb and node.memory_total_mb < res.memory_mb:
        return False
    return all(node.labels.get(k) == v for k, v in selector.items())


ShapeKey = tuple[object, ...]


def shape_key(n: NodeState, with_labels: bool = True) -> ShapeKey:
    """What ``node_accepts`` reads of a node: nodes with equal keys accept the same jobs."""
    return (*_static_shape(n), tuple(sorted(n.labels.items())) if with_labels else ())


def _static_shape(n: NodeState) -> ShapeKey:
    """The fields of a node's shape other than its labels."""
    return (n.gpu_type, n.total_gpus, n.gpu_memory_mb, n.cpu_total, n.memory_total_mb)


class FleetIndex:
    """Free capacity of a fleet by GPU type, kept across passes by a driver that owns the
    node states (the simulator): ``update`` re-indexes one changed node (a bisect in its
    type's list) instead of every node being indexed again on every pass.

    Per GPU type, ``lists[type]`` holds ``(free_gpus, node_id)`` of the schedulable nodes
    with free GPUs, sorted: the free-count buckets in order, so the best fit for ``k`` GPUs
    is ``bisect_left(lists[type], (k, ""))``. Static facts (capacity of the schedulable
    nodes, distinct node shapes, schedulable nodes grouped by shape) are computed on first
    use and again only after a node's shape or schedulability changed.

    Give it to a pass as ``ClusterSnapshot.fleet_index``: it must then describe exactly
    ``ClusterSnapshot.nodes``. A pass never changes it (``FreeIndex`` copies the lists it
    updates); the driver must not ``update`` it while a pass runs.
    """

    def __init__(self, nodes: Iterable[NodeState]) -> None:
        self.nodes: dict[str, NodeState] = {n.node_id: n for n in nodes}
        self.lists: dict[str, list[tuple[int, str]]] = {}
        self.free_by_type: dict[str, int] = {}
        self.buckets: dict[tuple[str, str], dict[str, list[tuple[int, str]]]] = {}
        """(GPU type, label) -> label value -> the type's list restricted to nodes with that
        value (jobs whose selector names one label: a rack, a zone, a team's partition).
        Made on a pass's first use of the label and kept up to date from then on."""
        self._static: _Static | None = None
        lists = self.lists
        free_by_type = self.free_by_type
        for n in self.nodes.values():
            f = n.free_gpus
            if f > 0 and n.schedulable:
                t = n.gpu_type
                free_by_type[t] = free_by_type.get(t, 0) + f
                lst = lists.get(t)
                if lst is None:
                    lst = lists[t] = []
                lst.append((f, n.node_id))
        for keys in lists.values():
            keys.sort()

    @property
    def static(self) -> _Static:
        if self._static is None:
            self._static = _Static(self.nodes)
        return self._static

    def update(self, node: NodeState) -> None:
        """Replace the state of a known node (raises KeyError for an unknown one)."""
        nid = node.node_id
        old = self.nodes[nid]
        if old is node:
            return
        self.nodes[nid] = node
        if old.schedulable != node.schedulable or shape_key(old) != shape_key(node):
            self._static = None
        if old.schedulable and old.free_gpus > 0:
            t = old.gpu_type
            entry = (old.free_gpus, nid)
            keys = self.lists[t]
            del keys[bisect.bisect_left(keys, entry)]
            self.free_by_type[t] -= old.free_gpus
            for (bt, label), by_value in self.buckets.items():
                v = old.labels.get(label)
                if bt == t and v is not None:
                    keys = by_value[v]
                    del keys[bisect.bisect_left(keys, entry)]
        f = node.free_gpus
        if node.schedulable and f > 0:
            t = node.gpu_type
            entry = (f, nid)
            bisect.insort(self.lists.setdefault(t, []), entry)
            self.free_by_type[t] = self.free_by_type.get(t, 0) + f
            for (bt, label), by_value in self.buckets.items():
                v = node.labels.get(label)
                if bt == t and v is not None:
                    bisect.insort(by_value.setdefault(v, []), entry)

    def bucket(self, gpu_type: str, label: str) -> None:
        """Start keeping ``buckets[(gpu_type, label)]`` (no-op when already kept)."""
        if (gpu_type, label) in self.buckets:
            return
        by_value: dict[str, list[tuple[int, str]]] = {}
        nodes = self.nodes
        for f, nid in self.lists.get(gpu_type, ()):
            v = nodes[nid].labels.get(label)
            if v is not None:
                by_value.setdefault(v, []).append((f, nid))
        self.buckets[(gpu_type, label)] = by_value


def labels_shape_key(n: NodeState, label_keys: tuple[str, ...]) -> ShapeKey:
    """``shape_key`` with only the labels ``label_keys`` (a selector's keys): what
    ``node_accepts`` reads of a node for a selector naming those labels."""
    return (*_static_shape(n), tuple([n.labels.get(k) for k in label_keys]))


class ShapeGroups:
    """Schedulable nodes grouped by shape (``labels_shape_key``: the static fields and the
    values of the labels ``label_keys`` only, so a selector on a zone does not split the
    fleet into a shape per rack).

    ``static``: the grouping of the same nodes without labels (``label_keys`` empty), when
    built already: a node's shape is then its static shape's position there and the label
    values, no shape fields read again (the same groups, in the same order)."""

    __slots__ = ("by_type", "of", "reps")

    def __init__(
        self,
        nodes: Mapping[str, NodeState],
        label_keys: tuple[str, ...],
        static: ShapeGroups | None = None,
    ) -> None:
        self.reps: list[tuple[NodeState, list[str]]] = []
        """Per shape: a node of the shape, and every node id of it (in node order)."""
        self.of: dict[str, int] = {}
        """Schedulable node id -> its shape (position in ``reps``)."""
        self.by_type: dict[str, list[int]] = {}
        """GPU type -> its shapes."""
        pos: dict[object, int] = {}
        reps, of = self.reps, self.of
        static_of = static.of if static is not None and label_keys else None
        for n in nodes.values():
            if not n.schedulable:
                continue
            if not label_keys:
                k: object = _static_shape(n)  # (``labels_shape_key`` less its empty tuple)
            elif static_of is None:
                k = labels_shape_key(n, label_keys)
            else:
                labels = n.labels
                k = (static_of[n.node_id], *[labels.get(x) for x in label_keys])
            i = pos.get(k)
            if i is None:
                i = pos[k] = len(reps)
                reps.append((n, [n.node_id]))
                self.by_type.setdefault(n.gpu_type, []).append(i)
            else:
                reps[i][1].append(n.node_id)
            of[n.node_id] = i


class Accepting:
    """The schedulable nodes whose shape accepts a request (ignoring what is free): a set
    of shapes, so membership and iteration cost per shape, not per node of the fleet."""

    __slots__ = ("_groups", "shapes")

    def __init__(self, groups: ShapeGroups, shapes: set[int]) -> None:
        self._groups = groups
        self.shapes = shapes

    def __bool__(self) -> bool:
        return bool(self.shapes)

    def __contains__(self, node_id: object) -> bool:
        return isinstance(node_id, str) and self._groups.of.get(node_id) in self.shapes

    def __len__(self) -> int:
        reps = self._groups.reps
        return sum(len(reps[i][1]) for i in self.shapes)

    def groups_of(self) -> Mapping[str, int]:
        """Schedulable node id -> its shape (read only; ``shapes`` holds the accepted)."""
        return self._groups.of

    def type_shapes(self, gpu_type: str) -> Sequence[int]:
        """Every shape of ``gpu_type`` (accepted or not)."""
        return self._groups.by_type.get(gpu_type, ())

    def groups(self) -> list[tuple[NodeState, list[str]]]:
        """(a node of the shape, its node ids) per accepted shape, in shape order."""
        reps = self._groups.reps
        return [reps[i] for i in sorted(self.shapes)]

    def gpu_types(self) -> list[str]:
        reps = self._groups.reps
        return sorted({reps[i][0].gpu_type for i in self.shapes})


class _Static:
    """Facts of a fleet that only a node's shape or schedulability changes: capacity of the
    schedulable nodes, GPU types, distinct shapes (with node counts), schedulable nodes
    grouped by shape per GPU type, the largest node per type. Built from ``nodes`` in their
    order (capacity sums in that order, as a pass without a ``FleetIndex`` adds them)."""

    def __init__(self, nodes: Mapping[str, NodeState]) -> None:
        self.nodes = nodes
        cap: dict[str, int] = {}
        cpu = 0.0
        mem = 0
        n_schedulable = 0
        for n in nodes.values():
            if not n.schedulable:
                continue
            n_schedulable += 1
            t = n.gpu_type
            cap[t] = cap.get(t, 0) + n.total_gpus
            cpu += n.cpu_total
            mem += n.memory_total_mb
        self.capacity_gpus = cap
        self.capacity_cpu = cpu
        self.capacity_memory_mb = mem
        self.n_schedulable = n_schedulable
        self.gpu_types: tuple[str, ...] = tuple(sorted(cap))
        self._groups: dict[tuple[str, ...], ShapeGroups] = {}
        self.accepting: dict[tuple[object, ...], Accepting] = {}
        """``FreeIndex.accepting`` answers by request (static facts: they hold as long as
        this object does)."""
        self._shapes: list[NodeState] | None = None
        self._shape_counts: dict[bool, list[tuple[NodeState, int, int]]] = {}
        self._node_gpus: dict[str, int] | None = None
        self._label_values: dict[tuple[str, str], frozenset[str]] = {}

    def label_values(self, gpu_type: str, label: str) -> frozenset[str]:
        """Values of ``label`` ("" where a node has none) on the schedulable nodes of
        ``gpu_type``, computed on first use."""
        key = (gpu_type, label)
        hit = self._label_values.get(key)
        if hit is None:
            hit = self._label_values[key] = frozenset(
                n.labels.get(label, "")
                for n in self.nodes.values()
                if n.schedulable and n.gpu_type == gpu_type
            )
        return hit

    def groups(self, label_keys: tuple[str, ...]) -> ShapeGroups:
        g = self._groups.get(label_keys)
        if g is None:
            static = self.groups(()) if label_keys else None
            g = self._groups[label_keys] = ShapeGroups(self.nodes, label_keys, static)
        return g

    def shapes(self) -> list[NodeState]:
        if self._shapes is None:
            shapes: dict[ShapeKey, NodeState] = {}
            for n in self.nodes.values():
                shapes.setdefault(shape_key(n), n)
            self._shapes = list(shapes.values())
        return self._shapes

    def shape_counts(self, with_labels: bool) -> list[tuple[NodeState, int, int]]:
        cached = self._shape_counts.get(with_labels)
        if cached is None:
            counts: dict[ShapeKey, tuple[NodeState, int, int]] = {}
            for n in self.nodes.values():
                key = shape_key(n, with_labels)
                first, every, sched = counts.get(key, (n, 0, 0))
                counts[key] = (first, every + 1, sched + int(n.schedulable))
            cached = self._shape_counts[with_labels] = list(counts.values())
        return cached

    def node_gpus(self) -> dict[str, int]:
        if self._node_gpus is None:
            sizes: dict[str, int] = {}
            for n in self.nodes.values():
                if n.total_gpus > sizes.get(n.gpu_type, 0):
                    sizes[n.gpu_type] = n.total_gpus
            self._node_gpus = sizes
        return self._node_gpus
