"""Random-init models of real shapes for the GPU benchmarks (built on the device in bf16 and
saved once: a stand-in for the real checkpoints, which cannot be downloaded there; with the tiny
tokenizer and the shape's full vocabulary of embedding rows), and the decode measurement the
shape benchmarks share.

    from bench_models import SHAPES, build_random      # (benchmarks/ is the script's directory)
    path = build_random("qwen3-8b", work_dir / "q8b", torch.device("cuda"))
"""

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM

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


def build_random(shape: str, out: Path, device: torch.device, num_layers: int | None = None) -> Path:
    """A random-init model of `shape` (its layer count cut to `num_layers` if given) at `out`."""
    if (out / "config.json").exists():
        return out
    cfg = TinyModelConfig(out=out, **{**SHAPES[shape], **({"num_layers": num_layers} if num_layers else {})})
    tokenizer = train_tokenizer()
    config = tiny_qwen3_config(cfg, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
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
            count = sum(len(u.tokens) for _, updates in core.step() for u in updates)
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
