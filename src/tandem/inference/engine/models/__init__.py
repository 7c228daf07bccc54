"""Model implementations of the native engine, by Hugging Face architecture name."""

import torch
from transformers import PreTrainedModel

from tandem.inference.engine.models.qwen3 import Qwen3ForCausalLM

ARCHITECTURES: dict[str, type[torch.nn.Module]] = {"Qwen3ForCausalLM": Qwen3ForCausalLM}


def build_model(hf_model: PreTrainedModel, max_positions: int, use_kernels: bool = True) -> torch.nn.Module:
    """The engine's implementation of `hf_model`'s architecture, holding the same weights."""
    config = hf_model.config
    names = config.architectures or []
    cls = next((ARCHITECTURES[n] for n in names if n in ARCHITECTURES), None)
    if cls is None:
        supported = ", ".join(ARCHITECTURES)
        raise ValueError(
            f"the native engine supports {supported}; this model is {names or config.model_type}"
        )
    device = next(hf_model.parameters()).device
    with torch.device("meta"):
        model = cls(config, max_positions)
    model.load_state_dict(hf_model.state_dict(), strict=True, assign=True)  # shares HF's tensors
    model.prepare(device, use_kernels)
    return model.eval().requires_grad_(False)
