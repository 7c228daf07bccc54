"""The node launcher's command line: a node whose peer never joins fails naming it, and leaves
the failure where a batch job's end reads it; a wrong or missing --node is one clear line; a port
this node will listen on that is taken is one line before anything starts."""

import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from tandem.cli import UserError
from tandem.config.loader import ConfigError, parse_config
from tandem.launch import node as node_module
from tandem.launch.config import RLConfig
from tandem.launch.node import PROG, hold_until_stopped, main, run_node
from tandem.net import free_port
from tandem.transport.weights import offered_version, write_offer


def node_launcher(tmp_path: Path, capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """`python -m tandem.launch.node @ rl.toml ARGS` (in this process); exit code and stderr."""
    for name in ("config.json", "tokenizer_config.json", "tokenizer.json", "model.safetensors"):
        (tmp_path / name).write_text("{}")  # enough for the model checks; nothing loads them
    config = tmp_path / "rl.toml"
    port = free_port()  # rdzv_port; weights_group_port beside it (its default, 29500, may be the one drawn)
    config.write_text(
        f"""
run_dir = "{tmp_path / "run"}"
[model]
name = "{tmp_path}"
[cluster]
inference_nodes = 1
hosts = ["127.0.0.1", "127.0.0.1"]
rdzv_port = {port}
weights_group_port = {port + 2}
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


NODE_PORTS = {  # node, what listens at the taken port P there, the key named, and the arguments
    "roll call": (
        "1",
        "the node roll call, which trainer-0's launcher hosts",
        "cluster.rdzv_port (the roll call takes the port after it)",
        "--cluster.rdzv_port={P_1}",
    ),
    "rendezvous": (
        "1",
        "the trainer's rendezvous (torchrun's c10d store), which trainer-0 hosts",
        "cluster.rdzv_port",
        "--cluster.trainer_nodes=2 --cluster.hosts=127.0.0.1,127.0.0.1,127.0.0.1 --cluster.rdzv_port={P}",
    ),
    "weights group": (
        "1",
        "the weight group's store, which trainer rank 0 hosts on trainer-0",
        "cluster.weights_group_port",
        "--cluster.weights_group_port={P}",
    ),
    "server": ("0", "inference server 0", "inference.port", "--inference.port={P}"),
}


@pytest.mark.parametrize("case", list(NODE_PORTS))
def test_a_taken_port_of_this_node_is_one_line_before_anything_starts(
    tmp_path: Path, capsys, monkeypatch, case: str
) -> None:
    """Trainer-0 hosts the roll call (rdzv_port + 1), torchrun's rendezvous (rdzv_port, with
    several trainer nodes) and the weight group's store; an inference node its servers. The
    rendezvous port was never checked (torchrun's agent joins whatever listens there), the roll
    call's failed with torch's message, and the others named keys the cluster overrides."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    node, what, key, args = NODE_PORTS[case]
    with socket.socket() as taken:  # on every address, as the node's process would bind it
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = args.format(P=port, P_1=port - 1).split()
        code, err = node_launcher(tmp_path, capsys, "--node", node, *argv)
    line = (
        f"port {port} on 0.0.0.0 is taken (Address already in use), for {what}; "
        f"stop what uses it or set {key}"
    )
    assert (code, err) == (2, f"rl node: error: {line}")
    unit = "trainer-0" if node == "1" else "inference-0"
    assert (
        tmp_path / "run" / "logs" / unit / "FAILED"
    ).read_text().strip() == f"rl {unit} (127.0.0.1): {line}"
    assert not (tmp_path / "run" / ".nodes").exists()  # it never joined the roll call
    assert not (tmp_path / "run" / "configs").exists()  # nor wrote a process's config


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


@pytest.mark.parametrize(
    ("failing", "how"), [("inference-0", "port"), ("trainer-0", "port"), ("trainer-1", "crash")]
)
def test_a_node_failing_its_checks_stops_the_waiting_nodes_at_once(
    tmp_path: Path, capsys, monkeypatch, failing: str, how: str
) -> None:
    """A node whose preflight fails never joins the roll call; it used to exit alone while the
    others waited cluster.join_timeout_s and then named it without its reason. It now posts its
    line to the roll call (trainer-0 hosting the store for it when it is the one failing), and the
    others stop within seconds, naming it, its host and the reason. A bug before the start (any
    exception, here raised in its resume preparation) is posted as its type and message, and a
    node slower to arrive than the others still reads it (trainer-0 keeps the board for it)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    node_launcher(tmp_path, capsys, "--node", "trainer-3")  # writes the model files and rl.toml
    common = ["--cluster.trainer_nodes=2", "--cluster.hosts=127.0.0.1,127.0.0.1,127.0.0.1"]
    port = free_port()
    common += [
        f"--cluster.rdzv_port={port}",
        f"--cluster.weights_group_port={port + 2}",
        "--cluster.join_timeout_s=30",
    ]
    nodes = ["trainer-0", "trainer-1", "inference-0"]
    errors: dict[str, str] = {}
    prepare_resume = node_module.prepare_resume

    def crash_here_slow_there(plan: object) -> None:
        if threading.current_thread().name == failing:
            time.sleep(1)  # once trainer-0 hosts the board (a post then lands at once)
            raise OSError("disk on fire")
        if threading.current_thread().name == "inference-0":
            time.sleep(4)  # joins after trainer-0 read the failure: it must still find the board
        prepare_resume(plan)

    if how == "crash":
        monkeypatch.setattr(node_module, "prepare_resume", crash_here_slow_there)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        key = "inference.port" if failing == "inference-0" else "cluster.weights_group_port"

        def node(name: str) -> None:
            args = [*common, f"--{key}={port}"] if name == failing and how == "port" else common
            try:
                run_node(parse_config(RLConfig, ["@", str(tmp_path / "rl.toml"), *args], prog=PROG), name)
            except (ConfigError, UserError) as e:
                errors[name] = str(e)
            except OSError as e:
                errors[name] = f"{type(e).__name__}: {e}"

        start = time.monotonic()
        threads = [threading.Thread(target=node, args=(name,), name=name) for name in nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        took = time.monotonic() - start
    assert set(errors) == set(nodes)
    reason = errors[failing]
    if how == "port":
        assert reason.startswith(f"port {port} on 0.0.0.0 is taken (Address already in use)")
    else:
        assert reason == "OSError: disk on fire"
    for name in nodes:
        if name != failing:
            assert errors[name] == f"stopping before the start: {failing} (127.0.0.1): {reason}"
    failed = (tmp_path / "run" / "logs" / failing / "FAILED").read_text().strip()
    assert failed == f"rl {failing} (127.0.0.1): {reason}"
    assert took < 20  # not cluster.join_timeout_s=30
