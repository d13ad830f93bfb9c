"""The job states with no way out (domain/states.py derives the same set from its table; the
SDK keeps its own copy so that it needs nothing of the server's code). A module of its own so
that the CLI can read it without building the SDK's dataclasses (:mod:`gpufleet.client.models`)."""

TERMINAL_STATES = frozenset({"SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED", "DEPENDENCY_FAILED"})
