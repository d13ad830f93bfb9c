"""YAML as the platform reads its files: ``yaml.safe_load`` except that a repeated key in a
mapping is an error (``domain.yamlfile.load_yaml``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpufleet.domain.yamlfile import load_yaml, yaml_problem

EXAMPLES = sorted(Path(__file__).resolve().parents[2].glob("examples/**/*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_the_examples_read_as_safe_load_reads_them(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert load_yaml(text) == yaml.safe_load(text)


def test_a_repeated_key_is_named_with_both_lines() -> None:
    with pytest.raises(yaml.YAMLError) as err:
        load_yaml("a: 1\nb:\n  c: 2\n  c: 3\n")
    assert yaml_problem(err.value) == (
        "at line 4, column 3: found the key 'c' twice (first at line 3)"
    )


def test_a_merge_key_may_be_overridden_but_not_repeated() -> None:
    """``<<: *base`` then ``y: 3`` overrides the merged ``y`` (YAML's intent); two own ``y``
    keys are still refused."""
    text = "base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  y: 3\n"
    assert (
        load_yaml(text)
        == yaml.safe_load(text)
        == {
            "base": {"x": 1, "y": 2},
            "other": {"x": 1, "y": 3},
        }
    )
    with pytest.raises(yaml.YAMLError, match="found the key 'y' twice"):
        load_yaml(text + "  y: 4\n")
