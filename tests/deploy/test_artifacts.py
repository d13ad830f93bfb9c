"""The deployment artefacts under deploy/ are valid as written: Kubernetes manifests against
the API schemas (offline, kubernetes-validate), the compose file's structure, the systemd
units (systemd-analyze verify), the haproxy configurations (haproxy -c), and every gpufleet
command line in them against the CLI's real commands and options."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
COMPOSE = DEPLOY / "compose" / "compose.yaml"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
K8S_VERSIONS = ("1.29", "1.33")

# Options the artefacts use that arrive with parallel work on the CLI (server TLS, agents'
# controller list and advertised address, `admin migrate`). Checked like any other option
# once the CLI has them; only their absence is tolerated.
LANDING: set[tuple[str, str]] = set()


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


# -- Kubernetes ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", K8S, ids=lambda p: p.name)
def test_kubernetes_manifests_validate_offline(path: Path, version: str) -> None:
    import kubernetes_validate

    docs = _docs(path)
    assert docs, path
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises on any error


def test_kubernetes_validation_catches_a_broken_manifest() -> None:
    """The validator itself refuses what it should (a test of the test)."""
    import kubernetes_validate

    doc = _docs(DEPLOY / "kubernetes" / "50-api.yaml")[0]
    doc["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)
    doc = _docs(DEPLOY / "kubernetes" / "50-api.yaml")[0]
    doc["spec"]["template"]["spec"]["containers"][0]["portz"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)


def _k8s_objects() -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for p in K8S for d in _docs(p)}


def _pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return dict(obj["spec"]["template"]["spec"])


def test_kubernetes_shape() -> None:
    objs = _k8s_objects()
    kinds = {k for k, _ in objs}
    assert {"Deployment", "DaemonSet", "Job", "Service", "Secret", "ConfigMap"} <= kinds
    ctl = objs[("Deployment", "gpufleet-controller")]
    api = objs[("Deployment", "gpufleet-api")]
    agent = next(o for (k, _), o in objs.items() if k == "DaemonSet")
    job = objs[("Job", "gpufleet-migrate")]
    assert ctl["spec"]["replicas"] >= 2 and api["spec"]["replicas"] >= 2
    assert ("Service", "gpufleet-api") in objs and ("Service", "gpufleet-controller") in objs
    assert job["spec"]["template"]["spec"]["containers"][0]["args"] == ["admin", "migrate"]
    # agents on GPU nodes only, with what they need stated in the manifest
    spec = _pod_spec(agent)
    assert "nvidia.com/gpu.present" in spec["nodeSelector"]
    assert spec["hostNetwork"] is True
    assert spec["containers"][0]["securityContext"]["privileged"] is True
    assert "nvidia.com/gpu" in spec["containers"][0]["resources"]["limits"]
    # server and controller unprivileged
    for obj in (ctl, api, job):
        pod = _pod_spec(obj)
        assert pod["securityContext"]["runAsNonRoot"] is True
        c = pod["containers"][0]["securityContext"]
        assert c["allowPrivilegeEscalation"] is False and c["readOnlyRootFilesystem"] is True
        assert c["capabilities"]["drop"] == ["ALL"]


def _env_sources(pod: dict[str, Any]) -> set[str]:
    names: set[str] = set()
    for c in pod["containers"]:
        for src in c.get("envFrom", []):
            names.add((src.get("secretRef") or src.get("configMapRef"))["name"])
        for env in c.get("env", []):
            ref = (env.get("valueFrom") or {}).get("secretKeyRef")
            if ref:
                names.add(ref["name"])
    for vol in pod.get("volumes", []):
        if "secret" in vol:
            names.add(vol["secret"]["secretName"])
    return names


def test_kubernetes_secrets_reach_only_who_needs_them() -> None:
    objs = _k8s_objects()
    agent = next(o for (k, _), o in objs.items() if k == "DaemonSet")
    agent_sources = _env_sources(_pod_spec(agent))
    assert not agent_sources & {"gpufleet-db", "gpufleet-redis", "gpufleet-ca"}, agent_sources
    api_sources = _env_sources(_pod_spec(objs[("Deployment", "gpufleet-api")]))
    assert "gpufleet-ca" not in api_sources  # ca.crt from a ConfigMap, never ca.key
    assert "gpufleet-ca" in _env_sources(_pod_spec(objs[("Deployment", "gpufleet-controller")]))
    declared = {name for (kind, name) in objs if kind in ("Secret", "ConfigMap")}
    for (kind, name), obj in objs.items():
        if kind in ("Deployment", "DaemonSet", "Job"):
            missing = _env_sources(_pod_spec(obj)) - declared
            assert not missing, f"{kind}/{name} uses undeclared {missing}"


# -- compose ------------------------------------------------------------------------------


def _compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())  # merge keys (<<) resolved by PyYAML
    assert isinstance(data, dict)
    return data


def test_compose_structure() -> None:
    data = _compose()
    services: dict[str, Any] = data["services"]
    networks, volumes = set(data["networks"]), set(data["volumes"])
    for name, svc in services.items():
        assert "image" in svc, name
        for dep in svc.get("depends_on", {}) or {}:
            assert dep in services, f"{name} depends on unknown {dep}"
        for net in svc.get("networks", []) or []:
            assert net in networks, f"{name}: network {net}"
        for vol in svc.get("volumes", []) or []:
            source = vol.split(":", 1)[0]
            if not source.startswith((".", "/")):
                assert source in volumes, f"{name}: volume {source}"
        for port in svc.get("ports", []) or []:
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    roles = dict(services.items())
    assert sum(1 for n in roles if n.startswith("controller-")) == 2
    assert sum(1 for n in roles if n.startswith("api-")) == 2
    assert sum(1 for n in roles if n.startswith("agent-")) >= 2
    assert {"postgres", "redis", "minio", "haproxy", "migrate"} <= set(services)
    assert "--requirepass" in services["redis"]["command"]


def test_compose_nodes_cannot_reach_database_or_redis() -> None:
    services = _compose()["services"]
    for name in ("postgres", "redis"):
        assert services[name]["networks"] == ["control"], name
    for name, svc in services.items():
        if name.startswith("agent-"):
            assert "control" not in svc["networks"], name
            env = svc.get("environment") or {}
            assert not {"GPUFLEET_DATABASE_URL", "GPUFLEET_REDIS_URL"} & set(env), name


def test_compose_and_manifests_say_what_servers_need() -> None:
    services = _compose()["services"]
    for name in ("api-1", "api-2"):
        cmd = services[name]["command"]
        assert cmd[:3] == ["server", "--host", "0.0.0.0"], cmd
    for name, svc in services.items():
        if name.startswith(("controller-", "api-")):
            order = svc["depends_on"]
            assert order["migrate"]["condition"] == "service_completed_successfully", name


# -- systemd ------------------------------------------------------------------------------


def _unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A unit file's sections: key -> values (repeated keys kept; continuations joined)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path.name}: {line!r} outside a section"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_systemd_units_parse_and_harden() -> None:
    names = {p.name for p in UNITS}
    assert names == {
        "gpufleet-server.service",
        "gpufleet-controller.service",
        "gpufleet-agent.service",
    }
    for path in UNITS:
        unit = _unit(path)
        assert {"Unit", "Service", "Install"} <= set(unit), path.name
        svc = unit["Service"]
        assert svc["ExecStart"][0].startswith("/opt/gpufleet/bin/gpufleet "), path.name
        if path.name == "gpufleet-agent.service":
            assert svc["User"] == ["root"]
            assert svc["KillMode"] == ["process"]  # an agent restart leaves jobs running
            assert "gpufleet.env" not in " ".join(svc["EnvironmentFile"])  # no DB credentials
            continue
        assert svc["User"] == ["gpufleet"], path.name
        for key, value in {
            "NoNewPrivileges": "yes",
            "ProtectSystem": "strict",
            "ProtectHome": "yes",
            "PrivateTmp": "yes",
            "CapabilityBoundingSet": "",
        }.items():
            assert svc.get(key) == [value], f"{path.name}: {key}"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    """systemd's own checker, on copies whose ExecStart names this checkout's gpufleet (the
    units name /opt/gpufleet/bin/gpufleet, which verify requires to exist)."""
    exe = ROOT / ".venv" / "bin" / "gpufleet"
    assert exe.exists()
    for path in UNITS:
        copy = tmp_path / path.name
        copy.write_text(path.read_text().replace("/opt/gpufleet/bin/gpufleet", str(exe)))
    r = subprocess.run(
        ["systemd-analyze", "verify", *(str(tmp_path / p.name) for p in UNITS)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # verify exits 0 with warnings it cannot act on here (no gpufleet user on this machine):
    # anything naming one of our units is a finding
    problems = [
        line
        for line in (r.stdout + r.stderr).splitlines()
        if "gpufleet-" in line and "getpwnam" not in line and "User" not in line
    ]
    assert r.returncode == 0 and not problems, r.stdout + r.stderr


# -- haproxy ------------------------------------------------------------------------------


def _self_signed_pem(path: Path) -> None:
    from datetime import UTC, datetime, timedelta

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "api.example")])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    path.write_bytes(
        cert.public_bytes(serialization.Encoding.PEM)
        + key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


@pytest.mark.parametrize(
    "cfg", [DEPLOY / "haproxy" / "haproxy.cfg", DEPLOY / "compose" / "haproxy.cfg"], ids=str
)
def test_haproxy_config_checks(cfg: Path, tmp_path: Path) -> None:
    haproxy = shutil.which("haproxy")
    assert haproxy, "haproxy is installed by scripts/ensure-services.sh"
    pem = tmp_path / "api.pem"
    _self_signed_pem(pem)
    copy = tmp_path / "haproxy.cfg"
    copy.write_text(cfg.read_text().replace("/etc/haproxy/certs/api.pem", str(pem)))
    r = subprocess.run(
        [haproxy, "-c", "-f", str(copy)], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0, r.stdout + r.stderr
    text = cfg.read_text()
    assert re.search(r"frontend agents\s+mode tcp", text), "agents' gRPC must pass through (mTLS)"
    assert "/healthz" in text


def test_haproxy_check_refuses_a_broken_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad.cfg"
    bad.write_text(
        (DEPLOY / "compose" / "haproxy.cfg").read_text().replace("balance leastconn", "balanc x")
    )
    r = subprocess.run(["haproxy", "-c", "-f", str(bad)], capture_output=True, timeout=30)
    assert r.returncode != 0


# -- the command lines in all of them -----------------------------------------------------


def _command_lines() -> list[tuple[str, list[str]]]:
    """(where, argv after `gpufleet`) for every gpufleet invocation in the artefacts."""
    found: list[tuple[str, list[str]]] = []
    for path in UNITS:
        for line in _unit(path)["Service"]["ExecStart"]:
            found.append((path.name, shlex.split(line)[1:]))
    for name, svc in _compose()["services"].items():
        if "gpufleet" not in str(svc.get("image", "")):
            continue
        cmd = svc.get("command")
        if svc.get("entrypoint"):  # sh -c '...; gpufleet ...'
            found += [(f"compose {name}", a) for a in _from_shell(" ".join(cmd))]
        else:
            found.append((f"compose {name}", list(cmd)))
    for (kind, name), obj in _k8s_objects().items():
        if kind not in ("Deployment", "DaemonSet", "Job"):
            continue
        c = _pod_spec(obj)["containers"][0]
        if c.get("command"):
            found += [(f"{kind}/{name}", a) for a in _from_shell(" ".join(c["args"]))]
        else:
            found.append((f"{kind}/{name}", list(c["args"])))
    return found


def _from_shell(script: str) -> list[list[str]]:
    out = []
    for part in re.split(r"[;|&]+|\bthen\b|\bfi\b", script):
        words = shlex.split(part.replace("$(", "").replace(")", ""), posix=True)
        if "gpufleet" in words:
            out.append(words[words.index("gpufleet") + 1 :])
    return out


def test_every_command_line_uses_real_commands_and_options() -> None:
    import typer

    from gpufleet.cli.main import app

    root = typer.main.get_command(app)
    from typer.core import TyperGroup as group_type  # a command with subcommands

    lines = _command_lines()
    assert len(lines) >= 10, lines
    for where, argv in lines:
        group: Any = root
        words = list(argv)
        path: list[str] = []
        while isinstance(group, group_type) and words and not words[0].startswith("-"):
            if hasattr(group, "_load"):  # a lazily built sub-app (admin, sim): build it
                group = group._load()
            sub = group.commands.get(words[0])
            if sub is None:
                break
            path.append(words.pop(0))
            group = sub
        name = " ".join(path)
        if hasattr(group, "_load"):
            group = group._load()
        if isinstance(group, group_type):
            assert (name + " " + words[0], "") in LANDING, f"{where}: no command {argv}"
            continue
        opts = {o for p in group.params for o in (*p.opts, *p.secondary_opts)}
        for word in words:
            if word.startswith("--"):
                flag = word.split("=", 1)[0]
                if flag not in opts:
                    assert (name, flag) in LANDING, f"{where}: `gpufleet {name}` has no {flag}"


def test_shell_snippets_parse() -> None:
    """The `sh -c` scripts of the compose services and the agent DaemonSet are valid sh."""
    scripts = [
        (name, " ".join(svc["command"]).replace("$$", "$"))
        for name, svc in _compose()["services"].items()
        if svc.get("entrypoint")
    ]
    for (kind, name), obj in _k8s_objects().items():
        if kind in ("Deployment", "DaemonSet", "Job"):
            c = _pod_spec(obj)["containers"][0]
            if c.get("command", [])[:2] == ["/bin/sh", "-c"]:
                scripts.append((f"{kind}/{name}", c["args"][0]))
    assert len(scripts) >= 5, scripts
    for where, script in scripts:
        r = subprocess.run(["sh", "-n", "-c", script], capture_output=True, text=True)
        assert r.returncode == 0, f"{where}: {r.stderr}"
