"""The node launcher's command line: a node whose peer never joins fails naming it, and leaves
the failure where a batch job's end reads it; a wrong or missing --node is one clear line."""

import os
import signal
import threading
from pathlib import Path

import pytest

from tandem.launch.node import hold_until_stopped, main
from tandem.net import free_port
from tandem.transport.weights import offered_version, write_offer


def node_launcher(tmp_path: Path, capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """`python -m tandem.launch.node @ rl.toml ARGS` (in this process); exit code and stderr."""
    for name in ("config.json", "tokenizer_config.json", "tokenizer.json", "model.safetensors"):
        (tmp_path / name).write_text("{}")  # enough for the model checks; nothing loads them
    config = tmp_path / "rl.toml"
    config.write_text(
        f"""
run_dir = "{tmp_path / "run"}"
[model]
name = "{tmp_path}"
[cluster]
inference_nodes = 1
hosts = ["127.0.0.1", "127.0.0.1"]
rdzv_port = {free_port()}
join_timeout_s = 2
"""
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["@", str(config), *args])
    return int(exit_info.value.code or 0), capsys.readouterr().err.strip()


def test_a_node_that_never_joins_is_named(tmp_path: Path, capsys, monkeypatch) -> None:
    """...and a node clears an earlier run's in-memory weight offer before the roll call (a
    resumed orchestrator read the old run's version and asked the servers for it)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    write_offer(tmp_path / "run", 7)
    code, err = node_launcher(tmp_path, capsys, "--node", "1")
    assert offered_version(tmp_path / "run") is None
    assert code == 2
    assert err.startswith(
        "rl node: error: inference-0 (127.0.0.1) did not join the node roll call at 127.0.0.1:"
    )
    assert err.endswith("within cluster.join_timeout_s=2")
    failed = (tmp_path / "run" / "logs" / "trainer-0" / "FAILED").read_text()
    assert failed.startswith("rl trainer-0 (127.0.0.1): inference-0 (127.0.0.1) did not join")


def test_wrong_or_missing_node(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("SLURM_NODEID", raising=False)
    assert node_launcher(tmp_path, capsys, "--node", "trainer-3") == (
        2,
        "rl node: error: --node trainer-3: not a node of this cluster (inference-0, trainer-0)",
    )
    assert node_launcher(tmp_path, capsys) == (
        2,
        "rl node: error: which node is this? pass --node K (node number) or --node NAME (e.g. trainer-0)",
    )
    monkeypatch.setenv("SLURM_NODEID", "7")  # under srun the node number comes from Slurm
    assert node_launcher(tmp_path, capsys)[1] == "rl node: error: --node 7: the cluster has nodes 0..1"


def test_hold_ends_on_sigterm() -> None:
    before = signal.getsignal(signal.SIGTERM)
    said: list[str] = []
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
    hold_until_stopped(said.append)
    assert said == ["the run finished; holding until stopped (--hold)", "stopped"]
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back
