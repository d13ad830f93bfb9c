"""Job runtimes of the agent (the ``container`` runtime lives in :mod:`.container`)."""
