"""Objectives and normalisation taken per sample (gspo, `normalize = "sample"`) against the same
quantities computed sample by sample with plain autograd in float64, on a packed micro-batch.

Two rows of 12 tokens: row 0 packs samples 3 and 0, row 1 packs sample 5 and padding; a prompt
token of each sample is not a loss token, nor is one completion token of sample 5. The step has
7 samples in all (the others in other micro-batches), so the divisor is 7, not 3.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from tandem.config import ConfigError, build_config
from tandem.trainer.rl.config import RLTrainerConfig
from tandem.trainer.rl.loss import LossInputs, SampleTokens, build_objective, policy_loss
from tandem.trainer.rl.train import micro_batch_loss
from tandem.transport.rollouts import (
    MicroBatch,
    RolloutError,
    Sample,
    SampleMeta,
    pack_samples,
    rank_path,
    read_rank,
    write_step,
)

STEP_SAMPLES = 7
# per row: (sample, tokens, loss tokens as a mask over them)
ROWS = [
    [(3, 5, [0, 1, 1, 1, 1]), (0, 7, [0, 0, 1, 1, 1, 1, 1])],
    [(5, 9, [0, 1, 1, 0, 1, 1, 1, 1, 1])],
]
WIDTH = 12
ADVANTAGE = {3: 1.0, 0: -0.5, 5: 2.0}


def packed(drift: dict[int, float]) -> tuple[LossInputs, dict[int, list[tuple[int, int]]]]:
    """Random logprobs; each sample's tokens' log ratios are `drift[sample]` plus a little noise.
    Returns the inputs and, per sample, its loss tokens' (row, column)."""
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    sampler = -3 * torch.rand(2, WIDTH, generator=generator, dtype=torch.float64)
    log_ratio = torch.zeros(2, WIDTH, dtype=torch.float64)
    index = torch.full((2, WIDTH), -1)
    mask = torch.zeros(2, WIDTH, dtype=torch.bool)
    advantages = torch.zeros(2, WIDTH, dtype=torch.float64)
    loss_tokens = torch.zeros(STEP_SAMPLES, dtype=torch.float64)
    where: dict[int, list[tuple[int, int]]] = {}
    for r, row in enumerate(ROWS):
        start = 0
        for sample, n, loss in row:
            span = slice(start, start + n)
            index[r, span] = sample
            mask[r, span] = torch.tensor(loss, dtype=torch.bool)
            advantages[r, span] = ADVANTAGE[sample] * torch.tensor(loss, dtype=torch.float64)
            log_ratio[r, span] = drift[sample] + 0.02 * torch.randn(
                n, generator=generator, dtype=torch.float64
            )
            loss_tokens[sample] = sum(loss)
            where[sample] = [(r, start + k) for k in range(n) if loss[k]]
            start += n
    inputs = LossInputs(
        logprobs=(sampler + log_ratio).requires_grad_(),
        sampler_logprobs=sampler,
        advantages=advantages,
        loss_mask=mask,
        entropy=torch.zeros(2, WIDTH, dtype=torch.float64),
        samples=SampleTokens(index, loss_tokens),
    )
    return inputs, where


def tandem_loss(table: dict, inputs: LossInputs) -> tuple[torch.Tensor, torch.Tensor, dict]:
    cfg = build_config(RLTrainerConfig, overrides=[(f"loss.{k}", v) for k, v in table.items()]).loss
    loss, stats = policy_loss(
        build_objective(cfg), cfg, inputs, num_loss_tokens=50, num_loss_samples=STEP_SAMPLES
    )
    loss.backward()
    return loss.detach(), inputs.logprobs.grad, stats.means()


@pytest.mark.parametrize(("drift", "clipped_sample"), [(0.3, 3), (-0.3, 0)])
def test_gspo_is_the_sequence_level_objective(drift: float, clipped_sample: int) -> None:
    """GSPO's J = (1/S)·Σ_i −min(s_i·A_i, clip(s_i)·A_i), s_i = exp(mean_t log r_t), differentiated
    through s_i by autograd: tandem's token form gives its value and gradient. Drifting above
    1 + eps_high, sample 3 (A > 0) is clipped (no gradient) and sample 0 (A < 0) is not (the min
    keeps its unclipped term); below 1 − eps_low the other way round. Sample 5 stays inside."""
    inputs, where = packed({3: drift, 0: drift, 5: 0.001})
    loss, grad, metrics = tandem_loss({"type": "gspo", "eps_low": 0.05, "eps_high": 0.06}, inputs)

    logprobs = inputs.logprobs.detach().clone().requires_grad_()
    want = torch.zeros((), dtype=torch.float64)
    for sample, tokens in where.items():
        rows, cols = zip(*tokens, strict=True)
        s = torch.exp((logprobs[rows, cols] - inputs.sampler_logprobs[rows, cols]).mean())
        a = ADVANTAGE[sample]
        want = want - torch.minimum(s * a, s.clamp(0.95, 1.06) * a)
    (want / STEP_SAMPLES).backward()

    torch.testing.assert_close(loss, want.detach() / STEP_SAMPLES, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, logprobs.grad, rtol=1e-12, atol=1e-14)
    clipped = where[clipped_sample]
    assert all(grad[r, c] == 0 for r, c in clipped)
    assert all(grad[r, c] != 0 for s in where if s != clipped_sample for r, c in where[s])
    loss_tokens = sum(len(t) for t in where.values())
    assert metrics["masked_fraction"] == pytest.approx(len(clipped) / loss_tokens)
    assert not grad[~inputs.loss_mask].any()


def test_gspo_with_token_normalisation_weights_tokens() -> None:
    """`normalize = "token"` with gspo: each loss token's gradient is −s_i·A_i over the step's 50
    loss tokens, whatever its sample's length (every sample inside the region here)."""
    inputs, where = packed({3: 0.0, 0: 0.0, 5: 0.0})
    _, grad, _ = tandem_loss({"type": "gspo", "normalize": "token", "eps_low": 0.5, "eps_high": 0.5}, inputs)
    log_ratio = (inputs.logprobs - inputs.sampler_logprobs).detach()
    for sample, tokens in where.items():
        rows, cols = zip(*tokens, strict=True)
        s = float(torch.exp(log_ratio[rows, cols].mean()))
        want = torch.full((len(tokens),), -ADVANTAGE[sample] * s / 50, dtype=torch.float64)
        torch.testing.assert_close(grad[rows, cols], want, rtol=1e-12, atol=1e-14)


def test_sample_normalisation_of_masked_is() -> None:
    """`normalize = "sample"`: the mean over the step's samples of each sample's token mean."""
    inputs, where = packed({3: 0.1, 0: -0.2, 5: 0.05})
    loss, grad, _ = tandem_loss({"normalize": "sample"}, inputs)
    log_ratio = (inputs.logprobs - inputs.sampler_logprobs).detach()
    want = 0.0
    for sample, tokens in where.items():
        rows, cols = zip(*tokens, strict=True)
        ratios = torch.exp(log_ratio[rows, cols])
        want += float((-ratios * ADVANTAGE[sample]).mean())
        torch.testing.assert_close(
            grad[rows, cols], -ratios * ADVANTAGE[sample] / len(tokens) / STEP_SAMPLES, rtol=1e-12, atol=1e-14
        )
    assert float(loss) == pytest.approx(want / STEP_SAMPLES, rel=1e-12)


def test_sample_mean_needs_the_samples() -> None:
    inputs, _ = packed({3: 0.0, 0: 0.0, 5: 0.0})
    inputs.samples = None
    with pytest.raises(ValueError, match="LossInputs.samples is not set"):
        tandem_loss({"type": "gspo"}, inputs)


def test_rollouts_without_a_sample_count_are_refused_in_one_line() -> None:
    """Rollout files written before `num_loss_samples` was recorded read back with None; a loss
    normalised per sample refuses them before any forward pass (the model is not touched)."""
    meta = SampleMeta(
        index=0,
        task_id="t",
        env="env",
        reward=1.0,
        advantage=1.0,
        policy_version=0,
        policy_versions=[0],
        prompt_len=1,
        completion_len=2,
        num_loss_tokens=2,
        metrics={},
    )
    ones = torch.ones(1, 3)
    mb = MicroBatch(
        input_ids=ones.long(),
        position_ids=torch.arange(3)[None],
        loss_mask=ones.bool(),
        sampler_logprobs=ones,
        advantages=ones,
        sample_index=torch.zeros(1, 3).long(),
        samples=[meta],
        step=4,
        temperature=1.0,
        num_loss_tokens=2,
    )
    cfg = build_config(RLTrainerConfig, overrides=[("loss.type", "gspo")])
    with pytest.raises(RolloutError, match=r"rollouts/step_4 do not record their number of samples"):
        micro_batch_loss(None, build_objective(cfg.loss), mb, cfg, torch.device("cpu"))


def as_written_before_the_sample_count(path: Path) -> None:
    """Rewrite a rollout file as tandem wrote it before `num_loss_samples`: without that key."""
    data = path.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(json.loads(data[8 : 8 + header_len])["__metadata__"]["tandem"])
    for mb in header["micro_batches"]:
        del mb["num_loss_samples"]
    path.write_bytes(save_tensors(load_tensors(data), metadata={"tandem": json.dumps(header)}))


def test_rollouts_written_before_the_sample_count_train_per_token(tmp_path: Path) -> None:
    """Such files read back (num_loss_samples None) and a loss normalised per token, gspo's too,
    trains on them as on new ones; only a loss normalised per sample refuses them, in one line."""
    from test_shared_prompts import tiny_model

    model = tiny_model()
    samples = [Sample([3, 4, 5], [7, 8, 9], [True] * 3, [-4.0] * 3, 1.0, 0.5, 0),
               Sample([3, 4], [10, 11], [True, False], [-4.2] * 2, 0.0, -0.5, 0)]  # fmt: skip
    write_step(tmp_path / "new", 4, pack_samples(samples, 16, 1, 64, step=4))
    write_step(tmp_path / "old", 4, pack_samples(samples, 16, 1, 64, step=4))
    as_written_before_the_sample_count(rank_path(tmp_path / "old", 4, 0))
    (new,), (old,) = (read_rank(tmp_path / run, 4, 0, timeout_s=1) for run in ("new", "old"))
    assert (new.num_loss_samples, old.num_loss_samples) == (2, None)
    for table in ({}, {"type": "gspo", "normalize": "token"}):
        cfg = build_config(RLTrainerConfig, overrides=[(f"loss.{k}", v) for k, v in table.items()])
        objective, cpu = build_objective(cfg.loss), torch.device("cpu")
        loss_new, _ = micro_batch_loss(model, objective, new, cfg, cpu)
        loss_old, _ = micro_batch_loss(model, objective, old, cfg, cpu)
        assert loss_new != 0 and loss_old == loss_new
    cfg = build_config(RLTrainerConfig, overrides=[("loss.type", "gspo")])
    with pytest.raises(RolloutError, match=r"^rollouts/step_4 do not record their number of samples [^\n]*$"):
        micro_batch_loss(model, build_objective(cfg.loss), old, cfg, torch.device("cpu"))


def test_gspo_config() -> None:
    loss = build_config(RLTrainerConfig, overrides=[("loss.type", "gspo")]).loss
    assert (loss.eps_low, loss.eps_high, loss.normalize) == (3e-4, 4e-4, "sample")
    assert build_config(RLTrainerConfig, overrides=[]).loss.normalize == "token"
    with pytest.raises(ConfigError, match="loss.normalize"):
        build_config(RLTrainerConfig, overrides=[("loss.normalize", "sequence")])
    with pytest.raises(ConfigError, match="loss.eps_low"):
        build_config(RLTrainerConfig, overrides=[("loss.type", "gspo"), ("loss.eps_low", 0)])
