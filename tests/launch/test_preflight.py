"""Every bad input is one short error before anything starts, under --dry-run too, and the
command line answers without importing torch."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.launch.cli import main
from tandem.models.tiny import build_tiny_model
from tandem.net import free_port


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model") / "tiny"
    return build_tiny_model(out=out, num_layers=1, hidden_size=32, head_dim=8, intermediate_size=64)


def rl_error(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("rl: error: ") and err.count("\n") <= 5, err
    return err


def bad_inputs(tmp_path: Path, model: Path) -> dict[str, tuple[list[str], str]]:
    not_utf8 = tmp_path / "latin1.toml"
    not_utf8.write_bytes('[model]\nname = "modèle"\n'.encode("latin-1"))
    a_file = tmp_path / "file"
    a_file.write_text("")
    two_envs = tmp_path / "two_envs.toml"
    two_envs.write_text(
        '[[orchestrator.envs]]\nname = "reverse_text"\n'
        '[[orchestrator.envs]]\nname = "reverse_text"\nlabel = "long"\nargs = { max_lenn = 3 }\n'
    )
    moe = tmp_path / "moe"  # what preflight reads of a mixture-of-experts checkpoint: its config.json
    shutil.copytree(model, moe)
    no_tokenizer_config = tmp_path / "no_tokenizer_config"  # (ran with a default tokenizer class)
    shutil.copytree(model, no_tokenizer_config)
    (no_tokenizer_config / "tokenizer_config.json").unlink()
    no_weights = tmp_path / "no_weights"
    shutil.copytree(model, no_weights)
    for weights in no_weights.glob("*.safetensors"):
        weights.unlink()
    config = json.loads((moe / "config.json").read_text())
    (moe / "config.json").write_text(json.dumps(config | {"model_type": "qwen3_moe", "num_experts": 4}))
    return {
        "config file not UTF-8": (["@", str(not_utf8)], f"{not_utf8} is not UTF-8 text"),
        "model without tokenizer_config.json": (
            ["--model.name", str(no_tokenizer_config)],
            f"model directory {no_tokenizer_config} lacks tokenizer_config.json",
        ),
        "model without weights": (
            ["--model.name", str(no_weights)],
            f"model directory {no_weights} lacks weights (*.safetensors)",
        ),
        "run_dir cannot be created": (
            ["--run_dir", str(a_file / "run")],
            f"run_dir {a_file / 'run'} cannot be created: {a_file} is a file",
        ),
        "seq_len too small": (
            ["--seq_len", "40", "--orchestrator.sampling.max_tokens", "30"],
            "seq_len 40 cannot fit one sample: prompt of task",
        ),
        "unknown environment": (
            ["--orchestrator.env.name", "wordel"],
            "orchestrator.env.name: unknown environment 'wordel' (did you mean 'wordle'? built in: ",
        ),
        "bad environment args": (
            ["--orchestrator.env.args.max_lenn", "3"],
            "'orchestrator.env.args.max_lenn': Extra inputs are not permitted",
        ),
        "bad args of the second of [[orchestrator.envs]]": (
            ["@", str(two_envs)],
            "'orchestrator.envs.1.args.max_lenn': Extra inputs are not permitted",
        ),
        "code problems file missing": (
            ["--orchestrator.env.name", "code", "--orchestrator.env.args.problems_file", str(a_file / "x")],
            f"orchestrator.env.args.problems_file: cannot read {a_file / 'x'}: Not a directory",
        ),
        "empty training split": (
            ["--orchestrator.env.name", "launch_helpers:NoTrainingTasksEnv"],
            "env no_tasks: its training split is empty",
        ),
        "training split that cannot be read": (
            ["--orchestrator.env.name", "launch_helpers:UnreadableTasksEnv"],
            "env unreadable: cannot load its training split: FileNotFoundError: [Errno 2] No such file "
            "or directory: 'data/train.jsonl'",
        ),
        "custom loss that does not import": (
            ["--trainer.loss.type", "custom", "--trainer.loss.import_path", "my_losses:ratio"],
            "trainer.loss.import_path 'my_losses:ratio' cannot be imported: no module named 'my_losses'",
        ),
        "custom loss option it does not take": (
            [
                "--trainer.loss.type",
                "custom",
                "--trainer.loss.import_path",
                "launch_helpers:scaled_reinforce",
                "--trainer.loss.options.scal",
                "2.0",
            ],
            "trainer.loss.options do not fit 'launch_helpers:scaled_reinforce': got an unexpected keyword "
            "argument 'scal' (it takes: scale)",
        ),
        "config path that is a directory": (["@", str(tmp_path)], f"config file {tmp_path} is a directory"),
        "number key given no value": (["--max_steps"], "'max_steps': expects a number, not true/false"),
        "key of the loss, under another loss type": (
            ["--trainer.loss.type", "ppo_clip", "--trainer.loss.bogus", "1"],
            "unknown key 'trainer.loss.bogus'",
        ),
        "inference.port = 0": (
            ["--inference.port", "0"],
            "inference.port = 0 (any free port) leaves the launcher no server URL to wait for",
        ),
        "weights.port = a server's port": (
            ["--inference.port", "8000", "--deployment.inference_servers", "2", "--weights.port", "8001"],
            "port 8001 is planned both for inference server 1 and for the weight group's store, which "
            "trainer rank 0 hosts on every address: set deployment.inference_ports / inference.port or "
            "weights.port",
        ),
        "inference.vllm.port = a server's port": (
            ["--inference.port", "8000", "--inference.backend", "vllm", "--inference.vllm.port", "8000"],
            "port 8000 is planned both for inference server 0 and for inference server 0's vLLM: set "
            "deployment.inference_ports / inference.port or inference.vllm.port",
        ),
        "one inference.vllm.port for several servers": (
            [
                "--deployment.inference_servers",
                "2",
                "--inference.backend",
                "vllm",
                "--inference.vllm.port",
                "8100",
            ],
            "inference.vllm.port = 8100 is the vLLM port of each of the 2 servers on vLLM: set it to 0 (a "
            "free port for each)",
        ),
        "non-finite number": (
            ["--trainer.optim.lr", "inf"],
            "'trainer.optim.lr': Input should be a finite number",
        ),
        "ep that does not divide the trainer's ranks": (
            ["--trainer.parallel.ep", "2"],
            "trainer.parallel.ep = 2 does not divide the trainer's 1 ranks (deployment.trainer_nproc)",
        ),
        "ep on a dense checkpoint": (
            ["--deployment.trainer_nproc", "2", "--trainer.parallel.ep", "2"],
            f"trainer.parallel.ep = 2, but {model / 'config.json'} (qwen3) has no experts to split",
        ),
        "ep that does not divide the experts": (
            ["--model.name", str(moe), "--deployment.trainer_nproc", "3", "--trainer.parallel.ep", "3"],
            f"trainer.parallel.ep = 3 does not divide the model's 4 experts ({moe / 'config.json'})",
        ),
    }


@pytest.mark.parametrize("dry_run", [True, False])
def test_each_bad_input_is_one_line_before_anything_starts(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture, dry_run: bool
) -> None:
    run_dir = tmp_path / "run"
    base = ["--model.name", str(model), "--run_dir", str(run_dir), *(["--dry-run"] if dry_run else [])]
    for why, (argv, message) in bad_inputs(tmp_path, model).items():
        err = rl_error([*base, *argv], capsys)
        assert message in err and err.count("\n") == 1, (why, err)
        assert not run_dir.exists(), why  # not even an empty run directory
    taken_ports = {  # each port the run will listen on: what binds it there, and the key that sets it
        "inference.port": (
            [],
            "127.0.0.1",
            "inference server 0",
            "deployment.inference_ports / inference.port",
        ),
        "weights.port": (
            ["--inference.port", str(free_port())],  # (the default transport, auto, is in-memory)
            "0.0.0.0",
            "the weight group's store, which trainer rank 0 hosts on every address",
            "weights.port",
        ),
        "inference.vllm.port": (
            ["--inference.backend", "vllm", "--inference.port", str(free_port())],
            "127.0.0.1",
            "inference server 0's vLLM",
            "inference.vllm.port",
        ),
    }
    for key, (argv, host, what, keys) in taken_ports.items():
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            err = rl_error([*base, *argv, f"--{key}", str(port)], capsys)
        assert err == (
            f"rl: error: port {port} on {host} is taken (Address already in use), for {what}; "
            f"stop what uses it or set {keys}\n"
        ), key
        assert not run_dir.exists()  # (a new run_dir: its ports are checked before it is made)


def test_a_port_no_process_will_bind_is_not_checked(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """weights.port with the filesystem transport (no weight group), inference.vllm.port on the
    native engine."""
    base = ["--model.name", str(model), "--run_dir", str(tmp_path / "run"), "--dry-run"]
    base += ["--inference.port", str(free_port())]
    unused = {
        "weights.port": ["--weights.transport", "filesystem"],
        "inference.vllm.port": ["--inference.backend", "native"],
    }
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for key, argv in unused.items():
            main([*base, *argv, f"--{key}", str(port)])
            assert capsys.readouterr().err == "", key


def test_the_command_line_answers_without_importing_torch(model: Path, tmp_path: Path) -> None:
    probe = (
        "import sys\nfrom tandem.launch.cli import main\ncode = 0\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
        "print('torch' in sys.modules, code, file=sys.stderr)\n"
    )
    cases = {
        "help": ["--help"],
        "dry run": ["--model.name", str(model), "--run_dir", str(tmp_path / "run"), "--dry-run"],
        "config error": ["--model.name", str(model), "--orchestrator.batch_size", "7"],
        "bad model path": ["--model.name", str(tmp_path / "nope")],
    }
    env = {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""}
    for why, argv in cases.items():
        done = subprocess.run(
            [sys.executable, "-c", probe, *argv], capture_output=True, text=True, env=env, timeout=120
        )
        assert done.stderr.splitlines()[-1] == f"False {0 if why in ('help', 'dry run') else 2}", (
            why,
            done.stderr,
        )


def rl_without(module: str, model: Path, tmp_path: Path, *argv: str) -> list[str]:
    """stderr's lines of the rl launcher run on a tiny model with `module` hidden (as if not
    installed) and `argv`; the last is "exit N", N its exit code."""
    probe = (
        f"import sys\nsys.modules[{module!r}] = None\nfrom tandem.launch.cli import main\ncode = 0\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
        "print('exit', code, file=sys.stderr)\n"
    )
    base = [
        "--model.name",
        str(model),
        "--run_dir",
        str(tmp_path / "run"),
        "--inference.port",
        str(free_port()),
    ]
    env = {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", probe, *base, *argv], capture_output=True, text=True, env=env, timeout=120
    )
    return done.stderr.splitlines()


def test_wandb_section_without_the_package_is_one_line(model: Path, tmp_path: Path) -> None:
    """The wandb module hidden (as without the extra): [monitor.wandb] fails at start, in one line;
    mode = disabled needs no package."""
    cases = {
        "dry run": (["--monitor.wandb.project", "p", "--dry-run"], 2),
        "disabled": (["--monitor.wandb.mode", "disabled", "--dry-run"], 0),
    }
    for why, (argv, code) in cases.items():
        lines = rl_without("wandb", model, tmp_path, *argv)
        assert lines[-1] == f"exit {code}", (why, lines)
        if code:
            assert lines[:-1] == [
                "rl: error: [monitor.wandb] is set but the wandb package is not installed: `uv sync "
                "--extra wandb` (or `pip install wandb`), or remove the section / set "
                "monitor.wandb.mode = disabled"
            ], (why, lines)


@pytest.mark.parametrize(
    ("attention", "module", "needs"),
    [
        ("cudnn", "cudnn", "NVIDIA's cuDNN frontend: pip install nvidia-cudnn-frontend"),
        ("flash", "flash_attn", "FlashAttention 4: pip install flash-attn-4"),
    ],
)
def test_attention_without_its_package_is_one_line(
    model: Path, tmp_path: Path, attention: str, module: str, needs: str
) -> None:
    """The backend's module hidden (as without its optional package): model.attention = "cudnn"
    or "flash" fails before any process starts, in one line."""
    lines = rl_without(module, model, tmp_path, "--model.attention", attention, "--dry-run")
    assert lines == [
        f"rl: error: model.attention = '{attention}' needs {needs} (or another model.attention)",
        "exit 2",
    ], lines


def test_a_run_dir_another_launcher_runs_is_refused_before_it_is_touched(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """(Two launchers on one run_dir overwrote each other's configs and both failed; a --resume
    deleted a live run's rollouts and weights.)"""
    from tandem.transport.layout import run_dir_lock

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with run_dir_lock(run_dir):
        err = rl_error(["--model.name", str(model), "--run_dir", str(run_dir), "--resume"], capsys)
    assert err == (
        f"rl: error: run_dir {run_dir} is in use by another rl launcher (pid {os.getpid()}); wait for it "
        "or choose another run_dir\n"
    )
    assert sorted(p.name for p in run_dir.iterdir()) == ["rl.lock"]  # no configs written


LEFT_BEHIND = """
import fcntl, os, socket, sys, time
lock = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(lock, fcntl.LOCK_EX)
os.pwrite(lock, sys.argv[2].encode() + b"\\n", 0)  # (its launcher's pid, as rl writes it)
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen()
print(server.getsockname()[1], flush=True)
time.sleep(float(sys.argv[3]))
"""
"""A server a killed launcher left: it holds run_dir/rl.lock and its port for a while, then exits."""


def test_a_resume_waits_for_a_killed_launchers_processes_before_it_checks_their_ports(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A --resume started right after the launcher was killed checked the servers' ports first,
    while the processes it left (which hold rl.lock until they exit) still held them, and failed
    with `port N is taken` instead of waiting for the lock."""
    from tandem.launch.plan import RunPlan

    class Started(Exception):
        pass

    def start(*args: object, **kwargs: object) -> None:
        raise Started

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    launcher = subprocess.Popen([sys.executable, "-c", "pass"])
    launcher.wait()  # (gone, as a killed launcher is)
    server = subprocess.Popen(
        [sys.executable, "-c", LEFT_BEHIND, str(run_dir / "rl.lock"), str(launcher.pid), "2"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        monkeypatch.setattr(RunPlan, "supervisor", start)  # (stop where the processes would start)
        argv = ["--model.name", str(model), "--run_dir", str(run_dir), "--resume"]
        with pytest.raises(Started):
            main([*argv, "--inference.port", str(port)])
        out = capsys.readouterr().out
        assert f"the rl launcher (pid {launcher.pid}) is gone; waiting up to 60 s" in out, out
    finally:
        server.kill()
        server.wait()


@pytest.mark.parametrize(("limit", "file"), [(0, "rl.lock"), (64, "configs/inference_0.toml")])
def test_a_full_disk_at_the_start_is_one_line_before_any_process_starts(
    model: Path, tmp_path: Path, limit: int, file: str
) -> None:
    """A run_dir that takes no more bytes (a full disk; here RLIMIT_FSIZE, which fails writes
    alike) was a traceback from the lock or the configs, and a half-written config was left."""
    import resource

    run_dir = tmp_path / "run"

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    argv = ["--model.name", str(model), "--run_dir", str(run_dir), "--inference.port", str(free_port())]
    result = subprocess.run(
        [sys.executable, "-m", "tandem.launch.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=small_files,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr == f"rl: error: run_dir {run_dir}: cannot write {run_dir / file}: File too large\n"
    assert result.stdout == ""  # (nothing started)
    assert not list(run_dir.rglob("*.tmp"))
