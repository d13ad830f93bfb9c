"""Helpers for tests that run the real container engine against the local registry
(``scripts/ensure-services.sh`` sets both up; tests fail without them, by design)."""

from __future__ import annotations

import os
import subprocess
import uuid

from gpufleet.agent.runtime.container import ContainerEngine

REGISTRY = os.environ.get("GPUFLEET_TEST_REGISTRY", "127.0.0.1:5000")
BUSYBOX = f"{REGISTRY}/gpufleet/busybox:1"
PRIVPROBE = f"{REGISTRY}/gpufleet/privprobe:1"
PYTHON = f"{REGISTRY}/gpufleet/python:3.11"


def fresh_image(engine: ContainerEngine, base: str = BUSYBOX) -> str:
    """Push ``base`` to the registry under a new tag and remove that tag locally, so the
    first start of the returned image must pull it (a cold start) without disturbing tests
    that share ``base``."""
    engine.ensure_present(base)
    tag = f"{base.rsplit(':', 1)[0]}:t{uuid.uuid4().hex[:10]}"
    run = [*engine.argv0]
    subprocess.run([*run, "tag", base, tag], env=engine.env, check=True, capture_output=True)
    subprocess.run(
        [*run, "push", "--tls-verify=false", tag],
        env=engine.env,
        check=True,
        capture_output=True,
    )
    subprocess.run([*run, "rmi", tag], env=engine.env, check=True, capture_output=True)
    assert not engine.has_image(tag)
    return tag
