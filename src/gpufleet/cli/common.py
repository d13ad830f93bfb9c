"""What the root app's own commands share (the platform processes in :mod:`~gpufleet.cli.serve`,
the database-host admin commands in :mod:`~gpufleet.cli.admin`, the root callback in
:mod:`~gpufleet.cli.main`): the Rich consoles, built on first use, the ``--data-dir`` option,
and the settings, logging and signal-wait helpers.

Cheap to import (Typer and the standard library): pydantic-settings and Rich load inside the
helpers that need them.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from gpufleet.settings import Settings


class _LazyConsole:
    """A Rich ``Console`` built on first use: most client calls print through
    :mod:`gpufleet.cli.output` or not at all, and ``import rich.console`` is ~20 ms of a
    call's CPU. Attribute reads and writes go to the real console."""

    def __init__(self, **kwargs: Any) -> None:
        object.__setattr__(self, "_kwargs", kwargs)
        object.__setattr__(self, "_console", None)

    def _get(self) -> Console:
        console: Console | None = object.__getattribute__(self, "_console")
        if console is None:
            from rich.console import Console

            console = Console(**object.__getattribute__(self, "_kwargs"))
            object.__setattr__(self, "_console", console)
        return console

    def __getattr__(self, name: str) -> Any:
        return getattr(self._get(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._get(), name, value)


def escape(markup: str) -> str:
    """:func:`rich.markup.escape`, imported when first needed."""
    from rich.markup import escape as rich_escape

    return rich_escape(markup)


# emoji=False: a job's name or a server's message with ``:rocket:`` in it is printed as it is
# (and rich's 3,000-entry emoji table is not loaded)
err: Console = _LazyConsole(stderr=True, emoji=False)  # type: ignore[assignment]
out: Console = _LazyConsole(emoji=False)  # type: ignore[assignment]


DataDir = Annotated[
    Path | None, typer.Option("--data-dir", help="State directory (GPUFLEET_DATA_DIR).")
]


def load_settings(data_dir: Path | None, **overrides: object) -> Settings:
    """The environment's settings, with ``--data-dir`` and the flags given (not None) on top."""
    from gpufleet.settings import Settings

    values = {k: v for k, v in overrides.items() if v is not None}
    if data_dir is not None:
        values["data_dir"] = data_dir
    return Settings(**values)  # type: ignore[arg-type]


def configure_logging(verbose: bool = False) -> None:
    """Log lines with a timestamp and the logger's name at INFO (DEBUG when ``verbose``);
    httpx's own only from WARNING."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)


def wait_for_signal() -> None:
    """Block until SIGTERM or SIGINT."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
