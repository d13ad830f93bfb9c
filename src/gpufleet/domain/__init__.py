"""Domain types, state machines, invariants and errors. Standard library only."""
