"""The in-memory weight transports update real inference servers so that they sample exactly what
the trainer computes: the RL trainer (in a thread, 3 steps) streams each version to two native
servers (processes, fp32 on CPU), one by broadcast (gloo) and one colocated (shared memory,
received by the server's engine process: engine.core_process); this test plays the orchestrator
(sample, write rollouts, tell both servers to take each version).
After every update the servers' logprobs must equal the trainer's (mismatch KL ≤ 1e-6), a request
in flight across an update finishes and names both versions, and the Hugging Face export is
written after the last step only. (The filesystem transport: test_rl_server_consistency.py.)"""

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from rl_helpers import sample_from_server, small_model, write_rollouts
from server_process import start_servers

from tandem.config import build_config
from tandem.monitor.metrics import read_metrics
from tandem.net import free_port
from tandem.trainer.rl.config import RLTrainerConfig
from tandem.trainer.rl.train import train
from tandem.transport.weights import offered_version, stable_versions

pytestmark = pytest.mark.slow  # (tests/conftest.py hands this file out first)

TEMPERATURE = 0.8
STEPS = 3
LONG = {
    "prompt": [5, 9, 14],
    "max_tokens": 200,
    "ignore_eos": True,
    "temperature": 0,
    "return_token_ids": True,
}


def wait_for_offer(run_dir: Path, version: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while (offered_version(run_dir) or 0) < version:
        assert time.monotonic() < deadline, f"the trainer did not offer version {version}"
        time.sleep(0.02)


def wait_until_generating(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while "tandem_requests_running 1" not in httpx.get(url + "/metrics").text:
        assert time.monotonic() < deadline, "the long request did not start"
        time.sleep(0.01)


def test_broadcast_and_colocated_keep_servers_equal_to_trainer(tmp_path: Path) -> None:
    model = small_model(tmp_path / "tiny")
    run_dir = tmp_path / "run"
    link = {"weights.port": free_port(), "weights.transfer_timeout_s": 60, "weights.transport": "auto"}
    cfg = build_config(
        RLTrainerConfig,
        overrides=[
            ("model.name", str(model)),
            ("model.device", "cpu"),
            ("run_dir", str(run_dir)),
            ("max_steps", STEPS),
            ("optim.lr", 1e-3),
            ("rollout_timeout_s", 120),
            ("weights.num_servers", 2),
            *link.items(),
        ],
    )
    errors: list[BaseException] = []

    def run_trainer() -> None:
        try:
            train(cfg)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    common = ["--model.name", str(model), "--model.dtype", "float32", "--run_dir", str(run_dir)]
    common += ["--served_model_name", "policy", "--engine.max_model_len", "512"]
    for key, value in link.items():
        common += [f"--{key}", str(value)]
    servers = [
        (
            [*common, "--weights.server_index", str(i), "--weights.transport", transport, *more],
            tmp_path / f"server_{i}.log",
        )
        for i, (transport, more) in enumerate(
            [("broadcast", []), ("colocated", ["--engine.core_process", "true"])]
        )
    ]
    # (started together: each joins the trainer's weight group in the background, once it is up)
    with start_servers(servers, timeout_s=180) as running, ThreadPoolExecutor(3) as pool:
        urls = [server.url for server in running]
        trainer = threading.Thread(target=run_trainer, daemon=True)
        trainer.start()
        for step in range(STEPS):
            samples = [
                s
                for i, url in enumerate(urls)
                for s in sample_from_server(url, 1, 4, TEMPERATURE, 16, seed=2 * step + i)
            ]
            assert {s.policy_version for s in samples} == {step}
            write_rollouts(run_dir, step, samples, TEMPERATURE)
            wait_for_offer(run_dir, step + 1)
            in_flight = None
            if step == 1:  # a request frozen mid-generation while the weights change under it
                in_flight = pool.submit(httpx.post, urls[1] + "/v1/completions", json=LONG, timeout=120)
                wait_until_generating(urls[1])
                assert httpx.post(urls[1] + "/pause").status_code == 200
            updates = [
                pool.submit(httpx.post, u + "/update_weights", json={"step": step + 1}, timeout=120)
                for u in urls
            ]
            for answer in (u.result() for u in updates):
                assert answer.status_code == 200 and answer.json()["weight_version"] == step + 1, answer.text
            if in_flight is not None:
                assert httpx.post(urls[1] + "/resume").status_code == 200
                choice = in_flight.result().json()["choices"][0]
                assert len(choice["token_ids"]) == LONG["max_tokens"]
                assert choice["weight_versions"] == [1, 2]
        trainer.join(timeout=120)
        health = [httpx.get(u + "/health").json() for u in urls]
    assert not trainer.is_alive(), "trainer did not finish"
    if errors:
        raise errors[0]

    assert [h["weight_version"] for h in health] == [STEPS, STEPS]
    assert [h["weights"] for h in health] == ["broadcast group rank 1", "colocated with trainer rank 0"]
    records = read_metrics(run_dir / "metrics.jsonl", "trainer")
    assert [r["step"] for r in records] == list(range(STEPS))
    for record in records:
        print({k: record[k] for k in ("step", "mismatch_kl", "max_abs_logprob_diff", "publish_s")})
        assert record["mismatch_kl"] <= 1e-6, record
        assert record["max_abs_logprob_diff"] <= 1e-3, record
    assert stable_versions(run_dir) == [STEPS]  # export_interval 0: the export after the last step only
