"""Long sequences on one GPU: ring context parallelism's query-columns attention on the CUDA
backends, and the memory settings (selective checkpointing, activation offload) give the
gradients of the plain model. Marked `gpu`; skipped without CUDA.

Multi-GPU context parallelism (NCCL) is tested with gloo on CPU (tests/trainer/
test_context_parallel.py); here the CUDA-only attention kernels and offload are checked alone.
"""

from pathlib import Path

import pytest
import torch

from tandem.config.base import ModelConfig
from tandem.models.layers.attention import PackedDocs
from tandem.models.tiny import build_tiny_model
from tandem.trainer.config import ParallelConfig
from tandem.trainer.model import build_trainer_model
from tandem.trainer.parallel import init_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


@pytest.mark.parametrize("backend", ["flex", "varlen", "sdpa_docs", "sdpa"])
def test_query_columns_attend_like_the_whole_row(backend: str) -> None:
    """Rank 1 of ring cp = 2 (chunks 1 and 2 of 4) against the whole rows' keys equals those
    columns of whole-row attention, for documents that cross the chunk boundaries."""
    lengths = [[100, 300, 112], [512]]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths]).to(CUDA)
    columns = torch.arange(128, 384, device=CUDA)
    torch.manual_seed(0)
    q = torch.randn(2, 512, 8, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 512, 2, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    grad = torch.randn(2, 256, 8, 64, device=CUDA, dtype=torch.bfloat16)
    whole = PackedDocs.from_positions(positions, "sdpa").attend(q, k, v, 0.125)[:, columns]
    whole.backward(grad)
    want = [whole.detach(), *(t.grad.clone() for t in (q, k, v))]
    q.grad = k.grad = v.grad = None
    part = PackedDocs.from_positions(positions, backend, columns).attend(q[:, columns], k, v, 0.125)
    part.backward(grad)
    for name, a, b in zip(["out", "q", "k", "v"], [part, q.grad, k.grad, v.grad], want, strict=True):
        assert rel(a, b) < 2e-2, (name, rel(a, b))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(out=tmp_path_factory.mktemp("tiny") / "m", num_layers=4)


@pytest.mark.parametrize(
    "options",
    [
        {"activation_checkpointing": "selective"},
        {"activation_checkpointing": "full"},
        {"activation_offload": True},
    ],
)
def test_memory_settings_keep_the_gradients_and_save_memory(tiny: Path, options: dict) -> None:
    world = init_distributed("cuda")
    positions = torch.cat([torch.arange(n) for n in (700, 1348)])[None].to(CUDA)
    ids = torch.randint(0, 500, positions.shape, device=CUDA, generator=torch.Generator(CUDA).manual_seed(0))
    results = {}
    for name, parallel in (("plain", ParallelConfig()), ("setting", ParallelConfig(**options))):
        model = build_trainer_model(ModelConfig(name=str(tiny)), world, parallel)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        logprobs, _ = model.sequence_logprobs(ids, positions)
        (-logprobs.sum()).backward()
        torch.cuda.synchronize()
        grads = [p.grad.full_tensor().float() for p in model.parameters()]
        results[name] = (float(logprobs.sum()), grads, torch.cuda.max_memory_allocated())
        del model, logprobs
    (loss, grads, peak), (loss_s, grads_s, peak_s) = results["plain"], results["setting"]
    assert loss_s == pytest.approx(loss, rel=1e-3)
    for a, b in zip(grads_s, grads, strict=True):
        assert rel(a, b) < 2e-2
    assert peak_s < peak, f"peak memory {peak_s / 2**20:.0f} MiB, without the setting {peak / 2**20:.0f} MiB"
