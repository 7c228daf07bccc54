"""`evaluate` end to end: it starts its own inference server (greedy reverse_text, the same answers as
transformers' greedy decoding), uses a running one with several environments and pass@k, and
refuses bad input with one line."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.envs.reverse_text import make_tasks

HELPERS = str(Path(__file__).parent)


def run_eval(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HELPERS, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "tandem.evaluate", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_eval_starts_a_server_and_decodes_greedily_like_transformers(
    tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "eval.json"
    args = ["--model.name", str(tiny_model), "--num-tasks", "6", "--seq-len", "128"]
    args += ["--sampling.max-tokens", "10", "--env.args.max_len", "8", "--out", str(out)]
    proc = run_eval(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    summary = result["envs"]["reverse_text"]
    rewards = [t["samples"][0]["reward"] for t in result["tasks"]]
    exact = [t["samples"][0]["metrics"]["exact_match"] for t in result["tasks"]]
    assert summary["num_tasks"] == 6 and summary["failed"] == 0 and summary["pass_at_k"] == {}
    assert summary["reward_mean"] == pytest.approx(sum(rewards) / 6)
    assert summary["metrics"]["exact_match"] == pytest.approx(sum(exact) / 6)
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(
        f"reverse_text: 6 held-out tasks, mean reward {summary['reward_mean']:.4f}, exact_match"
    )
    assert "similarity" in proc.stdout and "reward" in proc.stdout  # the table

    # the same held-out tasks, decoded greedily by transformers
    tasks = make_tasks("eval", 6, max_len=8)
    assert [t["task_id"] for t in result["tasks"]] == [t.task_id for t in tasks]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for task, record in zip(tasks, result["tasks"], strict=True):
        ids = tokenizer.apply_chat_template(task.messages, add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
        with torch.inference_mode():
            generated = model.generate(
                torch.tensor([ids]), max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        expected = tokenizer.decode(generated[0, len(ids) :], skip_special_tokens=True)
        assert record["samples"][0]["messages"][-1]["content"] == expected


def test_eval_on_a_running_server_mixes_environments_and_reports_pass_at_k(
    server: str, tiny_model: Path, tmp_path: Path
) -> None:
    config = tmp_path / "eval.toml"
    config.write_text(
        "n = 4\nseq_len = 128\n[sampling]\ntemperature = 1.0\nmax_tokens = 10\n\n"
        '[[envs]]\nname = "orchestrator_helpers:ParityEnv"\nargs = { num_tasks = 6 }\n\n'
        '[[envs]]\nname = "reverse_text"\nlabel = "reverse"\nargs = { max_len = 6 }\n'
    )
    out = tmp_path / "eval.json"
    args = ["@", str(config), "--model.name", str(tiny_model), "--num-tasks", "5", "--server", server]
    proc = run_eval(*args, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["envs"]) == {"parity", "reverse"} and result["server"] == server
    parity = [t for t in result["tasks"] if t["env"] == "parity"]
    assert len(parity) == 5 and all(len(t["samples"]) == 4 and t["error"] is None for t in parity)
    counts = [int(sum(s["metrics"]["even"] for s in t["samples"])) for t in parity]
    assert 0 < sum(counts) < 20, "the test needs some successes and some failures"
    pass_at_k = result["envs"]["parity"]["pass_at_k"]
    assert set(pass_at_k) == {"pass@1", "pass@2", "pass@4"}
    for k in (1, 2, 4):
        expected = sum(1 - math.comb(4 - c, k) / math.comb(4, k) for c in counts) / 5
        assert pass_at_k[f"pass@{k}"] == pytest.approx(expected)
    assert pass_at_k["pass@1"] == pytest.approx(sum(counts) / 20)
    assert pass_at_k["pass@1"] <= pass_at_k["pass@2"] <= pass_at_k["pass@4"]
    assert set(result["envs"]["reverse"]["pass_at_k"]) == {"pass@1", "pass@2", "pass@4"}  # exact_match
    assert "pass@4" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--env.name", "no_such_env"], "unknown environment 'no_such_env'"),
        (["--n", "4"], "n > 1 needs sampling.temperature > 0"),
        (["--out", "/"], "out: / is a directory; give a file path"),  # before the run, not after it
        (
            ["--env.name", "orchestrator_helpers:NoHeldOutTasksEnv"],
            "env no_held_out: its held-out split is empty",
        ),
        # (it served inference.model while prompts were tokenized for model.name)
        (["--inference.model.name", "Qwen/Qwen3-0.6B"], "differs from model.name"),
    ],
)
def test_eval_refuses_bad_input_with_one_line(tiny_model: Path, args: list[str], message: str) -> None:
    proc = run_eval("--model.name", str(tiny_model), *args, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr, proc.stderr


def test_sigterm_stops_the_server_it_started(tiny_model: Path) -> None:
    """SIGTERM (a timeout, a batch system) ends `evaluate` as Ctrl-C does: its server goes too
    (it was left running, holding its port and memory)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HELPERS, os.environ.get("PYTHONPATH", "")])}
    args = ["--model.name", str(tiny_model), "--num-tasks", "2000", "--seq-len", "128"]
    proc = subprocess.Popen([sys.executable, "-m", "tandem.evaluate", *args], env=env, stderr=subprocess.PIPE)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    deadline = time.monotonic() + 120
    while not (server := children.read_text().split()):
        assert proc.poll() is None and time.monotonic() < deadline, "evaluate started no server"
        time.sleep(0.2)
    time.sleep(3)  # (into the server's start or the rollouts)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 30
    while (
        Path(f"/proc/{server[0]}").exists()
        and "Z" not in Path(f"/proc/{server[0]}/stat").read_text().split()[2]
    ):
        assert time.monotonic() < deadline, "the server outlived evaluate"
        time.sleep(0.2)
