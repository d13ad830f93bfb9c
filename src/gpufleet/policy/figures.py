"""How ``why`` and messages print GPU-hour figures (pure; shared with the simulator)."""

from __future__ import annotations

__all__ = ["gpu_h"]


def gpu_h(x: float) -> str:
    """A GPU-hour figure (budget use, limit, preemption waste) to 3 significant digits:
    ``0.00833`` -> ``"0.00833"``, ``0.0599`` -> ``"0.0599"``, ``8.0`` -> ``"8"``,
    ``1234.5`` -> ``"1.23e+03"``. One helper so every message agrees with its details."""
    return f"{x:.3g}"
