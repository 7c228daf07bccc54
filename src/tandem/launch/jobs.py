"""What a Slurm or Kubernetes submission shares: the config every node launcher reads, and the
checks made on the submitting machine before anything is submitted.

The submitting machine (a login node, a laptop) is not where the processes run: its GPUs and
ports say nothing. So each node's plan is made here against `cluster.gpus_per_node` GPUs and
stand-in host names; a config whose GPU counts do not fit its nodes fails now, not in the job.
"""

from typing import Any

import tomli_w

from tandem.config.base import SHARED_FIELDS
from tandem.launch.cluster import is_multi_node, num_nodes, resolve_cluster, unshared_run_dir_warning
from tandem.launch.config import RLConfig
from tandem.launch.plan import plan_node, plan_run


def check_plans(config: RLConfig) -> None:
    """Plan every node of the run as its launcher will; raises ConfigError (one line)."""
    gpus = [str(i) for i in range(config.cluster.gpus_per_node or 0)]
    if not is_multi_node(config):
        plan_run(config, gpus)
        return
    cluster = resolve_cluster(config, [f"node{k}" for k in range(num_nodes(config))])
    for unit in cluster.units():
        plan_node(config, cluster, unit, [] if unit.role == "orchestrator" else gpus)


def shared_dir_warning(config: RLConfig) -> str | None:
    """A warning when a run on several nodes has its run_dir on a filesystem only this machine sees."""
    return unshared_run_dir_warning(config.run_dir) if num_nodes(config) > 1 else None


def node_config_text(config: RLConfig, **changes: Any) -> str:
    """The config as the user gave it (fields they set, not defaults), with `changes` merged in:
    each node launcher resolves it itself, with the addresses it learns in the job."""
    data = _without_spread(config.model_dump(mode="json", exclude_unset=True, exclude_none=True))
    for dotted, value in changes.items():
        section, _, key = dotted.rpartition(".")
        target = data.setdefault(section, {}) if section else data
        if value is None:
            target.pop(key, None)
        else:
            target[key] = value
    return tomli_w.dumps(_without_empty_tables(data))


def _without_spread(data: dict[str, Any]) -> dict[str, Any]:
    """Drop the copies of top-level shared fields (run_dir, model, ...) that loading spread into
    the sections: loading the text again spreads them anew, from a top level that may change."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            value = _without_spread(value)
            value = {k: v for k, v in value.items() if not (k in SHARED_FIELDS and data.get(k) == v)}
        out[key] = value
    return out


def _without_empty_tables(data: dict[str, Any]) -> dict[str, Any]:
    pruned = {k: _without_empty_tables(v) if isinstance(v, dict) else v for k, v in data.items()}
    return {k: v for k, v in pruned.items() if v != {} or not isinstance(data[k], dict)}
