"""Use cases (submit, cancel, complete, register, heartbeat...). Adapters stay thin around
these; these stay thin around ``store``."""
