"""The node agent: one per GPU node.

It reports the node's GPU inventory, logs every assignment durably before it starts anything,
starts each attempt (run_id) at most once under a per-attempt supervisor (the shim), pins GPUs,
streams logs, uploads checkpoints and artifacts with a manifest written last, heartbeats the
attempts that really run, and stops attempts with SIGTERM, grace, SIGKILL and a verified exit.

Entry point: :func:`gpufleet.agent.main.run_agent`. This package's ``__init__`` imports nothing
on purpose: the shim (``python -m gpufleet.agent.shim``) is started once per attempt and must
start fast.
"""
