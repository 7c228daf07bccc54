"""Trainer speed on one GPU: tandem's models against plain transformers, side by side.

    python benchmarks/trainer_mfu.py                        # every variant below, a table at the end
    python benchmarks/trainer_mfu.py --variants 0.6b:tandem,0.6b:hf_compiled --steps 8

Each variant runs in its own process (so peak memory and compile caches are its own) on the
same packed batch: 4 rows × 4,096 tokens of documents of mixed lengths (256–2,304 tokens,
drawn once with a fixed seed), random-init weights, one optimizer step per iteration.

- `tandem`: the trainers' real path (trainer/model.py): fp32 master weights, bf16 compute
  through FSDP2 mixed precision, torch.compile per block, packed attention by document
  (model.attention = auto unless `tandem-<backend>`), the chunked output head, fused AdamW.
  `tandem_bf16`: weights and AdamW state in bf16; `tandem_keep`: FSDP keeps each block's
  gathered bf16 weights from forward to backward (`reshard_after_forward = false`);
  `tandem_master`: bf16 parameters, the fp32 master weights and AdamW state in the optimizer
  (`optim.master_weights = "optimizer"`, trainer/master_weights.py); `tandem_logits`: the head
  keeps its logits for the backward (`model.head_logits = "keep"`); `tandem_master_bf16moments`:
  AdamW's moments in bf16 with stochastic rounding (`optim.moments_dtype = "bfloat16"`, needs
  `master`; `bf16moments` is its own flag, not `bf16`). Suffixes combine:
  `tandem_master_keep`, `moe:tandem_master_keep_logits_bf16moments`; `ac` and `sac`: full and
  selective activation checkpointing (`parallel.activation_checkpointing`); `short`: GLM-5 skips
  its indexers where no document is longer than index_topk (`model.sparse_attention =
  "long_documents"`; with `--max-doc-tokens 2048`: `glm-5:tandem_short,glm-5:tandem`); `overlap`:
  `master`'s optimizer step on a stream of its own, beside the next forward (`optim.overlap_step`,
  which the trainers turn on by default with `master` on one GPU; without the flag the step runs
  in line, so `_overlap` is the trainers' default form). With `master` on one GPU the model is
  not wrapped by FSDP at all (nothing to shard or cast), so `keep` changes nothing
  there. With `--nproc N` a tandem variant runs on N GPUs through torchrun: FSDP over all N,
  each rank training its own copy of the batch (tokens/s and MFU are per GPU, rank 0's), and
  `_ep<N>` splits a MoE shape's experts over N of them (`moe:tandem_master_ep2 --nproc 2`).
- Shapes: `0.6b`, `1.7b`, `4b` (Qwen3), `moe` (Qwen3-30B-A3B with 8 of its 48 layers, what fits
  one H200) and `moe<N>` (the same with N layers: `moe48` is the whole model, 30.5B parameters).
  `moe48:tandem_master_logits_bf16moments_ep8 --nproc 8`, estimated: 12 bytes a parameter (bf16
  weights and gradients, fp32 masters, bf16 moments) over 8 GPUs (ep = 8 puts 16 experts on each,
  FSDP shards the rest) 42.7 GiB each; activations ~1.3 GiB a layer for the 16,384 tokens (the
  8-layer shape's 77.5 GiB peak on one GPU less its 62.7 GiB of state and 4.6 GiB of kept
  logits, per layer), 62 GiB for 48; ~110 GiB in all of the H200's 139, before the routing's
  imbalance. If it does not fit, `ac` keeps one layer's at a time. MFU counts each forward once,
  recomputed or not.
  `smoke` is a tiny MoE for `--device cpu`: a check of the flow (gloo ranks under `--nproc`),
  not a measurement.
- `hf`, `hf_compiled`: transformers' model in bf16 (weights, grads and AdamW state), SDPA with
  the mask transformers derives from the restarting position ids, its own loss over full
  logits, fused AdamW; `hf_compiled` is the same under torch.compile.
- `rl:<impl>`: the RL trainer's step (trainer/rl/train.py `train_step`) on micro-batches the
  orchestrator's packer builds from 128 samples of 20–200 tokens (seq_len 2048, 8,192 tokens
  per micro-batch), fresh samples every step, so shapes vary as they do in a run;
  `rl:tandem-<backend>` with that `model.attention`.
- `glm-4.5-air`, `minimax-m2`, `glm-5` (`--variants families` runs their tandem and hf
  variants): the published configs' layer shapes (benchmarks/bench_models.py FAMILY_SHAPES)
  with the layer count cut to fit one H200's 141 GB: GLM-4.5-Air 2 layers (1 dense + 1 MoE),
  MiniMax-M2 1, GLM-5 2 (1 dense + 1 MoE, weights and AdamW state in bf16: one MoE layer is
  9.7B parameters). GLM-5's tandem variant takes the sparse attention path (auto on CUDA), and
  its process runs with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: without it the
  allocator's fragmentation (28 GiB reserved but free) made the backward run out of memory at
  125 GiB of live tensors on the H200.

MFU counts, per document of T tokens, 6·N·T + 6·L·d·T² FLOPs (N: parameters that take part in
matmuls, i.e. all but an untied input embedding — for MoE only the active experts' share, shared
experts included; L layers; d the attention width, heads × (q/k width + v width) / 2; the
causal half of 12·L·d·T²; for GLM-5 only the query-key pairs the indexer keeps, Σ min(t+1,
index_topk), and the indexer's own forward over every causal pair), against
989 TFLOP/s (H100/H200 dense bf16). Tokens/s and MFU are medians over the timed steps after
`--warmup` untimed ones; peak memory is torch's max allocated over the whole run.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timeline import gpu_idle, trace_of  # noqa: E402
from torchrun import child_command, child_env  # noqa: E402

PEAK_FLOPS = 989e12
ROWS, WIDTH = 4, 4096
SHAPES = {
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, tie_word_embeddings=True),
    "1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=6144, tie_word_embeddings=True),
    "4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, intermediate_size=9728, tie_word_embeddings=True),
    # Qwen3-30B-A3B with 8 of its 48 layers (moe<N>: with N)
    "moe": dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4,
                head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False),
    # a MoE small enough for --device cpu (a check of this script's flow, not a measurement)
    "smoke": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                  num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False, vocab_size=512),
}  # fmt: skip
CHECKPOINTING = {"ac": "full", "sac": "selective"}  # variant flag: parallel.activation_checkpointing
FAMILY_CUTS = {"glm-4.5-air": (2, None), "minimax-m2": (1, None), "glm-5": (2, 1)}  # (layers, dense layers)
FAMILY_WEIGHTS = {"glm-5": "bfloat16"}  # master weights (and AdamW state) where fp32 would not fit
NEAR_FULL = {"glm-5"}  # shapes that fit one H200 only without allocator fragmentation
FAMILY_VARIANTS = ",".join(f"{shape}:{impl}" for shape in FAMILY_CUTS for impl in ("tandem", "hf"))
DEFAULT_VARIANTS = (
    "0.6b:tandem,0.6b:hf,0.6b:hf_compiled,rl:tandem,rl:hf,"
    "1.7b:tandem,1.7b:hf,1.7b:hf_compiled,moe:tandem,moe:hf,moe:hf_compiled," + FAMILY_VARIANTS
)


def hf_config(shape: str):  # noqa: ANN201 (a transformers config)
    from transformers import Qwen3Config, Qwen3MoeConfig

    if shape in FAMILY_CUTS:
        from bench_models import family_config

        return family_config(shape, *FAMILY_CUTS[shape])
    layers = re.fullmatch(r"moe([1-9][0-9]*)", shape)
    if layers:
        fields = SHAPES["moe"] | {"num_hidden_layers": int(layers[1])}
    else:
        fields = SHAPES["0.6b" if shape == "rl" else shape]
    cls = Qwen3MoeConfig if "num_experts" in fields else Qwen3Config
    return cls(**{
        "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}, **fields,
    })  # fmt: skip


MAX_DOC_TOKENS = 2304  # --max-doc-tokens


def document_lengths(seed: int = 0) -> list[list[int]]:
    """Per row, lengths of documents drawn from 256–MAX_DOC_TOKENS tokens filling exactly WIDTH."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(ROWS):
        lengths, left = [], WIDTH
        while left:
            n = min(left, int(torch.randint(256, MAX_DOC_TOKENS + 1, (1,), generator=generator)))
            lengths.append(n)
            left -= n
        rows.append(lengths)
    return rows


def packed_batch(vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    docs = document_lengths()
    ids = torch.randint(0, vocab, (ROWS, WIDTH), generator=torch.Generator().manual_seed(1))
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in docs])
    return ids.to(device), positions.to(device), [n for row in docs for n in row]


def attention_params(config) -> float:  # noqa: ANN001
    d, heads = config.hidden_size, config.num_attention_heads
    if config.model_type == "glm_moe_dsa":  # MLA (the indexer runs without gradient: not here)
        qk, c = config.qk_nope_head_dim + config.qk_rope_head_dim, config
        return (d * (c.q_lora_rank + c.kv_lora_rank + c.qk_rope_head_dim) + c.q_lora_rank * heads * qk
                + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim) + heads * c.v_head_dim * d)  # fmt: skip
    q, kv = heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return d * (q + 2 * kv) + q * d


def mlp_params(config, layer: int) -> float:  # noqa: ANN001
    """Active matmul parameters of one layer's MLP: the chosen experts, shared ones, the router."""
    d = config.hidden_size
    experts = getattr(config, "num_experts", 0) or getattr(config, "n_routed_experts", 0)
    experts = experts or getattr(config, "num_local_experts", 0)
    dense = layer < getattr(config, "first_k_dense_replace", 0)
    if not experts or dense:
        return 3 * d * config.intermediate_size
    size = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared = getattr(config, "n_shared_experts", 0) or 0
    return (config.num_experts_per_tok + shared) * 3 * d * size + experts * d


def matmul_params(config) -> float:  # noqa: ANN001
    """Parameters that take part in matmuls per token (active experts only)."""
    L = config.num_hidden_layers
    layers = sum(attention_params(config) + mlp_params(config, i) for i in range(L))
    return layers + config.vocab_size * config.hidden_size  # + the output head (tied or not)


def step_flops(config, doc_lengths: list[int]) -> float:  # noqa: ANN001
    """6·N·T plus attention: 12·L·d·(query-key pairs), the pairs causal (and, for GLM-5, those the
    indexer keeps), d = heads × (q/k + v width) / 2; plus GLM-5's indexer forward."""
    tokens, L = sum(doc_lengths), config.num_hidden_layers
    if config.model_type == "glm_moe_dsa":
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        d_attn = config.num_attention_heads * (qk + config.v_head_dim) / 2
        k = config.index_topk
        pairs = sum(min(n, k) * (min(n, k) + 1) / 2 + max(0, n - k) * k for n in doc_lengths)
        indexer = 2 * config.index_n_heads * config.index_head_dim * sum(n * n / 2 for n in doc_lengths)
        indexer += 2 * tokens * config.index_n_heads * config.index_head_dim * config.q_lora_rank
        return 6 * matmul_params(config) * tokens + 12 * L * d_attn * pairs + L * indexer
    d_attn = config.num_attention_heads * config.head_dim
    return 6 * matmul_params(config) * tokens + 6 * L * d_attn * sum(n * n for n in doc_lengths)


PROFILE_DIR: Path | None = None  # --profile: where each variant writes its kernel table
DEVICE = "cuda"  # --device: cpu checks the flow of tandem variants (the smoke shape, gloo ranks)


def synchronize() -> None:
    """Wait for the current stream, as a trainer's step does when it reads its loss: an optimizer
    step running on a stream of its own (`optim.overlap_step`) goes on into the next step."""
    if DEVICE == "cuda":
        torch.cuda.current_stream().synchronize()


def profile(step, name: str) -> None:  # noqa: ANN001
    """Two more steps under torch.profiler; the top kernels by GPU time go to PROFILE_DIR/name.txt,
    then where the GPU sat idle (gpu_idle) and the operators by input shapes (which matmul shapes
    take the time)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    if not rank_zero():  # (the other ranks run the profiled steps only: they are collective)
        return
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=70)
    shapes = prof.key_averages(group_by_input_shape=True).table(
        sort_by="cuda_time_total", row_limit=60, max_name_column_width=40, max_shapes_column_width=90
    )
    idle = gpu_idle(trace_of(prof))
    (PROFILE_DIR / f"profile_{name.replace(':', '_')}.txt").write_text(f"{table}\n\n{idle}\n\n{shapes}")


def rank_zero() -> bool:
    """Whether this process records (the only one, or rank 0 of a torchrun group under --nproc)."""
    return int(os.environ.get("RANK", 0)) == 0


def timed_steps(step, steps: int, warmup: int, name: str = "") -> tuple[list[float], float]:  # noqa: ANN001
    """Seconds of each timed step, and of the warm-up (compile included)."""
    synchronize()
    start = time.perf_counter()
    for _ in range(warmup):
        step()
    synchronize()
    warm = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        synchronize()
        times.append(time.perf_counter() - start)
    if PROFILE_DIR is not None and name:
        profile(step, name)
    return times, warm


def write_config_dir(config, root: Path) -> Path:  # noqa: ANN001
    out = root / "config"
    config.save_pretrained(out)
    return out


def run_tandem(
    shape: str,
    attention: str,
    steps: int,
    warmup: int,
    weights: str,
    keep: bool = False,
    master: bool = False,
    keep_logits: bool = False,
    bf16_moments: bool = False,
    ep: int = 1,
    checkpointing: str = "none",
    short: bool = False,
    overlap_step: bool = False,
) -> dict:
    from tandem.config.base import ModelConfig
    from tandem.trainer.config import OptimConfig, ParallelConfig
    from tandem.trainer.model import build_trainer_model
    from tandem.trainer.optim import build_optimizer, clip_grad_norm
    from tandem.trainer.parallel import init_distributed

    config = hf_config(shape)
    world = init_distributed(DEVICE)
    with tempfile.TemporaryDirectory() as tmp:
        name = str(write_config_dir(config, Path(tmp)))
        head = "keep" if keep_logits else "recompute"
        sparse = "long_documents" if short else "always"
        model_cfg = ModelConfig(
            name=name, attention=attention, dtype=weights, head_logits=head, sparse_attention=sparse
        )
        parallel = ParallelConfig(
            reshard_after_forward=not keep, ep=ep, activation_checkpointing=checkpointing
        )
        master_weights = "optimizer" if master else "model"
        model = build_trainer_model(
            model_cfg, world, parallel, load_weights=False, master_weights=master_weights
        )
    model.init_weights()
    moments = "bfloat16" if bf16_moments else "float32"
    optim_cfg = OptimConfig(
        lr=1e-5, master_weights=master_weights, moments_dtype=moments, overlap_step=overlap_step
    )
    optimizer = build_optimizer(model, optim_cfg)
    ids, positions, docs = packed_batch(config.vocab_size, world.device)
    mask = positions > 0
    tokens = int(mask.sum())

    def step() -> None:
        logprobs, _ = model.sequence_logprobs(ids, positions)
        (-(logprobs * mask).sum() / tokens).backward()
        clip_grad_norm(optimizer, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    flags = "".join(
        f"_{flag}"
        for flag, on in (
            ("master", master),
            ("keep", keep),
            ("logits", keep_logits),
            ("bf16moments", bf16_moments),
            (f"ep{ep}", ep > 1),
            ("ac", checkpointing == "full"),
            ("sac", checkpointing == "selective"),
            ("short", short),
            ("overlap", overlap_step),
        )
        if on
    )
    times, warm = timed_steps(step, steps, warmup, f"{shape}:tandem{flags}-{attention}")
    return summary(config, docs, times, warm, backend=model.attention_backend, gpus=world.size)


def run_hf(shape: str, compiled: bool, steps: int, warmup: int) -> dict:
    from transformers import AutoModelForCausalLM

    config = hf_config(shape)
    device = torch.device("cuda")
    with device:  # built on the GPU: a CPU init of a MoE layer's billions of parameters takes minutes
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.config.use_cache = False
    model.train()
    forward = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids, positions, docs = packed_batch(config.vocab_size, device)
    labels = ids.masked_fill(positions == 0, -100)  # no target across a document boundary

    def step() -> None:
        forward(input_ids=ids, position_ids=positions, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times, warm = timed_steps(step, steps, warmup, f"{shape}:hf{'_compiled' if compiled else ''}")
    return summary(config, docs, times, warm, experts=getattr(model.config, "_experts_implementation", None))


def summary(config, docs: list[int], times: list[float], warm: float, **extra: object) -> dict:  # noqa: ANN001
    median = statistics.median(times)
    return {
        "tokens_per_s": sum(docs) / median,
        "mfu": step_flops(config, docs) / median / PEAK_FLOPS,
        "step_s": median,
        "step_s_min": min(times),
        "steps_s": [round(t, 4) for t in times],
        "warmup_s": warm,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else float("nan"),
        **extra,
    }


def rl_samples(step: int, vocab: int) -> list:
    from tandem.transport.rollouts import Sample

    generator = torch.Generator().manual_seed(100 + step)
    samples = []
    for i in range(128):
        total = int(torch.randint(20, 201, (1,), generator=generator))
        prompt = int(torch.randint(8, min(60, total - 4) + 1, (1,), generator=generator))
        n = total - prompt
        samples.append(
            Sample(
                prompt_ids=torch.randint(0, vocab, (prompt,), generator=generator).tolist(),
                completion_ids=torch.randint(0, vocab, (n,), generator=generator).tolist(),
                completion_mask=[True] * n,
                completion_logprobs=(-torch.rand(n, generator=generator) * 3).tolist(),
                reward=float(i % 2),
                advantage=float(torch.randn(1, generator=generator)),
                policy_version=0,
                task_id=str(i),
            )
        )
    return samples


def run_rl(impl: str, steps: int, warmup: int) -> dict:
    from transformers import AutoModelForCausalLM

    from tandem.config import build_config
    from tandem.trainer.model import build_trainer_model
    from tandem.trainer.optim import build_optimizer
    from tandem.trainer.parallel import init_distributed
    from tandem.trainer.rl.config import RLTrainerConfig
    from tandem.trainer.rl.loss import build_objective
    from tandem.trainer.rl.train import train_step
    from tandem.transport.rollouts import pack_samples

    config = hf_config("rl")
    world = init_distributed("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "model"
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(checkpoint)
        impl, _, attention = impl.partition("-")  # rl:tandem-<backend>: that model.attention
        overrides = [("model.name", str(checkpoint)), ("model.impl", impl)]
        cfg = build_config(
            RLTrainerConfig, overrides=overrides + ([("model.attention", attention)] if attention else [])
        )
        load_start = time.perf_counter()
        model = build_trainer_model(cfg.model, world, cfg.parallel)
        torch.cuda.synchronize()
        load_s = time.perf_counter() - load_start
    optimizer = build_optimizer(model, cfg.optim)
    objective = build_objective(cfg.loss)
    batches = [
        pack_samples(rl_samples(s, config.vocab_size), 2048, 1, 8192, step=s)[0]
        for s in range(warmup + steps)
    ]
    times, tokens = [], []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for s, micro_batches in enumerate(batches):
        step_start = time.perf_counter()
        stats = train_step(model, objective, optimizer, micro_batches, 0, cfg, world)
        torch.cuda.synchronize()
        if s == warmup - 1:
            warm = time.perf_counter() - start
        if s >= warmup:
            times.append(time.perf_counter() - step_start)
            tokens.append(stats["tokens"])
    median = statistics.median(t / n for t, n in zip(times, tokens, strict=True))
    return {
        "tokens_per_s": 1 / median,
        "step_s": statistics.median(times),
        "tokens_per_step": statistics.median(tokens),
        "warmup_s": warm,
        "load_s": load_s,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def run_one(variant: str, steps: int, warmup: int) -> list[dict]:
    shape, impl = variant.split(":")
    if shape == "rl":
        return [{"variant": variant, **run_rl(impl, steps, warmup)}]
    if impl.startswith("tandem"):
        backend = impl.split("-", 1)[1] if "-" in impl else "auto"
        # tandem_<flag>_<flag>: bf16, keep, master, logits, bf16moments, ep<N>, ac or sac, short,
        # overlap (whole tokens of a set)
        flags = set(impl.split("-", 1)[0].split("_")[1:])
        ep = next((int(f[2:]) for f in flags if re.fullmatch(r"ep[1-9][0-9]*", f)), 1)
        known = {"bf16", "keep", "master", "logits", "bf16moments", "short", "overlap", f"ep{ep}"}
        known |= set(CHECKPOINTING)
        unknown = flags - known
        if unknown:
            raise ValueError(f"unknown tandem flags {sorted(unknown)} in {variant}")
        if set(CHECKPOINTING) <= flags:
            raise ValueError(f"{variant}: ac (full) and sac (selective checkpointing) exclude each other")
        checkpointing = next((CHECKPOINTING[f] for f in flags if f in CHECKPOINTING), "none")
        weights = "bfloat16" if "bf16" in flags else FAMILY_WEIGHTS.get(shape, "auto")
        run = run_tandem(
            shape, backend, steps, warmup, weights, "keep" in flags, "master" in flags, "logits" in flags,
            "bf16moments" in flags, ep, checkpointing, "short" in flags, "overlap" in flags,
        )  # fmt: skip
        return [{"variant": variant, **run}]
    return [{"variant": variant, **run_hf(shape, impl == "hf_compiled", steps, warmup)}]


def print_table(rows: list[dict]) -> None:
    print(
        f"\n{'variant':26} {'tokens/s':>10} {'MFU':>7} {'step s':>8} {'warmup s':>9} {'peak GiB':>9}  notes"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:26} failed: {r['error']}")
        else:
            mfu = f"{100 * r['mfu']:6.1f}%" if "mfu" in r else "      -"
            notes = ", ".join(
                f"{k}={r[k]}" for k in ("backend", "experts", "tokens_per_step", "load_s", "gpus") if r.get(k)
            )
            print(
                f"{r['variant']:26} {r['tokens_per_s']:10,.0f} {mfu} {r['step_s']:8.3f} {r['warmup_s']:9.1f} "
                f"{r['peak_gib']:9.1f}  {notes}"
            )


def main() -> None:
    global MAX_DOC_TOKENS, PROFILE_DIR, DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--variants", default=DEFAULT_VARIANTS, help="comma-separated; 'families' = " + FAMILY_VARIANTS
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "trainer_mfu.jsonl")
    parser.add_argument(
        "--profile", action="store_true", help="write a kernel table per variant next to --out"
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="GPUs per variant (torchrun; tandem variants only): FSDP over all, experts over ep<N>",
    )
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu: a check of the tandem variants' flow (the smoke shape; gloo ranks under --nproc)",
    )
    parser.add_argument(
        "--max-doc-tokens",
        type=int,
        default=MAX_DOC_TOKENS,
        help="the packed batch's longest document (GLM-5's `short` flag skips the indexers only where no "
        "document is longer than index_topk, 2,048)",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    MAX_DOC_TOKENS = args.max_doc_tokens
    if args.one:
        PROFILE_DIR = args.out.parent if args.profile else None
        DEVICE = args.device
        from tandem.trainer.parallel import shutdown

        try:
            rows = run_one(args.one, args.steps, args.warmup)
        except Exception as e:
            rows = [{"variant": args.one, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}]
            raise
        finally:
            if rank_zero():  # (every rank measures the same step)
                with args.out.open("a") as f:
                    for row in rows:
                        f.write(json.dumps(row) + "\n")
        shutdown(completed=True)  # (after a failure the process exits with the error)
        return
    variants = args.variants.replace("families", FAMILY_VARIANTS).split(",")
    one_gpu = [v for v in variants if not v.split(":")[1].startswith("tandem")]
    if one_gpu and (args.nproc > 1 or args.device == "cpu"):
        given = f"--nproc {args.nproc}" if args.nproc > 1 else "--device cpu"
        parser.error(f"{given} runs tandem variants only (not {', '.join(one_gpu)})")
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        parser.error(f"--nproc {args.nproc}: this machine has {torch.cuda.device_count()} GPUs")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = len(args.out.read_text().splitlines()) if args.out.exists() else 0
    for variant in variants:
        print(f"== {variant}", flush=True)
        command = [
            *child_command(__file__, args.nproc),
            "--one",
            variant,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            *(["--profile"] if args.profile else []),
            "--max-doc-tokens",
            str(args.max_doc_tokens),
            "--device",
            args.device,
        ]
        env = child_env(args.nproc)
        if variant.split(":")[0] in NEAR_FULL:
            env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        subprocess.run([*command, "--out", str(args.out)], check=False, env=env)
    rows = [json.loads(line) for line in args.out.read_text().splitlines()[done:]]
    print_table(rows)


if __name__ == "__main__":
    main()
