"""The controller: gRPC service for agents, and the leader-only loops (scheduler, stop driver,
reconciler)."""
