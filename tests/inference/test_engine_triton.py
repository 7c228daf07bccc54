"""The engine's Triton kernels, run by Triton's CPU interpreter: the decode kernel against the
gather + SDPA path (one KV head or several per program, the context whole or split), the fused
kernels end to end against transformers' greedy tokens, the fused sampler against the torch
sampler, and the q/k norm + rotary + cache-write kernel against the torch path."""

import os
import subprocess
import sys

import pytest
from triton_interpreter import run_interpreted

pytest.importorskip("triton")

SCRIPT = """
import torch
from tandem.inference.engine.attention import decode_attention
from tandem.inference.engine.triton_decode import paged_decode_attention

torch.manual_seed(0)
for kv_heads, heads, dim in [(2, 4, 64), (8, 16, 128), (4, 4, 32)]:
    k_cache, v_cache = torch.randn(2, 40, 16, kv_heads, dim).unbind(0)
    q = torch.randn(3, heads, dim)
    tables = torch.tensor([[5, 9, 3, 0, 0], [1, 2, 0, 0, 0], [7, 8, 10, 11, 30]])
    lens = torch.tensor([40, 17, 80])
    ref = decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5)
    for per_program, fastest in [(1, False), (2, True), (4, False), (8, True)]:
        config = {"BLOCK_N": 32, "HEADS": per_program, "KV_HEAD_FASTEST": fastest, "splits": 1}
        out = paged_decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5, config)
        err = (out - ref).abs().max().item()
        assert err < 1e-5, (kv_heads, heads, dim, per_program, fastest, err)
print("ok")
"""


def test_decode_kernel_matches_gather_path_in_interpreter() -> None:
    run_interpreted(SCRIPT, timeout=120)


SPLIT_SCRIPT = """
import torch
from tandem.inference.engine.attention import decode_attention
from tandem.inference.engine.triton_decode import paged_decode_attention

torch.manual_seed(0)
# contexts of one batch: 1 (every split but the first empty), 7 (under one BLOCK_N), 33 (most of
# 8 splits empty), 97 (not a multiple of the block size; BLOCK_N 16 in 8 splits: the seventh
# holds 1 token, the eighth none)
lens = torch.tensor([1, 7, 33, 97])
tables = torch.randperm(28).view(4, 7)
for kv_heads, heads in [(2, 4), (2, 8)]:  # query heads per KV head: 2 and 4
    k_cache, v_cache = torch.randn(2, 28, 16, kv_heads, 16).unbind(0)
    q = torch.randn(4, heads, 16)
    ref = decode_attention(q, k_cache, v_cache, tables, lens, 0.25)
    for splits in (1, 2, 4, 8, None):  # None: the default, MAX_SPLITS for so few programs
        for per_program, block_n in [(1, 16), (2, 32)]:
            config = {"BLOCK_N": block_n, "HEADS": per_program, "KV_HEAD_FASTEST": per_program == 1}
            out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, {**config, "splits": splits})
            err = (out - ref).abs().max().item()  # NaN fails too
            assert err < 1e-5, (kv_heads, heads, splits, per_program, err)
print("ok")
"""


def test_split_decode_matches_gather_path_in_interpreter() -> None:
    """The context split 1, 2, 4 and 8 ways (then combined) against gather + SDPA in fp32, with
    empty splits, partial blocks and contexts of several lengths in one batch, GQA groups 2 and
    4, one and two KV heads per program."""
    run_interpreted(SPLIT_SCRIPT, timeout=120)


def test_decode_splits_fill_the_gpu_from_the_batch_alone() -> None:
    """The default split count: a power of two, 1 once the programs are enough, else the fewest
    splits that make TARGET_PROGRAMS, capped at MAX_SPLITS; an explicit count must be a power of
    two."""
    import torch

    from tandem.inference.engine.triton_decode import (
        CONFIG,
        MAX_SPLITS,
        TARGET_PROGRAMS,
        decode_splits,
        paged_decode_attention,
    )

    assert decode_splits(TARGET_PROGRAMS, 1) == decode_splits(TARGET_PROGRAMS // 8, 8) == 1
    assert decode_splits(1, 1) == MAX_SPLITS
    for batch in range(1, 2 * TARGET_PROGRAMS, 7):
        for groups in (1, 2, 3, 8):
            splits, programs = decode_splits(batch, groups), batch * groups
            assert splits & (splits - 1) == 0 and 1 <= splits <= MAX_SPLITS, (batch, groups, splits)
            if splits < MAX_SPLITS:
                assert programs * splits >= TARGET_PROGRAMS, (batch, groups, splits)
            if splits > 1:
                assert programs * splits // 2 < TARGET_PROGRAMS, (batch, groups, splits)
    cache = torch.zeros(2, 16, 1, 16)
    args = (torch.zeros(1, 1, 16), cache, cache, torch.zeros(1, 1), torch.ones(1), 1.0)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(*args, {**CONFIG, "splits": 3})


COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from tandem.inference.engine import triton_decode as t

POINTERS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "tables_ptr": "*i32", "lens_ptr": "*i32",
            "m_ptr": "*fp32", "denom_ptr": "*fp32", "acc_ptr": "*fp32", "scale": "fp32"}  # fmt: skip
SHAPE = {"GROUP": 4, "ROWS_PAD": 16, "HEADS": 1, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "BLOCK_N": 128,
         "KV_HEAD_FASTEST": True, "IEEE": False}  # fmt: skip
for fn, consts, out in (
    (t._decode_kernel, {**SHAPE, "SPLITS": 1}, "*bf16"),
    (t._decode_kernel, {**SHAPE, "SPLITS": 4}, "*fp32"),
    (t._combine_kernel, {"SPLITS": 4, "HEAD_DIM": 128}, "*bf16"),
):
    types = POINTERS | {"out_ptr": out}
    signature = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=consts)
    options = {"num_warps": 4, "num_stages": 3}
    assert triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"], consts
print("ok")
"""


def test_decode_kernels_compile_for_hopper_without_a_gpu() -> None:
    """Both forms of the decode kernel and the combine, compiled for SM90 with triton's own
    ptxas: the interpreter runs them as Python and misses what only the compiler refuses."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


MODEL_SCRIPT = """
import sys
import torch
from transformers import AutoModelForCausalLM
from tandem.inference.config import InferenceConfig
from tandem.inference.engine.api import SamplingParams
from tandem.inference.engine.core import EngineCore

path = sys.argv[1]
core = EngineCore(InferenceConfig.model_validate({"model": {"name": path}}))
core.model.use_kernels = True  # force the fused Triton kernels (interpreted on CPU)
for module in core.model.modules():
    if hasattr(module, "use_kernels"):
        module.use_kernels = True
prompts = [[5, 6, 7], list(range(10, 30)), [9]]
params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
for i, ids in enumerate(prompts):
    core.add_request(str(i), ids, params, 2 if i == 1 else 1)
got = {}
while core.has_work():
    for rid, updates in core.step():
        for u in updates:
            got.setdefault((rid, u.index), []).extend(u.token_ids)
hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
for i, ids in enumerate(prompts):
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=6, min_new_tokens=6, do_sample=False, eos_token_id=None)
    ref = ref[0, len(ids):].tolist()
    for (rid, index), tokens in got.items():
        if rid == str(i):
            assert tokens == ref, (i, index, tokens, ref)
print("ok")
"""


def test_fused_kernels_give_transformers_greedy_outputs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tandem.models.tiny import build_tiny_model

    path = build_tiny_model(
        out=tmp_path / "m", num_layers=2, hidden_size=64, head_dim=16, intermediate_size=128
    )
    run_interpreted(MODEL_SCRIPT, str(path), timeout=300)


SAMPLER_SCRIPT = """
import torch
from tandem.inference.engine.sampler import SamplingBatch, sample, sample_key, sampling_rows
from tandem.inference.engine.triton_sample import fused_sample

torch.manual_seed(0)
rows, vocab = 12, 1500
logits = (torch.randn(rows, vocab) * 3).to(torch.bfloat16)
temps = [0.0 if i % 4 == 0 else 0.4 + 0.15 * i for i in range(rows)]
batch = SamplingBatch(temps, [1.0] * rows, [0] * rows, [0.0] * rows,
                      [sample_key(7, i) for i in range(rows)], [100 + i for i in range(rows)])
want = sample(logits.float(), batch)
r = sampling_rows(batch, vocab, logits.device)
tokens = torch.full((rows,), -1)
got = fused_sample(logits, r.temperatures, r.keys, torch.tensor(batch.positions), 5, tokens)
assert got[0].long().tolist() == want.token_ids == tokens.tolist(), (got[0], want.token_ids)
err = (got[1] - torch.tensor(want.logprobs, dtype=torch.float64)).abs().max().item()
assert err < 1e-5, err
# unseeded rows: their noise comes from the step seed and the row, so identical rows draw apart
flat = torch.zeros(48, 64)
draws = [
    fused_sample(flat, torch.ones(48), torch.full((48,), -1), torch.zeros(48, dtype=torch.int64), seed,
                 torch.empty(48, dtype=torch.int64))[0].long().tolist()
    for seed in (1, 2)
]
assert len(set(draws[0])) > 20 and draws[0] != draws[1], draws
print("ok")
"""


def test_fused_sampler_draws_what_the_torch_sampler_draws(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Seeded and greedy rows: the same ids as the torch path (bf16 logits), logprobs to 1e-5;
    unseeded rows draw apart by row and by step seed."""
    run_interpreted(SAMPLER_SCRIPT, timeout=300)


RACE_SCRIPT = """
import numpy as np
import torch
from tandem.inference.engine import triton_sample
from tandem.inference.engine.sampler import fmix32, sample_key, uniform_noise


def race(logits, temps, keys, positions, step_seed):
    # every column's score, in float32 like the kernel (numpy's log, as the interpreter's)
    rows, vocab = logits.shape
    greedy = temps <= 0
    x = logits.float() / torch.where(greedy, 1.0, temps)[:, None]
    unseeded = fmix32(step_seed ^ fmix32(torch.arange(rows) + 0x2545F491))
    u = uniform_noise(torch.where(keys >= 0, keys, unseeded), positions, vocab).numpy()
    noise = torch.from_numpy(-np.log(-np.log(u)))
    score = torch.where(greedy[:, None], x, x + noise)
    tokens = score.argmax(-1)  # the first column of the maximum
    logprobs = torch.log_softmax(x.double(), -1).gather(1, tokens[:, None])[:, 0]
    return tokens, logprobs, noise


torch.manual_seed(0)
rows, vocab, step_seed = 32, 3000, 5
temps = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.0, 1.0, 2.0, 0.5, 1.0, 0.0, 0.9, 1.0, 0.0] + [1.0] * 8 + [1.0, 0.8] * 5 + [0.0])
keys = torch.tensor([sample_key(3, i) if i % 3 else -1 for i in range(rows)])
positions = torch.randint(0, 5000, (rows,))
base = torch.randn(rows, vocab) * 3
noise = race(base, temps, keys, positions, step_seed)[2]
base[4] = torch.randint(0, 4, (vocab,)).float()  # greedy, many exact ties: the first maximum
base[9, :-1] = 0.0  # greedy, the maximum in the last (partial) block
base[9, -1] = 1.0
base[10, ::7] = float("-inf")
base[11] = 1536.0 - noise[11]  # T = 1: every fp32 score exactly 1536, column 0 draws
base[12] = float("-inf")  # every score -inf: column 0
# T = 1, a later column beats column 5 by 2**-10 (exact at 1536), every other column far behind:
# its step, in 5's chunk, must not be skipped. The largest noise of its range: a tight bound
narrow = torch.arange(13, 21)
late = 512 + noise[narrow, 512:768].argmax(1)
base[narrow] = -100.0
base[narrow, 5] = 1536.0 - noise[narrow, 5]
base[narrow, late] = 1536.0 + 2**-10 - noise[narrow, late]
ordinary = [i for i in range(rows) if not 11 <= i < 21]
for block, programs in [(256, 8192), (128, 128), (64, 64)]:  # steps per chunk: 1, 6, 24
    triton_sample.BLOCK, triton_sample.PROGRAMS = block, programs
    for dtype in (torch.float32, torch.bfloat16):
        logits = base.to(dtype)
        want, want_lp, _ = race(logits, temps, keys, positions, step_seed)
        tokens = torch.empty(rows, dtype=torch.int64)
        got = triton_sample.fused_sample(logits, temps, keys, positions, step_seed, tokens)
        case = (block, programs, dtype)
        assert got[0].long().tolist() == want.tolist() == tokens.tolist(), (case, got[0], want)
        err = (got[1] - want_lp)[ordinary].abs().max().item()
        assert err < 1e-5, (case, err)
print("ok")
"""


def test_fused_sampler_is_the_race_written_out_in_torch() -> None:
    """Every column's score computed in torch (hash, noise, argmax, log_softmax) against the
    kernel, with several chunks per row and several steps per chunk: greedy, seeded and unseeded
    rows, fp32 and bf16 logits, exact ties (first column), -inf columns and rows. Same ids,
    logprobs to 1e-5."""
    run_interpreted(RACE_SCRIPT, timeout=300)


QK_NORM_ROPE_SCRIPT = """
import torch
from tandem.inference.engine.attention import write_kv
from tandem.inference.engine.kernels import qk_norm_rope_store
from tandem.inference.engine.models.layers import RMSNorm, RotaryEmbedding, apply_rope


def torch_path(qkv, heads, kv_heads, dim, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, slots):
    tokens, dtype = qkv.shape[0], qkv.dtype
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    q = q_norm.normalize(q.reshape(tokens, heads, dim))
    k = k_norm.normalize(k.reshape(tokens, kv_heads, dim))
    v = v.reshape(tokens, kv_heads, dim)
    c, s = cos[positions].to(dtype)[:, None], sin[positions].to(dtype)[:, None]
    q, k = apply_rope(q, c, s), apply_rope(k, c, s)
    write_kv(k_cache, v_cache, k, v, slots)
    return q, k, v


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


torch.set_grad_enabled(False)
torch.manual_seed(0)
# (tokens, heads, kv_heads, head_dim): Qwen3-0.6B's heads, and 9 heads padded to 16 in the tile
for (tokens, heads, kv_heads, dim), dtype in [
    ((7, 16, 8, 128), torch.bfloat16), ((5, 6, 3, 64), torch.bfloat16),
    ((7, 16, 8, 128), torch.float32), ((5, 6, 3, 64), torch.float32),
]:
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-5
    qkv = (3 * torch.randn(tokens, (heads + 2 * kv_heads) * dim)).to(dtype)
    q_norm, k_norm = RMSNorm(dim, 1e-6), RMSNorm(dim, 1e-6)
    q_norm.weight.copy_(torch.rand(dim) + 0.5)  # distinct weights: q and k heads cannot be mixed up
    k_norm.weight.copy_(torch.rand(dim) + 0.5)
    q_norm, k_norm = q_norm.to(dtype), k_norm.to(dtype)
    rope = RotaryEmbedding(dim, 10000.0, 300)
    positions = torch.randint(0, 300, (tokens,))
    slots = torch.randperm(4 * 16)[:tokens]
    caches = torch.randn(2, 4, 16, kv_heads, dim).to(dtype)  # [num_blocks, block_size, kv_heads, dim]
    want_k_cache, want_v_cache, k_cache, v_cache = (c.clone() for c in [*caches, *caches])
    args = (rope.cos, rope.sin, positions)
    want = torch_path(qkv, heads, kv_heads, dim, q_norm, k_norm, *args, want_k_cache, want_v_cache, slots)
    got = qk_norm_rope_store(
        qkv, heads, kv_heads, dim, q_norm.weight, k_norm.weight, 1e-6, *args, k_cache, v_cache, slots
    )
    case = (tokens, heads, kv_heads, dim, dtype)
    for name, g, w in zip("qkv", got, want):
        assert g.shape == w.shape and g.dtype == dtype, (case, name, g.shape, g.dtype)
        assert rel_err(g, w) < tol, (case, name, rel_err(g, w))
    assert rel_err(k_cache, want_k_cache) < tol, (case, "k cache", rel_err(k_cache, want_k_cache))
    assert torch.equal(got[2], want[2]) and torch.equal(v_cache, want_v_cache), (case, "v")
    untouched = torch.ones(4 * 16, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(k_cache.flatten(0, 1)[untouched], caches[0].flatten(0, 1)[untouched]), case
    # the tolerance tells apart a rotation with cos and sin swapped, and one by the next position
    norms = (q_norm, k_norm)
    swapped = torch_path(qkv, heads, kv_heads, dim, *norms, rope.sin, rope.cos, positions, *caches, slots)
    shifted = torch_path(qkv, heads, kv_heads, dim, *norms, *args[:2], (positions + 1) % 300, *caches, slots)
    for wrong in (swapped, shifted):
        assert min(rel_err(got[0], wrong[0]), rel_err(got[1], wrong[1])) > 0.2, case
print("ok")
"""


def test_qk_norm_rope_store_matches_torch_path_in_interpreter() -> None:
    """q and k within rounding of the torch path (bf16: 5% of the largest value, fp32: 1e-5), v and
    the v cache exact, the k cache written at the slots and nowhere else, for bf16 and fp32."""
    run_interpreted(QK_NORM_ROPE_SCRIPT, timeout=120)
