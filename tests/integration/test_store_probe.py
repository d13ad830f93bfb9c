"""The controller's RegisterNode reads the agent's probe object from its own store: a missing
object or another nonce refuses the node (not written), no nonce (an older agent) is not
read, and a store the controller cannot read itself is its own outage: logged once, the node
registered. Real database, real files (the agent's side is its :func:`probe`)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gpufleet.controller.servicer import ControllerServicer
from gpufleet.objectstore import PROBE_PREFIX, ObjectStore, new_probe_nonce, probe
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.store.db import Database
from gpufleet.store.tables import NodeRow


def _register(servicer: ControllerServicer, node_id: str, url: str, nonce: str) -> str:
    resp = servicer.RegisterNode(
        pb.RegisterNodeRequest(
            node_id=node_id,
            address="127.0.0.1:1",
            agent_epoch=1,
            gpus=[pb.Gpu(index=0, uuid=f"GPU-{node_id}", gpu_type="H100-80GB", memory_mb=81920)],
            cpu=8,
            memory_mb=65536,
            object_store_url=url,
            object_store_probe_nonce=nonce,
        ),
        None,
    )
    return resp.refused


def _registered(db: Database) -> set[str]:
    with db.read() as s:
        return {n.id for n in s.query(NodeRow).all()}


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_register_node_reads_the_probe_nonce_from_the_controllers_store(
    db: Database, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "objects"
    store = ObjectStore(str(root))
    url = f"file://{root}"
    servicer = ControllerServicer(
        db,
        store,
        heartbeat_interval_s=10.0,
        leader_epoch=lambda: 1,
        on_change=lambda: None,
        probe_timeout_s=0.5,
    )
    nonce = new_probe_nonce()
    assert probe(str(root), "good", nonce) is None
    assert _register(servicer, "good", url, nonce) == ""
    assert _register(servicer, "old-agent", url, "") == ""  # no nonce: not read

    # the agent wrote its probe to another store under the same name
    assert probe(str(tmp_path / "elsewhere"), "other", nonce) is None
    refused = _register(servicer, "other", url, nonce)
    assert refused == (
        f"the controller cannot read this agent's probe object at {url}/{PROBE_PREFIX}/other:"
        " the agent and the controller use different object stores (check AWS_ENDPOINT_URL"
        " / credentials)"
    )
    assert probe(str(root), "stale", new_probe_nonce()) is None
    assert "another nonce" in _register(servicer, "stale", url, nonce)
    assert _registered(db) == {"good", "old-agent"}

    # the controller's own store fails it (here: a directory at the key): logged once,
    # nodes registered unchecked, and a line when it answers again
    for node_id in ("u1", "u2"):
        (root / PROBE_PREFIX / node_id).mkdir(parents=True)
    with caplog.at_level(logging.INFO, logger="gpufleet.controller"):
        assert _register(servicer, "u1", url, new_probe_nonce()) == ""
        assert _register(servicer, "u2", url, new_probe_nonce()) == ""
        assert probe(str(root), "back", nonce) is None
        assert _register(servicer, "back", url, nonce) == ""
    lines = [r.getMessage() for r in caplog.records]
    outage = [ln for ln in lines if "cannot check agents' probe objects" in ln]
    assert len(outage) == 1 and "IsADirectoryError" in outage[0], lines
    assert sum("answers again" in ln for ln in lines) == 1, lines
    assert _registered(db) == {"good", "old-agent", "u1", "u2", "back"}
