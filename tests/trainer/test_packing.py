"""Packing: packed rows reproduce one-by-one logprobs; the loss mask is exactly the answer + eos."""

from pathlib import Path

import pytest
import torch

from tandem.config import ModelConfig
from tandem.envs.reverse_text import make_tasks
from tandem.models.loading import load_model, load_tokenizer
from tandem.models.tiny import build_tiny_model
from tandem.trainer.packing import Sample, make_micro_batches, pack_rows, shard_rows
from tandem.trainer.sft.data import chat_sample


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "m"
    return build_tiny_model(out=out, num_layers=2, hidden_size=64, head_dim=16, intermediate_size=128)


def token_logprobs(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Log-probability of each token given the previous ones: shape [rows, len - 1]."""
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits.double()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]


def test_packed_rows_match_sequences_run_one_by_one(tiny: Path) -> None:
    tokenizer = load_tokenizer(str(tiny))
    model = load_model(ModelConfig(name=str(tiny), dtype="float32", device="cpu"))
    samples = [chat_sample(tokenizer, t.messages, t.answer) for t in make_tasks("train", 7, seed=3)]
    seq_len = 160
    rows = pack_rows(samples, seq_len)
    assert len(rows) < len(samples), "several samples should share a row"
    (batch,) = make_micro_batches(rows, seq_len, tokenizer.pad_token_id, len(rows), 1)
    with torch.no_grad():
        packed = token_logprobs(model, batch.input_ids, batch.position_ids)
        r = 0
        for row_index, row in enumerate(rows):
            offset = 0
            for sample in row:
                ids = torch.tensor([sample.input_ids])
                alone = token_logprobs(model, ids, torch.arange(ids.shape[1])[None])[0]
                n = len(sample.input_ids)
                inside = packed[row_index, offset : offset + n - 1]
                torch.testing.assert_close(inside, alone, rtol=0, atol=1e-5)
                offset += n
                r += 1
    assert r == len(samples)
    # Without the position restarts the packed samples would see each other: the check has teeth.
    with torch.no_grad():
        plain = token_logprobs(model, batch.input_ids, torch.arange(seq_len).expand_as(batch.input_ids))
    assert (plain - packed).abs().max() > 1e-3


def test_loss_mask_is_the_answer_and_its_end_of_turn(tiny: Path) -> None:
    tokenizer = load_tokenizer(str(tiny))
    task = make_tasks("train", 1, seed=5)[0]
    sample = chat_sample(tokenizer, task.messages, task.answer)
    trained = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
    assert trained == tokenizer.encode(task.answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert tokenizer.decode(trained) == task.answer + "<|im_end|>"
    first = sample.loss_mask.index(True)
    prompt = tokenizer.apply_chat_template(task.messages, tokenize=True, add_generation_prompt=True)
    assert first == len(prompt["input_ids"])
    assert not any(sample.loss_mask[first + len(trained) :])


def test_rows_padding_and_rank_shares() -> None:
    samples = [Sample([5] * n, [False] + [True] * (n - 1)) for n in (6, 5, 4, 3, 7)]
    rows = pack_rows(samples, 10)
    assert [[len(s.input_ids) for s in row] for row in rows] == [[6, 4], [5, 3], [7]]
    mine, micro = shard_rows(rows, rank=1, world_size=2, micro_batch_size=1)
    assert len(mine) == 1 and micro == 2  # rank 0 has two rows, so rank 1 runs one empty pass
    batches = make_micro_batches(mine, 10, 0, 1, micro)
    assert batches[1].num_loss_tokens == 0 and batches[1].input_ids.eq(0).all()
    first = batches[0]
    assert first.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1]
    assert first.loss_mask[0].tolist() == [False, True, True, True, True, False, True, True, False, False]
    with pytest.raises(ValueError, match="does not fit"):
        pack_rows([Sample([1] * 11, [True] * 11)], 10)
