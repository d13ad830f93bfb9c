"""The chaos checker's pieces can fail (no test that cannot fail)."""

from __future__ import annotations

from tests.chaos.harness import double_holds


def test_double_holds_flags_a_gpu_in_two_live_reservations() -> None:
    rows = [
        ("r1", "n0", [0, 1], "CONFIRMED"),
        ("r2", "n0", [1, 2], "RESERVED"),
        ("r3", "n1", [1], "QUARANTINED"),
    ]
    assert double_holds(rows) == ["GPU n0/1 in two live reservations: r1, r2"]


def test_double_holds_accepts_disjoint_reservations() -> None:
    assert double_holds([("r1", "n0", "[0, 1]", "CONFIRMED"), ("r2", "n0", [2], "RESERVED")]) == []
