"""Trace-driven, discrete-event simulator that drives the same ``gpufleet.policy.schedule`` as
the live controller on an in-memory fleet and a virtual clock (docs/design/simulator.md)."""
