"""``WS /v1/jobs/{job_id}/exec``: exec, shell and port-forward into a running job.

The rules are docs/design/security.md, "Getting into a running job". One WebSocket is one
session. Every message is a serialized ``gpufleet.v1.ExecFrame`` (binary). The client sends
``start`` first (``command``, ``tty``, ``rows``/``cols``, or ``forward_port``; the server sets
``run_id``, ``token`` and ``actor`` itself), then ``stdin``, ``resize`` and ``stdin_eof``; it
receives ``started``, ``stdout``/``stderr`` and one ``exit`` (or one ``error``). The server
then closes the socket with code 1000, or, for a refusal, ``4000 + HTTP status`` (4401 no
token, 4404 no such job in the caller's team, 4409 not running, 4429 too many sessions,
4503 no exec on this server or the agent unreachable) after an ``error`` frame.

The API server calls the agent's ``Agent.Exec`` (mutual TLS, its own ``api`` certificate:
:class:`AgentDialer`) with synchronous gRPC in threads of its own (not the request thread
pool): a session holds one thread for its length, the gRPC call another.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from fastapi.concurrency import run_in_threadpool

from gpufleet.domain.errors import GpufleetError, Unauthenticated
from gpufleet.rpc import tls
from gpufleet.rpc.channel_options import CLIENT_OPTIONS
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.rpc.protos import fleet_pb2_grpc as pb_grpc
from gpufleet.services import auth, job_exec

log = logging.getLogger("gpufleet.api")

_STATUS_CLOSE = {
    "RESOURCE_EXHAUSTED": 4429,
    "NOT_FOUND": 4409,
    "FAILED_PRECONDITION": 4409,
    "PERMISSION_DENIED": 4503,
    "UNAVAILABLE": 4503,
}


class AgentDialer:
    """gRPC stubs for agents, as the API server (its ``api`` client certificate).

    Args:
        credentials: TLS channel credentials with the ``api`` certificate; None with
            ``plaintext`` (agents run ``--insecure``), else exec is off.
        plaintext: dial agents without TLS (``--insecure`` fleets only).
    """

    def __init__(
        self, credentials: grpc.ChannelCredentials | None, *, plaintext: bool = False
    ) -> None:
        self.credentials = credentials
        self.plaintext = plaintext
        self._lock = threading.Lock()
        self._stubs: dict[tuple[str, str], tuple[grpc.Channel, pb_grpc.AgentStub]] = {}

    @property
    def enabled(self) -> bool:
        return self.plaintext or self.credentials is not None

    @classmethod
    def from_pki_dir(cls, pki_dir: Path) -> AgentDialer:
        """Issue this server's ``api`` certificate from the fleet CA in ``pki_dir`` (as a
        controller issues its own at start); a dialer without credentials (exec off, said
        once in the log) when the directory has no ``ca.key`` this process can read."""
        try:
            ca = tls.load_ca(pki_dir)
        except (tls.PkiError, OSError) as exc:
            log.info("exec into jobs is off on this API server (no fleet CA key: %s)", exc)
            return cls(None)
        key_pem, chain_pem = ca.issue_api()
        return cls(tls.channel_credentials(ca.cert_pem, key_pem, chain_pem))

    def stub(self, node_id: str, address: str) -> pb_grpc.AgentStub:
        with self._lock:
            found = self._stubs.get((node_id, address))
            if found is None:
                if self.credentials is None:
                    channel = grpc.insecure_channel(address, options=list(CLIENT_OPTIONS))
                else:
                    channel = tls.secure_channel(
                        address, self.credentials, tls.node_target_name(node_id)
                    )
                found = (channel, pb_grpc.AgentStub(channel))
                self._stubs[(node_id, address)] = found
            return found[1]

    def close(self) -> None:
        with self._lock:
            for channel, _ in self._stubs.values():
                channel.close()
            self._stubs.clear()


def router(state: Any) -> APIRouter:
    """The exec WebSocket (module doc). ``state``: the app's ``AppState``."""
    r = APIRouter()

    @r.websocket("/v1/jobs/{job_id}/exec")
    async def exec_ws(websocket: WebSocket, job_id: str, rank: int = 0) -> None:
        await websocket.accept()
        try:
            who = await _principal(state, websocket)
            dialer: AgentDialer | None = getattr(state, "agent_dialer", None)
            if dialer is None or not dialer.enabled:
                await _refuse(websocket, 4503, "exec is not available on this API server")
                return
            team = None if who.is_admin else who.team_id
            target = await run_in_threadpool(job_exec.exec_target, state.db, team, job_id, rank)
            first = await websocket.receive_bytes()
            frame = pb.ExecFrame.FromString(first)
            if frame.WhichOneof("kind") != "start":
                await _refuse(websocket, 4400, "the first frame must be start")
                return
        except GpufleetError as exc:
            await _refuse(websocket, 4000 + exc.http_status, exc.message)
            return
        except WebSocketDisconnect:
            return
        except Exception as exc:  # a frame that does not parse
            await _refuse(websocket, 4400, f"bad frame: {type(exc).__name__}")
            return
        await _session(state, dialer, websocket, who, target, frame.start)

    return r


async def _principal(state: Any, websocket: WebSocket) -> auth.Principal:
    header = websocket.headers.get("authorization") or ""
    raw = header[7:].strip() if header.lower().startswith("bearer ") else None
    if not raw:
        raise Unauthenticated("a bearer token is required")

    def lookup() -> auth.Principal:
        with state.db.read() as s:
            return auth.authenticate(s, raw)

    return await run_in_threadpool(lookup)


async def _refuse(websocket: WebSocket, code: int, message: str) -> None:
    try:
        await websocket.send_bytes(pb.ExecFrame(error=message).SerializeToString())
        await websocket.close(code=code, reason=message[:120])
    except (WebSocketDisconnect, RuntimeError):
        pass


_END = object()


def _put_end(requests: queue.Queue[Any]) -> None:
    """End the request stream (dropped when the call stopped reading and the queue is full:
    the call is cancelled then anyway)."""
    with contextlib.suppress(queue.Full):
        requests.put(_END, timeout=1.0)


async def _drain(out: asyncio.Queue[Any]) -> None:
    """Take the cancelled call's last frames, so that its relay thread is never left blocked
    on a full queue."""
    while True:
        item = await out.get()
        if item is _END or isinstance(item, BaseException):
            return


async def _session(
    state: Any,
    dialer: AgentDialer,
    websocket: WebSocket,
    who: auth.Principal,
    target: job_exec.ExecTarget,
    start: pb.ExecStart,
) -> None:
    loop = asyncio.get_running_loop()
    requests: queue.Queue[Any] = queue.Queue(maxsize=64)
    out: asyncio.Queue[Any] = asyncio.Queue(maxsize=64)
    start.run_id, start.token = target.run_id, target.token
    start.actor = f"token {who.token_id} (team {who.team_id})"
    if start.forward_port:
        what = f"port-forward :{start.forward_port}"
    else:
        what = " ".join(start.command)[:1000]
    requests.put(pb.ExecFrame(start=start))

    def request_iter() -> Iterator[pb.ExecFrame]:
        while True:
            item = requests.get()
            if item is _END:
                return
            yield item

    stub = dialer.stub(target.node_id, target.address)
    call = stub.Exec(request_iter())

    def pump_out() -> None:
        try:
            for frame in call:
                asyncio.run_coroutine_threadsafe(out.put(frame), loop).result()
        except grpc.RpcError as exc:
            asyncio.run_coroutine_threadsafe(out.put(exc), loop).result()
        except Exception as exc:  # the loop closed
            log.debug("exec relay ended: %s", exc)
        else:
            asyncio.run_coroutine_threadsafe(out.put(_END), loop).result()

    threading.Thread(target=pump_out, name="api-exec", daemon=True).start()

    async def pump_in() -> None:
        try:
            while True:
                data = await websocket.receive_bytes()
                frame = pb.ExecFrame.FromString(data)
                if frame.WhichOneof("kind") in ("stdin", "stdin_eof", "resize"):
                    await loop.run_in_executor(None, requests.put, frame)
        except Exception:  # the client went away, or sent a text/bad frame: end the session
            call.cancel()
        finally:
            await loop.run_in_executor(None, _put_end, requests)

    reader = asyncio.create_task(pump_in())
    started_at = time.monotonic()
    exit_code: int | None = None
    close_code, reason = 1000, ""
    started = False
    try:
        while True:
            item = await out.get()
            if item is _END:
                break
            if isinstance(item, grpc.RpcError):
                code = item.code().name if callable(getattr(item, "code", None)) else "UNKNOWN"
                if code == "CANCELLED":
                    break
                details = item.details() if callable(getattr(item, "details", None)) else ""
                close_code = _STATUS_CLOSE.get(code, 4500)
                reason = details or code
                await websocket.send_bytes(pb.ExecFrame(error=reason).SerializeToString())
                break
            kind = item.WhichOneof("kind")
            if kind == "started" and not started:
                started = True
                await run_in_threadpool(
                    job_exec.record_exec,
                    state.db,
                    target,
                    "exec_started",
                    f"exec {what} by {start.actor}",
                    _details(who, target, start, what) | {"pid": item.started.pid},
                )
            elif kind == "exit":
                exit_code = item.exit.exit_code
            await websocket.send_bytes(item.SerializeToString())
    except (WebSocketDisconnect, RuntimeError):
        pass
    finally:
        reader.cancel()
        if call.cancel():  # still running: its relay thread puts CANCELLED last
            drain = asyncio.ensure_future(_drain(out))
            state.exec_tasks.add(drain)
            drain.add_done_callback(state.exec_tasks.discard)
        await loop.run_in_executor(None, _put_end, requests)
        if started:
            await run_in_threadpool(
                job_exec.record_exec,
                state.db,
                target,
                "exec_ended",
                f"exec {what} ended: exit code {exit_code}",
                _details(who, target, start, what)
                | {"exit_code": exit_code, "duration_s": round(time.monotonic() - started_at, 3)},
            )
    with contextlib.suppress(WebSocketDisconnect, RuntimeError):
        await websocket.close(code=close_code, reason=reason[:120])


def _details(
    who: auth.Principal, target: job_exec.ExecTarget, start: pb.ExecStart, what: str
) -> dict[str, Any]:
    return {
        "token_id": who.token_id,
        "team_id": who.team_id,
        "command": what,
        "tty": start.tty,
        "rank": target.rank,
        "forward_port": start.forward_port or None,
    }
