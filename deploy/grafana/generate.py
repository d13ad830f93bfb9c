"""Writes gpufleet.json (the Grafana dashboard) from the panel list below.

    python deploy/grafana/generate.py        # rewrites deploy/grafana/gpufleet.json

Edit the panels here, not the JSON; tests/unit/test_metrics_and_dashboard.py checks that every
query names a metric gpufleet exports.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DS = {"type": "prometheus", "uid": "${datasource}"}

ROWS: list[tuple[str, list[dict[str, Any]]]] = [
    (
        "Fleet",
        [
            {"title": "GPUs by use", "unit": "none", "stack": True, "targets": [
                ('sum by (use) (gpufleet_gpus{use!="total"})', "{{use}}")]},
            {"title": "GPU allocation", "unit": "percentunit", "kind": "stat", "targets": [
                ('sum(gpufleet_gpus{use="allocated"}) / sum(gpufleet_gpus{use="total"})',
                 "allocated")]},
            {"title": "GPUs by node status", "unit": "none", "targets": [
                ('sum by (node_status) (gpufleet_gpus{use="total"})', "{{node_status}}")]},
            {"title": "GPUs held for waiting jobs", "unit": "none", "targets": [
                ("sum by (reason) (gpufleet_gpus_held)", "{{reason}}")]},
            {"title": "Nodes by status", "unit": "none", "targets": [
                ("sum by (node_status) (gpufleet_nodes)", "{{node_status}}")]},
            {"title": "Quarantined GPUs", "unit": "none", "kind": "stat", "targets": [
                ('sum(gpufleet_gpus{use="quarantined"})', "quarantined")]},
        ],
    ),
    (
        "Teams",
        [
            {"title": "Allocated vs guaranteed GPUs", "unit": "none", "targets": [
                ('sum by (team) (gpufleet_team_gpus{kind="allocated"})', "{{team}} allocated"),
                ('sum by (team) (gpufleet_team_gpus{kind="guaranteed"})',
                 "{{team}} guaranteed")]},
            {"title": "Borrowed GPUs", "unit": "none", "stack": True, "targets": [
                ('sum by (team) (gpufleet_team_gpus{kind="borrowed"})', "{{team}}")]},
            {"title": "Weighted dominant share", "unit": "percentunit", "targets": [
                ("gpufleet_team_dominant_share_ratio", "{{team}}")]},
            {"title": "Charged usage (decayed)", "unit": "h", "targets": [
                ("gpufleet_team_usage_gpu_seconds / 3600", "{{team}} GPU-hours")]},
        ],
    ),
    (
        "Queue tails",
        [
            {"title": "Queued jobs by team", "unit": "none", "stack": True, "targets": [
                ("sum by (team) (gpufleet_queue_depth_jobs)", "{{team}}")]},
            {"title": "Queued jobs by GPU count", "unit": "none", "stack": True, "targets": [
                ("sum by (gpus) (gpufleet_queue_depth_jobs)", "{{gpus}} GPU")]},
            {"title": "Queue age p95 / p99 by job size", "unit": "s", "targets": [
                ("histogram_quantile(0.95, sum by (le, gpus) (gpufleet_queue_age_seconds_bucket))",
                 "p95 {{gpus}} GPU"),
                ("histogram_quantile(0.99, sum by (le, gpus) (gpufleet_queue_age_seconds_bucket))",
                 "p99 {{gpus}} GPU")]},
            {"title": "Queue age p99 by priority class", "unit": "s", "targets": [
                ("histogram_quantile(0.99, sum by (le, priority) "
                 "(gpufleet_queue_age_seconds_bucket))", "p99 {{priority}}")]},
            {"title": "Wait until placed p95 by job size", "unit": "s", "targets": [
                ("histogram_quantile(0.95, sum by (le, gpus) "
                 "(rate(gpufleet_queue_wait_seconds_bucket[5m])))", "p95 {{gpus}} GPU")]},
            {"title": "Time to start p50 / p95 (warm / cold image)", "unit": "s", "targets": [
                ("histogram_quantile(0.5, sum by (le, image) "
                 "(rate(gpufleet_time_to_start_seconds_bucket[5m])))", "p50 {{image}}"),
                ("histogram_quantile(0.95, sum by (le, image) "
                 "(rate(gpufleet_time_to_start_seconds_bucket[5m])))", "p95 {{image}}")]},
        ],
    ),
    (
        "Fragmentation",
        [
            {"title": "Nodes by free GPUs (cumulative)", "unit": "none", "targets": [
                ("sum by (le) (gpufleet_node_free_gpus_bucket)", "<= {{le}} free")]},
            {"title": "Largest single-node job that fits now", "unit": "none", "targets": [
                ("gpufleet_largest_fitting_job_gpus", "{{gpu_type}}")]},
            {"title": "Backfills and preemptions", "unit": "ops", "targets": [
                ("sum (rate(gpufleet_backfills_total[5m]))", "backfill"),
                ("sum by (reason) (rate(gpufleet_preemptions_total[5m]))",
                 "preempt ({{reason}})")]},
            {"title": "Stops by reason", "unit": "ops", "targets": [
                ("sum by (reason) (rate(gpufleet_stop_requests_total[5m]))", "{{reason}}")]},
        ],
    ),
    (
        "Control plane",
        [
            {"title": "Scheduling pass p50 / p99", "unit": "s", "targets": [
                ("histogram_quantile(0.5, sum by (le) "
                 "(rate(gpufleet_scheduler_pass_duration_seconds_bucket[5m])))", "p50"),
                ("histogram_quantile(0.99, sum by (le) "
                 "(rate(gpufleet_scheduler_pass_duration_seconds_bucket[5m])))", "p99")]},
            {"title": "Decisions per second", "unit": "ops", "targets": [
                ("sum by (kind) (rate(gpufleet_scheduler_decisions_total[5m]))", "{{kind}}"),
                ("sum (rate(gpufleet_scheduler_conflicts_total[5m]))", "conflicts")]},
            {"title": "Decisions per pass p99", "unit": "none", "targets": [
                ("histogram_quantile(0.99, sum by (le) "
                 "(rate(gpufleet_scheduler_pass_decisions_bucket[5m])))", "p99")]},
            {"title": "Leader epoch and lease age", "unit": "none", "targets": [
                ("max(gpufleet_leader_epoch)", "epoch"),
                ("max(gpufleet_leader_lease_age_seconds)", "lease age (s)"),
                ("sum(gpufleet_leader)", "leaders")]},
            {"title": "Reconciler outcomes (1 h)", "unit": "none", "targets": [
                ("sum by (outcome) (increase(gpufleet_reconcile_outcomes_total[1h]))",
                 "{{outcome}}")]},
            {"title": "Failure detector transitions (1 h)", "unit": "none", "targets": [
                ("sum by (to) (increase(gpufleet_failure_detector_transitions_total[1h]))",
                 "to {{to}}")]},
            {"title": "Node status changes (1 h)", "unit": "none", "targets": [
                ("sum by (from_status, to_status) "
                 "(increase(gpufleet_node_status_changes_total[1h]))",
                 "{{from_status}} -> {{to_status}}")]},
            {"title": "Agent heartbeat RTT p99", "unit": "s", "targets": [
                ("histogram_quantile(0.99, sum by (le, instance) "
                 "(rate(gpufleet_agent_heartbeat_rtt_seconds_bucket[5m])))", "{{instance}}")]},
            {"title": "Agents: running attempts, heartbeat failures", "unit": "none",
             "targets": [
                ("sum(gpufleet_agent_running_attempts)", "running attempts"),
                ("sum(increase(gpufleet_agent_heartbeat_failures_total[5m]))",
                 "heartbeat failures (5 m)")]},
            {"title": "Agent uploads", "unit": "Bps", "targets": [
                ("sum by (instance) (rate(gpufleet_agent_upload_bytes_total[5m]))",
                 "{{instance}}")]},
            {"title": "Agent disk free (lowest directory)", "unit": "bytes", "targets": [
                ("min by (instance) (gpufleet_agent_disk_free_bytes)", "{{instance}}")]},
            {"title": "API submissions", "unit": "ops", "targets": [
                ("sum by (outcome) (rate(gpufleet_api_submits_total[5m]))", "{{outcome}}")]},
        ],
    ),
]


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for row, items in ROWS:
        panels.append({"type": "row", "title": row, "id": pid, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, p in enumerate(items):
            kind = p.get("kind", "timeseries")
            custom = {"stacking": {"mode": "normal" if p.get("stack") else "none"},
                      "fillOpacity": 20 if p.get("stack") else 0}
            panels.append({
                "type": kind,
                "title": p["title"],
                "id": pid,
                "datasource": DS,
                "gridPos": {"h": 8, "w": 8, "x": (i % 3) * 8, "y": y + (i // 3) * 8},
                "fieldConfig": {"defaults": {"unit": p["unit"],
                                             **({"custom": custom} if kind == "timeseries"
                                                else {})},
                                "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}}
                if kind == "timeseries" else {"reduceOptions": {"calcs": ["lastNotNull"]}},
                "targets": [
                    {"refId": chr(ord("A") + k), "datasource": DS, "expr": expr,
                     "legendFormat": legend}
                    for k, (expr, legend) in enumerate(p["targets"])
                ],
            })
            pid += 1
        y += ((len(items) + 2) // 3) * 8
    return {
        "title": "gpufleet",
        "uid": "gpufleet-overview",
        "description": "Fleet, teams, queue tails, fragmentation and control plane of a "
        "gpufleet installation (metrics: docs/design/observability.md).",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "tags": ["gpufleet"],
        "templating": {"list": [{
            "name": "datasource", "type": "datasource", "query": "prometheus",
            "label": "Prometheus", "current": {}, "hide": 0,
        }]},
        "annotations": {"list": []},
        "panels": panels,
    }


if __name__ == "__main__":
    out = Path(__file__).with_name("gpufleet.json")
    out.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {out}")
