"""Bad values in real config files and on the command line: each is one line naming the key (and
the file it came from) before anything starts; nothing is read as something the user did not write."""

from pathlib import Path

import pytest

from tandem.config import ConfigError, build_config, parse_config
from tandem.launch.config import RLConfig
from tandem.trainer.sft.config import SFTConfig

EXAMPLES = Path(__file__).parents[2] / "examples"
MODEL = '[model]\nname = "m"\n'


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def error(argv: list[str], cls: type = RLConfig) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(cls, argv)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        (
            'max_steps = "10"',
            "'max_steps': Input should be a valid integer (got the string '10': write it without",
        ),
        (
            '[trainer.optim]\nlr = "3e-4"',
            "'trainer.optim.lr': Input should be a valid number (got the string '3e-4'",
        ),
        (
            "[orchestrator]\nbatch_size = 64.0",
            "'orchestrator.batch_size': Input should be a valid integer (got 64.0: write 64)",
        ),
        (
            "[orchestrator]\nbatch_size = 64.5",
            "'orchestrator.batch_size': Input should be a valid integer (got 64.5)",
        ),
        ("resume = 1", "'resume': Input should be a valid boolean (got 1)"),
        (
            '[orchestrator]\nshare_prompts = "false"',
            "'orchestrator.share_prompts': Input should be a valid boolean (got the string",
        ),
        (
            '[trainer.optim]\nlr = "nan"',
            "'trainer.optim.lr': Input should be a valid number (got the string 'nan'",
        ),
        ("run_dir = 5", "'run_dir': expects a path, written as a string (got 5)"),
    ],
)
def test_a_file_value_has_its_toml_type(tmp_path: Path, toml: str, message: str) -> None:
    """Pydantic's lax mode would read "10" as 10, 64.0 as 64 and 1 or "false" as booleans."""
    a = write(tmp_path / "a.toml", f"{toml}\n{MODEL}")
    assert error(["@", str(a)]).startswith(f"invalid config: {a}: {message}")


def test_a_shared_key_of_the_wrong_type_is_named_once(tmp_path: Path) -> None:
    a = write(tmp_path / "a.toml", f'seq_len = "256"\n{MODEL}')
    assert error(["@", str(a)]) == (
        f"invalid config: {a}: 'seq_len': Input should be a valid integer "
        "(got the string '256': write it without quotes)"
    )


@pytest.mark.parametrize(
    ("argv", "key", "value"),
    [
        (["--kubernetes.cpu", "32"], "kubernetes.cpu", "32"),  # was refused: "valid string (got 32)"
        (["--slurm.time", "04:00:00"], "slurm.time", "04:00:00"),  # was a datetime.time, refused
        (["--slurm.env.RANKS", "8"], "slurm.env", {"RANKS": "8"}),
        (["--inference.api_key", "12345"], "inference.api_key", "12345"),
        (["--trainer.optim.lr", ".5"], "trainer.optim.lr", 0.5),
        (["--trainer.optim.lr", "1"], "trainer.optim.lr", 1.0),
        (["--seq_len", "1e3"], "seq_len", 1000),
        (["--resume", "no"], "resume", False),
        (["--resume", "false"], "resume", False),
        (["--run_dir", "runs/x"], "run_dir", Path("runs/x")),
        (["--trainer.optim.betas", "[0.8, 0.9]"], "trainer.optim.betas", (0.8, 0.9)),
        (["--trainer.loss.type", "ppo_clip", "--trainer.loss.eps_low", "0.1"], "trainer.loss.eps_low", 0.1),
        (["--orchestrator.env.args.max_len", "9"], "orchestrator.env.args", {"max_len": 9}),
    ],
)
def test_command_line_text_is_read_as_its_key_type(argv: list[str], key: str, value: object) -> None:
    config = parse_config(RLConfig, ["--model.name", "m", *argv])
    for part in key.split("."):
        config = getattr(config, part)
    assert config == value and type(config) is type(value)


def test_a_command_line_value_over_a_file_is_not_blamed_on_the_file(tmp_path: Path) -> None:
    a = write(tmp_path / "a.toml", f"max_steps = 5\n{MODEL}[orchestrator]\nbatch_size = 60\n")
    assert error(["@", str(a), "--max_steps", "0"]) == (
        "invalid config: 'max_steps': Input should be greater than 0 (got 0)"
    )
    # a section's own check names the file that set its keys, unless the command line set one
    assert error(["@", str(a)]) == (
        f"invalid config: {a}: 'orchestrator': batch_size (60) must be a multiple of group_size (8)"
    )
    assert error(["@", str(a), "--orchestrator.group_size", "7"]) == (
        "invalid config: 'orchestrator': batch_size (60) must be a multiple of group_size (7)"
    )


def test_errors_name_the_file_that_gave_the_key(tmp_path: Path) -> None:
    a = write(tmp_path / "a.toml", f"{MODEL}[trainer.optim]\nlr = 0.1\n[orchestrator]\nbatch_size = 0\n")
    b = write(tmp_path / "b.toml", "[trainer.optim]\nlr = -1.0\n")
    assert error(["@", str(a), "@", str(b)]) == (
        f"invalid config: {a}: 'orchestrator.batch_size': Input should be greater than 0 (got 0); "
        f"{b}: 'trainer.optim.lr': Input should be greater than 0 (got -1.0)"
    )
    c = write(tmp_path / "c.toml", '[[orchestrator.envs]]\nname = "reverse_text"\nweight = -1.0\n')
    assert error(["--model.name", "m", "@", str(c)]).startswith(
        f"invalid config: {c}: 'orchestrator.envs.0.weight': Input should be greater than 0"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--orchestator.batch_size", "8"], "unknown key 'orchestator' (did you mean 'orchestrator'?)"),
        (
            ["--orchestrator.batchsize", "8"],
            "unknown key 'orchestrator.batchsize' (did you mean 'orchestrator.batch_size'?)",
        ),
        (["--trainer.optimizer.lr", "1"], "unknown key 'trainer.optimizer' (did you mean 'trainer.optim'?)"),
        (
            ["--trainer.loss.type", "ppo_clip", "--trainer.loss.eps_hi", "1"],
            "unknown key 'trainer.loss.eps_hi' (did you mean 'trainer.loss.eps_high'?)",
        ),
        (
            ["--orchestrator.envs", '[{name = "math", wieght = 2}]'],
            "unknown key 'orchestrator.envs.0.wieght' (did you mean 'orchestrator.envs.0.weight'?)",
        ),
        (
            ["--trainer.loss.type", "grpo"],
            "'trainer.loss.type': 'grpo' is not one of 'masked_is', 'ppo_clip', 'tis', 'gspo', 'custom'",
        ),
    ],
)
def test_unknown_keys_and_types_suggest_what_exists(argv: list[str], message: str) -> None:
    assert error(["--model.name", "m", *argv]) == f"invalid config: {message}"


def test_an_unknown_key_like_none_lists_its_sections_keys() -> None:
    from tandem.trainer.config import OptimConfig

    keys = ", ".join(sorted(OptimConfig.model_fields))
    assert error(["--model.name", "m", "--trainer.optim.nope", "1"]) == (
        f"invalid config: unknown key 'trainer.optim.nope' ([trainer.optim] has: {keys})"
    )
    top = error(["--model.name", "m", "--bogus", "1"])
    assert top.startswith("invalid config: unknown key 'bogus' (the top level has: cluster, deployment, ")


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (["--run_dir="], "run_dir"),  # was Path("") == Path("."): the run went into the current directory
        (["--run_dir", ""], "run_dir"),
        (["--inference.host", ""], "inference.host"),
        (["--weights.host", ""], "weights.host"),
        (["--orchestrator.env.name", ""], "orchestrator.env.name"),
        (["--orchestrator.envs", '[{name = "math", label = ""}]'], "orchestrator.envs.0.label"),
        (["--trainer.lora.target_modules", ""], "trainer.lora.target_modules"),
        (["--monitor.wandb.project", ""], "monitor.wandb.project"),
        (["--kubernetes.image", ""], "kubernetes.image"),
    ],
)
def test_an_empty_text_or_path_is_refused(argv: list[str], key: str) -> None:
    assert error(["--model.name", "m", *argv]) == (
        f"invalid config: '{key}': is empty: give a value or leave the key out (got '')"
    )


def test_an_empty_path_in_a_file_is_refused(tmp_path: Path) -> None:
    a = write(tmp_path / "a.toml", 'run_dir = ""\n')
    assert error(["@", str(a)], SFTConfig) == (
        f"invalid config: {a}: 'run_dir': is empty: give a value or leave the key out (got '')"
    )
    assert build_config(RLConfig).model.name == ""  # a key whose default is "" (unset) still takes it


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--trainer.optim.betas", "[1.0, 0.999]"],
            "'trainer.optim.betas.0': Input should be less than 1 (got 1.0)",
        ),
        (
            ["--trainer.optim.betas", "[0.9, -0.1]"],
            "'trainer.optim.betas.1': Input should be greater than or equal to 0",
        ),
        (["--trainer.lora.target_modules", "[]"], "'trainer.lora.target_modules': is empty: name a module"),
        (
            ["--orchestrator.servers", '["127.0.0.1:8000"]'],
            "'orchestrator.servers': Value error, '127.0.0.1:8000' is not a base URL",
        ),
        (
            ["--orchestrator.prefill_servers", '["localhost"]'],
            "'orchestrator.prefill_servers': Value error, 'localhost' is not",
        ),
    ],
)
def test_values_the_processes_would_refuse_after_start(argv: list[str], message: str) -> None:
    assert error(["--model.name", "m", *argv]).startswith(f"invalid config: {message}")


def test_evaluate_refuses_more_samples_than_its_server_gives() -> None:
    from tandem.evaluate import EvalConfig

    argv = ["--model.name", "m", "--n", "65", "--sampling.temperature", "1.0"]
    assert "n (65) exceeds inference.engine.max_n (64)" in error(argv, EvalConfig)
    assert parse_config(EvalConfig, [*argv, "--inference.engine.max_n", "65"]).n == 65
    assert parse_config(EvalConfig, [*argv, "--server", "http://127.0.0.1:9"]).n == 65  # its own server
    assert "'server': Value error, '127.0.0.1:9' is not a base URL" in error(
        ["--model.name", "m", "--server", "127.0.0.1:9"], EvalConfig
    )


def test_rl_refuses_a_group_larger_than_the_engine_gives_one_request() -> None:
    from tandem.launch.plan import plan_run

    argv = ["--model.name", "m", "--orchestrator.group_size", "128", "--orchestrator.batch_size", "256"]
    with pytest.raises(
        ConfigError, match=r"orchestrator.group_size \(128\) exceeds inference.engine.max_n \(64\)"
    ):
        plan_run(parse_config(RLConfig, argv), visible_gpus=[])
    plan = plan_run(parse_config(RLConfig, [*argv, "--inference.engine.max_n", "128"]), visible_gpus=[])
    assert plan.orchestrator.group_size == 128


def test_environment_args_have_their_toml_types(tmp_path: Path) -> None:
    from tandem.envs.registry import load_environment

    with pytest.raises(ConfigError, match="'env.args.max_len': Input should be a valid integer"):
        load_environment("reverse_text", {"max_len": "9"})


@pytest.mark.parametrize("path", sorted(EXAMPLES.rglob("*.toml")), ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_every_example_config_parses(path: Path) -> None:
    """sft*.toml are `sft` configs; the rest `rl` ones (slurm.toml is layered over rl.toml)."""
    if path.name.startswith("sft"):
        build_config(SFTConfig, [path])
    else:
        build_config(RLConfig, [path])


@pytest.mark.parametrize(
    "path",
    sorted(p for p in EXAMPLES.rglob("*.toml") if not p.name.startswith("sft") and p.name != "slurm.toml"),
    ids=lambda p: str(p.relative_to(EXAMPLES)),
)
def test_the_launchers_process_configs_parse_back(path: Path, tmp_path: Path) -> None:
    """Each process reads the section `rl` wrote for it (run_dir/configs/*.toml) as strictly as a
    user's file: every resolved value must come back with its type."""
    from tandem.config.loader import to_toml
    from tandem.inference.config import InferenceConfig
    from tandem.launch.plan import plan_run
    from tandem.orchestrator.config import OrchestratorConfig
    from tandem.trainer.rl.config import RLTrainerConfig

    named = [] if build_config(RLConfig, [path]).model.name else [("model.name", "m")]
    gpus = ["0", "1"] if "gpu" in path.parent.name else []
    plan = plan_run(build_config(RLConfig, [path], named), visible_gpus=gpus)
    sections = [(InferenceConfig, s) for s in plan.inference]
    sections += [
        (OrchestratorConfig, plan.orchestrator),
        (RLTrainerConfig, plan.trainer),
        (RLConfig, plan.config),
    ]
    for cls, section in sections:
        written = tmp_path / "section.toml"
        written.write_text(to_toml(section))
        assert build_config(cls, [written]) == section
