"""docs/config-reference.md is generated from the config classes; it must match them."""

from pathlib import Path

from tandem.config.reference import DOCUMENTED, render_reference

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
    """The rows of one config's table, by key: [type, default, meaning]."""
    text = render_reference().split(f"## {title} ")[1].split("\n## ")[0]
    cells = [line.strip("|").split(" | ") for line in text.splitlines() if line.startswith("| `")]
    return {row[0].strip(" `"): [cell.strip() for cell in row[1:]] for row in cells}


def test_every_key_has_a_row_with_its_effective_default() -> None:
    """Union members' keys, optional sections' keys, and defaults a section's default instance sets
    (the rl launcher's `WeightsConfig(transport="auto")`)."""
    rl = rows("RL launcher")
    assert rl["weights.transport"][1] == '`"auto"`'
    assert rl["trainer.weights.transport"][1] == '`"filesystem"`'  # the section's own default
    assert rl["trainer.loss.type"][1] == '`"masked_is"`'
    assert rl["trainer.loss.delta"][1:] == [
        "`1.0`",
        "(masked_is) Trust region [1/(1+delta), 1+delta] for the token ratio.",
    ]
    assert rl["trainer.loss.eps_low"][1] == "`0.2`" and rl["trainer.loss.eps_low"][2].startswith("(ppo_clip)")
    assert rl["trainer.loss.import_path"][1] == "required"
    assert rl["trainer.loss.kl_coef"][2].startswith("Weight")  # every type's key names none
    assert rl["slurm"][:2] == ["SlurmConfig (optional)", "`null`"]
    for key in ("slurm.partition", "kubernetes.namespace", "monitor.wandb.project", "trainer.lora.rank"):
        assert key in rl, key
    assert rl["inference.vllm.extra_args"][1] == "`[]`"
