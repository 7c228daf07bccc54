"""Config loading: TOML merging, CLI overrides, shared fields and every error case."""

import subprocess
import sys
from pathlib import Path
from typing import Annotated, Literal

import pytest
from pydantic import Discriminator, Field, Tag

from tandem.config import ConfigError, ModelConfig, Section, build_config, parse_config, to_toml
from tandem.config.loader import split_args


class Optim(Section):
    lr: float = 1e-3
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.999])


class Trainer(Section):
    model: ModelConfig = ModelConfig()
    seq_len: int = 128
    max_steps: int = 10
    optim: Optim = Optim()


class Orchestrator(Section):
    model: ModelConfig = ModelConfig()
    seq_len: int = 128
    batch_size: int = 8


class Root(Section):
    model: ModelConfig = ModelConfig()
    seq_len: int = 64
    max_steps: int = 5
    trainer: Trainer = Trainer()
    orchestrator: Orchestrator = Orchestrator()


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_files_merge_left_to_right(tmp_path: Path) -> None:
    a = write(tmp_path / "a.toml", "[trainer.optim]\nlr = 0.1\n[orchestrator]\nbatch_size = 4\n")
    b = write(tmp_path / "b.toml", "[trainer.optim]\nlr = 0.2\n")
    cfg = parse_config(Root, ["@", str(a), f"@{b}"])
    assert cfg.trainer.optim.lr == 0.2
    assert cfg.orchestrator.batch_size == 4


def test_cli_overrides_win_and_parse_toml_values(tmp_path: Path) -> None:
    a = write(tmp_path / "a.toml", "[trainer.optim]\nlr = 0.1\n")
    cfg = parse_config(
        Root,
        [
            "@",
            str(a),
            "--trainer.optim.lr",
            "3e-4",
            "--trainer.optim.betas",
            "[0.8, 0.9]",
            "--model.name=x/y",
        ],
    )
    assert cfg.trainer.optim.lr == pytest.approx(3e-4)
    assert cfg.trainer.optim.betas == [0.8, 0.9]
    assert cfg.model.name == "x/y"


def test_kebab_and_snake_case_both_accepted(tmp_path: Path) -> None:
    a = write(tmp_path / "a.toml", "seq-len = 99\n[orchestrator]\nbatch-size = 3\n")
    cfg = parse_config(Root, ["@", str(a), "--orchestrator.batch_size", "5", "--max-steps", "7"])
    assert (cfg.seq_len, cfg.orchestrator.batch_size, cfg.max_steps) == (99, 5, 7)


def test_shared_fields_reach_every_subsection_unless_set_there(tmp_path: Path) -> None:
    a = write(
        tmp_path / "a.toml",
        'seq_len = 256\n[model]\nname = "m"\ndtype = "bfloat16"\n[trainer]\nmax_steps = 3\n[trainer.model]\ndtype = "float32"\n',
    )
    cfg = parse_config(Root, ["@", str(a)])
    assert cfg.trainer.seq_len == cfg.orchestrator.seq_len == 256
    assert cfg.trainer.model.name == cfg.orchestrator.model.name == "m"
    assert cfg.trainer.model.dtype == "float32"  # a sub-section's own value wins
    assert cfg.orchestrator.model.dtype == "bfloat16"
    assert cfg.trainer.max_steps == 3


def test_flag_without_value_means_true() -> None:
    class WithFlag(Section):
        resume: bool = False
        lr: float = 0.1

    assert parse_config(WithFlag, ["--resume", "--lr", "0.5"]).resume is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trainer.optim.nope", "1"], "unknown key 'trainer.optim.nope'"),
        (["--trainer.optim.lr", "fast"], "'trainer.optim.lr'"),
        (["--model.dtype", "float8"], "'model.dtype'"),
        (["--seq_len.x", "1"], "'seq_len'"),
        (["stray"], "unexpected argument 'stray'"),
        (["@"], "'@' must be followed"),
        (["@", "/does/not/exist.toml"], "config file not found: /does/not/exist.toml"),
    ],
)
def test_errors_name_the_problem(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        parse_config(Root, argv)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_malformed_toml_names_the_file(tmp_path: Path) -> None:
    bad = write(tmp_path / "bad.toml", "[trainer\nlr = 1\n")
    with pytest.raises(ConfigError, match="malformed TOML in .*bad.toml"):
        parse_config(Root, ["@", str(bad)])


def test_unknown_key_in_file_names_full_path(tmp_path: Path) -> None:
    bad = write(tmp_path / "bad.toml", "[trainer.optim]\nlearning_rate = 1\n")
    with pytest.raises(ConfigError, match="unknown key 'trainer.optim.learning_rate'"):
        parse_config(Root, ["@", str(bad)])


def test_dry_run_prints_resolved_toml_that_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(Root, ["--seq-len", "77", "--dry-run"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    out = write(tmp_path / "resolved.toml", printed)
    again = parse_config(Root, ["@", str(out)])
    assert again == build_config(Root, overrides=[("seq_len", 77)])
    assert to_toml(again) == printed


def test_split_args_separates_files_overrides_and_flags() -> None:
    files, overrides, flags = split_args(["@a.toml", "--x.y", "1", "--dry-run", "--z"])
    assert files == [Path("a.toml")]
    assert overrides == [("x.y", 1), ("z", True)]
    assert flags["dry_run"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model.name", "/no/such/model"], "model.name = '/no/such/model': no such directory"),
        (["--bogus", "1"], "unknown key 'bogus'"),
        (["@", "/no/such.toml"], "config file not found"),
    ],
)
def test_console_script_prints_one_line_and_exits_2(args: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from tandem.evaluate import main; main()", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_section_default_instances_keep_their_values(tmp_path: Path) -> None:
    class Custom(Section):
        model: ModelConfig = ModelConfig()
        optim: Optim = Optim(lr=5e-6)

    class Top(Section):
        model: ModelConfig = ModelConfig()
        custom: Custom = Custom()

    assert parse_config(Top, []).custom.optim.lr == 5e-6
    assert parse_config(Top, ["--model.name", "m"]).custom.optim.lr == 5e-6
    a = write(tmp_path / "a.toml", "[custom.optim]\nbetas = [0.5, 0.6]\n")
    cfg = parse_config(Top, ["@", str(a)])
    assert (cfg.custom.optim.lr, cfg.custom.optim.betas) == (5e-6, [0.5, 0.6])


def test_a_number_is_not_true_or_false(tmp_path: Path) -> None:
    """Pydantic would read true as 1: `--max_steps` with its value forgotten, or `lr = true`."""
    with pytest.raises(ConfigError, match="'max_steps': expects a number, not true/false"):
        parse_config(Root, ["--max_steps"])
    a = write(tmp_path / "a.toml", "[trainer.optim]\nlr = true\n")
    with pytest.raises(ConfigError, match="'trainer.optim.lr': expects a number"):
        parse_config(Root, ["@", str(a)])

    class Limits(Section):
        limit: int | None = None
        on: bool | int = 0

    with pytest.raises(ConfigError, match="'limit': expects a number"):
        parse_config(Limits, ["--limit"])
    assert parse_config(Limits, ["--on"]).on is True  # a field that takes booleans still does


def test_a_config_path_that_is_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a directory"):
        parse_config(Root, ["@", str(tmp_path)])


class Plain(Section):
    type: Literal["plain"] = "plain"
    scale: float = 1.0


class Clipped(Section):
    type: Literal["clipped"]
    clip: float


class WithUnions(Section):
    loss: Annotated[
        Annotated[Plain, Tag("plain")] | Annotated[Clipped, Tag("clipped")],
        Discriminator(lambda v: v.get("type", "plain") if isinstance(v, dict) else v.type),
    ] = Plain()
    modules: list[str] | str = "all"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--loss.bogus", "1"], "unknown key 'loss.bogus'"),
        (["--loss.type", "clipped"], "missing required key 'loss.clip'"),
        (["--loss.type", "clipped", "--loss.clip", "x"], "'loss.clip': Input should be a valid number"),
        # (a table: `--modules 3` is the text "3", which a text key takes)
        (["--modules", "{a = 1}"], "'modules': Input should be a valid list; 'modules': Input should"),
    ],
)
def test_errors_name_keys_not_union_members(argv: list[str], message: str) -> None:
    """Pydantic puts the union member it tried in the error's location (`loss.plain.bogus`)."""
    with pytest.raises(ConfigError) as info:
        parse_config(WithUnions, argv)
    assert str(info.value).startswith(f"invalid config: {message}"), str(info.value)


def test_a_shared_field_error_is_named_once() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(Root, ["--seq_len", "x", "--model.dtype", "fp8"])
    problems = str(info.value).removeprefix("invalid config: ").split("; ")
    assert [p.split("'")[1] for p in problems] == ["model.dtype", "seq_len"]
    with pytest.raises(ConfigError) as info:  # set in a section too: both are named
        parse_config(Root, ["--seq_len", "x", "--trainer.seq_len", "y"])
    assert [p.split("'")[1] for p in str(info.value).split(": ", 1)[1].split("; ")] == [
        "seq_len",
        "trainer.seq_len",
    ]


def test_a_key_written_in_both_spellings_in_one_file(tmp_path: Path) -> None:
    """TOML refuses a key written twice; `batch-size` and `batch_size` are one key here too."""
    a = write(tmp_path / "a.toml", "[orchestrator]\nbatch_size = 8\nbatch-size = 16\n")
    with pytest.raises(ConfigError, match=f"{a}: key 'orchestrator.batch_size' is written twice"):
        parse_config(Root, ["@", str(a)])


def test_a_temperature_the_servers_cannot_sample_is_refused() -> None:
    from tandem.launch.config import RLConfig

    with pytest.raises(
        ConfigError, match=r"'orchestrator.sampling.temperature': .*must be 0 \(greedy\) or at least"
    ):
        parse_config(
            RLConfig,
            [
                "@",
                str(Path(__file__).parents[2] / "examples/reverse_text/rl.toml"),
                "--orchestrator.sampling.temperature",
                "1e-9",
            ],
        )


def help_lines(cls: type[Section], capsys: pytest.CaptureFixture) -> list[str]:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(cls, ["--help"])
    assert exit_info.value.code == 0
    return [line.strip() for line in capsys.readouterr().out.splitlines()]


def test_help_lists_every_key(capsys: pytest.CaptureFixture) -> None:
    """Optional sections and a union's members are walked into (each member's keys name their
    `type`); defaults come from default factories and from a section's default instance."""

    class Top(Section):
        optim: Optim = Optim(lr=5e-6)
        extra: Optim | None = Field(None, description="Another optimizer.")
        unions: WithUnions = WithUnions(loss=Clipped(type="clipped", clip=0.5))

    lines = help_lines(Top, capsys)
    assert "--optim.lr (default 5e-06)" in lines
    assert "--optim.betas (default [0.9, 0.999])" in lines
    assert "[extra] (optional)  Another optimizer." in lines
    assert "--extra.lr (default 0.001)" in lines
    assert any(line.startswith("--unions.loss.type (default 'clipped')  ") for line in lines)
    assert "--unions.loss.scale (plain; default 1.0)" in lines
    assert "--unions.loss.clip (clipped; default 0.5)" in lines
    assert "--unions.modules (default 'all')" in lines
    assert "--loss.clip (clipped; required)" in help_lines(WithUnions, capsys)


def test_rl_help_lists_every_key(capsys: pytest.CaptureFixture) -> None:
    from tandem.launch.config import RLConfig

    text = "\n".join(help_lines(RLConfig, capsys))
    for line in [
        "--trainer.loss.type (default 'masked_is')",
        "--trainer.loss.delta (masked_is; default 1.0)",
        "--trainer.loss.eps_low (ppo_clip; default 0.2)",
        "--trainer.loss.import_path (custom; required)",
        "--trainer.lora.rank (default 16)",
        "--slurm.partition (default None)",
        "--kubernetes.namespace (default",
        "--monitor.wandb.project (default",
        "--inference.vllm.extra_args (default [])",
        "--weights.transport (default 'auto')",
    ]:
        assert line in text, line
    assert "PydanticUndefined" not in text
    assert "--trainer.loss (" not in text and "--slurm (" not in text
