"""The hollow runtime: the agent's own code with a simulated job process, for scale runs.

A *hollow node* (after Kubernetes' kubemark) is the real node agent — gRPC server and client
with mutual TLS, join, registration, heartbeats, the fsynced assignment log, confirm and
completion reports, uploads to the object store — whose attempts run no process. This module
is that one difference: :class:`HollowRuntime` implements the runtime interface
(:mod:`gpufleet.agent.runtime.base`) with a clock instead of a shim. The job's environment
says what its "process" does:

``HOLLOW_RUN_S`` (float seconds, default :data:`DEFAULT_RUN_S`)
    How long it runs before it exits on its own.
``HOLLOW_EXIT`` (int, default 0)
    Its exit code when it ends on its own.
``HOLLOW_ON_TERM`` (``exit`` or ``ignore``, default ``exit``)
    At a stop: ``exit`` ends it at once with ``-15`` (killed by SIGTERM); ``ignore`` keeps it
    running until the grace ends, then it ends with ``-9`` (SIGKILL after grace), as the
    process runtime's stop protocol would.
``HOLLOW_ARTIFACT_BYTES`` (int, default 0)
    Bytes written to ``artifacts/hollow.bin`` at start (uploaded with the manifest at the end).

An agent restarted on the same state dir adopts its hollow attempts from the ``started``
event (wall-clock start and the parameters above are in ``runtime_state``), as a real agent
adopts the shims that outlived it; an attempt logged ``assigned`` but not ``started`` is
abandoned (reported NEVER_STARTED). :class:`HollowOptions` carries what many agents in one
process share (``python -m gpufleet.agent.hollow``). See docs/design/hollow-nodes.md.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import grpc

from gpufleet.agent.runtime.base import ExitInfo, Launch, RunHandle, StartError
from gpufleet.agent.workdir import RunPaths

if TYPE_CHECKING:
    from gpufleet.agent.assignment_log import RunRecord

__all__ = ["DEFAULT_RUN_S", "HollowHandle", "HollowOptions", "HollowRuntime"]

DEFAULT_RUN_S = 5.0
"""Seconds a hollow attempt runs when its job sets no ``HOLLOW_RUN_S``."""
ARTIFACT_NAME = "hollow.bin"
_MAX_ARTIFACT_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class HollowParams:
    """What a hollow attempt does, from its job's environment (module doc)."""

    run_s: float = DEFAULT_RUN_S
    exit_code: int = 0
    on_term: str = "exit"
    artifact_bytes: int = 0

    @classmethod
    def from_env(cls, env: dict[str, str]) -> HollowParams:
        """Raises:
        StartError: a malformed ``HOLLOW_*`` value (the job's fault: it never runs)."""
        try:
            run_s = float(env.get("HOLLOW_RUN_S", DEFAULT_RUN_S))
            code = int(env.get("HOLLOW_EXIT", "0"))
            artifact = int(env.get("HOLLOW_ARTIFACT_BYTES", "0"))
        except ValueError as exc:
            raise StartError(f"hollow job: bad HOLLOW_* value: {exc}") from None
        on_term = env.get("HOLLOW_ON_TERM", "exit")
        if (
            on_term not in ("exit", "ignore")
            or run_s < 0
            or not 0 <= artifact <= _MAX_ARTIFACT_BYTES
        ):
            raise StartError(
                "hollow job: HOLLOW_ON_TERM must be exit or ignore, HOLLOW_RUN_S >= 0, "
                "HOLLOW_ARTIFACT_BYTES in 0..1 GiB"
            )
        return cls(run_s, code, on_term, artifact)


@dataclass(slots=True, kw_only=True)
class HollowHandle(RunHandle):
    """A hollow attempt: when it started (wall clock, seconds since the epoch) and what it
    does."""

    runtime: ClassVar[str] = "hollow"
    started_at_s: float = 0.0
    params: HollowParams = field(default_factory=HollowParams)

    def log_fields(self) -> dict[str, Any]:
        p = self.params
        state = {
            "started_at_s": self.started_at_s,
            "run_s": p.run_s,
            "exit_code": p.exit_code,
            "on_term": p.on_term,
        }
        return {"pid": self.pid, "boot_id": self.boot_id, "runtime_state": state}


class HollowRuntime:
    """Attempts that are a timer (module doc); no process, cgroup or namespace is made."""

    kind = "hollow"

    def spawn(self, rec: RunRecord, launch: Launch) -> RunHandle:
        params = HollowParams.from_env(launch.env)
        paths = launch.paths
        try:
            with open(paths.log, "a") as f:
                f.write(
                    f"hollow attempt {rec.run_id}: runs {params.run_s:g} s, exits "
                    f"{params.exit_code}, on SIGTERM: {params.on_term}\n"
                )
            if params.artifact_bytes:
                paths.artifacts.mkdir(parents=True, exist_ok=True)
                with open(paths.artifacts / ARTIFACT_NAME, "wb") as out:
                    left = params.artifact_bytes
                    chunk = b"\0" * min(left, 1 << 20)
                    while left > 0:
                        left -= out.write(chunk[:left])
        except OSError as exc:
            raise StartError(f"hollow attempt: {exc}", node_fault=True) from exc
        return HollowHandle(started_at_s=time.time(), params=params)

    def resolve_unstarted(self, rec: RunRecord, paths: RunPaths) -> RunHandle | None:  # noqa: ARG002
        return None  # the simulated process lived in the agent that crashed: it never ran

    def adopt(self, rec: RunRecord, paths: RunPaths) -> RunHandle:  # noqa: ARG002
        state = rec.runtime_state
        params = HollowParams(
            run_s=float(state.get("run_s", DEFAULT_RUN_S)),
            exit_code=int(state.get("exit_code", 0)),
            on_term=str(state.get("on_term", "exit")),
        )
        return HollowHandle(
            pid=rec.pid, started_at_s=float(state.get("started_at_s", 0.0)), params=params
        )

    def poll(self, rec: RunRecord, h: RunHandle, now: float) -> ExitInfo | None:
        assert isinstance(h, HollowHandle)
        p = h.params
        if rec.stop_requested and h.term_sent_at is None:
            h.term_sent_at = now
            if p.on_term == "exit":
                return ExitInfo(exit_code=-signal.SIGTERM, finished_at_s=time.time())
        if time.time() - h.started_at_s >= p.run_s:
            return ExitInfo(exit_code=p.exit_code, finished_at_s=time.time())
        if h.term_sent_at is not None and now - h.term_sent_at >= rec.stop_grace_s:
            h.kill_sent_at = now
            return ExitInfo(
                exit_code=-signal.SIGKILL,
                finished_at_s=time.time(),
                message=f"killed with SIGKILL after {rec.stop_grace_s:g} s grace",
            )
        return None

    def release(self, rec: RunRecord) -> None:
        pass

    def describe(self) -> str:
        return "hollow (simulated attempts, no processes)"


class _Unreachable(grpc.RpcError):  # type: ignore[misc]
    """What a silenced hollow node's calls to the controller raise: as if the network
    dropped them (UNAVAILABLE)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "hollow node silenced"


class _SilenceClient(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self, silenced: threading.Event) -> None:
        self.silenced = silenced

    def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        if self.silenced.is_set():
            raise _Unreachable()
        return continuation(client_call_details, request)


class _SilenceServer(grpc.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, silenced: threading.Event) -> None:
        self.silenced = silenced

        def refuse(_request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAVAILABLE, "hollow node silenced")

        self._refuse = grpc.unary_unary_rpc_method_handler(refuse)

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: Any
    ) -> Any:
        if self.silenced.is_set():
            return self._refuse
        return continuation(handler_call_details)


@dataclass
class HollowOptions:
    """How :func:`gpufleet.agent.main.run_agent` runs as a hollow node.

    Attributes:
        rpc_executor: the pool serving the agent's gRPC calls; one may be shared by every
            agent of a process (None: the agent's own pool).
        outbox_workers: confirm and complete worker threads each (the real agent has 4).
        monitor_interval_s: how often its attempts are polled, seconds.
        silenced: while set, the node is cut off from the control plane: its calls to the
            controller fail UNAVAILABLE before they leave and calls to it are answered
            UNAVAILABLE (a network partition; its attempts go on and their reports wait).
        grpc_workers: the size of its own pool when ``rpc_executor`` is None.
    """

    rpc_executor: ThreadPoolExecutor | None = None
    outbox_workers: int = 1
    monitor_interval_s: float = 0.25
    silenced: threading.Event = field(default_factory=threading.Event)
    grpc_workers: int = 2

    def executor(self) -> ThreadPoolExecutor:
        return self.rpc_executor or ThreadPoolExecutor(
            max_workers=self.grpc_workers, thread_name_prefix="agent-rpc"
        )

    def server_interceptors(self) -> list[grpc.ServerInterceptor]:
        return [_SilenceServer(self.silenced)]

    def wrap_channel(self, make: Callable[[str], grpc.Channel]) -> Callable[[str], grpc.Channel]:
        """``make`` whose channels fail every call while :attr:`silenced` is set."""
        client = _SilenceClient(self.silenced)

        def wrapped(address: str) -> grpc.Channel:
            return grpc.intercept_channel(make(address), client)

        return wrapped
