"""Hugging Face checkpoints out of a sharded trainer: weights/step_N, final/, exports.

    out_dir/  config.json, model.safetensors (or model-0000i-of-0000n + index), tokenizer files,
              generation_config.json

For tandem's models the full tensors are formed one parameter at a time (an all-gather of its
shards, a collective every rank joins), split into the checkpoint's tensors by the family's
state-dict adapter and streamed by rank 0 into safetensors shards, so no process ever holds
the whole model. Transformers' models (model.impl = "hf") are gathered and written by
save_pretrained. The directory is written under a temporary name and renamed into place.
"""

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from tandem.models.hf_checkpoint import ShardedSafetensorsWriter, split_full
from tandem.models.layers.transformer import CausalLM
from tandem.models.loading import save_model, save_tokenizer_files
from tandem.models.registry import family
from tandem.trainer.checkpoint import full_model_state, replace_dir, tmp_dir
from tandem.trainer.parallel import World, barrier


def iter_hf_tensors(
    model: nn.Module, of: Callable[[torch.Tensor], torch.Tensor | None] = lambda t: t
) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, full tensor) for every tensor of a tandem model, in layer order.

    `of` picks what to gather for each parameter or buffer (its gradient, say; None skips it).
    Collective: every rank must consume the whole iterator (each step all-gathers one
    parameter); every rank receives the full tensors.
    """
    from tandem.trainer.model import persistent_tensors

    layouts = family(model.hf_config.model_type).hf_layout(model.hf_config)
    for name, tensor in persistent_tensors(model).items():
        picked = of(tensor)
        if picked is not None:
            full = picked.full_tensor() if isinstance(picked, DTensor) else picked
            yield from split_full(layouts[name], full.detach())


def write_hf_model(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: Path,
    world: World,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write the model as a Hugging Face checkpoint to `out_dir`, replacing it (collective)."""
    tmp = tmp_dir(out_dir)
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(model, CausalLM):
        writer = ShardedSafetensorsWriter(tmp, max_shard_bytes) if world.is_main else None
        dtype = None
        for name, tensor in iter_hf_tensors(model):
            if writer is not None:
                writer.add(name, tensor)
                dtype = tensor.dtype
        if world.is_main:
            writer.close()
            config = model.hf_config
            config.dtype = dtype
            config.save_pretrained(tmp)
            save_tokenizer_files(tokenizer, tmp)
    else:
        state = full_model_state(model)
        if world.is_main:
            save_model(model, tokenizer, tmp, state_dict=state)
    if world.is_main:
        replace_dir(tmp, Path(out_dir))
    barrier()
