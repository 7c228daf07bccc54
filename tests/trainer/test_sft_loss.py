"""The SFT loss goes through the chunked output head; it must equal plain cross-entropy over full
logits (float64 reference), value and gradients, on packed rows with several samples each."""

from pathlib import Path

import torch
import torch.nn.functional as F
from rl_helpers import small_model
from transformers import AutoModelForCausalLM

from tandem.trainer.logprobs import attach_sequence_logprobs
from tandem.trainer.packing import MicroBatch
from tandem.trainer.sft.train import token_loss_sum


def test_chunked_sft_loss_equals_full_logits_cross_entropy(tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(small_model(tmp_path / "m"), dtype=torch.float64)
    attach_sequence_logprobs(model)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 300, (2, 40), generator=gen)
    position_ids = torch.cat([torch.arange(25), torch.arange(15)]).repeat(2, 1)  # two samples a row
    loss_mask = torch.rand(2, 40, generator=gen) < 0.6
    batch = MicroBatch(input_ids, position_ids, loss_mask)

    chunked = token_loss_sum(model, batch)
    chunked.backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    mask = loss_mask[:, 1:]
    reference = F.cross_entropy(logits[:, :-1][mask], input_ids[:, 1:][mask], reduction="sum")
    reference.backward()

    assert torch.allclose(chunked, reference, rtol=1e-12, atol=1e-10), (chunked, reference)
    for name, p in model.named_parameters():
        assert torch.allclose(got[name], p.grad, rtol=1e-9, atol=1e-12), name
