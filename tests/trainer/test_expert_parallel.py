"""Expert parallelism on gloo ranks takes the same steps as one rank without it.

A tiny Qwen3-MoE (4 experts, top-2) trains 3 steps on a fixed packed batch: with ep = 2 on 2
ranks and ep = 2 on 4 ranks (experts also FSDP-sharded over the other mesh dimension, with the
gradient divide factor of the world), losses and the last step's gradients equal the 1-rank
run's. (ep = 4 on 4 ranks, one expert each, passes too; it is left out to keep CI short.) With
the fp32 master weights in the optimizer (optim.master_weights = "optimizer", fp32 compute on CPU)
ep = 2 on 2 ranks takes the same steps too, and so it does with selective activation
checkpointing (the experts' FSDP unit nested in each checkpointed block: models/parallelism.py).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from process_output import failure

from tandem.models.tiny import build_tiny_model

pytestmark = pytest.mark.slow  # (tests/conftest.py hands this file out first)

WORKER = Path(__file__).parent / "ep_worker.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("ep")
    model = build_tiny_model(
        out=root / "moe", num_layers=2, hidden_size=64, head_dim=16, intermediate_size=128,
        num_experts=4, moe_intermediate_size=32,
    )  # fmt: skip
    out = root / "ep1.pt"
    done = subprocess.run([sys.executable, WORKER, model, out, "1"], capture_output=True, text=True, env=ENV)
    assert done.returncode == 0, failure(done)
    return model, torch.load(out)


@pytest.mark.parametrize(
    ("ranks", "ep", "master_weights", "checkpointing"),
    [
        (2, 2, "model", "none"),
        (4, 2, "model", "none"),
        (2, 2, "optimizer", "none"),
        (2, 2, "model", "selective"),
    ],
)
def test_ep_matches_one_rank(
    reference: tuple[Path, dict], tmp_path: Path, ranks: int, ep: int, master_weights: str, checkpointing: str
) -> None:
    model, want = reference
    out = tmp_path / f"ep{ep}.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    done = subprocess.run(
        [*command, WORKER, model, out, str(ep), master_weights, checkpointing],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert done.returncode == 0, failure(done)
    got = torch.load(out)
    assert got["losses"] == pytest.approx(want["losses"], abs=1e-5)
    assert want["grads"].keys() == got["grads"].keys()
    assert any("experts.3.down_proj" in name for name in got["grads"])
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=0, atol=1e-5, msg=name)
    for name, weight in want["weights"].items():
        # 1% of one Adam update (lr 1e-3): near-zero gradients make the update itself noisy
        torch.testing.assert_close(got["weights"][name], weight, rtol=0, atol=1e-5, msg=name)
