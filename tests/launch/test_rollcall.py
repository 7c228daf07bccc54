"""The node roll call on real TCPStores on 127.0.0.1: missing nodes are named, an unshared run
directory is caught, and the status board carries one node's failure to the others."""

import re
import threading
import time
from pathlib import Path

import pytest

from tandem.cli import UserError
from tandem.config.loader import build_config
from tandem.launch.cluster import Cluster, resolve_cluster
from tandem.launch.config import RLConfig
from tandem.launch.rollcall import RollCall
from tandem.net import free_port


def two_nodes(tmp_path: Path, timeout_s: float = 3) -> Cluster:
    overrides = {"model.name": "tiny", "run_dir": str(tmp_path), "cluster.inference_nodes": 1}
    # the roll call listens at rdzv_port + 1; the weights group's and the servers' ports are set
    # beside it, for their defaults (29500, 8000…) may be what free_port drew (a CI run failed so)
    roll_call = free_port()
    overrides |= {"cluster.hosts": ["127.0.0.1", "127.0.0.1"], "cluster.rdzv_port": roll_call - 1}
    overrides |= {"cluster.weights_group_port": roll_call + 1, "inference.port": roll_call + 2}
    overrides |= {"cluster.join_timeout_s": timeout_s}
    return resolve_cluster(build_config(RLConfig, overrides=list(overrides.items())))


def join_all(cluster: Cluster, run_dirs: dict[str, Path]) -> tuple[dict[str, RollCall], dict[str, Exception]]:
    calls = {u.name: RollCall(cluster, u, lambda _: None) for u in cluster.units()}
    errors: dict[str, Exception] = {}

    def join(name: str) -> None:
        try:
            calls[name].join(run_dirs[name], cluster.config.join_timeout_s)
        except UserError as e:
            errors[name] = e

    threads = [threading.Thread(target=join, args=(name,)) for name in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return calls, errors


def test_a_node_that_never_joins_is_named(tmp_path: Path) -> None:
    cluster = two_nodes(tmp_path, timeout_s=2)
    trainer = RollCall(cluster, cluster.unit("trainer-0"), lambda _: None)
    message = (
        f"inference-0 (127.0.0.1) did not join the node roll call at 127.0.0.1:{cluster.rollcall_port} "
        "within cluster.join_timeout_s=2"
    )
    with pytest.raises(UserError, match=re.escape(message)):
        trainer.join(tmp_path, 2)


def test_the_hosting_node_missing_is_named(tmp_path: Path) -> None:
    cluster = two_nodes(tmp_path, timeout_s=1)
    inference = RollCall(cluster, cluster.unit("inference-0"), lambda _: None)
    message = f"trainer-0 (127.0.0.1), which hosts the node roll call at 127.0.0.1:{cluster.rollcall_port}"
    with pytest.raises(UserError, match=re.escape(message)):
        inference.join(tmp_path, 1)


def test_nodes_join_and_share_failures_and_the_end(tmp_path: Path) -> None:
    cluster = two_nodes(tmp_path)
    calls, errors = join_all(cluster, {"inference-0": tmp_path, "trainer-0": tmp_path})
    assert not errors
    assert sorted(p.name for p in (tmp_path / ".nodes").iterdir()) == ["inference-0", "trainer-0"]
    inference, trainer = calls["inference-0"], calls["trainer-0"]
    assert inference.peer_failure() is None and trainer.event() is None

    inference.post(None)  # it carries the orchestrator: its end is the run's end
    trainer._last_poll = 0.0
    assert trainer.event() == ("done", "the orchestrator finished; the run is over")
    trainer.post("trainer failed: exit code 1 (log x)")
    assert inference.peer_failure() == "trainer-0 (127.0.0.1): trainer failed: exit code 1 (log x)"
    trainer.linger(5)  # returns at once: both nodes posted


def test_the_board_waits_for_a_node_that_has_not_joined_yet(tmp_path: Path) -> None:
    """trainer-0 stopping before the start (joined, then a failure) keeps the board until every node
    read the failure, also a node still on its way (it used to wait only for the nodes that had joined, so a slower node
    found no store and waited cluster.join_timeout_s, blaming trainer-0)."""
    cluster = two_nodes(tmp_path, timeout_s=10)
    said: list[str] = []
    trainer = RollCall(cluster, cluster.unit("trainer-0"), said.append)
    inference = RollCall(cluster, cluster.unit("inference-0"), lambda _: None)
    trainer.post("its preflight failed")  # hosts the store just for this
    trainer.store.set("joined/trainer-0", "{}")  # as after a failure of a third node it had waited for

    def leave() -> None:
        trainer.linger(10)
        trainer.store = None  # leaving: the store closes

    host = threading.Thread(target=leave)
    host.start()
    time.sleep(3)  # inference-0's slower preflight; the note says whom the board waits for
    assert said and said[0].startswith(
        "keeping the node roll call open until inference-0 posted how it ended"
    )
    with pytest.raises(UserError) as caught:
        inference.join(tmp_path, 10)
    assert str(caught.value) == "stopping before the start: trainer-0 (127.0.0.1): its preflight failed"
    inference.post(None, stopped_by_peer=True)
    host.join(timeout=10)
    assert not host.is_alive()


def test_a_run_dir_the_nodes_do_not_share_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tandem.launch.rollcall.SHARE_GRACE_S", 0.5)
    cluster = two_nodes(tmp_path)
    a, b = tmp_path / "a", tmp_path / "b"  # two directories stand for two nodes' local disks
    _, errors = join_all(cluster, {"inference-0": a, "trainer-0": b})
    assert set(errors) == {"inference-0", "trainer-0"}
    assert re.search(
        rf"run_dir {a} is not shared between the nodes: trainer-0 \(host .+\) wrote {a}/.nodes/trainer-0, "
        r"which inference-0 \(host .+\) does not see",
        str(errors["inference-0"]),
    )
