"""``TeamBook`` keeps each team's largest share across charges instead of recomputing it."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.quota import TeamBook
from gpufleet.policy.snapshot import TeamState

TYPES = ("A100", "H100", "T4")  # T4: no capacity (a share of it is never counted)

charges = st.lists(
    st.tuples(
        st.sampled_from(("a", "b", "c")),
        st.sampled_from(TYPES),
        st.integers(0, 16),
        st.floats(0, 64, allow_nan=False),
        st.integers(0, 1 << 20),
    ),
    max_size=40,
)


CAP_GPUS = {"A100": 64, "H100": 32}
CAP_MEMORY_MB = 1 << 24


def fresh(book: TeamBook, teams: dict[str, TeamState], cap_cpu: float, team_id: str) -> float:
    """The dominant share as a new book, told the allocations ``book`` has now, computes it."""
    now = {
        t: replace(
            ts,
            allocated_gpus=dict(book.alloc.get(t, {})),
            allocated_cpu=book.cpu.get(t, 0.0),
            allocated_memory_mb=book.mem.get(t, 0),
        )
        for t, ts in teams.items()
    }
    return TeamBook(now, (), CAP_GPUS, cap_cpu, CAP_MEMORY_MB, PolicyConfig()).dominant_share(
        team_id
    )


@settings(max_examples=200, deadline=None)
@given(charges, st.lists(st.booleans(), min_size=40, max_size=40), st.booleans())
def test_kept_share_is_the_recomputed_one(
    steps: list[tuple[str, str, int, float, int]], ask: list[bool], no_cpu: bool
) -> None:
    teams = {
        "a": TeamState("a", weight=2.0),
        "b": TeamState("b", weight=0.5),
        "c": TeamState("c"),
    }
    cap_cpu = 0.0 if no_cpu else 512.0
    book = TeamBook(teams, (), CAP_GPUS, cap_cpu, CAP_MEMORY_MB, PolicyConfig())
    for (team_id, gpu_type, gpus, cpu, mem), asked in zip(steps, ask, strict=False):
        if asked:  # (a share read before the charge: kept, then raised by it)
            assert book.dominant_share(team_id) == fresh(book, teams, cap_cpu, team_id)
        book.charge(team_id, gpu_type, gpus, cpu, mem)
    for team_id in teams:
        assert book.dominant_share(team_id) == fresh(book, teams, cap_cpu, team_id)
