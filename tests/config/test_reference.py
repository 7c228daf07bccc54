"""docs/config-reference.md is generated from the config classes; it must match them."""

from pathlib import Path

from pydantic import BaseModel

from tandem.config.fields import walk_keys
from tandem.config.loader import build_config
from tandem.config.reference import DOCUMENTED, render_reference
from tandem.evaluate import EvalConfig, server_section
from tandem.launch.config import RLConfig
from tandem.launch.plan import plan_run

DOC = Path(__file__).parents[2] / "docs" / "config-reference.md"


def test_reference_doc_is_current() -> None:
    assert DOC.read_text() == render_reference(), (
        "docs/config-reference.md is stale: run `uv run python -m tandem.config.reference > docs/config-reference.md`"
    )


def test_every_documented_config_is_rendered_with_descriptions() -> None:
    text = render_reference()
    for title, command, _ in DOCUMENTED:
        assert f"## {title} (`{command}`)" in text


def rows(title: str) -> dict[str, list[str]]:
    """The rows of one config's table, by key: [type, default, meaning] (a key that union members
    hold with different defaults has a row for each: the first)."""
    text = render_reference().split(f"## {title} ")[1].split("\n## ")[0]
    cells = [line.strip("|").split(" | ") for line in text.splitlines() if line.startswith("| `")]
    table: dict[str, list[str]] = {}
    for row in cells:
        table.setdefault(row[0].strip(" `"), [cell.strip() for cell in row[1:]])
    return table


def test_every_key_has_a_row_with_its_effective_default() -> None:
    """Union members' keys, optional sections' keys, and defaults a section's default instance sets
    (the rl launcher's `WeightsConfig(transport="auto")`)."""
    rl = rows("RL launcher")
    assert rl["weights.transport"][1] == '`"auto"`'
    assert rl["trainer.weights.transport"][1] == '`"auto"`'  # the top-level [weights]' (what a run gets)
    assert rl["trainer.loss.type"][1] == '`"masked_is"`'
    assert rl["trainer.loss.delta"][1:] == [
        "`1.0`",
        "(masked_is) Trust region [1/(1+delta), 1+delta] for the token ratio.",
    ]
    assert rl["trainer.loss.eps_low"][1] == "`0.2`" and rl["trainer.loss.eps_low"][2].startswith("(ppo_clip)")
    assert "| `trainer.loss.eps_low` | float | `0.0003` | (gspo) " in render_reference()
    assert rl["trainer.loss.normalize"][1] == '`"token"`'
    assert '| `trainer.loss.normalize` | "token" \\| "sample" | `"sample"` | (gspo) ' in render_reference()
    assert rl["trainer.loss.import_path"][1] == "required"
    assert rl["trainer.loss.kl_coef"][2].startswith("Weight")  # every type's key names none
    assert rl["slurm"][:2] == ["SlurmConfig (optional)", "`null`"]
    for key in ("slurm.partition", "kubernetes.namespace", "monitor.wandb.project", "trainer.lora.rank"):
        assert key in rl, key
    assert rl["inference.vllm.extra_args"][1] == "`[]`"


def value_at(config: BaseModel, path: str) -> object:
    for part in path.split("."):
        config = getattr(config, part)
    return config


def test_rl_prints_the_defaults_a_run_gets() -> None:
    """A per-process key left unset gets what the launcher fills in (the top-level max_steps and
    [weights], seq_len as the servers' context length, run_dir), and `rl --help` and the reference
    print that (they printed each section's own default: orchestrator.max_steps 100 in a run of
    20 steps, every weights.transport "filesystem" in a run with "auto")."""
    plan = plan_run(build_config(RLConfig, overrides=[("model.name", "m")]), visible_gpus=[])
    sections = {"inference": plan.inference[0], "orchestrator": plan.orchestrator, "trainer": plan.trainer}
    machine = {"model.name", "weights.port"}  # given here; a free port picked at each start
    checked = 0
    for key in walk_keys(RLConfig):
        process, _, rest = key.path.partition(".")
        if key.section or process not in sections or rest in machine:
            continue
        try:
            actual = value_at(sections[process], rest)
        except AttributeError:  # in an optional section the run leaves out ([trainer.lora])
            continue
        parent = value_at(sections[process], rest.rpartition(".")[0]) if "." in rest else None
        if key.types and getattr(parent, "type", None) not in key.types:
            continue  # another union member's row ([trainer.loss] gspo's normalize in a masked_is run)
        assert actual == key.default, f"{key.path}: printed {key.default!r}, a run gets {actual!r}"
        checked += 1
    assert checked > 150
    rl = rows("RL launcher")
    assert rl["orchestrator.max_steps"][1] == "`20`" and rl["inference.engine.max_model_len"][1] == "`2048`"


def test_evaluate_prints_the_defaults_its_server_gets() -> None:
    server = server_section(build_config(EvalConfig, overrides=[("model.name", "m")]))
    for key in walk_keys(EvalConfig):
        process, _, rest = key.path.partition(".")
        if process == "inference" and not key.section and rest != "model.name":
            assert value_at(server, rest) == key.default, key.path
    assert rows("Evaluation")["inference.engine.max_model_len"][1] == "`2048`"
