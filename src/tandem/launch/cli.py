"""`uv run rl @ examples/reverse_text/rl.toml [--resume] [--dry-run]`: one RL run on one machine.

Writes the resolved per-process configs to run_dir/configs/, starts the inference server(s),
waits for their /health, then starts the trainer and the orchestrator, streaming every line to
the console and to run_dir/logs/<name>.log. Exits 0 when trainer and orchestrator finish; when
any process fails, stops the rest and shows the failed one's last lines.
"""

import shlex
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from tandem.cli import UserError, run_cli
from tandem.config.loader import parse_config, to_toml
from tandem.launch.config import RLConfig
from tandem.launch.devices import visible_gpus
from tandem.launch.plan import RunPlan, plan_run
from tandem.launch.supervisor import Console, Supervisor
from tandem.models.loading import check_model_source
from tandem.transport.weights import clear_offer

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
    return to_toml(plan.config) + "\n" + "\n".join(lines) + "\n"


def preflight(plan: RunPlan) -> None:
    """Fail before starting anything on a missing model, a used run directory or a taken port."""
    check_model_source(plan.orchestrator.model.name)
    if not plan.config.resume:
        from tandem.transport.rollouts import written_steps

        if done := written_steps(plan.config.run_dir):
            raise UserError(
                f"{plan.config.run_dir} already holds rollouts up to step {done[-1]}: pass --resume to "
                "continue that run, or choose another run_dir"
            )
    taken = [(cfg.host, cfg.port, "deployment.inference_ports / inference.port") for cfg in plan.inference]
    if plan.trainer.weights.in_memory:
        taken.append((plan.trainer.weights.host, plan.trainer.weights.port, "weights.port"))
    for host, port, setting in taken:
        with socket.socket() as probe:
            probe.setsockopt(
                socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
            )  # as the servers will: TIME_WAIT is free
            try:
                probe.bind((host, port))
            except OSError as e:
                raise UserError(
                    f"port {port} on {host} is taken ({e.strerror}); stop what uses it or set {setting}"
                ) from None


def latest_weights(run_dir: Path) -> Path | None:
    published = [p for p in (run_dir / "weights").glob("step_*") if (p / "STABLE").is_file()]
    return max(published, key=lambda p: int(p.name.removeprefix("step_")), default=None)


def launch(plan: RunPlan) -> int:
    preflight(plan)
    plan.write_configs()
    clear_offer(plan.config.run_dir)  # an earlier run's in-memory offer is void: its trainer is gone
    console = Console()
    supervisor = Supervisor(
        plan.specs(),
        plan.log_dir,
        startup_timeout_s=plan.config.deployment.startup_timeout_s,
        shutdown_grace_s=plan.config.deployment.shutdown_grace_s,
        console=console,
        prog=PROG,
    )
    supervisor.say(f"run_dir {plan.config.run_dir}; configs in {plan.config_dir}")
    code = supervisor.run()
    if code == 0:
        weights = latest_weights(plan.config.run_dir)
        supervisor.say(
            f"finished {plan.trainer.max_steps} steps; final weights: {weights or 'none published'}; "
            f"metrics in {plan.config.run_dir}"
        )
    return code


def main(argv: Sequence[str] | None = None) -> None:
    def run() -> None:
        args = list(sys.argv[1:] if argv is None else argv)
        dry_run = any(a in ("--dry-run", "--dry_run") for a in args)
        args = [a for a in args if a not in ("--dry-run", "--dry_run")]
        plan = plan_run(parse_config(RLConfig, args, prog=PROG), visible_gpus())
        if dry_run:
            print(describe(plan), end="")
            return
        code = launch(plan)
        if code:
            raise SystemExit(code)

    run_cli(run, PROG)


if __name__ == "__main__":
    main()
