"""Node label syntax (Kubernetes' rules), the key=value / key- argument forms, precedence."""

from __future__ import annotations

import pytest

from gpufleet.domain.errors import ValidationFailed
from gpufleet.domain.labels import (
    MAX_LABELS,
    effective_labels,
    key_problem,
    parse_label_args,
    parse_label_list,
    validate_labels,
    value_problem,
)


class TestKeys:
    @pytest.mark.parametrize(
        "key",
        [
            pytest.param("rack", id="plain name"),
            pytest.param("Rack_1.a-b", id="upper, digits, _ . -"),
            pytest.param("topology.kubernetes.io/zone", id="DNS prefix"),
            pytest.param("a" * 63, id="63-character name"),
            pytest.param("x/" + "a" * 63, id="short prefix"),
        ],
    )
    def test_valid(self, key: str) -> None:
        assert key_problem(key) is None

    @pytest.mark.parametrize(
        ("key", "want_in_message"),
        [
            pytest.param("", "the name must be", id="empty"),
            pytest.param("a" * 64, "the name must be", id="64-character name"),
            pytest.param("-rack", "the name must be", id="starts with a dash"),
            pytest.param("rack.", "the name must be", id="ends with a dot"),
            pytest.param("ra ck", "the name must be", id="space"),
            pytest.param("rack=1", "the name must be", id="equals sign"),
            pytest.param("/rack", "empty prefix", id="empty prefix"),
            pytest.param("Example.com/rack", "DNS subdomain", id="upper-case prefix"),
            pytest.param("a..b/rack", "DNS subdomain", id="empty DNS label"),
            pytest.param("a/b/rack", "DNS subdomain", id="two slashes"),
            pytest.param("é", "the name must be", id="non-ASCII"),
        ],
    )
    def test_invalid(self, key: str, want_in_message: str) -> None:
        problem = key_problem(key)
        assert problem is not None and want_in_message in problem


class TestValues:
    @pytest.mark.parametrize("value", ["", "r1", "A.b_c-9", "v" * 63])
    def test_valid(self, value: str) -> None:
        assert value_problem("k", value) is None

    @pytest.mark.parametrize("value", ["v" * 64, "-r1", "r1-", "r 1", "a/b", "x=y", "ü"])
    def test_invalid(self, value: str) -> None:
        assert value_problem("k", value) is not None


class TestValidateLabels:
    def test_field_names_the_key(self) -> None:
        with pytest.raises(ValidationFailed) as exc:
            validate_labels({"rack": "r1", "sw itch": "s3"})
        assert exc.value.field == "labels.sw itch"
        assert exc.value.http_status == 422

    def test_bad_value_names_its_key(self) -> None:
        with pytest.raises(ValidationFailed) as exc:
            validate_labels({"rack": "r 1"})
        assert exc.value.field == "labels.rack"

    def test_agent_prefix_is_reserved(self) -> None:
        with pytest.raises(ValidationFailed, match="set by the agent") as exc:
            validate_labels({"gpufleet/containment": "none"})
        assert exc.value.field == "labels.gpufleet/containment"

    def test_none_values_are_removals(self) -> None:
        validate_labels({"rack": None})

    def test_too_many(self) -> None:
        with pytest.raises(ValidationFailed) as exc:
            validate_labels({f"k{i}": "v" for i in range(MAX_LABELS + 1)})
        assert exc.value.field == "labels"


class TestParse:
    def test_set_and_remove(self) -> None:
        assert parse_label_args(["rack=r1", "switch-", "empty="]) == {
            "rack": "r1",
            "switch": None,
            "empty": "",
        }

    def test_later_item_wins(self) -> None:
        assert parse_label_args(["rack=r1", "rack=r2"]) == {"rack": "r2"}

    @pytest.mark.parametrize("item", ["rack", "-", "=r1"])
    def test_malformed(self, item: str) -> None:
        with pytest.raises(ValidationFailed):
            parse_label_args([item])

    def test_no_removal_where_not_allowed(self) -> None:
        with pytest.raises(ValidationFailed, match="use key=value"):
            parse_label_args(["rack-"], allow_remove=False)

    def test_list_form_of_the_env_var(self) -> None:
        assert parse_label_list(" rack=r1, switch=s3  zone=z1 ") == {
            "rack": "r1",
            "switch": "s3",
            "zone": "z1",
        }
        assert parse_label_list("") == {}

    def test_list_form_rejects_bad_keys(self) -> None:
        with pytest.raises(ValidationFailed) as exc:
            parse_label_list("rack=r1,bad key=x")
        assert exc.value.field == "labels"  # "bad" alone is not key=value


class TestEffective:
    def test_admin_wins_on_a_shared_key(self) -> None:
        agent = {"rack": "r1", "gpufleet/containment": "pidns"}
        admin = {"rack": "r2", "switch": "s3"}
        assert effective_labels(agent, admin) == {
            "rack": "r2",
            "switch": "s3",
            "gpufleet/containment": "pidns",
        }

    def test_missing_sources(self) -> None:
        assert effective_labels(None, None) == {}
        assert effective_labels({"a": "1"}, None) == {"a": "1"}
