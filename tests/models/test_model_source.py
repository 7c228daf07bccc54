"""A model.name that is not a loadable model fails in one line within seconds: a local-looking path
that does not exist at once, a hub name that no hub answers for after one request (huggingface_hub
retried an uncached file for about a minute before it gave up)."""

import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tandem.cli import UserError
from tandem.models.source import check_model_source

LOAD_TOKENIZER = (
    "import sys\nfrom tandem.cli import UserError\nfrom tandem.models.loading import load_tokenizer\n"
    "try:\n    load_tokenizer(sys.argv[1])\nexcept UserError as e:\n    print(e)\n"
)
RL_DRY_RUN = "import sys\nfrom tandem.launch.cli import main\nmain(sys.argv[1:])\n"  # (exits 2 on a refusal)


def closed_port() -> int:
    """A port nothing listens on: a hub that cannot be reached."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hub_env(tmp_path: Path, endpoint: str) -> dict[str, str]:
    """This process's environment (its PYTHONPATH included) with an empty Hugging Face cache and
    `endpoint` as the hub."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    return env | {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": endpoint, "CUDA_VISIBLE_DEVICES": ""}


def run(
    code: str, args: list[str], env: dict[str, str], cwd: Path
) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120
    )
    return done, time.monotonic() - start


def test_which_names_are_local_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.models.source import is_local_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    for name in ("./ckpt/step_5", "/abs/model", "~/model", "runs/a/step_5", "models/qwen3-tiny", "models"):
        assert is_local_path(name), name
    for name in ("Qwen/Qwen3-0.6B", "gpt2", "checkpoints/step_5"):  # (no ./checkpoints here)
        assert not is_local_path(name), name
    for name in ("./ckpt/step_5", "runs/a/step_5"):
        with pytest.raises(UserError) as raised:
            check_model_source(name)
        assert str(raised.value) == f"model.name = '{name}': no such directory"
    with pytest.raises(UserError) as raised:  # an "org/name" read as a path because ./org exists: said
        check_model_source("models/qwen3-tiny")
    assert str(raised.value) == (
        "model.name = 'models/qwen3-tiny': no such directory (read as a local path: ./models is a directory here)"
    )
    with pytest.raises(UserError, match="'models': the directory has no config.json"):
        check_model_source("models")
    check_model_source("Qwen/Qwen3-0.6B")  # a hub name: checked where it is loaded (no network here)


def test_a_hub_name_no_hub_answers_for_fails_in_seconds(tmp_path: Path) -> None:
    """One-slash names that are not local directories go to the hub; with none reachable (a closed
    port) loading the tokenizer fails after one request, not a minute of retries."""
    env = hub_env(tmp_path, f"http://127.0.0.1:{closed_port()}")
    done, seconds = run(LOAD_TOKENIZER, ["models/qwen3-tiny"], env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(
        "model.name = 'models/qwen3-tiny' is neither a local directory nor a reachable hub model ("
    ), done.stdout
    assert done.stdout.count("\n") == 1 and seconds < 20, (done.stdout, seconds)


class NoSuchRepo(BaseHTTPRequestHandler):
    """The hub's answer for a repository it does not have."""

    def do_HEAD(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_rl_refuses_a_model_that_is_neither_local_nor_on_the_hub(tmp_path: Path) -> None:
    """Under --dry-run (before: it passed, and each process then retried the hub for a minute)."""
    (tmp_path / "models").mkdir()  # a typo of models/qwen3_tiny: local, as ./models exists
    env = hub_env(tmp_path, f"http://127.0.0.1:{closed_port()}")
    base = ["--run_dir", str(tmp_path / "run"), "--dry-run", "--model.name"]
    done, seconds = run(RL_DRY_RUN, [*base, "models/qwen3-tiny"], env, tmp_path)
    assert done.returncode == 2 and seconds < 30
    assert done.stderr == (
        "rl: error: model.name = 'models/qwen3-tiny': no such directory "
        "(read as a local path: ./models is a directory here)\n"
    )

    done, seconds = run(RL_DRY_RUN, [*base, "org/qwen3-tiny"], env, tmp_path)  # no hub answers
    assert done.returncode == 2 and seconds < 30, seconds
    assert (
        done.stderr.startswith(
            "rl: error: model.name = 'org/qwen3-tiny' is neither a local directory nor a reachable hub model"
        )
        and done.stderr.count("\n") == 1
    ), done.stderr

    hub = ThreadingHTTPServer(("127.0.0.1", 0), NoSuchRepo)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    try:
        env = hub_env(tmp_path, f"http://127.0.0.1:{hub.server_address[1]}")
        done, _ = run(RL_DRY_RUN, [*base, "org/qwen3-tiny"], env, tmp_path)
    finally:
        hub.shutdown()
    assert done.returncode == 2
    assert (
        done.stderr.startswith(
            "rl: error: model.name = 'org/qwen3-tiny' is neither a local directory nor a hub model on "
            f"http://127.0.0.1:{hub.server_address[1]}"
        )
        and done.stderr.count("\n") == 1
    ), done.stderr

    env = hub_env(tmp_path, "http://127.0.0.1:1") | {"HF_HUB_OFFLINE": "1"}
    done, _ = run(RL_DRY_RUN, [*base, "org/qwen3-tiny"], env, tmp_path)
    assert done.returncode == 2
    assert done.stderr == (
        "rl: error: model.name = 'org/qwen3-tiny' is neither a local directory nor a model in the "
        "Hugging Face cache (HF_HUB_OFFLINE is set)\n"
    )
