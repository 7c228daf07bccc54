"""Model families of the native engine, by Hugging Face architecture name: one file each.

The contract between a family and the engine (the base class `layers.CausalLM` implements all
of it; a family subclasses it and says what its layers' MLPs are):

- `Family(config, max_positions)` builds the model on the meta device, its parameters named as
  the family's checkpoints name their tensors; `from_transformers(state_dict, config)` renames a
  loaded transformers model's tensors to those names when transformers holds them otherwise.
- `prepare(device, use_kernels)` runs once the weights are loaded (assigned, not copied): it
  builds the rotary table, fuses projections and picks the CUDA kernels or the torch path.
- `forward(input_ids [T], positions [T], kv_caches, meta)` → hidden states [T, hidden] after the
  final norm, for the flattened tokens of a step (attention.py's metadata says which is which);
  `logits(hidden)` → [rows, vocab].
- `cache_shapes(config)` is, per token and layer, the shape of each part of the paged cache (keys
  and values, [num_key_value_heads, head_dim] each, unless the family stores something else);
  `config` carries `num_hidden_layers` and `vocab_size`. A family with `prompts_from_cache`
  set has its whole prompts attended over the cache, like prompt chunks (attention.py).
- `checkpoint_tensors()` is what a weight update may address (weights.py); `projections()` are
  the matmuls FP8 may take over (fp8.py); `graph_safe(dtype)` says whether a decode step can be
  captured in a CUDA graph.
"""

import torch
from transformers import PreTrainedModel

from tandem.cli import UserError
from tandem.inference.engine.fp8 import quantize_model
from tandem.inference.engine.models.glm4_moe import Glm4MoeForCausalLM
from tandem.inference.engine.models.glm_moe_dsa import GlmMoeDsaForCausalLM
from tandem.inference.engine.models.layers import CausalLM
from tandem.inference.engine.models.minimax_m2 import MiniMaxM2ForCausalLM
from tandem.inference.engine.models.qwen3 import Qwen3ForCausalLM
from tandem.inference.engine.models.qwen3_moe import Qwen3MoeForCausalLM
from tandem.models.registry import UnsupportedConfig

ARCHITECTURES: dict[str, type[CausalLM]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "MiniMaxM2ForCausalLM": MiniMaxM2ForCausalLM,
    "GlmMoeDsaForCausalLM": GlmMoeDsaForCausalLM,
}


def model_class(config: object) -> type[CausalLM]:
    names = getattr(config, "architectures", None) or []
    cls = next((ARCHITECTURES[n] for n in names if n in ARCHITECTURES), None)
    if cls is None:
        supported = ", ".join(ARCHITECTURES)
        raise ValueError(
            f"the native engine supports {supported}; this model is {names or config.model_type}"
        )
    return cls


def build_model(
    hf_model: PreTrainedModel,
    max_positions: int,
    use_kernels: bool = True,
    quantization: str = "none",
    fp8_kernel: str = "rowwise",
    dtype: torch.dtype = torch.float32,
) -> CausalLM:
    """The engine's implementation of `hf_model`'s architecture, holding the same weights (FP8
    ones with `quantization = "fp8"`: quantized now, or as the checkpoint holds them; `dtype` is
    what the rest of the model computes in)."""
    config = hf_model.config
    cls = model_class(config)
    device = next(hf_model.parameters()).device
    try:
        with torch.device("meta"):
            model = cls(config, max_positions)
    except UnsupportedConfig as e:
        raise UserError(f"the native engine cannot serve this model: {e}; use backend = 'vllm'") from None
    state = cls.from_transformers(dict(hf_model.state_dict()), config)
    scales = {name: state.pop(name) for name in [n for n in state if n.endswith(".weight_scale_inv")]}
    if scales and quantization != "fp8":
        raise UserError(
            f"the model holds FP8 weights ({next(iter(scales))}): set engine.quantization = 'fp8'"
        )
    model.load_state_dict(state, strict=True, assign=True)  # shares transformers' tensors
    model.prepare(device, use_kernels)
    if quantization == "fp8":
        quantize_model(model, fp8_kernel, scales, dtype)
    return model.eval().requires_grad_(False)
