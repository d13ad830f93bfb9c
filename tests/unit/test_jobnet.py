"""Parsing of the job network flags and the nftables table they produce (no root needed;
the rules themselves are exercised with real traffic in tests/integration/test_job_network.py)."""

from __future__ import annotations

import ipaddress

import pytest

from gpufleet.agent.runtime import jobnet
from gpufleet.agent.runtime.jobnet import JobNet, NetPolicy, Target, parse_targets


def test_targets_parse_cidrs_hosts_and_ports() -> None:
    got = parse_targets("10.0.0.0/8, 10.1.2.3:5432,[fd00::1]:443,localhost:6379")
    assert got[0] == Target(ipaddress.ip_network("10.0.0.0/8"))
    assert got[1] == Target(ipaddress.ip_network("10.1.2.3/32"), 5432)
    assert got[2] == Target(ipaddress.ip_network("fd00::1/128"), 443)
    assert Target(ipaddress.ip_network("127.0.0.1/32"), 6379) in got[3:]
    assert [str(t) for t in got[:3]] == ["10.0.0.0/8", "10.1.2.3:5432", "[fd00::1]:443"]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("10.0.0.0/33", "not a network"),
        ("10.0.0.1:0", "port '0'"),
        ("10.0.0.1:http", "port 'http'"),
        ("no-such-host.invalid:5432", "cannot resolve"),
        ("[fd00::1]x", "expected [IPv6]:port"),
    ],
)
def test_a_bad_entry_is_refused_naming_the_flag_and_entry(text: str, why: str) -> None:
    with pytest.raises(ValueError, match="--job-egress-deny") as err:
        parse_targets(text)
    assert "--job-egress-deny" in str(err.value) and text in str(err.value)
    assert why in str(err.value)


def test_default_deny_has_the_metadata_range_and_the_controller() -> None:
    deny = jobnet.default_deny(["127.0.0.1:8421", "", "no-such-host.invalid:1"])
    assert Target(ipaddress.ip_network("169.254.0.0/16")) in deny
    assert Target(ipaddress.ip_network("127.0.0.1/32"), 8421) in deny
    assert len(deny) == 2  # the unresolvable name is skipped (with a warning)


def test_ruleset_refuses_the_node_the_deny_list_and_filters_host_network_uids() -> None:
    policy = NetPolicy(
        deny=tuple(parse_targets("10.9.0.0/16,10.8.0.1:5432")),
        own_ports=(8430, 9100),
        job_uids=((1900000000, 1901048575), (999, 999)),
    )
    net = JobNet("netns", "node-a-1234", policy)
    rules = net.ruleset()
    prefix = net.if_prefix
    assert f'iifname "{prefix}*" goto refuse' in rules  # input: the node itself
    assert "elements = { 10.9.0.0/16 }" in rules
    assert "elements = { 10.8.0.1/32 . 5432 }" in rules
    assert "meta skuid { 1900000000-1901048575, 999 } jump host_job" in rules
    assert "th dport { 8430, 9100 } goto refuse" in rules
    assert "ip saddr 10.231.0.0/16 ip daddr != 10.231.0.0/16 masquerade" in rules
    assert "    goto refuse\n    accept" not in rules  # egress allowed past the deny list
    closed = JobNet("netns", "node-a-1234", NetPolicy(egress="none")).ruleset()
    assert "ip daddr @allow4 accept" in closed
    assert "    goto refuse\n    accept" in closed  # egress none: refused past the allow list


def test_names_fit_the_kernel_and_differ_per_agent_and_attempt() -> None:
    a, b = JobNet("netns", "node-a-1"), JobNet("netns", "node-b-1")
    assert len(a.host_if("r-" + "x" * 40)) <= 15
    assert a.host_if("r1") != b.host_if("r1") and a.host_if("r1") != a.host_if("r2")
    assert a.ns_name("r1").startswith(a.ns_prefix) and a.table != b.table


def test_gang_members_use_the_host_namespace() -> None:
    assert jobnet.host_network({"GPUFLEET_GANG_SIZE": "2"})
    assert not jobnet.host_network({"GPUFLEET_GANG_SIZE": "1"})
    assert not jobnet.host_network({})
    net = JobNet("host", "s", problem="forced")
    assert jobnet.attempt_netns(net, "r1", {}) == []
    assert "share the node's network" in net.describe()


def test_unknown_kinds_are_refused() -> None:
    with pytest.raises(ValueError, match="--job-network"):
        jobnet.detect("s", NetPolicy(), want="bridge")
    with pytest.raises(ValueError, match="--job-egress"):
        jobnet.detect("s", NetPolicy(egress="some"), want="host")


def test_an_agent_that_is_not_root_falls_back_to_the_host_namespace_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("gpufleet.agent.runtime.jobnet.os.geteuid", lambda: 1000)
    net = jobnet.detect("s", NetPolicy())
    assert (net.kind, net.problem, net.label) == ("host", "the agent is not root", "host")
    assert net.prune(keep=()) == []  # touches nothing of the host
    with pytest.raises(ValueError, match="--job-network netns: the agent is not root"):
        jobnet.detect("s", NetPolicy(), want="netns")


def test_missing_tools_fall_back_to_the_host_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gpufleet.agent.runtime.jobnet.os.geteuid", lambda: 0)
    monkeypatch.setattr("gpufleet.agent.runtime.jobnet.shutil.which", lambda *_a, **_k: None)
    net = jobnet.detect("s", NetPolicy())
    assert net.kind == "host" and "ip, nft, nsenter not installed" in net.problem
