"""The CLI's terminal-safety helpers: ``clean`` and the streaming log filter (the commands
that use them are tested in test_cli_client.py, ``TestTerminalSafety``)."""

from __future__ import annotations

import pytest

from gpufleet.cli import output

HOSTILE = [
    pytest.param("\x1b]0;owned\x07title", "title", id="OSC window title (BEL)"),
    pytest.param("\x1b]52;c;ZXZpbA==\x1b\\clip", "clip", id="OSC 52 clipboard write (ST)"),
    pytest.param("\x1b[2J\x1b[Hclear", "clear", id="CSI clear screen + home"),
    pytest.param("\x1b[31mred\x1b[0m", "red", id="SGR colour"),
    pytest.param("\x1bPqdcs\x1b\\x", "x", id="DCS string"),
    pytest.param("a\x1b7b\x1b8c", "abc", id="save/restore cursor"),
    pytest.param("a\x9b31mb", "a31mb", id="8-bit CSI (C1) removed"),
    pytest.param("bell\x07 back\x08space\rcr", "bell backspacecr", id="C0 controls"),
    pytest.param("del\x7f", "del", id="DEL"),
    pytest.param("tab\tand\nnewline", "tab\tand\nnewline", id="tab and newline kept"),
    pytest.param("ünïcödé ✓", "ünïcödé ✓", id="printable unicode kept"),
    pytest.param("lone ESC\x1b", "lone ESC", id="a lone ESC at the end"),
]


@pytest.mark.parametrize(("raw", "want"), HOSTILE)
def test_clean(raw: str, want: str) -> None:
    assert output.clean(raw) == want


class TestTerminalLogFilter:
    def test_a_sequence_split_across_chunks_is_still_removed(self) -> None:
        data = b"before \x1b]0;owned\x07 \x1b[31mred\x1b[0m after\r\n"
        for cut in range(1, len(data)):
            f = output.TerminalLogFilter()
            got = f.feed(data[:cut]) + f.feed(data[cut:]) + f.feed(b"", final=True)
            assert got == "before  red after\r\n", cut

    def test_split_utf8_and_invalid_bytes(self) -> None:
        f = output.TerminalLogFilter()
        text = "✓".encode()
        got = f.feed(text[:1]) + f.feed(text[1:] + b"\xff\n") + f.feed(b"", final=True)
        assert got == "✓\ufffd\n"
