"""``admin team set``'s limit flags as the ``limits`` object (``cli.admin_limits``): merged
into the team's current limits, validated by the same rules as the API, errors naming the
flag."""

from __future__ import annotations

import pytest

from gpufleet.cli.admin_limits import LimitFlags, merge_limits
from gpufleet.cli.options import ClientError
from gpufleet.services.team_limits import normalize_limits


def test_the_example_flags_make_limits_the_api_accepts() -> None:
    got = merge_limits(
        {},
        LimitFlags(
            allow_classes="NORMAL,HIGH",
            disallowed="demote",
            budget="500",
            budget_window="30d",
            class_budget=["CRITICAL=50/7d"],
        ),
    )
    assert got == {
        "allowed_classes": ["NORMAL", "HIGH"],
        "disallowed": "demote",
        "class_budgets": {"CRITICAL": {"gpu_hours": 50.0, "window_s": 604800.0, "over": "demote"}},
        "gpu_budgets": [
            {
                "gpu_hours": 500.0,
                "period": "rolling",
                "window_s": 2592000.0,
                "gpu_type": None,
                "hard": True,
            }
        ],
    }
    assert normalize_limits(got) is not None  # the server's validation takes it


def test_flags_change_only_their_part_of_the_current_limits() -> None:
    current = {
        "allowed_classes": ["NORMAL", "LOW"],
        "disallowed": "refuse",
        "gpu_budgets": [
            {
                "gpu_hours": 100,
                "period": "month",
                "window_s": None,
                "gpu_type": None,
                "hard": True,
            },
            {
                "gpu_hours": 9,
                "period": "month",
                "window_s": None,
                "gpu_type": "H100",
                "hard": True,
            },
        ],
        "preemption_waste": {"gpu_hours": 20, "window_s": 86400},
    }
    got = merge_limits(current, LimitFlags(budget="200", budget_mode="soft"))
    assert got["allowed_classes"] == ["NORMAL", "LOW"]
    assert got["preemption_waste"] == current["preemption_waste"]
    assert [(b["gpu_type"], b["gpu_hours"], b["hard"]) for b in got["gpu_budgets"]] == [
        ("H100", 9, True),
        (None, 200.0, False),
    ]
    assert current["gpu_budgets"][0]["gpu_hours"] == 100  # not changed in place
    gone = merge_limits(got, LimitFlags(budget="none", budget_gpu_type="H100"))
    assert [b["gpu_type"] for b in gone["gpu_budgets"]] == [None]
    assert "allowed_classes" not in merge_limits(got, LimitFlags(allow_classes="all"))
    held = merge_limits({}, LimitFlags(class_budget=["HIGH=5"], class_over="hold"))
    assert held["class_budgets"] == {
        "HIGH": {"gpu_hours": 5.0, "window_s": 604800.0, "over": "hold"}
    }
    assert merge_limits(held, LimitFlags(class_budget=["HIGH=none"])) == {}
    assert merge_limits(current, LimitFlags(no_limits=True)) == {}


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (LimitFlags(allow_classes="NORMAL,URGENT"), "--allow-classes"),
        (LimitFlags(disallowed="maybe"), "--disallowed"),
        (LimitFlags(budget="lots"), "--budget"),
        (LimitFlags(budget="-1"), "--budget"),
        (LimitFlags(budget="5", budget_window="fortnight"), "--budget-window"),
        (LimitFlags(budget="5", budget_mode="strict"), "--budget-mode"),
        (LimitFlags(budget_window="30d"), "--budget-window"),
        (LimitFlags(class_budget=["NORMAL=5/7d"]), "--class-budget"),
        (LimitFlags(class_budget=["CRITICAL"]), "--class-budget"),
        (LimitFlags(class_budget=["CRITICAL=5/soon"]), "--class-budget"),
        (LimitFlags(class_over="hold"), "--class-over"),
        (LimitFlags(no_limits=True, budget="5"), "--no-limits"),
        (LimitFlags(budget="10", budget_window="1000000d"), "--budget-window"),
        (LimitFlags(budget="1e12"), "--budget"),
        (LimitFlags(class_budget=["CRITICAL=5/1000d"]), "--class-budget"),
    ],
)
def test_a_bad_flag_is_refused_naming_it(flags: LimitFlags, field: str) -> None:
    with pytest.raises(ClientError) as err:
        merge_limits({}, flags)
    assert err.value.field == field
    assert field in err.value.message


def test_budgets_are_keyed_by_window_and_gpu_type() -> None:
    """A new window adds a budget, the same window replaces it (keeping its mode unless
    --budget-mode is given), ``none`` with a window removes that one only."""
    soft = merge_limits({}, LimitFlags(budget="0.01", budget_window="2h", budget_mode="soft"))
    both = merge_limits(soft, LimitFlags(budget="0.02", budget_window="30d"))
    assert [(b["window_s"], b["gpu_hours"], b["hard"]) for b in both["gpu_budgets"]] == [
        (7200.0, 0.01, False),
        (2592000.0, 0.02, True),
    ]
    assert normalize_limits(both) is not None  # two rolling windows: two budgets
    again = merge_limits(both, LimitFlags(budget="0.05", budget_window="2h"))
    assert [(b["window_s"], b["gpu_hours"], b["hard"]) for b in again["gpu_budgets"]] == [
        (2592000.0, 0.02, True),
        (7200.0, 0.05, False),  # replaced; still soft
    ]
    gone = merge_limits(again, LimitFlags(budget="none", budget_window="30d"))
    assert [b["window_s"] for b in gone["gpu_budgets"]] == [7200.0]
    monthly = merge_limits(gone, LimitFlags(budget="5"))
    assert [b["period"] for b in monthly["gpu_budgets"]] == ["rolling", "month"]
