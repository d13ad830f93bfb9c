"""Job networking: each attempt in a network namespace of its own, behind an nftables filter.

A job that shares the node's network namespace reaches everything the node reaches: the
database and Redis on loopback, the API's plain-HTTP traffic on ``lo``, the agent's gRPC and
metrics ports. So by default the agent (root) gives every attempt, process or container, its
own namespace:

* ``ip netns add gf-{scope}-{run}`` (a bind mount in ``/run/netns``, so it outlives the agent
  and a restarted agent finds it by the run_id alone), a veth pair ``gf{scope}{run}`` (host
  side) / ``eth0`` (job side), one ``/30`` per attempt from a per-node private subnet
  (``--job-subnet``, default :data:`DEFAULT_SUBNET`), the job's loopback up, a default route
  via the host side, and masquerade (source NAT) for egress;
* one nftables table of this agent's own, ``table inet gpufleet_{scope}`` (:meth:`JobNet.setup`,
  replaced atomically at every agent start; it holds no per-attempt rule, only rules on the
  interface-name prefix of this agent's veths, so nothing is added or left behind per
  attempt): traffic from a job namespace **to the node itself** (any of its addresses, which
  covers the agent's gRPC and metrics ports and every node-local service) is refused in the
  ``input`` hook, no DNS exception; forwarded traffic to the **deny list** (``--job-egress-deny``;
  by default the controller and join addresses the agent was given, resolved, and the
  link-local metadata range ``169.254.0.0/16``) and to other job namespaces is refused;
  everything else is forwarded. ``--job-egress none`` refuses all egress but the
  ``--job-egress-allow`` list. Refusals are a TCP reset or an ICMP administratively-prohibited:
  the job sees "connection refused" / "unreachable" at once instead of a time-out.

Multi-node jobs (gang members) run in the host namespace instead (NCCL/gloo peers connect to
each other's node addresses on ephemeral ports, and RDMA devices cannot be moved into a veth
namespace); for them the same table's ``output`` hook matches the job uids (``meta skuid``:
the per-attempt range and the shared job user) and refuses the deny list, the job subnet, the
agent's own ports and every node-local port outside DNS and the ephemeral range. See
docs/design/security.md for what each choice costs.

An agent killed with SIGKILL leaves all of this behind; the next agent to start on the host
(on any state dir) removes what belongs to agents that are gone and no running job uses
(:mod:`.jobnet_owners`).

Where the agent cannot do this (not root, no ``ip``, no ``nft``, a probe fails) :func:`detect`
returns ``kind="host"`` with the reason: jobs share the node's namespace, said at agent start
and in the node label ``gpufleet/job-network``.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import logging
import os
import shutil
import socket
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpufleet.agent.runtime import jobnet_owners as owners
from gpufleet.agent.runtime.base import StartError
from gpufleet.agent.runtime.jobnet_owners import NETNS_DIR
from gpufleet.agent.runtime.jobnet_owners import host_lock as _host_lock
from gpufleet.agent.runtime.jobuser import JobUsers

logger = logging.getLogger("gpufleet.agent")

DEFAULT_SUBNET = "10.231.0.0/16"
METADATA_RANGE = "169.254.0.0/16"
NETWORK_LABEL = "gpufleet/job-network"
"""Node label: ``netns`` or ``host`` (jobs share the node's network namespace)."""
IP_TIMEOUT_S = 20.0
KINDS = ("auto", "netns", "host")
EGRESS = ("allow", "none")

Net = ipaddress.IPv4Network | ipaddress.IPv6Network


class JobNetError(Exception):
    """A namespace, veth or nftables step failed (message: the command and its stderr)."""


@dataclass(frozen=True, slots=True)
class Target:
    """One deny/allow entry: a network and optionally one port (TCP and UDP)."""

    net: Net
    port: int | None = None

    def __str__(self) -> str:
        host = str(self.net.network_address if self.net.num_addresses == 1 else self.net)
        if self.port is None:
            return host
        return f"[{host}]:{self.port}" if self.net.version == 6 else f"{host}:{self.port}"


def parse_targets(text: str | Iterable[str], *, what: str = "--job-egress-deny") -> list[Target]:
    """Parse ``CIDR[:port]`` entries (comma separated or an iterable): ``10.0.0.0/8``,
    ``10.0.0.5:5432``, ``[fd00::1]:443``, ``db.example:5432`` (names are resolved now, every
    address they have).

    Raises:
        ValueError: an entry is malformed or its name does not resolve (the message names
            ``what`` and the entry).
    """
    items = [t.strip() for t in text.split(",")] if isinstance(text, str) else list(text)
    out: list[Target] = []
    for item in items:
        if not item:
            continue
        try:
            out.extend(_parse_one(item))
        except ValueError as exc:
            raise ValueError(f"{what} {item!r}: {exc}") from None
    return out


def _parse_one(item: str) -> list[Target]:
    host, port = item, None
    if item.startswith("["):
        host, _, rest = item[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise ValueError("expected [IPv6]:port")
            port = _port(rest[1:])
    elif item.count(":") == 1:
        host, p = item.split(":")
        port = _port(p)
    try:
        return [Target(ipaddress.ip_network(host, strict=False), port)]
    except ValueError:
        pass
    if "/" in host:
        raise ValueError("not a network (CIDR)")
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        raise ValueError(f"cannot resolve {host!r}: {exc}") from None
    nets = {ipaddress.ip_network(str(i[4][0]).split("%")[0]) for i in infos}
    return [Target(n, port) for n in sorted(nets, key=str)]


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"port {text!r} is not 1-65535")
    return int(text)


@dataclass(frozen=True, slots=True)
class NetPolicy:
    """What jobs may reach (see the module doc).

    Attributes:
        subnet: the private IPv4 subnet job namespaces get their ``/30`` from.
        deny: refused destinations (the defaults already added by the caller).
        egress: ``allow`` (everything not denied) or ``none`` (only ``allow``).
        allow: with ``egress="none"``, the only destinations jobs may reach.
        own_ports: the agent's own TCP ports (gRPC, metrics): refused to host-network jobs.
        job_uids: inclusive uid ranges of job processes, for host-network jobs' filter.
    """

    subnet: str = DEFAULT_SUBNET
    deny: tuple[Target, ...] = ()
    egress: str = "allow"
    allow: tuple[Target, ...] = ()
    own_ports: tuple[int, ...] = ()
    job_uids: tuple[tuple[int, int], ...] = ()

    def describe(self) -> str:
        deny = ", ".join(str(t) for t in self.deny) or "nothing"
        if self.egress == "none":
            allowed = ", ".join(str(t) for t in self.allow) or "nothing"
            return f"egress only to {allowed}"
        return f"egress denied to the node and {deny}"


def default_deny(addresses: Iterable[str]) -> list[Target]:
    """The deny list's defaults: each ``host:port`` the agent was given for the control plane
    (resolved; a name that does not resolve is skipped with a warning) and
    :data:`METADATA_RANGE`."""
    out = [Target(ipaddress.ip_network(METADATA_RANGE))]
    for addr in addresses:
        if not addr:
            continue
        try:
            out.extend(parse_targets([addr], what="controller address"))
        except ValueError as exc:
            logger.warning("job network: %s (not in the deny list)", exc)
    return out


@dataclass(frozen=True, slots=True)
class JobNetns:
    """One attempt's namespace: ``name`` (in /run/netns), the host-side veth and both
    addresses (strings, no prefix length)."""

    name: str
    host_if: str
    host_ip: str
    job_ip: str

    @property
    def path(self) -> Path:
        return NETNS_DIR / self.name

    def to_json(self) -> dict[str, str]:
        return {
            "name": self.name,
            "host_if": self.host_if,
            "host_ip": self.host_ip,
            "job_ip": self.job_ip,
        }


def _h(text: str, n: int) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:n]


@dataclass
class JobNet:
    """The node's job networking, chosen once at agent start by :func:`detect`.

    Attributes:
        kind: ``netns`` (each attempt its own namespace) or ``host`` (jobs share the
            node's namespace).
        scope: this agent among the agents of the host (``agent_scope``).
        policy: what jobs may reach.
        problem: why ``kind`` is ``host`` ("" otherwise).
    """

    kind: str
    scope: str
    policy: NetPolicy = field(default_factory=NetPolicy)
    problem: str = ""

    # ------------------------------------------------------------------ names

    @property
    def tag(self) -> str:
        """4 hex digits naming this agent's namespaces, veths and table."""
        return _h(self.scope, 4)

    @property
    def table(self) -> str:
        return f"gpufleet_{self.tag}"

    @property
    def ns_prefix(self) -> str:
        return f"gf-{self.tag}-"

    @property
    def if_prefix(self) -> str:
        return f"gf{self.tag}"

    def ns_name(self, run_id: str) -> str:
        return f"{self.ns_prefix}{_h(run_id, 8)}"

    def host_if(self, run_id: str) -> str:
        return f"{self.if_prefix}{_h(run_id, 8)}"  # 14 characters (IFNAMSIZ is 16)

    def describe(self) -> str:
        """One line for the agent's start log: the kind and the policy."""
        if self.kind == "host":
            return f"host (jobs share the node's network namespace: {self.problem})"
        return f"netns per attempt from {self.policy.subnet}; {self.policy.describe()}"

    @property
    def label(self) -> str:
        """The ``gpufleet/job-network`` node label."""
        return self.kind

    # ------------------------------------------------------------------ node-wide rules

    def setup(self) -> None:
        """Install (replace atomically) this agent's nftables table and enable IPv4
        forwarding (needed for egress; the agent says so when it changes it).

        Raises:
            JobNetError: nft refused the table.
        """
        if self.kind != "netns":
            return
        self.claim()
        _nft(self.ruleset())
        if self.policy.egress != "none" or self.policy.allow:
            fwd = Path("/proc/sys/net/ipv4/ip_forward")
            if fwd.read_text().strip() != "1":
                fwd.write_text("1")
                logger.info("job network: enabled net.ipv4.ip_forward (job egress is routed)")

    def add_own_ports(self, *ports: int) -> None:
        """Add the agent's own ports once bound (a port 0 becomes a real one) and reinstall
        the table (host-network jobs are refused them)."""
        own = tuple(sorted({*self.policy.own_ports, *(p for p in ports if p)}))
        if own != self.policy.own_ports:
            self.policy = replace(self.policy, own_ports=own)
            self.setup()

    def teardown_rules(self) -> None:
        """Remove this agent's table and its ownership record (at a stop with no attempt
        left, and tests; an agent leaves both for its running jobs)."""
        with contextlib.suppress(JobNetError):
            _nft(f"delete table inet {self.table}\n")
        with _host_lock():
            owners.release(self.tag)

    def claim(self) -> None:
        """Record this process as the owner of this agent's objects (an agent at its start:
        taken over from a predecessor on the same state dir, see :mod:`.jobnet_owners`).

        Raises:
            OSError: the record cannot be written.
        """
        with _host_lock():
            owners.claim(self._me(), take_over=True)

    def _me(self) -> owners.Owner:
        return owners.me(self.tag, self.scope, self.policy.job_uids)

    def ruleset(self) -> str:
        """The nft script of this agent's table (see the module doc)."""
        p = self.policy
        jobs = f'"{self.if_prefix}*"'
        deny4, deny6, dport4, dport6 = _split(p.deny)
        allow4, allow6, aport4, aport6 = _split(p.allow)
        subnet = ipaddress.ip_network(p.subnet)
        lines = [
            f"table inet {self.table} {{}}",
            f"delete table inet {self.table}",
            f"table inet {self.table} {{",
            *_set("deny4", "ipv4_addr", deny4),
            *_set("deny6", "ipv6_addr", deny6),
            *_set("deny4p", "ipv4_addr . inet_service", dport4),
            *_set("deny6p", "ipv6_addr . inet_service", dport6),
            *_set("allow4", "ipv4_addr", allow4),
            *_set("allow6", "ipv6_addr", allow6),
            *_set("allow4p", "ipv4_addr . inet_service", aport4),
            *_set("allow6p", "ipv6_addr . inet_service", aport6),
            "  chain refuse {",
            "    meta l4proto tcp reject with tcp reset",
            "    reject with icmpx type admin-prohibited",
            "  }",
            # the node itself: every local address (agent, metrics, database, Redis, API)
            "  chain input {",
            "    type filter hook input priority filter - 5; policy accept;",
            f"    iifname {jobs} goto refuse",
            "  }",
            "  chain forward {",
            "    type filter hook forward priority filter - 5; policy accept;",
            f"    iifname {jobs} jump job_egress",
            f"    oifname {jobs} ct state established,related accept",
            f"    oifname {jobs} goto refuse",
            "  }",
            "  chain job_egress {",
            f"    ip daddr {subnet} goto refuse",  # other job namespaces
            "    ip daddr @deny4 goto refuse",
            "    ip6 daddr @deny6 goto refuse",
            "    meta l4proto { tcp, udp } ip daddr . th dport @deny4p goto refuse",
            "    meta l4proto { tcp, udp } ip6 daddr . th dport @deny6p goto refuse",
        ]
        if p.egress == "none":
            lines += [
                "    ip daddr @allow4 accept",
                "    ip6 daddr @allow6 accept",
                "    meta l4proto { tcp, udp } ip daddr . th dport @allow4p accept",
                "    meta l4proto { tcp, udp } ip6 daddr . th dport @allow6p accept",
                "    goto refuse",
            ]
        lines += ["    accept", "  }"]
        if p.job_uids:
            uids = ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in p.job_uids)
            lo, hi = _ephemeral_range()
            own = ", ".join(str(x) for x in sorted(set(p.own_ports)))
            lines += [
                # host-network jobs (gang members): the same deny list, by socket owner
                "  chain output {",
                "    type filter hook output priority filter - 5; policy accept;",
                f"    meta skuid {{ {uids} }} jump host_job",
                "  }",
                "  chain host_job {",
                "    ip daddr @deny4 goto refuse",
                "    ip6 daddr @deny6 goto refuse",
                "    meta l4proto { tcp, udp } ip daddr . th dport @deny4p goto refuse",
                "    meta l4proto { tcp, udp } ip6 daddr . th dport @deny6p goto refuse",
                f"    ip daddr {subnet} goto refuse",
            ]
            if own:
                lines.append(
                    f"    fib daddr type local meta l4proto {{ tcp, udp }} th dport {{ {own} }}"
                    " goto refuse"
                )
            lines += [
                "    fib daddr type local meta l4proto { tcp, udp }"
                f" th dport != {{ 53, {lo}-{hi} }} goto refuse",
                "  }",
            ]
        lines += [
            "  chain postrouting {",
            "    type nat hook postrouting priority srcnat; policy accept;",
            f"    ip saddr {subnet} ip daddr != {subnet} masquerade",
            "  }",
            "}",
        ]
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------ per attempt

    def create(self, run_id: str) -> JobNetns:
        """Make the attempt's namespace (idempotent: an existing one is returned as is).

        Raises:
            JobNetError: a step failed (nothing of it is left).
        """
        name, host_if = self.ns_name(run_id), self.host_if(run_id)
        with _host_lock():
            found = self.lookup(run_id)
            if found is not None:
                return found
            owners.claim(self._me(), take_over=False)  # a live agent's tag stays its
            self._remove(name, host_if)  # half-made by a crash: start again
            host_ip, job_ip = self._allocate(run_id)
            ns = JobNetns(name, host_if, host_ip, job_ip)
            try:
                _ip(
                    [],
                    f"netns add {name}\n"
                    f"link add {host_if} type veth peer name eth0 netns {name}\n"
                    f"addr add {host_ip}/30 dev {host_if}\n",
                )
                with contextlib.suppress(OSError):  # no IPv6 link-local to the host
                    Path(f"/proc/sys/net/ipv6/conf/{host_if}/disable_ipv6").write_text("1")
                _ip([], f"link set {host_if} up\n")
                _ip(
                    ["-n", name],
                    f"addr add {job_ip}/30 dev eth0\n"
                    "link set lo up\n"
                    "link set eth0 up\n"
                    f"route add default via {host_ip}\n",
                )
            except JobNetError:
                self._remove(name, host_if)
                raise
        return ns

    def lookup(self, run_id: str) -> JobNetns | None:
        """The attempt's namespace if it exists (with its addresses), else None."""
        name, host_if = self.ns_name(run_id), self.host_if(run_id)
        if not (NETNS_DIR / name).exists():
            return None
        addrs = _addresses().get(host_if)
        if addrs is None:
            return None
        host = ipaddress.ip_interface(addrs)
        return JobNetns(name, host_if, str(host.ip), str(host.ip + 1))

    def remove(self, run_id: str) -> None:
        """Remove the attempt's veth and namespace (idempotent). A process still in the
        namespace keeps it alive, cut off (its veth is gone)."""
        with _host_lock():
            self._remove(self.ns_name(run_id), self.host_if(run_id))

    def _remove(self, name: str, host_if: str) -> None:
        if (Path("/sys/class/net") / host_if).exists():
            _ip([], f"link del {host_if}\n", check=False)
        if (NETNS_DIR / name).exists():
            _ip([], f"netns del {name}\n", check=False)

    def existing(self) -> list[str]:
        """Names of this agent's namespaces in /run/netns."""
        with contextlib.suppress(OSError):
            return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(self.ns_prefix))
        return []

    def prune(self, keep: Iterable[str]) -> list[str]:
        """Remove this agent's namespaces (and veths) of attempts not in ``keep`` (run_ids):
        left by a crash between an attempt's end and its cleanup. Returns the names removed."""
        if self.kind != "netns":
            return []
        wanted = {self.ns_name(r) for r in keep}
        removed = []
        with _host_lock():
            for name in self.existing():
                if name not in wanted:
                    self._remove(name, self.if_prefix + name[len(self.ns_prefix) :])
                    removed.append(name)
            for dev in _addresses(all_links=True):
                ns = self.ns_prefix + dev[len(self.if_prefix) :]
                if dev.startswith(self.if_prefix) and ns not in wanted:
                    _ip([], f"link del {dev}\n", check=False)
        return removed

    def enter_prefix(self, ns: JobNetns) -> tuple[str, ...]:
        """argv prefix that runs a command in ``ns`` (run by root, before any user switch)."""
        return (_which("nsenter"), f"--net={ns.path}", "--")

    def _allocate(self, run_id: str) -> tuple[str, str]:
        subnet = ipaddress.ip_network(self.policy.subnet)
        if not isinstance(subnet, ipaddress.IPv4Network) or subnet.prefixlen > 29:
            raise JobNetError(f"--job-subnet {subnet}: an IPv4 network of /29 or larger")
        blocks = subnet.num_addresses // 4
        used = set()
        for addr in _addresses().values():
            iface = ipaddress.ip_interface(addr)
            if iface.ip in subnet:
                used.add((int(iface.ip) - int(subnet.network_address)) // 4)
        start = int(_h(run_id, 8), 16) % blocks
        for k in range(blocks):
            i = (start + k) % blocks
            if i not in used:
                base = subnet.network_address + 4 * i
                return str(base + 1), str(base + 2)
        raise JobNetError(f"no free /30 left in --job-subnet {subnet}")


def _split(
    targets: Sequence[Target],
) -> tuple[list[str], list[str], list[str], list[str]]:
    v4: list[str] = []
    v6: list[str] = []
    p4: list[str] = []
    p6: list[str] = []
    for t in targets:
        if t.port is None:
            (v4 if t.net.version == 4 else v6).append(str(t.net))
        else:
            (p4 if t.net.version == 4 else p6).append(f"{t.net} . {t.port}")
    return v4, v6, p4, p6


def _set(name: str, kind: str, elements: list[str]) -> list[str]:
    lines = [f"  set {name} {{", f"    type {kind}", "    flags interval"]
    if elements:
        lines.append(f"    elements = {{ {', '.join(sorted(set(elements)))} }}")
    lines.append("  }")
    return lines


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def _which(name: str) -> str:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin") or name


def _nft(script: str) -> None:
    try:
        done = subprocess.run(
            [_which("nft"), "-f", "-"],
            input=script,
            capture_output=True,
            text=True,
            timeout=IP_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise JobNetError(f"nft: {exc}") from exc
    if done.returncode != 0:
        raise JobNetError(f"nft -f failed: {done.stderr.strip()[-500:]}")


def _ip(opts: list[str], batch: str, *, check: bool = True) -> None:
    try:
        done = subprocess.run(
            [_which("ip"), *opts, "-batch", "-"],
            input=batch,
            capture_output=True,
            text=True,
            timeout=IP_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise JobNetError(f"ip: {exc}") from exc
    if check and done.returncode != 0:
        raise JobNetError(f"ip {' '.join(opts)} -batch failed: {done.stderr.strip()[-500:]}")


def _addresses(*, all_links: bool = False) -> dict[str, str]:
    """{interface: its first IPv4 address with prefix} of this (the host's) namespace; with
    ``all_links`` every link, with "" when it has no IPv4 address."""
    out: dict[str, str] = {}
    try:
        if all_links:
            text = subprocess.run(
                [_which("ip"), "-o", "link", "show"],
                capture_output=True,
                text=True,
                timeout=IP_TIMEOUT_S,
            ).stdout
            for line in text.splitlines():
                parts = line.split(":", 2)
                if len(parts) >= 2:
                    out[parts[1].strip().split("@")[0]] = ""
            return out
        text = subprocess.run(
            [_which("ip"), "-o", "-4", "addr", "show"],
            capture_output=True,
            text=True,
            timeout=IP_TIMEOUT_S,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return out
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "inet":
            out.setdefault(parts[1].split("@")[0], parts[3])
    return out


def host_network(env: Mapping[str, str]) -> bool:
    """Whether an attempt runs in the host namespace: a gang member (the controller sets
    ``GPUFLEET_GANG_SIZE``; jobs cannot set ``GPUFLEET_*`` variables themselves)."""
    size = env.get("GPUFLEET_GANG_SIZE", "1")
    return size.isdigit() and int(size) > 1


def attempt_netns(jobnet: JobNet | None, run_id: str, env: Mapping[str, str]) -> list[str]:
    """Make the attempt's namespace; returns the argv prefix that enters it (``[]`` without
    job namespaces, or for a host-network attempt).

    Raises:
        StartError: the namespace could not be made (the node's fault; nothing is left).
    """
    ns = attempt_namespace(jobnet, run_id, env)
    return [] if ns is None or jobnet is None else list(jobnet.enter_prefix(ns))


def attempt_namespace(
    jobnet: JobNet | None, run_id: str, env: Mapping[str, str]
) -> JobNetns | None:
    """The attempt's namespace, made now; None without job namespaces or for a
    host-network attempt.

    Raises:
        StartError: the namespace could not be made (the node's fault; nothing is left).
    """
    if jobnet is None or jobnet.kind != "netns" or host_network(env):
        return None
    try:
        return jobnet.create(run_id)
    except (JobNetError, OSError) as exc:
        raise StartError(
            f"cannot create the attempt's network namespace: {exc}", node_fault=True
        ) from exc


def drop_netns(jobnet: JobNet | None, run_id: str) -> None:
    """Remove the attempt's namespace if it has one (idempotent; errors are logged)."""
    if jobnet is None or jobnet.kind != "netns":
        return
    try:
        jobnet.remove(run_id)
    except (JobNetError, OSError) as exc:
        logger.warning("run %s: cannot remove its network namespace: %s", run_id, exc)


def _sweep() -> None:
    """Remove what agents that are gone left (:func:`.jobnet_owners.sweep`); a failure is
    logged, not fatal (the agent's own namespaces do not depend on it)."""
    try:
        swept = owners.sweep()
    except OSError as exc:
        logger.warning("job network: cannot sweep what dead agents left: %s", exc)
        return
    if swept:
        logger.info("job network: %s", swept.describe())


def detect(scope: str, policy: NetPolicy, *, want: str = "auto") -> JobNet:
    """Choose the node's job networking (see the module doc) and install its rules.

    Args:
        scope: this agent's scope (``agent_scope``).
        policy: what jobs may reach.
        want: ``auto`` (a namespace per attempt where possible, else ``host`` with the
            reason), ``netns`` (the same, but an error where impossible) or ``host``.

    Raises:
        ValueError: ``want`` is unknown, or ``netns`` was asked for and cannot be had.
    """
    if want not in KINDS:
        raise ValueError(f"--job-network {want!r}: use one of {', '.join(KINDS)}")
    if policy.egress not in EGRESS:
        raise ValueError(f"--job-egress {policy.egress!r}: use one of {', '.join(EGRESS)}")
    ipaddress.ip_network(policy.subnet)  # ValueError names the subnet
    if want == "host":
        return JobNet("host", scope, policy, "forced by --job-network host")
    problem = ""
    if os.geteuid() != 0:
        problem = "the agent is not root"
    else:
        missing = [t for t in ("ip", "nft", "nsenter") if _which(t) == t and not shutil.which(t)]
        if missing:
            problem = f"{', '.join(missing)} not installed"
    net = JobNet("netns", scope, policy)
    if not problem:
        try:
            net.claim()  # before the sweep, so it never takes a predecessor's objects
            _sweep()
            net.setup()
            probe = net.create(f".probe-{os.getpid()}")
            net.remove(f".probe-{os.getpid()}")
            del probe
        except (JobNetError, OSError) as exc:
            problem = f"cannot set up job namespaces: {exc}"
    if problem:
        if want == "netns":
            raise ValueError(f"--job-network netns: {problem}")
        return JobNet("host", scope, policy, problem)
    return net


def configure(
    scope: str,
    *,
    want: str = "auto",
    subnet: str = DEFAULT_SUBNET,
    deny: str = "",
    egress: str = "allow",
    allow: str = "",
    control_plane: Iterable[str] = (),
    own_ports: Iterable[int] = (),
    users: JobUsers | None = None,
) -> JobNet:
    """The agent's job networking from its flags: the policy (deny list = ``deny`` plus
    :func:`default_deny` of ``control_plane``), then :func:`detect`; says at start what it
    got (a warning when jobs share the node's namespace).

    Args:
        users: the agent's :class:`.jobuser.JobUsers` (the uids the host-network filter
            matches); without user switching host-network jobs are not filtered.

    Raises:
        ValueError: a flag is malformed (the message names it), or ``want="netns"`` cannot
            be had.
    """
    uids: list[tuple[int, int]] = []
    if users is not None and users.switch:
        uids.append((users.uid, users.uid))
        if users.per_attempt:
            uids.append((users.uid_base, users.uid_base + users.uid_count - 1))
    policy = NetPolicy(
        subnet=subnet,
        deny=tuple(default_deny(control_plane)) + tuple(parse_targets(deny)),
        egress=egress,
        allow=tuple(parse_targets(allow, what="--job-egress-allow")),
        own_ports=tuple(p for p in own_ports if p),
        job_uids=tuple(uids),
    )
    net = detect(scope, policy, want=want)
    if net.kind == "host":
        logger.warning(
            "job network: host (%s): jobs share the node's network namespace and reach "
            "whatever the node reaches (its database, Redis, agent and metrics ports)",
            net.problem,
        )
    else:
        logger.info("job network: %s", net.describe())
        if not uids:
            logger.warning(
                "job network: jobs run as the agent's user, so multi-node (host-network) "
                "jobs are not filtered"
            )
    return net
