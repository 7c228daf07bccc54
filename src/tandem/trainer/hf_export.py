"""Hugging Face checkpoints out of a sharded trainer: weights/step_N, final/, exports.

    out_dir/  config.json, model.safetensors (or model-0000i-of-0000n + index), tokenizer files,
              generation_config.json (the source checkpoint's, copied: models/loading.py)

For tandem's models the full tensors are formed one parameter at a time (an all-gather of its
shards, a collective every rank joins), split into the checkpoint's tensors by the family's
state-dict adapter and streamed by rank 0 into safetensors shards, so no process ever holds
the whole model. Transformers' models (model.impl = "hf") are gathered and written by
save_pretrained. The directory is written under a temporary name and renamed into place.

A model with LoRA adapters (models/lora.py) is written as a PEFT adapter instead:

    out_dir/  adapter_config.json, adapter_model.safetensors    (PEFT's names, the base model's modules)

or, with `merged`, as the full model with the adapters merged into its weights.

With master weights in the optimizer (`[optim] master_weights = "optimizer"`, trainer/
master_weights.py) the weights written are the optimizer's fp32 masters, not the model's bf16
parameters: the same fp32 checkpoint as with master_weights = "model".
"""

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from tandem.models.hf_checkpoint import ShardedSafetensorsWriter
from tandem.models.layers.transformer import CausalLM
from tandem.models.loading import save_model, save_tokenizer_files
from tandem.models.lora import has_lora
from tandem.trainer.checkpoint import full_model_state, replace_dir, tmp_dir
from tandem.trainer.master_weights import MasterAdamW
from tandem.trainer.parallel import World, barrier
from tandem.trainer.weight_stream import iter_adapter_weights, iter_hf_weights

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def write_hf_model(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: Path,
    world: World,
    max_shard_bytes: int = 5 * 2**30,
    merged: bool = False,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Write the model as a Hugging Face checkpoint to `out_dir`, replacing it (collective); a
    model with LoRA adapters as a PEFT adapter, or merged into a full checkpoint with `merged`.
    A MasterAdamW `optimizer`'s fp32 masters are written in place of the parameters."""
    tmp = tmp_dir(out_dir)
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    lora = has_lora(model)
    if lora and not merged:
        tensors = dict(iter_adapter_weights(model))
        if world.is_main:
            tmp.mkdir(parents=True)
            save_file(
                {n: t.contiguous().cpu() for n, t in tensors.items()}, tmp / ADAPTER_WEIGHTS, {"format": "pt"}
            )
            (tmp / ADAPTER_CONFIG).write_text(json.dumps(model.adapter_config, indent=2))
    elif isinstance(model, CausalLM) or lora:
        writer = ShardedSafetensorsWriter(tmp, max_shard_bytes) if world.is_main else None
        sizes: dict[torch.dtype, int] = {}  # bytes written per dtype
        for name, tensor in iter_hf_weights(model, of=_masters(optimizer)):
            if writer is not None:
                writer.add(name, tensor)
                sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + tensor.numel() * tensor.element_size()
        if world.is_main:
            writer.close()
            config = model.hf_config
            config.dtype = max(sizes, key=sizes.get)  # the bulk's (routers may be kept in fp32)
            config.save_pretrained(tmp)
            save_tokenizer_files(tokenizer, tmp, config.name_or_path)
    else:
        state = full_model_state(model)
        if world.is_main:
            save_model(model, tokenizer, tmp, state_dict=state)
    if world.is_main:
        replace_dir(tmp, Path(out_dir))
    barrier()


def _masters(optimizer: torch.optim.Optimizer | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What to write for each of the model's tensors: a MasterAdamW's fp32 master of a parameter
    (buffers as they are); None (the tensors themselves) for any other optimizer."""
    if not isinstance(optimizer, MasterAdamW):
        return None
    return lambda tensor: optimizer.master(tensor) if tensor in optimizer.state else tensor
