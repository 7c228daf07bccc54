"""`rl @ cfg.toml` with a [slurm] section: render an sbatch script and submit it (or, under
--dry-run, write it and stop).

The script comes from the package's Jinja2 templates (templates/slurm/: single_node for
`cluster.inference_nodes = 0`, multi_node otherwise, both extending base) or from the user's
`slurm.template`, which may `{% extends "multi_node.sbatch.j2" %}` and override a block. Inside
the job, srun starts one node launcher (tandem.launch.node) per node; the multi-node script
first collects the nodes' addresses in node order and passes them as cluster.hosts.

Written next to each other in run_dir/slurm/: job.sbatch (the script) and job.toml (the config
the node launchers read). The job's output goes to run_dir/logs/slurm-<job id>.out.
"""

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import jinja2

from tandem.cli import UserError
from tandem.launch.cluster import is_multi_node, num_nodes
from tandem.launch.config import RLConfig, SlurmConfig
from tandem.launch.jobs import check_plans, node_config_text, shared_dir_warning

TEMPLATES = Path(__file__).with_name("templates") / "slurm"
NODE_MODULE = "tandem.launch.node"


def script_dir(config: RLConfig) -> Path:
    return config.run_dir / "slurm"


def render(config: RLConfig, slurm: SlurmConfig) -> str:
    """The sbatch script for `config` (raises ConfigError / UserError on bad input)."""
    run_dir = config.run_dir.absolute()
    template_path = slurm.template
    if template_path is not None and not template_path.is_file():
        raise UserError(f"slurm.template: no such file {template_path}")
    search = [str(TEMPLATES)] + ([str(template_path.parent.absolute())] if template_path else [])
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(search),
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["quote"] = lambda value: shlex.quote(str(value))
    env.filters["sbatch_quote"] = sbatch_quote
    multi = is_multi_node(config)
    name = template_path.name if template_path else ("multi_node" if multi else "single_node") + ".sbatch.j2"
    python = slurm.python or sys.executable
    launcher = [python, "-m", NODE_MODULE, "@", str(script_dir(config).absolute() / "job.toml")]
    try:
        return env.get_template(name).render(
            template=str(template_path or TEMPLATES / name),
            script=str(script_dir(config).absolute() / "job.sbatch"),
            run_dir=str(run_dir),
            log_dir=str(run_dir / "logs"),
            output=str(run_dir / "logs" / "slurm-%j.out"),
            workdir=str(Path.cwd()),
            job_name=slurm.job_name or f"tandem-{run_dir.name}",
            nodes=num_nodes(config),
            gpus_per_node=config.cluster.gpus_per_node,
            slurm=slurm,
            sbatch_lines=[line.removeprefix("#SBATCH").strip() for line in slurm.sbatch],
            launcher=shlex.join(launcher),
            layout=_layout(config),
            config=config,
        )
    except jinja2.TemplateError as e:
        raise UserError(f"slurm template {name}: {e}") from None


def sbatch_quote(value: object) -> str:
    """One #SBATCH option value as sbatch reads it: in double quotes, with backslash before `\\`
    and `"` (unquoted, a space ended the value and a `#` began a comment)."""
    text = str(value)
    if "\n" in text or "\r" in text:
        raise UserError(f"a Slurm option value cannot hold a line break: {text!r}")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _layout(config: RLConfig) -> str:
    c = config.cluster
    parts = [f"nodes 0..{c.inference_nodes - 1} inference"]
    parts.append(f"{c.inference_nodes}..{c.inference_nodes + c.trainer_nodes - 1} trainer")
    if c.orchestrator_node == "own":
        parts.append(f"{c.inference_nodes + c.trainer_nodes} the orchestrator")
    return ", ".join(parts)


def write_job(config: RLConfig, slurm: SlurmConfig, say: Callable[[str], None]) -> Path:
    """Check the config against its nodes, write job.toml and job.sbatch; the script's path."""
    check_plans(config)
    if warning := shared_dir_warning(config):
        say(f"warning: {warning}")
    text = render(config, slurm)
    folder = script_dir(config)
    folder.mkdir(parents=True, exist_ok=True)
    (config.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    _write(folder / "job.toml", node_config_text(config))
    script = folder / "job.sbatch"
    _write(script, text)
    script.chmod(0o755)
    return script


def submit(config: RLConfig, slurm: SlurmConfig, dry_run: bool, say: Callable[[str], None]) -> str | None:
    """Write the job and submit it with sbatch (unless `dry_run`); the job id."""
    sbatch = shutil.which("sbatch")
    script = write_job(config, slurm, say)
    if dry_run:
        say(f"wrote {script} (and job.toml beside it); submit it with: sbatch {script}")
        return None
    if sbatch is None:
        raise UserError(
            f"the config has a [slurm] section but sbatch is not on this machine's PATH; run `rl` on a "
            f"Slurm login node, or pass --dry-run to only write the script ({script} is written)"
        )
    done = subprocess.run(
        [sbatch, "--parsable", str(script)], capture_output=True, text=True, env=os.environ.copy()
    )
    if done.returncode != 0:
        raise UserError(f"sbatch {script} failed: {(done.stderr or done.stdout).strip()}")
    job_id = done.stdout.strip().split(";")[0]
    log = config.run_dir.absolute() / "logs" / f"slurm-{job_id}.out"
    say(f"submitted Slurm job {job_id} ({num_nodes(config)} node(s)); its output: {log}")
    return job_id


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
