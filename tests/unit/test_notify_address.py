"""Which resolved addresses a webhook may go to (services.notify.address_problem): IP
literals, so no DNS is needed."""

from __future__ import annotations

import pytest

from gpufleet.services.notify import address_problem
from gpufleet.settings import Settings


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8080/x",
        "http://[::1]/x",
        "http://10.1.2.3/x",
        "http://192.168.0.1/x",
        "http://169.254.169.254/latest/meta-data",
        "http://224.0.0.1/x",
        "http://0.0.0.0/x",
        "http://[fd00::1]/x",
    ],
)
def test_non_public_addresses_are_refused(url: str) -> None:
    problem = address_problem(url, Settings())
    assert problem is not None and "non-public address" in problem
    assert address_problem(url, Settings(notify_allow_private=True)) is None


def test_allow_hosts_names_one_host() -> None:
    allowed = Settings(notify_allow_hosts="10.1.2.3, LocalHost")
    assert address_problem("http://10.1.2.3/x", allowed) is None
    assert address_problem("http://localhost:9/x", allowed) is None
    assert address_problem("http://10.1.2.4/x", allowed) is not None


def test_a_public_address_passes() -> None:
    assert address_problem("https://93.184.215.14/hook", Settings()) is None


def test_the_connection_goes_to_the_checked_address() -> None:
    from gpufleet.services.notify import pinned

    assert pinned("https://hooks.example.com/a?b=1", "93.184.215.14") == (
        "https://93.184.215.14/a?b=1",
        {"Host": "hooks.example.com"},
        {"sni_hostname": "hooks.example.com"},
    )
    assert pinned("http://localhost:8080/x", "::1") == (
        "http://[::1]:8080/x",
        {"Host": "localhost:8080"},
        {},
    )
