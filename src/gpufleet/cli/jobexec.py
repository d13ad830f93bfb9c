"""``gpufleet exec``, ``gpufleet shell`` and ``gpufleet port-forward``: into a running job.

Each session is one WebSocket to ``/v1/jobs/{job}/exec`` carrying ``ExecFrame`` messages
(:mod:`gpufleet.api.jobexec` has the protocol; docs/design/security.md the rules). The
command's exit code is this command's (a death by signal N: 128 + N); a refusal prints the
server's message and exits 2 (no such job, not running, too many sessions) or 1 (the server
or the agent cannot do it now).

``websockets`` and the protobuf module are imported by these commands only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from typing import Annotated, Any

import typer

from gpufleet.cli import output
from gpufleet.cli.joblogs import MAX_RANK
from gpufleet.cli.options import JobArg, TokenOpt, UrlOpt

SHELL = "if command -v bash >/dev/null 2>&1; then exec bash -i; else exec sh -i; fi"
"""What ``gpufleet shell`` runs in the job: bash where the job has it, else sh."""


class Refused(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _ws_url(url: str, job: str, rank: int) -> str:
    from urllib.parse import quote

    base = url.rstrip("/")
    scheme = "wss" + base[5:] if base.startswith("https") else "ws" + base[4:]
    return f"{scheme}/v1/jobs/{quote(job, safe='')}/exec?rank={rank}"


def connect(url: str | None, token: str | None, job: str, rank: int) -> Any:
    """An open WebSocket for one session (the client config's URL, token and CA bundle).

    Raises:
        ConfigError: no token configured.
        OSError: the server cannot be reached.
    """
    from websockets.sync.client import connect as ws_connect

    from gpufleet.client.config import require_token, resolve_client_config

    cfg = resolve_client_config(url, token)
    ssl_ctx = None
    if cfg.url.lower().startswith("https"):
        import ssl

        ssl_ctx = ssl.create_default_context(
            cafile=os.path.expanduser(cfg.ca_bundle) if cfg.ca_bundle else None
        )
    return ws_connect(
        _ws_url(cfg.url, job, rank),
        additional_headers={"Authorization": f"Bearer {require_token(cfg)}"},
        ssl=ssl_ctx,
        max_size=1 << 20,
        open_timeout=10,
        close_timeout=2,
    )


def _frames(ws: Any, *, stop_on_error: bool = False) -> Any:
    """The server's frames until the socket closes; raises :class:`Refused` after an error
    frame (with the close code; at the error frame itself with ``stop_on_error``)."""
    from websockets.exceptions import ConnectionClosed

    from gpufleet.rpc.protos import fleet_pb2 as pb

    error = ""
    while True:
        try:
            data = ws.recv()
        except ConnectionClosed as exc:
            rcvd = exc.rcvd
            code = rcvd.code if rcvd is not None else 1006
            if error or code >= 4000:
                raise Refused(error or (rcvd.reason if rcvd else "closed"), code) from None
            return
        if isinstance(data, str):
            continue
        frame = pb.ExecFrame.FromString(data)
        if frame.WhichOneof("kind") == "error":
            error = frame.error
            if stop_on_error:
                raise Refused(error, 4000)
            continue
        yield frame


def run_session(
    ws: Any,
    command: list[str],
    *,
    tty: bool,
    stdin: bool,
) -> int:
    """Relay one command session on ``ws``; returns its exit code (128 + N for signal N).

    Raises:
        Refused: the server refused it.
    """
    from gpufleet.rpc.protos import fleet_pb2 as pb

    rows, cols = _size()
    ws.send(
        pb.ExecFrame(
            start=pb.ExecStart(command=command, tty=tty, rows=rows, cols=cols)
        ).SerializeToString()
    )
    restore = None
    restore_out: tuple[int, Any] | None = None
    # stdin goes to the session only when asked for (-i; ``shell`` always): ``exec -t`` alone
    # is a terminal for the output, as ``docker exec -t``. Forwarding it anyway sent whatever
    # the local side wrote there (``script`` writes an EOF byte when its own stdin ends),
    # which the remote terminal echoed as a stray ``^@``. The local terminal is made raw
    # only when keys go through (else Ctrl-C stays local: it ends the call and the session).
    if tty and stdin and sys.stdin.isatty():
        import termios
        import tty as ttymod

        restore = termios.tcgetattr(sys.stdin.fileno())
        ttymod.setraw(sys.stdin.fileno(), termios.TCSANOW)  # keep what was typed ahead
    elif tty and sys.stdout.isatty():
        import termios

        # the remote terminal already ends lines with CR LF: no second CR from this one
        restore_out = (sys.stdout.fileno(), termios.tcgetattr(sys.stdout.fileno()))
        attrs = termios.tcgetattr(sys.stdout.fileno())
        attrs[1] &= ~termios.OPOST
        termios.tcsetattr(sys.stdout.fileno(), termios.TCSANOW, attrs)
    if tty and sys.stdout.isatty():

        def resized(*_: Any) -> None:
            r, c = _size()
            with contextlib.suppress(Exception):
                ws.send(pb.ExecFrame(resize=pb.ExecResize(rows=r, cols=c)).SerializeToString())

        signal.signal(signal.SIGWINCH, resized)

    def pump_in() -> None:
        fd = sys.stdin.fileno()
        try:
            while True:
                data = os.read(fd, 65536)
                if not data:
                    ws.send(pb.ExecFrame(stdin_eof=True).SerializeToString())
                    return
                ws.send(pb.ExecFrame(stdin=data).SerializeToString())
        except Exception:  # the session ended
            return

    if stdin:
        threading.Thread(target=pump_in, name="exec-stdin", daemon=True).start()
    else:
        ws.send(pb.ExecFrame(stdin_eof=True).SerializeToString())
    code = 1
    try:
        for frame in _frames(ws):
            kind = frame.WhichOneof("kind")
            if kind == "stdout":
                os.write(sys.stdout.fileno(), frame.stdout)
            elif kind == "stderr":
                os.write(sys.stderr.fileno(), frame.stderr)
            elif kind == "exit":
                code = frame.exit.exit_code
                if frame.exit.message:
                    typer.echo(f"\r\nsession ended: {output.clean(frame.exit.message)}", err=True)
    finally:
        if restore is not None:
            import termios

            termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, restore)
        if restore_out is not None:
            import termios

            termios.tcsetattr(restore_out[0], termios.TCSADRAIN, restore_out[1])
        with contextlib.suppress(Exception):
            ws.close()
    return 128 - code if code < 0 else code


def _size() -> tuple[int, int]:
    try:
        sz = os.get_terminal_size(sys.stdout.fileno())
        return sz.lines, sz.columns
    except OSError:
        return 24, 80


def _exit_for(exc: BaseException) -> typer.Exit:
    from websockets.exceptions import ConnectionClosed

    if isinstance(exc, ConnectionClosed):  # closed while sending: the close says why
        rcvd = exc.rcvd
        exc = Refused(
            rcvd.reason if rcvd else "the server closed the session", rcvd.code if rcvd else 1006
        )
    if isinstance(exc, Refused):
        output.print_error(exc.args[0])
        # 44xx: the caller's request (no job, not running, too many); others: try later
        return typer.Exit(2 if 4400 <= exc.code < 4500 else 1)
    output.print_error(f"exec failed: {exc}")
    return typer.Exit(1)


def exec_(
    job: JobArg,
    command: Annotated[list[str], typer.Argument(help="The command and its arguments.")],
    rank: Annotated[
        int, typer.Option("--rank", min=0, max=MAX_RANK, help="Gang member (default 0).")
    ] = 0,
    tty: Annotated[bool, typer.Option("--tty", "-t", help="Run it on a terminal.")] = False,
    stdin: Annotated[
        bool, typer.Option("--stdin", "-i", help="Pass this command's stdin to it.")
    ] = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Run COMMAND inside a running job (its user, cgroup, namespaces, env and GPUs):
    ``gpufleet exec JOB -- nvidia-smi``. Exits with the command's exit code."""

    try:
        ws = connect(url, token, job, rank)
        code = run_session(ws, list(command), tty=tty, stdin=stdin)
    except Exception as exc:  # Refused, ConnectionClosed, OSError, ConfigError
        raise _exit_for(exc) from None
    raise typer.Exit(code)


def shell(
    job: JobArg,
    rank: Annotated[
        int, typer.Option("--rank", min=0, max=MAX_RANK, help="Gang member (default 0).")
    ] = 0,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """An interactive shell inside a running job (a terminal; bash where the job has it).
    Exits with the shell's exit code."""

    try:
        ws = connect(url, token, job, rank)
        code = run_session(ws, ["/bin/sh", "-c", SHELL], tty=True, stdin=True)
    except Exception as exc:  # Refused, ConnectionClosed, OSError, ConfigError
        raise _exit_for(exc) from None
    raise typer.Exit(code)


def forward_connection(ws: Any, conn: socket.socket, port: int) -> None:
    """Relay one accepted local connection through ``ws`` to ``127.0.0.1:port`` in the job."""
    from gpufleet.rpc.protos import fleet_pb2 as pb

    def pump_in() -> None:
        try:
            while True:
                data = conn.recv(65536)
                if not data:
                    ws.send(pb.ExecFrame(stdin_eof=True).SerializeToString())
                    return
                ws.send(pb.ExecFrame(stdin=data).SerializeToString())
        except Exception:
            return

    try:
        ws.send(pb.ExecFrame(start=pb.ExecStart(forward_port=port)).SerializeToString())
        threading.Thread(target=pump_in, name="forward-in", daemon=True).start()
        for frame in _frames(ws, stop_on_error=True):
            if frame.WhichOneof("kind") == "stdout":
                conn.sendall(frame.stdout)
    except Refused as exc:
        typer.echo(f"port-forward: {output.clean(exc.args[0])}", err=True)
    except Exception as exc:  # OSError, the socket closed by the server (ConnectionClosed)
        typer.echo(f"port-forward: {output.clean(str(exc))}", err=True)
    finally:
        with contextlib.suppress(Exception):
            ws.close()
        # the local client sees the end at once (a refused or failed forward left it hanging)
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        conn.close()


def port_forward(
    job: JobArg,
    ports: Annotated[str, typer.Argument(help="LOCAL:REMOTE (or PORT for both).")],
    rank: Annotated[
        int, typer.Option("--rank", min=0, max=MAX_RANK, help="Gang member (default 0).")
    ] = 0,
    address: Annotated[
        str, typer.Option("--address", help="Local address to listen on.")
    ] = "127.0.0.1",
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Listen on LOCAL and carry each connection to 127.0.0.1:REMOTE inside the job's network
    namespace (until Ctrl-C): ``gpufleet port-forward JOB 8888:8888``."""

    local_s, _, remote_s = ports.partition(":")
    try:
        local, remote = int(local_s), int(remote_s or local_s)
        if not (0 <= local <= 65535 and 0 < remote <= 65535):
            raise ValueError
    except ValueError:
        output.print_error(f"PORTS must be LOCAL:REMOTE port numbers, not {ports!r}")
        raise typer.Exit(2) from None
    # the job first: a job that does not exist, is another team's or does not run is refused
    # before anything listens
    from gpufleet.cli.options import path_segment
    from gpufleet.cli.session import _call, _session

    with _session(url, token) as http:
        data = _call(http, "GET", f"/v1/jobs/{path_segment(job)}")
    if data.get("status") != "RUNNING":
        output.print_error(
            f"job {job} does not run (it is {data.get('status')}): nothing to forward to"
        )
        raise typer.Exit(2)
    try:
        server = socket.create_server((address, local))
    except OSError as exc:
        output.print_error(f"cannot listen on {address}:{local}: {exc.strerror or exc}")
        raise typer.Exit(2) from None
    typer.echo(
        f"forwarding {address}:{server.getsockname()[1]} -> 127.0.0.1:{remote} in job {job}",
        err=True,
    )
    try:
        while True:
            conn, _ = server.accept()
            try:
                ws = connect(url, token, job, rank)
            except Exception as exc:  # OSError, ConfigError, a refused handshake
                typer.echo(f"port-forward: {output.clean(str(exc))}", err=True)
                conn.close()
                continue
            threading.Thread(
                target=forward_connection, args=(ws, conn, remote), daemon=True
            ).start()
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    finally:
        server.close()


def register(app: typer.Typer) -> None:
    app.command("exec")(exec_)
    app.command("shell")(shell)
    app.command("port-forward")(port_forward)
