"""Random-init models of real shapes for the GPU benchmarks (built on the device in bf16 and
saved once: a stand-in for the real checkpoints, which cannot be downloaded there; with the tiny
tokenizer and the shape's full vocabulary of embedding rows), and the decode measurement the
shape benchmarks share. The Qwen3 shapes are tiny.py's; the GLM and MiniMax ones
(`FAMILY_SHAPES`) are their published configs' dimensions, with the layer count cut to fit.

    from bench_models import SHAPES, build_random      # (benchmarks/ is the script's directory)
    path = build_random("qwen3-8b", work_dir / "q8b", torch.device("cuda"))
"""

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from tandem.models.loading import save_model
from tandem.models.tiny import QWEN3_0_6B_SHAPE, TinyModelConfig, tiny_qwen3_config
from tandem.models.tokenizer import train_tokenizer

if TYPE_CHECKING:
    from tandem.inference.engine.core import EngineCore

SHAPES: dict[str, dict] = {
    "qwen3-0.6b": QWEN3_0_6B_SHAPE,
    "qwen3-8b": {
        "hidden_size": 4096, "num_layers": 36, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128,
        "intermediate_size": 12288, "vocab_size": 151936, "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": {
        "hidden_size": 2048, "num_layers": 48, "num_heads": 32, "num_kv_heads": 4, "head_dim": 128,
        "intermediate_size": 6144, "num_experts": 128, "experts_per_token": 8, "moe_intermediate_size": 768,
        "vocab_size": 151936, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    },
}  # fmt: skip


FAMILY_SHAPES: dict[str, dict] = {  # transformers config fields of the published checkpoints
    # zai-org/GLM-4.5-Air: 46 layers (the first dense), 128 experts top-8 + 1 shared, GQA 96/8 heads
    "glm-4.5-air": {
        "model_type": "glm4_moe", "hidden_size": 4096, "num_hidden_layers": 46, "num_attention_heads": 96,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True,
        "use_qk_norm": False, "attention_bias": True, "vocab_size": 151552, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
    },
    # MiniMaxAI/MiniMax-M2: 62 layers, 256 experts top-8, no shared, GQA 48/8 heads, 64 of 128 rotate
    "minimax-m2": {
        "model_type": "minimax_m2", "hidden_size": 3072, "num_hidden_layers": 62, "num_attention_heads": 48,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 1536, "num_local_experts": 256,
        "num_experts_per_tok": 8, "vocab_size": 200064, "max_position_embeddings": 196608,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
    },
    # zai-org/GLM-5: 78 layers (3 dense), MLA (q rank 2048, kv rank 512, rope 64, nope 192, v 256)
    # over 64 heads, an indexer of 32 heads of 128 keeping 2,048 keys, 256 experts top-8 + 1 shared
    "glm-5": {
        "model_type": "glm_moe_dsa", "hidden_size": 6144, "num_hidden_layers": 78, "num_attention_heads": 64,
        "num_key_value_heads": 64, "intermediate_size": 12288, "moe_intermediate_size": 2048,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "q_lora_rank": 2048, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 192, "v_head_dim": 256, "index_topk": 2048,
        "index_head_dim": 128, "index_n_heads": 32, "vocab_size": 154880, "max_position_embeddings": 202752,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    },
}  # fmt: skip


def family_config(
    shape: str, num_layers: int, dense_layers: int | None = None, **extra: object
) -> PretrainedConfig:
    """The transformers config of a FAMILY_SHAPES shape with `num_layers` layers, the first
    `dense_layers` of them dense (default: as published, at most all)."""
    fields = dict(FAMILY_SHAPES[shape])
    model_type = fields.pop("model_type")
    fields["num_hidden_layers"] = num_layers
    if "first_k_dense_replace" in fields:
        fields["first_k_dense_replace"] = min(fields["first_k_dense_replace"] if dense_layers is None
                                              else dense_layers, num_layers)  # fmt: skip
    return AutoConfig.for_model(model_type, **fields, **extra)


def build_random(
    shape: str,
    out: Path,
    device: torch.device,
    num_layers: int | None = None,
    dense_layers: int | None = None,
) -> Path:
    """A random-init model of `shape` (its layer count cut to `num_layers` if given, the first
    `dense_layers` of a GLM shape dense) at `out`."""
    if (out / "config.json").exists():
        return out
    tokenizer = train_tokenizer()
    if shape in FAMILY_SHAPES:
        ids = {
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": None,
        }
        layers = num_layers or FAMILY_SHAPES[shape]["num_hidden_layers"]
        config = family_config(shape, layers, dense_layers, **ids)
    else:
        fields = {**SHAPES[shape], **({"num_layers": num_layers} if num_layers else {})}
        config = tiny_qwen3_config(TinyModelConfig(out=out, **fields), len(tokenizer), tokenizer.eos_token_id,
                                   tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    save_model(model, tokenizer, out)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_throughput(
    core: "EngineCore", concurrency: int, prompt_len: int, output_len: int, seed: int
) -> dict:
    """`concurrency` requests of random prompts, all added at once, run to the end (after an
    untimed run of the same shape, for graph capture and kernel tuning). Returns output tok/s
    over the whole run and over its decode steps alone (every running sample decoding)."""
    from tandem.inference.engine.api import SamplingParams

    vocab = min(core.vocab_size, len(core.tokenizer))
    params = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True)
    result: dict = {}
    for run in ("warm-up", "timed"):
        gen = torch.Generator().manual_seed(seed + (run == "timed"))
        prompts = torch.randint(3, vocab, (concurrency, prompt_len), generator=gen).tolist()
        sync()
        start = time.perf_counter()
        for i, ids in enumerate(prompts):
            core.add_request(f"{run}-{i}", ids, params, 1)
        tokens = decode_tokens = 0
        decode_seconds = 0.0
        while core.has_work():
            decoding = not core.scheduler.waiting and all(s.num_uncached <= 1 for s in core.scheduler.running)
            step_start = time.perf_counter()
            count = sum(len(u.token_ids) for _, updates in core.step() for u in updates)
            tokens += count
            if decoding:
                decode_tokens += count
                decode_seconds += time.perf_counter() - step_start
        sync()
        seconds = time.perf_counter() - start
        result = {
            "concurrency": concurrency,
            "seconds": seconds,
            "output_tokens": tokens,
            "tok_per_s": tokens / seconds,
            "decode_tok_per_s": decode_tokens / decode_seconds if decode_seconds else None,
        }
    return result
