"""The ``gpufleet`` command: the root app, its lazy loading, and the executable's entry point.

The commands live elsewhere: the client commands in :mod:`gpufleet.cli.client`, the
platform's processes (``up``, ``demo``, ``server``, ``controller``, ``agent``) in
:mod:`gpufleet.cli.serve`, and the ``admin`` and ``sim`` sub-apps in :mod:`gpufleet.cli.admin`
and :mod:`gpufleet.sim.cli`.

Start-up is kept cheap (a client call should cost well under 150 ms of CPU): this module
imports only Typer and the commands (Rich when something is printed, see
:class:`~gpufleet.cli.common._LazyConsole`); everything heavy (settings and pydantic,
SQLAlchemy, gRPC, the simulator with numpy/matplotlib) is imported inside the command that
needs it, and the ``admin`` and ``sim`` sub-apps are imported and turned into click commands
only when called (:class:`_RootGroup`). docs/design/cli.md (Start-up cost) lists the rest;
``tests/integration/test_cli_sdk.py`` checks the import sets of real calls and
``benchmarks/cli_start.py`` prints the CPU times.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from functools import partial
from typing import Annotated, Any, ClassVar

import typer
from typer.core import TyperCommand, TyperGroup

from gpufleet.cli import serve
from gpufleet.cli.client import register_client_commands
from gpufleet.cli.common import err, escape, out

# httpx's own command-line tool (httpx._main: click, pygments, rich.syntax) is imported by
# `import httpx` when its dependencies happen to be installed; this CLI never uses it, and it
# is a fifth of a client call's start-up. A None entry makes httpx take its "not installed"
# branch, in this process only.
if "httpx" not in sys.modules:
    sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]


class _LazyGroup(TyperGroup):
    """A sub-app listed in ``--help`` by name and help text, built (imported and turned into
    a click group) only when it is invoked or its own help is asked for."""

    def __init__(self, name: str, help_text: str, load: Callable[[], TyperGroup]) -> None:
        super().__init__(name=name, help=help_text)
        self._load = load

    def make_context(self, info_name: Any, args: Any, parent: Any = None, **extra: Any) -> Any:
        # the real group parses and runs; this one only stood in for the listing
        return self._load().make_context(info_name, args, parent=parent, **extra)


def _admin_group() -> TyperGroup:
    from gpufleet.cli.admin import admin_group

    return admin_group()


def _sim_group() -> TyperGroup:
    try:
        from gpufleet.sim.cli import app as sim_app
    except ImportError as exc:
        err.print(
            f"[red]error:[/] the simulator needs the 'sim' extra ({escape(str(exc))}): "
            "pip install 'gpufleet[sim]'"
        )
        raise typer.Exit(2) from None
    group = typer.main.get_group(sim_app)
    assert isinstance(group, TyperGroup)
    return group


LAZY_GROUPS: dict[str, tuple[str, Callable[[], TyperGroup]]] = {
    "admin": (
        "Operator commands: team, token and node through the API with an admin token;"
        " check and ca on the database host.",
        _admin_group,
    ),
    "sim": ("Trace-driven simulator of the scheduling policy.", _sim_group),
}


class _RootGroup(TyperGroup):
    """The root command: the eager commands plus :data:`LAZY_GROUPS` stand-ins."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        for name, (help_text, load) in LAZY_GROUPS.items():
            self.commands.setdefault(name, _LazyGroup(name, help_text, load))


class _LazyCommand(TyperCommand):
    """A command listed by name and docstring; Typer builds its parameters (type hints,
    defaults: the costly part of start-up for 20 commands) only when it is the one run."""

    def __init__(self, name: str, build: Callable[[], TyperCommand], help_text: str) -> None:
        super().__init__(name=name, help=help_text)
        self._build = build

    def make_context(self, info_name: Any, args: Any, parent: Any = None, **extra: Any) -> Any:
        return self._build().make_context(info_name, args, parent=parent, **extra)


class _LazyTyper(typer.Typer):
    """The root app: its commands become click commands on demand (see :class:`_LazyCommand`).
    ``typer.main.get_command(app)`` (CliRunner in tests) still builds everything eagerly."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import inspect

        infos = list(self.registered_commands)
        self.registered_commands = []
        try:
            root = typer.main.get_command(self)
        finally:
            self.registered_commands = infos
        assert isinstance(root, TyperGroup)
        groups = dict(root.commands)
        root.commands.clear()
        for info in infos:
            assert info.callback is not None
            name = info.name or typer.main.get_command_name(info.callback.__name__)
            build = partial(
                typer.main.get_command_from_info,
                info,
                pretty_exceptions_short=self.pretty_exceptions_short,
                rich_markup_mode=self.rich_markup_mode,
            )
            doc = (inspect.getdoc(info.callback) if info.help is None else info.help) or ""
            summary = " ".join(doc.split("\n\n")[0].split())  # the listing's one paragraph
            root.commands[name] = _LazyCommand(name, build, summary)  # type: ignore[arg-type]
            root.commands[name].hidden = info.hidden
        root.commands.update(groups)
        return root(*args, **kwargs)


app = _LazyTyper(
    cls=_RootGroup,
    help="gpufleet: a GPU job platform (queue, fair share, best-fit placement, node agents).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
register_client_commands(app)
serve.register(app)


def _show_version(value: bool) -> None:
    if value:
        from gpufleet import __version__

        typer.echo(f"gpufleet {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[  # noqa: ARG001 - handled by its eager callback
        bool,
        typer.Option(
            "--version", callback=_show_version, is_eager=True, help="Print the version."
        ),
    ] = False,
    no_color: Annotated[
        bool,
        typer.Option("--no-color", help="No colours (also when NO_COLOR is set)."),
    ] = False,
) -> None:
    """gpufleet: a GPU job platform (queue, fair share, best-fit placement, node agents)."""
    if no_color:
        import os

        os.environ["NO_COLOR"] = "1"  # read by every Rich console built from now on
        err.no_color = out.no_color = True


class _LightRichUtils:
    """Import hook for ``typer.rich_utils`` (loaded by Typer for ``--help`` and usage errors):
    it imports ``rich.markdown`` (markdown-it, Pygments) and ``rich.traceback`` at module
    level, ~30 ms of CPU, for ``rich_markup_mode="markdown"`` and pretty tracebacks, neither
    of which this CLI uses. While it is imported, those two modules are stand-ins whose
    classes import the real module when first used; afterwards they are imported normally."""

    DEFERRED: ClassVar[dict[str, tuple[str, ...]]] = {
        "rich.markdown": ("Markdown",),
        "rich.traceback": ("Traceback",),
    }

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:  # noqa: ARG002
        if name != "typer.rich_utils":
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        real = spec.loader
        deferred = self.DEFERRED

        class Loader:
            def create_module(self, spec: Any) -> Any:
                return real.create_module(spec)

            def exec_module(self, module: Any) -> None:
                import types

                stubs = {}
                for mod_name, attrs in deferred.items():
                    if mod_name in sys.modules:
                        continue
                    stub = types.ModuleType(mod_name)
                    for attr in attrs:
                        setattr(stub, attr, _deferred_class(mod_name, attr))
                    stubs[mod_name] = sys.modules[mod_name] = stub
                try:
                    real.exec_module(module)
                finally:
                    for mod_name, stub in stubs.items():
                        if sys.modules.get(mod_name) is stub:
                            del sys.modules[mod_name]

        spec.loader = Loader()  # type: ignore[assignment]
        return spec


def _deferred_class(module: str, name: str) -> type:
    """A stand-in for ``module.name``: calling it or reading an attribute imports the real
    class and defers to it."""

    def real() -> Any:
        import importlib

        return getattr(importlib.import_module(module), name)

    class Deferred(type):
        def __call__(cls, *args: Any, **kwargs: Any) -> Any:
            return real()(*args, **kwargs)

        def __getattr__(cls, attr: str) -> Any:
            return getattr(real(), attr)

    return Deferred(name, (), {})


def main() -> None:
    """Run the root app (``gpufleet.cli.main`` is the executable's entry point). After the
    command the process exits without tearing down its modules (``os._exit`` once the
    ``atexit`` handlers ran and stdout/stderr are flushed: ~15 ms of a client call's CPU),
    unless a thread other than the main one is still running."""
    import os

    if not any(isinstance(f, _LightRichUtils) for f in sys.meta_path):
        sys.meta_path.insert(0, _LightRichUtils())
    code: Any = 0
    try:
        app()
    except SystemExit as exc:
        code = exc.code
    if any(t is not threading.main_thread() and not t.daemon for t in threading.enumerate()):
        sys.exit(code)
    import atexit

    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        sys.exit(code)  # let the interpreter report a broken pipe as it always did
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    os._exit(code)


if __name__ == "__main__":
    main()
