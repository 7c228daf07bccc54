"""`python -m tandem.launch.node @ cfg.toml [--node K|NAME] [--hold] [--cluster.hosts a,b,...] [--key value ...]`

The node-local launcher of a run on several nodes: it starts this node's processes only, with
every address derived from the cluster (tandem.launch.cluster). Under Slurm one runs on each
node (srun) and K defaults to SLURM_NODEID; on Kubernetes one runs in each pod, named by its
unit (`--node trainer-1`); without a scheduler, start one on each host of cluster.hosts.

Before anything starts, each node checks what `rl` checks (tandem.launch.preflight), the ports
its own processes will listen on included (planned_ports), then the nodes meet at the roll call
(tandem.launch.rollcall): a node that never joins, or a run directory the nodes do not share,
fails there with the node named; a node whose checks fail posts its line there, so the nodes
waiting for it stop at once naming it. While the run goes, a process failing on any node stops every
node; the failing node names itself and the process, and leaves that line in
run_dir/logs/<unit>/FAILED.

A config for one machine (cluster.inference_nodes = 0) runs exactly as `rl` runs it. `--hold`
keeps the launcher alive after a successful run until it is stopped (a Kubernetes StatefulSet
would restart a container that exits).
"""

import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence

from tandem.cli import UserError, run_cli
from tandem.config.loader import ConfigError, parse_config
from tandem.launch.cli import launch, prepare_resume
from tandem.launch.cluster import is_multi_node, resolve_cluster
from tandem.launch.config import RLConfig
from tandem.launch.devices import visible_gpus
from tandem.launch.plan import RunPlan, plan_node, plan_run
from tandem.launch.preflight import preflight
from tandem.launch.rollcall import RollCall
from tandem.launch.supervisor import Console, record_failure

PROG = "rl node"
LINGER_S = 3600.0
"""How long the node hosting the roll call waits, after its own end, for the others to report theirs."""


def take_node(args: list[str]) -> tuple[str | None, bool, list[str]]:
    """`--node X` (or `--node=X`; default SLURM_NODEID under srun) and `--hold` out of argv."""
    rest, node, hold = [], os.environ.get("SLURM_NODEID"), False
    i = 0
    while i < len(args):
        if args[i] == "--hold":
            hold = True
        elif args[i] == "--node":
            if i + 1 >= len(args):
                raise ConfigError("--node needs a node number or a unit name (inference-0, trainer-1, ...)")
            node = args[i + 1]
            i += 2
            continue
        elif args[i].startswith("--node="):
            node = args[i].partition("=")[2]
        else:
            rest.append(args[i])
        i += 1
    return node, hold, rest


def hold_until_stopped(say: Callable[[str], None]) -> None:
    """Sleep until SIGTERM or SIGINT."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    say("the run finished; holding until stopped (--hold)")
    try:
        stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    say("stopped")


def run_node(config: RLConfig, node: str | None) -> int:
    """Start this node's share of the run and supervise it to the end; the exit code."""
    if not is_multi_node(config):
        plan = plan_run(config, visible_gpus())
        try:
            return launch(plan)
        except (ConfigError, UserError) as e:
            record_failure(plan.log_dir, f"rl: {e}")
            raise
    if node is None:
        raise ConfigError("which node is this? pass --node K (node number) or --node NAME (e.g. trainer-0)")
    cluster = resolve_cluster(config)
    unit = cluster.unit(node)
    prog = f"rl {unit.name} ({cluster.host(unit)})"
    console = Console()
    rollcall = RollCall(cluster, unit, lambda text: console.line(prog, text))
    plan = None
    try:
        plan = plan_node(config, cluster, unit, visible_gpus())
        preflight(plan, create=True)
        prepare_resume(plan)  # before the roll call, so before any process of any node starts
        rollcall.join(config.run_dir, config.cluster.join_timeout_s)
    except Exception as e:
        # a check's one line, or a bug's type and message (its traceback goes to this node's stderr)
        reason = str(e) if isinstance(e, (ConfigError, UserError)) else f"{type(e).__name__}: {e}"
        if plan is not None:
            record_failure(plan.log_dir, f"{prog}: {reason}")
        # also when this node never joined: the nodes waiting in the roll call stop naming it
        rollcall.post(reason, stopped_by_peer=rollcall.stopped_by_peer)
        if rollcall.hosting:  # it keeps the board for the nodes still on their way: say why first
            console.line(prog, reason if rollcall.stopped_by_peer else f"not starting: {reason}")
        rollcall.linger(config.cluster.join_timeout_s)
        raise
    return _supervise(plan, rollcall, console, prog)


def _supervise(plan: RunPlan, rollcall: RollCall, console: Console, prog: str) -> int:
    plan.write_configs()
    supervisor = plan.supervisor(console, prog, peer_event=rollcall.event)
    supervisor.say(f"configs in {plan.config_dir}, logs in {plan.log_dir}")
    code, crash = 1, None
    try:
        code = supervisor.run()
    except Exception as e:  # a bug of the launcher's own: the others learn its type and message
        crash = f"the node launcher failed: {type(e).__name__}: {e}"
        raise
    finally:
        failure = None if code == 0 else supervisor.failure or crash or f"stopped (exit code {code})"
        rollcall.post(failure, stopped_by_peer=supervisor.stopped_by_peer)
        rollcall.linger(LINGER_S)
    return code


def main(argv: Sequence[str] | None = None) -> None:
    def run() -> None:
        node, hold, args = take_node(list(sys.argv[1:] if argv is None else argv))
        code = run_node(parse_config(RLConfig, args, prog=PROG), node)
        if code:
            raise SystemExit(code)
        if hold:
            console = Console()
            hold_until_stopped(lambda text: console.line(PROG, text))

    run_cli(run, PROG)


if __name__ == "__main__":
    main()
