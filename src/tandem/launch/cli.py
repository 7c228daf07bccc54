"""`uv run rl @ examples/reverse_text/rl.toml [--resume] [--dry-run] [--k8s]`: one RL run.

On one machine by default. With a [slurm] section it renders an sbatch script and submits it;
with --k8s or a [kubernetes] section it renders Kubernetes manifests (docs/scaling.md).

Checks everything it can first (launch/preflight.py; also under --dry-run), in one line per
problem and without importing torch. Then writes the resolved per-process configs to
run_dir/configs/, starts the inference server(s),
waits for their /health, then starts the trainer and the orchestrator, streaming every line to
the console and to run_dir/logs/<name>.log. Exits 0 when trainer and orchestrator finish; when
any process fails, stops the rest and shows the failed one's last lines, then one line naming it
and its log. It holds run_dir/rl.lock, and so do its processes (launch/supervisor.py), so that
a launcher started while any of them runs refuses or, when only a killed launcher's processes
hold it, waits for them (docs/configs.md, "Failures and stopping").
"""

import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from tandem.cli import UserError, run_cli
from tandem.config.loader import parse_config, to_toml
from tandem.launch.config import KubernetesConfig, RLConfig
from tandem.launch.devices import visible_gpus
from tandem.launch.plan import RunPlan, plan_run
from tandem.launch.preflight import check_ports, preflight
from tandem.launch.supervisor import Console
from tandem.transport.layout import CHECKPOINTS, checkpoint_steps, run_dir_lock, written_steps
from tandem.transport.resume import drop_weights_to_republish, orchestrator_start
from tandem.transport.weights import clear_offer, latest_version, weights_dir

PROG = "rl"


def describe(plan: RunPlan) -> str:
    """What --dry-run prints: the resolved config (itself a valid config file), then the commands."""
    devices = plan.devices
    where = "CPU only" if not devices.on_gpu else ("colocated on GPU" if devices.colocated else "split GPUs")
    lines = [f"# commands ({where}); {plan.config_dir}/<name>.toml holds each one's section of the above:"]
    for spec in plan.specs():
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in spec.env.items())
        health = f"  (waits for {spec.health_url})" if spec.health_url else ""
        lines.append(f"#   [{spec.name}] {env} {shlex.join(spec.argv)}{health}")
    if plan.orchestrator.prefill_servers:
        lines.append(
            f"# prefill servers (no rollouts; the other servers take their prompts from them): "
            f"{', '.join(plan.orchestrator.prefill_servers)}"
        )
    return to_toml(plan.config) + "\n" + "\n".join(lines) + "\n"


def latest_weights(run_dir: Path) -> Path | None:
    version = latest_version(run_dir)
    return None if version is None else weights_dir(run_dir, version)


def prepare_resume(plan: RunPlan) -> None:
    """Before any process starts: an earlier run's in-memory offer is void (its trainer is gone),
    and a resumed orchestrator's deletions (rollouts past a gap or packed for another number of
    trainer ranks, weights past its start: transport/resume.py) are done now, so that no trainer
    reads a step that is about to go; the orchestrator repeats them at its start. The weights
    the resumed trainer will publish again (past its checkpoint) go too, so that no server is
    told to load a directory the trainer then rewrites (this one only here, before the trainer)."""
    clear_offer(plan.config.run_dir)
    if plan.runs_orchestrator and plan.orchestrator.resume:
        orchestrator_start(plan.config.run_dir, plan.orchestrator.trainer_shape)
        drop_weights_to_republish(plan.config.run_dir)


def launch(plan: RunPlan) -> int:
    run_dir = plan.config.run_dir
    # The processes a killed launcher left hold run_dir/rl.lock and their ports until they exit: in
    # a run_dir that exists the ports are checked once the lock is taken (a --resume started right
    # after the kill waits for them, then finds the ports free), in a new one (no lock, nothing
    # to wait for) before the run_dir is made, like every other check.
    existing = run_dir.exists()
    preflight(plan, create=True, ports=not existing)
    console = Console()
    # (before anything in run_dir is written or deleted; the processes inherit it: it stays held
    # until the last of them has exited, also when this launcher is killed first)
    with run_dir_lock(run_dir, say=lambda text: console.line(PROG, text)) as lock:
        if existing:
            check_ports(plan)
        try:
            plan.write_configs()
            prepare_resume(plan)
            plan.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # (a full disk: one line, before any process starts)
            raise UserError(
                f"run_dir {run_dir}: cannot write {e.filename or run_dir}: {e.strerror}"
            ) from None
        supervisor = plan.supervisor(console, PROG, pass_fds=(lock,))
        supervisor.say(f"run_dir {run_dir}; configs in {plan.config_dir}")
        code = supervisor.run()
    if supervisor.stop_signal is not None or (code and supervisor.children):
        latest = checkpoint_steps(run_dir / CHECKPOINTS)
        if supervisor.stop_signal is not None or latest or written_steps(run_dir):
            # (the last line of a stopped or failed run says how to go on)
            where = f"its checkpoint of step {latest[-1]}" if latest else "step 0 (no checkpoint yet)"
            supervisor.say(f"stopped; `rl ... --resume` continues this run_dir from {where}")
    if code == 0:
        weights = latest_weights(run_dir)
        supervisor.say(
            f"finished {plan.trainer.max_steps} steps; final weights: {weights or 'none published'}; "
            f"metrics in {run_dir}"
        )
    return code


def submit_to_scheduler(config: RLConfig, k8s: bool, dry_run: bool) -> None:
    """Hand the run to Slurm (sbatch) or write Kubernetes manifests; nothing starts here."""
    console = Console()

    def say(text: str) -> None:
        console.line(PROG, text)

    if config.slurm is not None and (k8s or config.kubernetes is not None):
        raise UserError("the config has both [slurm] and [kubernetes] (or --k8s): choose one")
    if config.slurm is not None:
        from tandem.launch.slurm import submit

        submit(config, config.slurm, dry_run, say)
    else:
        from tandem.launch.kubernetes import write_manifests

        write_manifests(config, config.kubernetes or KubernetesConfig(), say)


def main(argv: Sequence[str] | None = None) -> None:
    def run() -> None:
        args = list(sys.argv[1:] if argv is None else argv)
        dry_run = any(a in ("--dry-run", "--dry_run") for a in args)
        k8s = "--k8s" in args
        args = [a for a in args if a not in ("--dry-run", "--dry_run", "--k8s")]
        config = parse_config(RLConfig, args, prog=PROG)
        if k8s or config.slurm is not None or config.kubernetes is not None:
            submit_to_scheduler(config, k8s, dry_run)
            return
        plan = plan_run(config, visible_gpus())
        if dry_run:
            preflight(plan, create=False)
            print(describe(plan), end="")
            return
        code = launch(plan)
        if code:
            raise SystemExit(code)

    run_cli(run, PROG)


if __name__ == "__main__":
    main()
