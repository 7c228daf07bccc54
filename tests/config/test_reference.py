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
