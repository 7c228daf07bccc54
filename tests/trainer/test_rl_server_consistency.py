"""Trainer and the real inference server agree, before the first update and after a weight sync.

A miniature synchronous loop with real parts: the native inference server (fp32, CPU) samples
reverse-text rollouts; the trainer (in a thread) consumes rollouts/step_0 and publishes
weights/step_1; the server loads them through /update_weights; its step-1 samples must carry
version 1 and match the trainer's logprobs just as closely as the step-0 ones did.
"""

import threading
from pathlib import Path

import httpx
from rl_helpers import inference_server, sample_from_server, small_model, write_rollouts

from tandem.config import build_config
from tandem.monitor.metrics import read_metrics
from tandem.trainer.rl.config import RLTrainerConfig
from tandem.trainer.rl.train import train
from tandem.transport.weights import wait_for_version

TEMPERATURE = 0.8


def test_trainer_matches_server_logprobs_at_step0_and_after_sync(tmp_path: Path) -> None:
    model = small_model(tmp_path / "tiny")
    run_dir = tmp_path / "run"
    cfg = build_config(
        RLTrainerConfig,
        overrides=[
            ("model.name", str(model)),
            ("model.device", "cpu"),
            ("run_dir", str(run_dir)),
            ("max_steps", 2),
            ("optim.lr", 1e-3),
            ("rollout_timeout_s", 300),
        ],
    )
    errors: list[BaseException] = []

    def run_trainer() -> None:
        try:
            train(cfg)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    server_args = ["--model.name", str(model), "--model.dtype", "float32", "--run_dir", str(run_dir)]
    server_args += ["--served_model_name", "policy"]
    with inference_server(server_args, tmp_path / "server.log") as url:
        trainer = threading.Thread(target=run_trainer, daemon=True)
        trainer.start()
        step0 = sample_from_server(url, 3, 4, TEMPERATURE, 24, seed=0)
        assert {s.policy_version for s in step0} == {0}
        write_rollouts(run_dir, 0, step0, TEMPERATURE)

        wait_for_version(run_dir, 1, timeout_s=300)
        answer = httpx.post(url + "/update_weights", json={"step": 1}, timeout=120)
        assert answer.status_code == 200 and answer.json()["weight_version"] == 1, answer.text
        step1 = sample_from_server(url, 3, 4, TEMPERATURE, 24, seed=1)
        assert {s.policy_version for s in step1} == {1}
        write_rollouts(run_dir, 1, step1, TEMPERATURE)
        trainer.join(timeout=300)
    assert not trainer.is_alive(), "trainer did not finish"
    if errors:
        raise errors[0]

    records = read_metrics(run_dir / "metrics.jsonl", "trainer")
    assert [r["step"] for r in records] == [0, 1]
    for record in records:
        print({k: record[k] for k in ("step", "mismatch_kl", "max_abs_logprob_diff", "loss_tokens")})
        assert record["mismatch_kl"] <= 1e-6, record
        assert record["max_abs_logprob_diff"] <= 1e-3, record
        assert record["staleness"] == 0 and record["masked_fraction"] == 0
    assert records[1]["policy_version"] == 2
