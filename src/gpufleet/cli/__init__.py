"""Command-line entry points: the root app (main.py) and the user-facing client commands."""
