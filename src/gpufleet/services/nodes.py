"""Nodes on the control plane (the agent's side of the protocol, control-plane half), by phase:

* ``node_register``: registration, and the drain when an agent reports other GPUs;
* ``node_heartbeat``: heartbeats (liveness, health, the agent's running set checked);
* ``node_health``: a node's status on its own word (UNHEALTHY, HEALTHY again) and the node
  problems a job waits on (``why``, ``status``);
* ``node_fence``: fencing (seed DD3): a node's attempts revoked, its GPUs QUARANTINED until
  the runs are known gone, an agent that lost its state;
* ``node_upkeep``: the reconciler's failure detector and drains (SUSPECT, CORDONED, fenced);
* ``node_admin``: operator actions (cordon, drain, uncordon, fence a dead node, pre-pulls).

This module only re-exports those modules' public names (``from gpufleet.services import
nodes``; ``nodes.register_node``). Import from the phase module in new code; patch a name where
it is defined, not here.
"""

from __future__ import annotations

from gpufleet.services.node_admin import operator_fence, prepull_images, set_node_status
from gpufleet.services.node_fence import (
    Fenced,
    KeptState,
    fence_lost_agent_state,
    fence_node,
    kept_state_problem,
    release_gone_quarantined,
)
from gpufleet.services.node_health import (
    apply_health,
    back_to_healthy,
    mark_unhealthy,
    node_problems,
    set_status_reason,
)
from gpufleet.services.node_heartbeat import (
    HeartbeatRun,
    HeartbeatVerdict,
    NodeHealth,
    heartbeat,
)
from gpufleet.services.node_register import (
    INVENTORY_DRAIN,
    KEEPS_INVENTORY,
    NodeInventory,
    register_node,
)
from gpufleet.services.node_upkeep import (
    UpkeepDue,
    active_runs_on,
    fence_silent_nodes,
    finish_drains,
    mark_silent_nodes_suspect,
    upkeep_due,
)

__all__ = [
    "INVENTORY_DRAIN",
    "KEEPS_INVENTORY",
    "Fenced",
    "HeartbeatRun",
    "HeartbeatVerdict",
    "KeptState",
    "NodeHealth",
    "NodeInventory",
    "UpkeepDue",
    "active_runs_on",
    "apply_health",
    "back_to_healthy",
    "fence_lost_agent_state",
    "fence_node",
    "fence_silent_nodes",
    "finish_drains",
    "heartbeat",
    "kept_state_problem",
    "mark_silent_nodes_suspect",
    "mark_unhealthy",
    "node_problems",
    "operator_fence",
    "prepull_images",
    "register_node",
    "release_gone_quarantined",
    "set_node_status",
    "set_status_reason",
    "upkeep_due",
]
