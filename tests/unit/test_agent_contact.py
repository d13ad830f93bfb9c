"""gpufleet.agent.contact: an agent out of touch renews contact before new work, or refuses."""

from __future__ import annotations

import pytest

from gpufleet.agent.contact import Contact, OutOfTouch


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class TestContact:
    def test_never_heard_in_this_process_is_out_of_touch(self) -> None:
        contact = Contact(Clock())
        assert contact.out_of_touch()
        with pytest.raises(OutOfTouch, match="since it started"):
            contact.ensure(limit_s=0.1)

    def test_silence_longer_than_the_timeout_asks_and_an_answer_lets_work_start(self) -> None:
        clock = Clock()
        contact = Contact(clock)
        contact.heard(clock(), timeout_s=15.0)
        clock.now += 15.0
        assert not contact.out_of_touch()  # at the bound: still in touch
        clock.now += 0.5
        asked: list[float] = []

        def ask(limit_s: float) -> None:
            asked.append(limit_s)
            contact.heard(clock())  # a heartbeat answered

        contact.ask = ask
        contact.ensure(limit_s=3.0)
        assert asked == [3.0]
        contact.ensure()  # in touch now: no second heartbeat
        assert asked == [3.0]

    def test_no_answer_refuses_and_says_for_how_long(self) -> None:
        clock = Clock()
        contact = Contact(clock)
        contact.heard(clock(), timeout_s=2.0)
        clock.now += 7.9

        class Unavailable(Exception):
            def code(self) -> object:
                class C:
                    name = "UNAVAILABLE"

                return C()

        def ask(limit_s: float) -> None:
            raise Unavailable()

        contact.ask = ask
        with pytest.raises(OutOfTouch) as info:
            contact.ensure(limit_s=3.0)
        text = str(info.value)
        assert "7.9 s" in text and "contact timeout 2 s" in text and "UNAVAILABLE" in text

    def test_an_older_controller_names_no_timeout_only_registration_counts(self) -> None:
        clock = Clock()
        contact = Contact(clock)
        contact.heard(clock(), timeout_s=0.0)
        clock.now += 3600
        assert not contact.out_of_touch()

    def test_contact_counts_from_the_request_sent_not_the_answer(self) -> None:
        clock = Clock()
        contact = Contact(clock)
        contact.heard(50.0, timeout_s=40.0)  # sent at 50, answered at 100
        clock.now = 91.0
        assert contact.out_of_touch()
        contact.heard(40.0)  # an older request answered late does not move it back
        assert contact.silent_for_s() == 41.0
