"""A scenario's fleet: ``cluster:`` (node groups, the openb fleet, Philly's VCs) and ``teams:``.

Also :func:`partition`, which confines each team to whole nodes of its own (the baselines
that run with borrowing off, and the literature's per-team baselines).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpufleet.sim.loaders import load_openb_fleet, philly_teams, philly_vc_sizes
from gpufleet.sim.model import NodeGroup, TeamSpec
from gpufleet.sim.scenario_fields import (
    _MISSING,
    MAX_GPUS_PER_NODE,
    MAX_NODES,
    ScenarioError,
    _int,
    _list,
    _mapping,
    _number,
    _per_type,
    _text,
    read_trace,
)

PARTITION_LABEL = "gpufleet.sim/partition"

NODE_GROUP_KEYS = frozenset(
    {"name", "count", "gpus_per_node", "gpu_type", "gpu_memory_mb", "cpu", "memory_mb", "labels"}
)
TEAM_KEYS = frozenset(
    {"id", "weight", "guaranteed_gpus", "borrow_limit_gpus", "lending_limit_gpus"}
)


def parse_cluster(
    path: Path, raw: Any, traces_dir: Path, warnings: list[str] | None = None
) -> tuple[list[NodeGroup], list[TeamSpec], dict[str, int]]:
    """``cluster:`` of the scenario at ``path``: its node groups, the teams it implies (one
    per Philly VC) and the Philly VC sizes in nodes (empty without ``philly_vcs``).
    Doubtful but valid input (a ``capacity`` that rounds VCs up to one node) is appended to
    ``warnings``, one line each."""

    def at(field_path: str) -> str:
        return f"{path}: {field_path}"

    cluster = _mapping(raw, at("cluster"), ("node_groups", "openb_nodes", "philly_vcs"))
    groups: list[NodeGroup] = []
    teams: list[TeamSpec] = []
    sources: list[str] = []  # the field each group comes from, for check_node_ids
    named: dict[str, int] = {}  # node group name -> its first index
    for n, g in enumerate(_list(cluster.get("node_groups"), at("cluster.node_groups"))):
        w = at(f"cluster.node_groups[{n}]")
        g = _mapping(g, w, NODE_GROUP_KEYS)
        name = _text(g.get("name", _MISSING), f"{w}.name")
        first = named.setdefault(name, n)
        if first != n:
            raise ScenarioError(
                f"{w}.name: node group {name!r} is declared twice (first at "
                f"cluster.node_groups[{first}]); give each group its own name"
            )
        sources.append(f"cluster.node_groups[{n}].name")
        groups.append(
            NodeGroup(
                name=name,
                count=_int(g.get("count", 1), f"{w}.count", ge=1, le=MAX_NODES),
                gpus_per_node=_int(
                    g.get("gpus_per_node", _MISSING),
                    f"{w}.gpus_per_node",
                    ge=1,
                    le=MAX_GPUS_PER_NODE,
                ),
                gpu_type=_text(g.get("gpu_type", "GPU"), f"{w}.gpu_type"),
                gpu_memory_mb=_int(g.get("gpu_memory_mb", 0), f"{w}.gpu_memory_mb", ge=0),
                cpu=_number(g.get("cpu", 0), f"{w}.cpu", ge=0),
                memory_mb=_int(g.get("memory_mb", 0), f"{w}.memory_mb", ge=0),
                labels={
                    str(k): _text(v, f"{w}.labels[{k}]")
                    for k, v in _mapping(g.get("labels"), f"{w}.labels").items()
                },
            )
        )
    if "openb_nodes" in cluster:
        openb = read_trace(
            traces_dir, at("cluster.openb_nodes"), cluster["openb_nodes"], load_openb_fleet
        )
        groups.extend(openb)
        sources.extend(f"cluster.openb_nodes (node {g.name!r})" for g in openb)
    vc_sizes: dict[str, int] = {}
    if "philly_vcs" in cluster:
        w = at("cluster.philly_vcs")
        pv = _mapping(
            cluster["philly_vcs"], w, ("path", "capacity", "gpus_per_node", "gpu_type", "cpu")
        )
        capacity = _number(pv.get("capacity", 1.0), f"{w}.capacity", gt=0, le=100)
        gpn = _int(pv.get("gpus_per_node", 8), f"{w}.gpus_per_node", ge=1, le=MAX_GPUS_PER_NODE)
        gpu_type = _text(pv.get("gpu_type", "GPU"), f"{w}.gpu_type")
        cpu = _number(pv.get("cpu", 96), f"{w}.cpu", ge=0)
        vc_sizes = read_trace(traces_dir, f"{w}.path", pv.get("path", _MISSING), philly_vc_sizes)
        if capacity != 1.0:
            # every VC scaled alike (at least one node), so its guarantee keeps its share
            raised = sorted(vc for vc, n in vc_sizes.items() if round(n * capacity) < 1)
            asked = sum(n * capacity for n in vc_sizes.values())
            vc_sizes = {vc: max(1, round(n * capacity)) for vc, n in vc_sizes.items()}
            if raised and warnings is not None:
                nodes = sum(vc_sizes.values())
                warnings.append(
                    f"{w}.capacity: {capacity:g} gives {len(raised)} of {len(vc_sizes)} VCs "
                    f"less than one node; each keeps one, so the fleet is {nodes:,} nodes / "
                    f"{nodes * gpn:,} GPUs, not ~{asked:.3g} nodes"
                )
        groups.append(NodeGroup("philly", sum(vc_sizes.values()), gpn, gpu_type, cpu=cpu))
        sources.append("cluster.philly_vcs (nodes 'philly-NNNN')")
        teams.extend(philly_teams(vc_sizes, gpn, gpu_type))
    if not groups:
        raise ScenarioError(
            f"{path}: cluster has no nodes; give cluster.node_groups, cluster.openb_nodes or "
            "cluster.philly_vcs"
        )
    nodes = sum(g.count for g in groups)
    if nodes > MAX_NODES:
        raise ScenarioError(f"{path}: cluster has {nodes:,} nodes in all, more than {MAX_NODES:,}")
    check_node_ids(path, groups, sources)
    return groups, teams, vc_sizes


def check_node_ids(path: Path, groups: list[NodeGroup], sources: list[str]) -> None:
    """Every node of the fleet has its own id (``NodeGroup.node_ids``): two nodes with one
    id would be one node in the simulated fleet while the report counted both. ``sources``:
    the field each group comes from, named in the error."""
    owner: dict[str, int] = {}  # node id -> the index of the group that has it
    for k, g in enumerate(groups):
        for node_id in g.node_ids():
            first = owner.setdefault(node_id, k)
            if first != k:
                raise ScenarioError(
                    f"{path}: {sources[k]}: node {node_id!r} is also a node of "
                    f"{sources[first]}; every node needs its own id (rename a group)"
                )


def parse_teams(path: Path, raw: Any, teams: list[TeamSpec]) -> list[TeamSpec]:
    """``teams:`` of the scenario at ``path``, after ``teams`` (those the cluster implies);
    a team declared twice is an error."""
    teams = list(teams)
    for n, t in enumerate(_list(raw, f"{path}: teams")):
        w = f"{path}: teams[{n}]"
        t = _mapping(t, w, TEAM_KEYS)
        team_id = _text(t.get("id", _MISSING), f"{w}.id")
        if any(x.team_id == team_id for x in teams):
            raise ScenarioError(f"{w}.id: team {team_id!r} is declared twice")
        borrow = t.get("borrow_limit_gpus")
        teams.append(
            TeamSpec(
                team_id=team_id,
                weight=_number(t.get("weight", 1.0), f"{w}.weight", gt=0),
                guaranteed_gpus=_per_type(t.get("guaranteed_gpus"), f"{w}.guaranteed_gpus"),
                borrow_limit_gpus=(
                    None if borrow is None else _int(borrow, f"{w}.borrow_limit_gpus", ge=0)
                ),
                lending_limit_gpus=_per_type(
                    t.get("lending_limit_gpus"), f"{w}.lending_limit_gpus"
                ),
            )
        )
        _check_team(path, teams[-1])
    return teams


def partition(groups: list[NodeGroup], teams: list[TeamSpec]) -> list[NodeGroup]:
    """Give each team whole nodes covering its guarantee, per GPU type, in team order; the
    nodes left over are labelled ``unassigned`` (nobody's partition)."""
    singles: dict[str, list[NodeGroup]] = {}
    for g in groups:
        for name in g.node_ids():
            singles.setdefault(g.gpu_type, []).append(replace(g, name=name, count=1))
    out: list[NodeGroup] = []
    for gpu_type, nodes in sorted(singles.items()):
        it = iter(nodes)
        for t in teams:
            want = t.guaranteed_gpus.get(gpu_type, 0)
            while want > 0:
                n = next(it, None)
                if n is None:
                    break
                out.append(replace(n, labels={**n.labels, PARTITION_LABEL: t.team_id}))
                want -= n.gpus_per_node
        out.extend(replace(n, labels={**n.labels, PARTITION_LABEL: "unassigned"}) for n in it)
    return out


def _check_team(path: Path, t: TeamSpec) -> None:
    where = f"{path}: teams[{t.team_id}]"
    if not math.isfinite(t.weight) or t.weight <= 0:
        raise ScenarioError(f"{where}.weight must be a finite number > 0, not {t.weight}")
    for field_name, per_type in (
        ("guaranteed_gpus", t.guaranteed_gpus),
        ("lending_limit_gpus", t.lending_limit_gpus),
    ):
        for gpu_type, n in per_type.items():
            if n < 0:
                raise ScenarioError(f"{where}.{field_name}[{gpu_type}] must be >= 0, not {n}")
    for gpu_type, keep in t.lending_limit_gpus.items():
        if keep > t.guaranteed_gpus.get(gpu_type, 0):
            raise ScenarioError(
                f"{where}.lending_limit_gpus[{gpu_type}] = {keep} exceeds the guarantee"
            )
    if t.borrow_limit_gpus is not None and int(t.borrow_limit_gpus) < 0:
        raise ScenarioError(f"{where}.borrow_limit_gpus must be >= 0 or absent (no limit)")
