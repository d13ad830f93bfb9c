"""YAML as the platform reads its files (scenarios, job files): PyYAML's safe loader, except
that a mapping with the same key twice is an error. PyYAML keeps the last value silently, so
a job file with two ``command:`` keys, or a scenario with two ``workload:`` sections, would run
something other than what its author reads."""

from __future__ import annotations

from typing import Any

import yaml


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` refusing a repeated key in a mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # ``<<: *base``: its keys may be overridden here, as YAML intends
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base class says so
                break
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping",
                    node.start_mark,
                    f"found the key {key!r} twice (first at line {first.start_mark.line + 1})",
                    key_node.start_mark,
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """``text`` parsed as YAML (a superset of JSON), like ``yaml.safe_load``.

    Raises:
        yaml.YAMLError: not valid YAML, or a mapping repeats a key (a ``ConstructorError``
            whose ``problem`` names the key and ``problem_mark`` its second place).
    """
    return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: safe


def yaml_problem(exc: yaml.YAMLError) -> str:
    """One line for a parse error: ``at line 4, column 1: found the key 'x' twice ...``."""
    mark = getattr(exc, "problem_mark", None)
    where = f"at line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    return where + (getattr(exc, "problem", None) or str(exc).splitlines()[0])
