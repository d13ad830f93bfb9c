"""DD9: image locality breaks ties between equally good nodes, never at the cost of fit."""

from __future__ import annotations

from dataclasses import replace

import pytest
from policy_builders import job, node, snap, team

from gpufleet.domain.images import normalize_image
from gpufleet.policy.config import Placement, PolicyConfig
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import Place

IMG = normalize_image("registry.local/train:1")


def placed_on(result: object, job_id: str) -> str:
    return next(
        d.node_id
        for d in result.decisions  # type: ignore[attr-defined]
        if isinstance(d, Place) and d.job_id == job_id
    )


def with_images(n, *images: str):
    return replace(n, images=frozenset(images))


class TestImageLocality:
    def test_of_two_equally_good_nodes_the_one_holding_the_image_wins(self) -> None:
        # n1 sorts first by id; only n2 has the image
        nodes = [node("n1", free=4), with_images(node("n2", free=4), IMG)]
        s = snap(nodes, pending=[replace(job("j", gpus=2), image=IMG)], teams=[team("a")])
        assert placed_on(schedule(s), "j") == "n2"

    def test_without_an_image_the_tie_goes_by_node_id(self) -> None:
        nodes = [node("n1", free=4), with_images(node("n2", free=4), IMG)]
        s = snap(nodes, pending=[job("j", gpus=2)], teams=[team("a")])
        assert placed_on(schedule(s), "j") == "n1"

    def test_best_fit_still_wins_over_the_image(self) -> None:
        # n1 fits exactly (2 free for 2 GPUs); n2 holds the image but would be fragmented
        nodes = [node("n1", free=2), with_images(node("n2", free=6), IMG)]
        s = snap(nodes, pending=[replace(job("j", gpus=2), image=IMG)], teams=[team("a")])
        assert placed_on(schedule(s), "j") == "n1"

    def test_spread_prefers_the_image_among_the_emptiest_only(self) -> None:
        nodes = [
            node("n1", free=8),
            with_images(node("n2", free=8), IMG),
            with_images(node("n3", free=4), IMG),
        ]
        cfg = PolicyConfig(placement=Placement.SPREAD)
        s = snap(nodes, pending=[replace(job("j", gpus=2), image=IMG)], teams=[team("a")])
        assert placed_on(schedule(s, cfg), "j") == "n2"

    def test_an_unfit_node_holding_the_image_is_skipped(self) -> None:
        # n2 holds the image and has the same free count, but not enough CPU
        n1 = replace(node("n1", free=4), cpu_total=32, cpu_free=32)
        n2 = replace(with_images(node("n2", free=4), IMG), cpu_total=32, cpu_free=1)
        j = replace(job("j", gpus=2), image=IMG)
        j = replace(j, resources=replace(j.resources, cpu=8))
        s = snap([n1, n2], pending=[j], teams=[team("a")])
        assert placed_on(schedule(s), "j") == "n1"


@pytest.mark.parametrize(
    ("ref", "want"),
    [
        ("busybox", "docker.io/library/busybox:latest"),
        ("pytorch/pytorch:2.3-cuda12", "docker.io/pytorch/pytorch:2.3-cuda12"),
        ("127.0.0.1:5000/gpufleet/busybox:1", "127.0.0.1:5000/gpufleet/busybox:1"),
        ("localhost/x", "localhost/x:latest"),
        ("ghcr.io/a/b@sha256:00", "ghcr.io/a/b@sha256:00"),
        ("", ""),
    ],
)
def test_normalize_image(ref: str, want: str) -> None:
    assert normalize_image(ref) == want
