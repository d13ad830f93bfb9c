"""Manifest entries must name normalised keys under the attempt's own prefix (pure checks)."""

from __future__ import annotations

import pytest

from gpufleet.domain.manifest import Manifest, ManifestFile, file_problem, path_problem

PREFIX = "jobs/j-1/attempts/r-1"


def entry(kind: str = "artifact", path: str = "model.bin", key: str | None = None) -> ManifestFile:
    folder = {"artifact": "artifacts", "checkpoint": "checkpoints", "log": "logs"}.get(kind, kind)
    return ManifestFile(kind, path, key or f"{PREFIX}/{folder}/{path}", "u", "0" * 64, 1)


@pytest.mark.parametrize(
    "path",
    [
        pytest.param("model.bin", id="a file"),
        pytest.param("ckpt/step-100/weights.npz", id="nested"),
        pytest.param("..hidden", id="dots in a name are fine"),
        pytest.param("a b/ü.txt", id="spaces and unicode"),
    ],
)
def test_good_paths(path: str) -> None:
    assert path_problem(path) is None
    assert file_problem(entry(path=path), PREFIX) is None


@pytest.mark.parametrize(
    "path",
    [
        pytest.param("", id="empty"),
        pytest.param("../../j-2/attempts/r-9/artifacts/model.bin", id="dot-dot"),
        pytest.param("a/../../b", id="dot-dot inside"),
        pytest.param("/etc/passwd", id="absolute"),
        pytest.param("a//b", id="empty segment"),
        pytest.param("./a", id="dot segment"),
        pytest.param("a/", id="trailing slash"),
        pytest.param("..\\..\\x", id="backslashes"),
        pytest.param("a\x00b", id="NUL"),
        pytest.param("a\nb", id="newline"),
        pytest.param("x" * 2000, id="too long"),
    ],
)
def test_bad_paths(path: str) -> None:
    assert path_problem(path) is not None
    assert file_problem(entry(path=path), PREFIX) is not None


@pytest.mark.parametrize(
    "f",
    [
        pytest.param(
            entry(key=f"{PREFIX}/artifacts/../../../j-2/attempts/r-9/artifacts/model.bin"),
            id="key climbs out of the prefix",
        ),
        pytest.param(entry(key="jobs/j-2/attempts/r-9/artifacts/model.bin"), id="another job"),
        pytest.param(entry(key=f"/{PREFIX}/artifacts/model.bin"), id="absolute key"),
        pytest.param(entry(key=f"{PREFIX}/checkpoints/model.bin"), id="key in another folder"),
        pytest.param(entry(key=f"{PREFIX}/artifacts/other.bin"), id="key and path differ"),
        pytest.param(entry(kind="secret"), id="unknown kind"),
        pytest.param(entry(key=f"{PREFIX}-evil/artifacts/model.bin"), id="a sibling prefix"),
    ],
)
def test_keys_must_be_the_canonical_key_under_the_prefix(f: ManifestFile) -> None:
    assert file_problem(f, PREFIX) is not None


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param("[]", id="not an object"),
        pytest.param('{"job_id": 1}', id="a number for a name"),
        pytest.param('{"files": [{"key": 5}]}', id="a number for a key"),
        pytest.param('{"files": "x"}', id="files not a list"),
        pytest.param("{", id="not JSON"),
    ],
)
def test_malformed_manifests_raise_value_error(raw: str) -> None:
    with pytest.raises(ValueError, match="malformed manifest"):
        Manifest.from_json(raw)
