"""Per-token logprobs and entropy of a Hugging Face causal LM (model.impl = "hf"), through the
chunked output head of models/layers/chunked_head.py; tandem's own models have the same method.
"""

from types import MethodType

import torch
from torch import nn
from torch.distributed.fsdp import register_fsdp_forward_method

from tandem.models.layers.chunked_head import next_token_logprobs


def sequence_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of every token given the tokens before it, and the entropy there, for packed rows.

    Both outputs are [rows, width], aligned with `input_ids`: entry t belongs to the prediction
    of token t from positions < t. Column 0 has no prediction and is 0. Rows may hold several
    samples: `position_ids` restarting at 0 makes attention block-diagonal (no attention mask
    and no cache, so transformers derives the packed-sequence mask from the positions).

    Under FSDP2 register this as a forward method of the root module (see
    `torch.distributed.fsdp.register_fsdp_forward_method`), since it reads the output head's
    weight directly rather than calling the model's forward.
    """
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__}: output heads with a bias are not supported")
    out = model.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    keep = getattr(model, "keep_head_logits", False)  # model.head_logits = "keep"
    return next_token_logprobs(out.last_hidden_state, head.weight, input_ids, temperature, chunk_size, keep)


def attach_sequence_logprobs(model: nn.Module) -> None:
    """Give an FSDP2-sharded `model` a `sequence_logprobs` method that gathers its parameters the
    way its forward does (it reads the output head's weight directly)."""
    model.sequence_logprobs = MethodType(sequence_logprobs, model)
    register_fsdp_forward_method(model, "sequence_logprobs")
