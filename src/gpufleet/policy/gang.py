"""Multi-node jobs (gangs): the member split, the never-fits test and topology-aware placement.

A job is a gang when it asks for several nodes (``Resources.nodes > 1``, or ``gpus_per_node``
below ``gpu_count``), or when no acceptable GPU type has a node big enough for all of its GPUs
(then it is split into whole nodes of the type; see :func:`gang_members`). A job that one node
of an acceptable type can hold stays a single-node job: its placement is exactly the
single-node path of ``policy.placement``.

Members of a gang are placed all or nothing, on one GPU type, in one pass:

  * **whole free nodes first**: a member that needs a whole node goes only to a node with all
    of its GPUs free; a smaller member (``allow_partial_nodes`` remainder, or an explicit
    ``gpus_per_node`` below the node size) goes best fit (fewest free GPUs that still fit);
  * **topology**: nodes are grouped by their ``rack`` label inside their ``switch`` label
    (nodes without labels form one domain). One rack is preferred, then one switch, then the
    fewest racks, taken largest first; ties by the smallest leftover, then by name;
  * holds and backfill shadows are respected exactly as for single-node jobs (each member is
    checked with ``FreeIndex._acceptable`` for its own GPU count).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace

from gpufleet.domain.types import Resources
from gpufleet.policy.fleet_index import node_accepts
from gpufleet.policy.placement import FreeIndex
from gpufleet.policy.snapshot import NodeState

RACK_LABEL = "rack"
SWITCH_LABEL = "switch"

_Group = tuple[tuple[str, str], list[tuple[int, str]]]

Members = tuple[int, ...]
"""GPUs per member, largest first (rank 0 is the first member)."""


def explicit_gang(res: Resources) -> bool:
    """The request names several nodes itself (``nodes > 1`` or ``gpus_per_node`` below the
    job's GPU count)."""
    return (res.nodes is not None and res.nodes > 1) or (
        res.gpus_per_node is not None and 0 < res.gpus_per_node < res.gpu_count
    )


def gang_members(res: Resources, node_gpus: int) -> Members | None:
    """The member split of ``res`` on a GPU type whose largest node has ``node_gpus`` GPUs.

    Returns a tuple of GPUs per member, largest first; ``(gpu_count,)`` for a single-node
    job; None when the type can never hold the job in this shape:

      * explicit ``nodes`` x ``gpus_per_node`` (either may be derived from ``gpu_count``):
        ``gpu_count`` must equal their product, unless ``allow_partial_nodes`` lets the split
        be uneven (as even as possible: 10 GPUs on 3 nodes -> 4 + 3 + 3); each member must
        fit one node of the type;
      * derived (neither given): one node when ``gpu_count <= node_gpus``; else whole nodes
        (``gpu_count`` divisible by ``node_gpus``), or, with ``allow_partial_nodes``, whole
        nodes plus one partial member for the remainder (12 on 8-GPU nodes -> 8 + 4).
    """
    n = res.gpu_count
    if n < 1 or node_gpus < 1:
        return None
    nodes, per = res.nodes, res.gpus_per_node
    if nodes is None and per is None:
        if n <= node_gpus:
            return (n,)
        whole, rest = divmod(n, node_gpus)
        if rest == 0:
            return (node_gpus,) * whole
        if res.allow_partial_nodes:
            return (node_gpus,) * whole + (rest,)
        return None
    if nodes is None:
        assert per is not None
        if per < 1:
            return None
        nodes = -(-n // per)
    if nodes < 1:
        return None
    if per is not None and per * nodes == n:
        members: Members = (per,) * nodes
    elif per is None and n % nodes == 0:
        members = (n // nodes,) * nodes
    elif res.allow_partial_nodes and nodes <= n:
        base, extra = divmod(n, nodes)
        members = (base + 1,) * extra + (base,) * (nodes - extra)
    else:
        return None
    if members[0] > node_gpus:
        return None
    return members


def member_resources(res: Resources, gpus: int) -> Resources:
    """What one member needs on its node (CPU and memory are per member already)."""
    return replace(res, gpu_count=gpus, nodes=None, gpus_per_node=None)


def _assignable(capacities: Sequence[int], members: Members) -> bool:
    """Whether nodes of these capacities can hold the members (largest first, best fit)."""
    caps = sorted(capacities)
    for m in members:
        for i, c in enumerate(caps):
            if c >= m:
                del caps[i]
                break
        else:
            return False
    return True


def static_fit(
    shapes: Iterable[tuple[NodeState, int]],
    res: Resources,
    selector: Mapping[str, str],
    members_by_type: Mapping[str, Members],
) -> bool:
    """Whether some GPU type has enough nodes to hold every member at once: the gang form of
    "could ever fit". ``shapes``: distinct nodes with how many nodes share each shape (pass
    all nodes, or the schedulable ones only)."""
    caps: dict[str, list[int]] = {}
    mres = {t: member_resources(res, m[-1]) for t, m in members_by_type.items()}
    for n, count in shapes:
        t = n.gpu_type
        members = members_by_type.get(t)
        if members is None or count <= 0:
            continue
        if not node_accepts(n, mres[t], selector):
            continue
        caps.setdefault(t, []).extend([n.total_gpus] * min(count, len(members)))
    return any(
        len(caps.get(t, ())) >= len(m) and _assignable(caps[t], m)
        for t, m in members_by_type.items()
    )


def could_ever_fit(
    shapes: Iterable[tuple[NodeState, int]], res: Resources, selector: Mapping[str, str]
) -> bool:
    """Whether the fleet (``shapes``: distinct nodes and how many have each, any state) could
    ever hold the job: one node for a single-node job, enough nodes of one type for every
    member of a gang (the same rule as the pass's ``never_fits``)."""
    shapes = list(shapes)
    if not explicit_gang(res) and any(node_accepts(n, res, selector) for n, _ in shapes):
        return True
    sizes: dict[str, int] = {}
    for n, _ in shapes:
        sizes[n.gpu_type] = max(sizes.get(n.gpu_type, 0), n.total_gpus)
    types = res.gpu_types or tuple(sorted(sizes))
    if not explicit_gang(res) and any(res.gpu_count <= sizes.get(t, 0) for t in types):
        return False  # a single-node job of a type big enough: the node filter said no
    every = {t: m for t in types if (m := gang_members(res, sizes.get(t, 0))) is not None}
    return bool(every) and static_fit(shapes, res, selector, every)


def domain(node: NodeState) -> tuple[str, str]:
    """The node's topology domain: (its ``switch`` label, its ``rack`` label), "" if unset."""
    labels = node.labels
    return labels.get(SWITCH_LABEL, ""), labels.get(RACK_LABEL, "")


def _assign(
    cands: Sequence[tuple[int, str]],
    members: Members,
    accepts: Callable[[int, str], bool],
) -> list[tuple[int, str]] | None:
    """Best fit of ``members`` (largest first) onto ``cands`` ((free, node_id), sorted):
    ``[(member index, node_id)]`` for all of them, else None. ``accepts(m, node_id)``: whether
    the node may hold a member of ``m`` GPUs, asked only of a node with ``m`` GPUs free and
    not used yet, when the walk reaches it. The walk for a member goes on where the last
    member of its size stopped (the nodes before were used, too small or refused, and stay
    so)."""
    used: set[str] = set()
    out: list[tuple[int, str]] = []
    n = len(cands)
    size, i = -1, 0
    for k, m in enumerate(members):
        if m != size:
            size, i = m, 0
        while i < n:
            free, nid = cands[i]
            i += 1
            if free >= m and nid not in used and accepts(m, nid):
                used.add(nid)
                out.append((k, nid))
                break
        else:
            return None
    return out


def _in_member_order(chosen: list[tuple[int, str]] | None, n: int) -> tuple[str, ...] | None:
    """``[(member index, node_id)]`` as the node ids in member order."""
    if chosen is None:
        return None
    out = [""] * n
    for k, nid in chosen:
        out[k] = nid
    return tuple(out)


def _fill(
    groups: Sequence[_Group],
    members: Members,
    ok: Mapping[int, set[str]],
) -> list[tuple[int, str]] | None:
    """Members spread over ``groups`` in order, each group taking what it can (best fit)."""
    left = list(enumerate(members))
    out: list[tuple[int, str]] = []
    for _, cands in groups:
        if not left:
            break
        used: set[str] = set()
        rest: list[tuple[int, int]] = []
        for k, m in left:
            accept = ok[m]
            for free, nid in cands:
                if free >= m and nid not in used and nid in accept:
                    used.add(nid)
                    out.append((k, nid))
                    break
            else:
                rest.append((k, m))
        left = rest
    return out if not left else None


def find_gang(
    index: FreeIndex,
    res: Resources,
    selector: Mapping[str, str],
    gpu_type: str,
    members: Members,
    hard_end_s: float | None,
    job_id: str,
    held_nodes: Iterable[str] = (),
) -> tuple[str, ...] | None:
    """Nodes for every member of ``members`` on ``gpu_type`` (one per member, in member
    order), or None when they cannot all be placed now. Pure what-if: nothing is taken.
    ``held_nodes``: nodes where GPUs are held for ``job_id`` (they count as free for it)."""
    smallest = members[-1]
    cands = index.gang_candidates(gpu_type, selector, smallest, job_id, held_nodes)
    if len(cands) < len(members):
        return None
    if (
        len(index.label_values(gpu_type, SWITCH_LABEL)) == 1
        and len(index.label_values(gpu_type, RACK_LABEL)) == 1
    ):
        # One topology domain: the one-rack best fit below over every candidate, each node's
        # acceptability asked only when the walk reaches it (the same nodes chosen).
        if held_nodes:
            mine = set(held_nodes)
            cands.sort(key=lambda e: (e[0], e[1] not in mine, e[1]))
        sized = {m: member_resources(res, m) for m in set(members)}

        def accepts(m: int, nid: str) -> bool:
            return index.acceptable(nid, sized[m], hard_end_s, job_id)

        return _in_member_order(_assign(cands, members, accepts), len(members))
    return _topology_fit(index, res, cands, members, hard_end_s, job_id, held_nodes)


def _topology_fit(
    index: FreeIndex,
    res: Resources,
    cands: list[tuple[int, str]],
    members: Members,
    hard_end_s: float | None,
    job_id: str,
    held_nodes: Iterable[str],
) -> tuple[str, ...] | None:
    """``find_gang`` over ``cands`` (sorted ``(free, node_id)``) grouped by topology domain:
    one rack, else one switch with the fewest racks, else the whole type."""
    ok: dict[int, set[str]] = {}
    for m in set(members):
        mres = member_resources(res, m)
        ok[m] = {
            nid
            for free, nid in cands
            if free >= m and index.acceptable(nid, mres, hard_end_s, job_id)
        }
    if any(sum(1 for m2 in members if m2 == m) > len(s) for m, s in ok.items()):
        return None
    nodes = index.nodes
    by_rack: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for free, nid in cands:
        by_rack.setdefault(domain(nodes[nid]), []).append((free, nid))
    if held_nodes:
        # GPUs held for this gang (after a preemption) are used first among equal fits
        mine = set(held_nodes)
        for lst in by_rack.values():
            lst.sort(key=lambda e: (e[0], e[1] not in mine, e[1]))
    need = sum(members)

    def leftover(assign: list[tuple[int, str]]) -> int:
        free = {nid: f for f, nid in cands}
        return sum(free[nid] for _, nid in assign) - need

    chosen: list[tuple[int, str]] | None = None
    # 1. one rack
    best: tuple[int, tuple[str, str]] | None = None
    for key in sorted(by_rack):
        a = _assign(by_rack[key], members, lambda m, nid: nid in ok[m])
        if a is not None and (best is None or (leftover(a), key) < best):
            best = (leftover(a), key)
            chosen = a
    if chosen is None and len(by_rack) > 1:
        # 2. one switch, fewest racks (largest racks first); 3. the whole type, the same way
        def by_size(keys: Iterable[tuple[str, str]]) -> list[_Group]:
            return sorted(
                ((k, by_rack[k]) for k in keys),
                key=lambda g: (-sum(f for f, _ in g[1]), g[0]),
            )

        switches: dict[str, list[tuple[str, str]]] = {}
        for key in by_rack:
            switches.setdefault(key[0], []).append(key)
        best_sw: tuple[int, int, str] | None = None
        if len(switches) > 1:
            for sw in sorted(switches):
                a = _fill(by_size(switches[sw]), members, ok)
                if a is None:
                    continue
                racks = len({domain(nodes[nid]) for _, nid in a})
                score = (racks, leftover(a), sw)
                if best_sw is None or score < best_sw:
                    best_sw = score
                    chosen = a
        if chosen is None:
            chosen = _fill(by_size(by_rack), members, ok)
    return _in_member_order(chosen, len(members))
