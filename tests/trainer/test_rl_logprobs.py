"""Chunked logprobs equal the naive full-logits computation, values and gradients."""

from pathlib import Path

import pytest
import torch

from tandem.config import ModelConfig
from tandem.models.layers.chunked_head import chunked_logprobs
from tandem.models.loading import load_model
from tandem.models.tiny import build_tiny_model
from tandem.trainer.config import ParallelConfig
from tandem.trainer.logprobs import sequence_logprobs
from tandem.trainer.model import build_trainer_model
from tandem.trainer.parallel import init_distributed, shutdown


def naive(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float):
    logp = ((hidden @ weight.T) / temperature).log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), entropy


@pytest.mark.parametrize(("chunk_size", "temperature"), [(1, 1.0), (7, 0.7), (64, 1.3), (1000, 1.0)])
def test_matches_naive_values_and_gradients(chunk_size: int, temperature: float) -> None:
    gen = torch.Generator().manual_seed(chunk_size)
    hidden = torch.randn(3, 17, 32, generator=gen, requires_grad=True)
    weight = (torch.randn(101, 32, generator=gen) * 0.3).requires_grad_()
    targets = torch.randint(0, 101, (3, 17), generator=gen)
    w_lp, w_ent = torch.randn(3, 17, generator=gen), torch.randn(3, 17, generator=gen)

    lp, ent = chunked_logprobs(hidden, weight, targets, temperature, chunk_size)
    (lp * w_lp + ent * w_ent).sum().backward()
    got = (lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None

    ref_lp, ref_ent = naive(hidden, weight, targets, temperature)
    (ref_lp * w_lp + ref_ent * w_ent).sum().backward()
    want = (ref_lp.detach(), ref_ent.detach(), hidden.grad, weight.grad)
    for name, a, b in zip(("logprobs", "entropy", "grad hidden", "grad weight"), got, want, strict=True):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("keep", [False, True], ids=["recompute", "keep"])
def test_gradcheck_float64(keep: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(9, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.randint(0, 9, (5,), generator=gen)
    assert torch.autograd.gradcheck(
        lambda h, w: chunked_logprobs(h, w, targets, 0.9, 2, keep_logits=keep), (hidden, weight)
    )


@pytest.mark.parametrize("chunk_size", [5, 64])
def test_kept_logits_give_the_recomputed_gradients(chunk_size: int) -> None:
    """Kept logits: the same logprobs and entropy bit for bit, the same gradients up to float
    rounding (one matmul over all tokens instead of one per chunk), and a second backward through
    the same graph recomputes what the first consumed."""
    gen = torch.Generator().manual_seed(chunk_size)
    hidden = torch.randn(2, 19, 32, generator=gen, requires_grad=True)
    weight = (torch.randn(101, 32, generator=gen) * 0.3).requires_grad_()
    targets = torch.randint(0, 101, (2, 19), generator=gen)
    w_lp, w_ent = torch.randn(2, 19, generator=gen), torch.randn(2, 19, generator=gen)
    results = []
    for keep in (False, True):
        lp, ent = chunked_logprobs(hidden, weight, targets, 0.8, chunk_size, keep_logits=keep)
        ctx = lp.grad_fn.next_functions[0][0]  # ChunkedLogprobs' ctx
        assert (ctx.kept is not None) == keep and (not keep or ctx.kept.shape == (38, 101))
        (lp * w_lp + ent * w_ent).sum().backward(retain_graph=True)
        assert ctx.kept is None  # consumed
        results.append((lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone()))
        if keep:
            hidden.grad = weight.grad = None
            (lp * w_lp + ent * w_ent).sum().backward()
            results.append((lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone()))
        hidden.grad = weight.grad = None
    recomputed = results[0]
    for other in results[1:]:
        assert torch.equal(other[0], recomputed[0]) and torch.equal(other[1], recomputed[1])
        for got, want in zip(other[2:], recomputed[2:], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_only_weight_needs_grad() -> None:
    hidden = torch.randn(4, 8)
    weight = torch.randn(11, 8, requires_grad=True)
    lp, _ = chunked_logprobs(hidden, weight, torch.tensor([1, 2, 3, 4]), 1.0, 3)
    lp.sum().backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="temperature must be > 0"):
        chunked_logprobs(torch.randn(2, 4), torch.randn(5, 4), torch.tensor([0, 1]), 0.0)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        chunked_logprobs(torch.randn(2, 4), torch.randn(5, 4), torch.tensor([0, 1]), 1.0, 0)


def test_packed_rows_match_separate_sequences(tmp_path: Path) -> None:
    """Two samples packed in one row give the same logprobs as each run alone through transformers."""
    path = build_tiny_model(
        out=tmp_path / "m", num_layers=2, hidden_size=64, head_dim=16, intermediate_size=128
    )
    model = load_model(ModelConfig(name=str(path), device="cpu", dtype="float32"))
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randint(3, 300, (9,), generator=gen), torch.randint(3, 300, (13,), generator=gen)
    row = torch.cat([a, b, torch.zeros(3, dtype=torch.long)])[None]
    positions = torch.cat([torch.arange(9), torch.arange(13), torch.arange(3)])[None]
    lp, ent = sequence_logprobs(model, row, positions, temperature=0.8, chunk_size=5)
    for seq, start in ((a, 0), (b, 9)):
        with torch.no_grad():
            logits = model(input_ids=seq[None]).logits[0].float() / 0.8
        ref = logits.log_softmax(-1)[:-1].gather(-1, seq[1:, None]).squeeze(-1)
        ref_ent = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)[:-1]
        torch.testing.assert_close(lp[0, start + 1 : start + len(seq)].detach(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            ent[0, start + 1 : start + len(seq)].detach(), ref_ent, atol=1e-5, rtol=1e-5
        )
    assert lp[0, 0] == 0


@pytest.mark.parametrize("impl", ["tandem", "hf"])
def test_head_logits_keep_reaches_the_trainer_model(tmp_path: Path, impl: str) -> None:
    """`model.head_logits = "keep"` switches the trainer model's head (tandem's and transformers')
    to the kept logits, with the recomputed path's gradients."""
    path = build_tiny_model(out=tmp_path / "tiny", num_layers=1)
    world = init_distributed("cpu")
    try:
        grads = {}
        for mode in ("recompute", "keep"):
            cfg = ModelConfig(name=str(path), device="cpu", impl=impl, head_logits=mode)
            model = build_trainer_model(cfg, world, ParallelConfig(compile="off"))
            assert model.keep_head_logits is (mode == "keep")
            ids = torch.randint(
                0, model.hf_config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)
            )
            logprobs, _ = model.sequence_logprobs(ids, torch.arange(12).repeat(2, 1))
            logprobs.sum().backward()
            grads[mode] = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        for name, grad in grads["recompute"].items():
            torch.testing.assert_close(grads["keep"][name], grad, rtol=0, atol=0, msg=name)
    finally:
        shutdown()
