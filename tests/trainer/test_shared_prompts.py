"""Shared prompts: a group's prompt packed once, its completions as branches, trains exactly as
the samples packed one by one (transport/rollouts.py, models/layers/attention.py)."""

import random

import pytest
import torch
from transformers import Qwen3Config

from tandem.models.layers.attention import PackedDocs
from tandem.models.registry import family
from tandem.orchestrator.config import OrchestratorConfig
from tandem.trainer.rl.train import attend_shared_prompts
from tandem.transport.rollouts import RolloutError, Sample, pack_samples, shares_prompts

VOCAB = 61


def group_samples(seed: int) -> list[Sample]:
    """Three prompts of 8 samples each (lengths drawn fresh), one of them with a 1-token
    completion, and a lone sample whose prompt nobody shares."""
    rng = random.Random(seed)
    samples = []
    for g, prompt_len in enumerate((5, 9, 2)):
        prompt = [rng.randrange(VOCAB) for _ in range(prompt_len)]
        for k in range(8):
            n = 1 if (g, k) == (0, 3) else rng.randint(2, 9)
            completion = [rng.randrange(VOCAB) for _ in range(n)]
            mask = [True] * n
            if n > 3:
                mask[2] = False  # an environment token inside the completion
            logprobs = [-rng.random() * 3 for _ in range(n)]
            samples.append(Sample(prompt, completion, mask, logprobs, 0.0, rng.uniform(-1, 1), 0, f"t{g}"))
    samples.append(Sample([1, 2, 3, 4], [5, 6, 7], [True] * 3, [-1.0] * 3, 0.0, 0.5, 0, "lone"))
    return samples


def tiny_model() -> torch.nn.Module:
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = family("qwen3").build(config, "sdpa").double()
    model.init_weights(std=0.2)
    return model


def loss_and_logprobs(
    model: torch.nn.Module, micro_batches: list
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The policy-gradient surrogate Σ logprob · advantage over loss tokens, and each sample's
    loss-token logprobs in order."""
    attend_shared_prompts(model, micro_batches, step=0)
    total = torch.zeros((), dtype=torch.float64)
    per_sample: dict[int, torch.Tensor] = {}
    for mb in micro_batches:
        logprobs, _ = model.sequence_logprobs(mb.input_ids, mb.position_ids)
        total = total + (logprobs * mb.advantages.double() * mb.loss_mask).sum()
        for meta in mb.samples:
            where = (mb.sample_index == meta.index) & mb.loss_mask
            per_sample[meta.index] = logprobs[where].detach()
    return total, per_sample


def test_shared_prompts_train_exactly_as_unshared() -> None:
    samples = group_samples(seed=random.randrange(1 << 30))
    model = tiny_model()
    results = []
    for share in (False, True):
        micro_batches = pack_samples(samples, 128, 1, 256, share_prompts=share)[0]
        assert any(shares_prompts(mb.position_ids) for mb in micro_batches) is share
        model.zero_grad()
        loss, per_sample = loss_and_logprobs(model, micro_batches)
        loss.backward()
        tokens = sum(mb.num_tokens for mb in micro_batches)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((loss.detach(), per_sample, grads, tokens, micro_batches))
    (loss_a, lp_a, grads_a, tokens_a, mbs_a), (loss_b, lp_b, grads_b, tokens_b, mbs_b) = results
    assert sorted(lp_a) == sorted(lp_b) == list(range(len(samples)))
    for i in lp_a:
        torch.testing.assert_close(lp_b[i], lp_a[i], rtol=0, atol=1e-12, msg=f"sample {i}")
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=1e-12)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-10, atol=1e-12, msg=name)
    # each group's prompt but one is computed once: (8 - 1) × (prompt length - 1) fewer tokens
    assert tokens_a - tokens_b == 7 * (4 + 8 + 1)
    assert sum(len(mb.samples) for mb in mbs_b) == len(samples)
    assert sum(int(mb.loss_mask.sum()) for mb in mbs_b) == sum(int(mb.loss_mask.sum()) for mb in mbs_a)


def test_a_group_longer_than_a_row_is_split() -> None:
    samples = [Sample(list(range(1, 11)), [7] * 20, [True] * 20, [-1.0] * 20, 0.0, 1.0, 0) for _ in range(8)]
    micro_batches = pack_samples(samples, 64, 1, 64, share_prompts=True)[0]
    # 9 shared + 2 × 21 = 51 tokens fit a row of 64; a third sample would not (72)
    assert [mb.num_tokens for mb in micro_batches] == [51] * 4
    assert all(mb.position_ids.shape[1] <= 64 for mb in micro_batches)


def test_flex_mask_is_the_sdpa_mask() -> None:
    """flex's mask_mod (evaluated on every query/key pair, no kernel) allows what sdpa's mask does."""
    mb = pack_samples(group_samples(seed=3), 64, 1, 256, share_prompts=True)[0][0]
    dense = PackedDocs.from_positions(mb.position_ids, "sdpa", shared_prompts=True).mask[:, 0]
    flex = PackedDocs.from_positions(mb.position_ids, "flex", shared_prompts=True).block_mask
    rows, width = mb.position_ids.shape
    b, q, kv = torch.meshgrid(torch.arange(rows), torch.arange(width), torch.arange(width), indexing="ij")
    assert torch.equal(flex.mask_mod(b, torch.zeros_like(b), q, kv), dense)
    # a later branch sees its prompt, not the branches before it
    assert not torch.equal(dense, PackedDocs.from_positions(mb.position_ids, "sdpa").mask[:, 0])


def test_models_that_cannot_attend_shared_prompts_refuse_them() -> None:
    micro_batches = pack_samples(group_samples(seed=1), 64, 1, 128, share_prompts=True)[0]
    with pytest.raises(RolloutError, match="orchestrator.share_prompts"):
        attend_shared_prompts(torch.nn.Linear(2, 2), micro_batches, step=4)  # e.g. transformers' model
    with pytest.raises(ValueError, match="'sdpa' or 'flex'"):
        PackedDocs.from_positions(micro_batches[0].position_ids, "sdpa_docs", shared_prompts=True)
    with pytest.raises(ValueError, match="share_prompts needs cp = 1"):
        OrchestratorConfig(num_ranks=2, cp=2, share_prompts=True)
