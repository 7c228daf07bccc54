"""FP8 weights (CPU): 128×128 block quantization against a reference, the checkpoint layout,
quantize-at-load and quantize-at-update through the weight-loading path, refused shapes and
devices. The CUDA kernels are checked in tests/gpu/test_fp8_cuda.py and, interpreted, below."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from triton_interpreter import run_interpreted

from tandem.cli import UserError
from tandem.inference.config import InferenceConfig
from tandem.inference.engine.api import WeightLoadError
from tandem.inference.engine.attention import AttentionMetadata, Prompts
from tandem.inference.engine.core import EngineCore
from tandem.inference.engine.fp8 import (
    E4M3_MAX,
    Fp8Weight,
    dequantize_blocks,
    quantize_blocks,
    quantize_model,
)
from tandem.inference.engine.models import build_model
from tandem.inference.engine.weights import apply_checkpoint, read_checkpoint
from tandem.models.tiny import build_tiny_model


def reference_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block quantization written out block by block."""
    n, k = weight.shape
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty(n // 128, k // 128)
    for i in range(n // 128):
        for j in range(k // 128):
            block = weight[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            scale_inv[i, j] = block.abs().max() / 448.0
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (block / scale_inv[i, j]).to(
                torch.float8_e4m3fn
            )
    return q, scale_inv


def test_block_quantization_matches_the_reference_and_bounds_the_error() -> None:
    torch.manual_seed(0)
    weight = torch.randn(256, 384) * torch.logspace(-3, 1, 384)  # blocks of very different ranges
    q, scale_inv = quantize_blocks(weight)
    ref_q, ref_scale = reference_blocks(weight)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (2, 3) and scale_inv.dtype == torch.float32
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.allclose(scale_inv, ref_scale)
    blocks = q.float().reshape(2, 128, 3, 128).abs().amax(dim=(1, 3))
    assert torch.equal(blocks, torch.full((2, 3), E4M3_MAX))  # each block's largest value maps to e4m3's
    restored = dequantize_blocks(q, scale_inv)
    bound = (
        scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1) * E4M3_MAX / 16
    )  # half an ulp at the top
    assert ((restored - weight).abs() <= bound).all()


def test_checkpoint_tensors_are_taken_as_they_are() -> None:
    torch.manual_seed(1)
    q, scale_inv = quantize_blocks(torch.randn(256, 256))
    fp8 = Fp8Weight(384, 256, "triton", torch.device("cpu"))
    fp8.load_quantized(128, q, scale_inv)
    assert torch.equal(fp8.weight[128:].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(fp8.scale[1:3, :2], scale_inv) and fp8.scale.shape == (3, 4)  # K/128 padded to 4
    rowwise = Fp8Weight(256, 256, "rowwise", torch.device("cpu"))
    rowwise.load_quantized(0, q, scale_inv)  # converted: one scale per row
    exact = dequantize_blocks(q, scale_inv)
    assert rowwise.scale.shape == (1, 256)
    assert (rowwise.dequantized(torch.float32) - exact).abs().max() <= exact.abs().max() / 16


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny Qwen3s whose layers are multiples of 128 wide (hidden 256, heads of 64)."""
    root = tmp_path_factory.mktemp("fp8")
    return build_tiny_model(out=root / "a", num_layers=2), build_tiny_model(
        out=root / "b", num_layers=2, seed=1
    )


def engine_model(path: Path, quantization: str = "fp8", kernel: str = "triton") -> torch.nn.Module:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return build_model(hf, 64, use_kernels=False, quantization=quantization, fp8_kernel=kernel)


def logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """A whole-prompt forward pass straight into the model (a KV cache of one sequence)."""
    config = model.config
    n = len(ids)
    cache = torch.zeros(2, config.num_hidden_layers, 2, 64, config.num_key_value_heads, config.head_dim)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), prompts=Prompts(None, None, slice(0, n), None, n))
    caches = [(cache[0, i], cache[1, i]) for i in range(config.num_hidden_layers)]
    with torch.no_grad():
        return model.logits(model(torch.tensor(ids), torch.arange(n), caches, meta)).float()


IDS = [5, 17, 99, 3, 250, 41, 8, 77]


@pytest.mark.parametrize("kernel", ["triton", "rowwise"])
def test_quantized_model_stays_close_and_updates_quantize_into_place(model_dirs, kernel: str) -> None:
    a, b = model_dirs
    fp8, reference = engine_model(a, kernel=kernel), engine_model(a, quantization="none")
    projections = dict(fp8.projections())
    assert projections and all(p.weight is None and p.matmul is not None for p in projections.values())
    kl = torch.nn.functional.kl_div(logits(fp8, IDS).log_softmax(-1), logits(reference, IDS).log_softmax(-1),
                                    log_target=True, reduction="batchmean")  # fmt: skip
    assert kl < 1e-3, kl
    # an update of bf16/fp32 tensors by checkpoint name is quantized into the FP8 weights
    tensors = read_checkpoint(b, fp8)
    slot = fp8.checkpoint_tensors()["model.layers.0.self_attn.k_proj.weight"]
    assert slot.shape == (128, 256) and slot.dtype == torch.float32
    apply_checkpoint(fp8, tensors)
    assert torch.allclose(logits(fp8, IDS), logits(engine_model(b, kernel=kernel), IDS), atol=1e-5)


def test_an_update_with_wrong_shapes_is_refused_and_the_weights_stay(model_dirs, tmp_path: Path) -> None:
    a, _ = model_dirs
    fp8 = engine_model(a)
    before = logits(fp8, IDS)
    wide = build_tiny_model(out=tmp_path / "wide", num_layers=2, intermediate_size=1024)
    with pytest.raises(
        WeightLoadError, match=r"proj\.weight.* has shape \(256, 1024\), the model needs \(256, 768\)"
    ):
        read_checkpoint(wide, fp8)
    assert torch.equal(logits(fp8, IDS), before)


def test_an_fp8_checkpoints_tensors_load_as_they_are(model_dirs) -> None:
    """What transformers hands over for a published FP8 checkpoint: e4m3 weights and their
    weight_scale_inv; the engine keeps the bits."""
    a, _ = model_dirs
    model = engine_model(a, quantization="none")
    scales, expected = {}, {}
    for name, projection in model.projections():
        prefix = name.rsplit(".", 1)[0]
        parts = []
        for part, start, rows in projection.parts:
            q, scale_inv = quantize_blocks(projection.weight[start : start + rows])
            scales[f"{prefix}.{part}_scale_inv"], expected[f"{prefix}.{part}"] = scale_inv, q
            parts.append(q)
        projection.weight = torch.cat(parts)
    quantize_model(model, "triton", scales, torch.float32)
    k_proj = "model.layers.1.self_attn.k_proj.weight"
    slot = model.checkpoint_tensors()[k_proj]
    stored = slot.fp8.weight[slot.start : slot.start + slot.shape[0]]
    assert torch.equal(stored.view(torch.uint8), expected[k_proj].view(torch.uint8))


def test_layers_that_are_not_multiples_of_128_are_refused(tmp_path: Path) -> None:
    path = build_tiny_model(out=tmp_path / "narrow", num_layers=1, hidden_size=64, head_dim=16)
    with pytest.raises(
        UserError, match=r"cannot quantize model\.layers\.0\.self_attn\.q_proj\.weight \[64, 64\]"
    ):
        engine_model(path)


def test_blockwise_refuses_a_k_that_is_not_a_multiple_of_512(model_dirs) -> None:
    a, _ = model_dirs  # hidden size 256
    with pytest.raises(
        UserError,
        match=r"'blockwise': model\.layers\.0\.self_attn\.q_proj\.weight has K = 256; .* multiple of 512",
    ):
        quantize_model(engine_model(a, quantization="none"), "blockwise", {}, torch.float32)


def test_fp8_on_a_cpu_fails_at_start_in_one_line(model_dirs) -> None:
    a, _ = model_dirs
    config = {"model": {"name": str(a)}, "engine": {"quantization": "fp8"}}
    with pytest.raises(UserError, match="engine.quantization = 'fp8' needs a CUDA GPU"):
        EngineCore(InferenceConfig.model_validate(config))
    result = subprocess.run(
        [sys.executable, "-m", "tandem.inference.cli", "--model", str(a), "--engine.quantization", "fp8"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "engine.quantization = 'fp8'" in lines[0], lines


KERNEL_SCRIPT = """
import torch
from tandem.inference.engine.fp8 import dequantize_blocks, quantize_blocks
from tandem.inference.engine.triton_fp8 import _run, fp8_matmul, quantize_groups, quantize_rows, scale_outer_

torch.manual_seed(0)
w = torch.randn(256, 384)
q, scale_inv = quantize_blocks(w)
scale = torch.ones(2, 4)  # K/128 = 3 padded to 4, as Fp8Weight holds it
scale[:, :3] = scale_inv
ref_w = dequantize_blocks(q, scale_inv).T
# float32 activations: the interpreter's bf16 dot is wrong (Triton 3.8), a float32 one is not
for rows in (1, 5, 64, 100, 256):  # the interpreter's config: 64-row blocks, 3 K steps split in 2
    x = torch.randn(rows, 384)
    out = fp8_matmul(x, q, scale)
    ref = x @ ref_w
    assert out.shape == (rows, 256) and torch.allclose(out, ref, atol=1e-3, rtol=1e-4), (out - ref).abs().max()
# (BLOCK_M, BLOCK_N, SPLIT_K, warps, stages): unsplit (stored, not added), 128 weight rows, and a
# split of 4 over 3 K steps (one program adds nothing)
for config in ((16, 128, 1, 4, 1), (128, 64, 4, 8, 1)):
    out = _run(x[:100], q, scale, config)
    assert torch.allclose(out, x[:100] @ ref_w, atol=1e-3, rtol=1e-4), (config, (out - x[:100] @ ref_w).abs().max())
# W8A8: e4m3 activations with per-row, per-128-channel scales (the interpreter's e4m3 dot, and
# the same split config), against the dequantized activations' product
xq, xs = quantize_groups(x[:100], 100)
ref = (xq.float().view(100, 3, 128) * xs[:, :, None]).view(100, 384) @ ref_w
for config in ((16, 128, 1, 4, 1), (128, 64, 4, 8, 1)):
    out = _run(xq, q, scale, config, xs, torch.float32)
    assert torch.allclose(out, ref, atol=1e-3, rtol=1e-4), (config, (out - ref).abs().max())
out = fp8_matmul(xq, q, scale, xs)
assert out.dtype == torch.bfloat16 and torch.allclose(out.float(), ref, atol=0.05, rtol=0.02)
x = x[:5]
# the activation quantizers: scales exactly amax / 448 in the layout _scaled_mm wants; values
# only roughly (the interpreter rounds to e4m3 less exactly than the GPU, which the GPU test checks)
xq, xs = quantize_groups(x, 8)
assert xq.shape == (8, 384) and xs.shape == (8, 3) and xs.stride() == (1, 8)
assert torch.allclose(xs[:5], x.view(5, 3, 128).abs().amax(-1) / 448) and (xs[5:] == 1).all()
back = (xq[:5].float().view(5, 3, 128) * xs[:5, :, None]).view(5, 384)
assert ((back - x).abs() <= xs[:5].repeat_interleave(128, 1) * 448 * 0.15).all()
assert (xq[5:].float() == 0).all()
y = torch.randn(5, 1500)
assert torch.allclose(scale_outer_(y.clone(), rs_ := torch.rand(8, 1), cs := torch.rand(1, 1500)), y * rs_[:5] * cs)
rq, rs = quantize_rows(x, 16)
assert rq.shape == (16, 384) and rs.shape == (16, 1) and torch.allclose(rs[:5, 0], x.abs().amax(-1) / 448)
assert ((rq[:5].float() * rs[:5] - x).abs() <= rs[:5] * 448 * 0.15).all()
z = 3 * torch.randn(3, 5000)  # wider than one piece of columns: two, the second partly masked
zq, zs = quantize_rows(z, 4)
assert torch.allclose(zs[:3, 0], z.abs().amax(-1) / 448) and zs[3, 0] == 1 and (zq[3].float() == 0).all()
assert ((zq[:3].float() * zs[:3] - z).abs() <= zs[:3] * 448 * 0.15).all()
print("ok")
"""


def test_fp8_kernels_in_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    run_interpreted(KERNEL_SCRIPT)


COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from tandem.inference.engine import triton_fp8 as t

POINTERS = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "xs_ptr": "*fp32", "a_ptr": "*fp32", "b_ptr": "*fp32", "out_ptr": "*bf16", "q_ptr": "*fp8e4nv"}
MATMUL = {"BLOCK_K": 128, "WIDEN_ASM": True, "X_FP8": False}
W8A8 = {"BLOCK_K": 128, "WIDEN_ASM": True, "X_FP8": True}
for fn, consts, pointers, options in (
    (t._fp8_matmul_kernel, {"BLOCK_M": 64, "BLOCK_N": 64, "SPLIT_K": 1} | MATMUL, {}, (4, 3)),
    (t._fp8_matmul_kernel, {"BLOCK_M": 16, "BLOCK_N": 128, "SPLIT_K": 4} | MATMUL, {"out_ptr": "*fp32"}, (4, 3)),
    (t._fp8_matmul_kernel, {"BLOCK_M": 128, "BLOCK_N": 128, "SPLIT_K": 2} | MATMUL, {"out_ptr": "*fp32"}, (8, 3)),
    (t._fp8_matmul_kernel, {"BLOCK_M": 64, "BLOCK_N": 128, "SPLIT_K": 4} | W8A8, {"x_ptr": "*fp8e4nv", "out_ptr": "*fp32"}, (4, 3)),
    (t._quantize_groups_kernel, {"GROUP": 128}, {}, (4, 3)),
    (t._quantize_rows_kernel, {"BLOCK_K": 4096}, {}, (4, 3)),
    (t._scale_outer_kernel, {"BLOCK_N": 1024}, {}, (4, 3)),
):
    types = POINTERS | pointers
    signature = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
    # pointers, strides, N and K 16-divisible, as the launches specialize them (the pipelined loads)
    aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
               if a.endswith("_ptr") or a.startswith("stride") or a in ("N", "K")}  # fmt: skip
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=aligned)
    asm = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(zip(("num_warps", "num_stages"), options))).asm
    assert asm["cubin"], fn.__name__
    if fn is t._fp8_matmul_kernel and consts["X_FP8"]:  # wgmma on e4m3 operands, nothing widened
        assert "wgmma.mma_async" in asm["ptx"] and ".e4m3.e4m3" in asm["ptx"] and "fma.rn.bf16x2" not in asm["ptx"]
    elif fn is t._fp8_matmul_kernel:  # wgmma, the weight widened by integer ops, no cvt from e4m3
        assert "wgmma.mma_async" in asm["ptx"] and "fma.rn.bf16x2" in asm["ptx"] and "e4m3" not in asm["ptx"]
print("ok")
"""


def test_fp8_kernels_compile_for_hopper_without_a_gpu() -> None:
    """The interpreter runs kernels as Python and misses what only the compiler refuses (a
    non-constexpr global, once): compile each one for SM90 here, with triton's own ptxas."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


FUSED_SCRIPT = """
import sys
import torch
from tandem.inference.engine import kernels
from tandem.inference.engine.fp8 import padded_rows
from tandem.inference.engine.triton_fp8 import quantize_rows, scale_outer_

torch.manual_seed(0)
torch.set_default_device(sys.argv[1])
rows, n, pad = 5, 384, padded_rows(5)
dtype = torch.bfloat16


def product(width):  # an FP8 product before its scales, with its row (padded) and column scales
    return (40 * torch.randn(rows, width)).to(dtype), torch.rand(pad, 1) * 0.02, torch.rand(1, width) * 0.05


def same(fused, separate, what):
    (fq, fs), (sq, ss) = fused, separate
    assert fq.shape == sq.shape == (pad, fq.shape[1]) and fs.shape == ss.shape == (pad, 1), what
    assert torch.equal(fq.view(torch.uint8), sq.view(torch.uint8)) and torch.equal(fs, ss), what


# residual add + RMSNorm over a scaled product, quantized: the bits of scale_outer_ -> rms_norm -> quantize_rows
raw, row_s, col_s = product(n)
residual, weight = torch.randn(rows, n).to(dtype), (torch.rand(n) + 0.5).to(dtype)
scaled = scale_outer_(raw.clone(), row_s, col_s)
normed, want_residual = kernels.rms_norm(scaled, weight, 1e-6, residual)
fused, got_residual = kernels.rms_norm(raw, weight, 1e-6, residual, (row_s, col_s), pad)
same(fused, quantize_rows(normed, pad), "rms_norm")
assert torch.equal(got_residual, want_residual)
# the same norm's plain (unscaled, unquantized) output is what it was
plain, _ = kernels.rms_norm(scaled, weight, 1e-6, residual)
assert torch.equal(plain, normed)
same(kernels.rms_norm(scaled, weight, 1e-6, residual, None, pad)[0], quantize_rows(normed, pad), "rms_norm, tensor in")
# SiLU·mul over gate|up's scaled product, quantized (N spans two 1024-wide blocks)
raw, row_s, col_s = product(2 * 1536)
want = quantize_rows(kernels.silu_mul(scale_outer_(raw.clone(), row_s, col_s)), pad)
same(kernels.silu_mul_quantized(raw, pad, (row_s, col_s)), want, "silu_mul")
same(kernels.silu_mul_quantized(scale_outer_(raw.clone(), row_s, col_s), pad), want, "silu_mul, tensor in")
# q/k norm + rotary + cache write over qkv's scaled product
heads, kv_heads, dim = 4, 2, 64
raw, row_s, col_s = product((heads + 2 * kv_heads) * dim)
norms = [(torch.rand(dim) + 0.5).to(dtype) for _ in range(2)]
cos, sin = torch.randn(2, 50, dim)
positions, slots = torch.randint(0, 50, (rows,)), torch.randperm(32)[:rows]
caches = [torch.zeros(2, 16, kv_heads, dim, dtype=dtype) for _ in range(4)]
want = kernels.qk_norm_rope_store(
    scale_outer_(raw.clone(), row_s, col_s), heads, kv_heads, dim, *norms, 1e-6, cos, sin, positions, *caches[:2], slots
)
got = kernels.qk_norm_rope_store(
    raw, heads, kv_heads, dim, *norms, 1e-6, cos, sin, positions, *caches[2:], slots, (row_s, col_s)
)
for g, w in zip([*got, *caches[2:]], [*want, *caches[:2]]):
    assert torch.equal(g, w), (g - w).abs().max()
print("ok")
"""


def test_fused_fp8_launches_give_the_bits_of_separate_ones() -> None:
    """RMSNorm and SiLU·mul writing e4m3 rows, and the norms reading a product before its scales
    (fp8.py, "Fused launches"): bit for bit what scale_outer_, the plain kernel and
    quantize_rows give one after another, in the interpreter."""
    pytest.importorskip("triton")
    run_interpreted(FUSED_SCRIPT, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an FP8 GPU"
)
def test_fused_fp8_launches_give_the_bits_of_separate_ones_on_cuda() -> None:
    result = subprocess.run(
        [sys.executable, "-c", FUSED_SCRIPT, "cuda"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


FUSED_COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from tandem.inference.engine import kernels as k

FP32 = ("row_scale_ptr", "col_scale_ptr", "q_scale_ptr", "cos_ptr", "sin_ptr")
for fn, consts in (
    (k._rms_norm_kernel, {"N": 4096, "BLOCK": 4096, "HAS_RESIDUAL": True, "X_SCALED": True, "QUANT": True}),
    (k._silu_mul_quant_kernel, {"BLOCK": 16384, "X_SCALED": True}),
    (k._qk_norm_rope_kernel, {"HEADS": 32, "KV_HEADS": 8, "HEAD_DIM": 128, "HEADS_P2": 64, "X_SCALED": True}),
):
    def kind(a):
        if a in consts:
            return "constexpr"
        if a == "eps":
            return "fp32"
        if not a.endswith("_ptr"):
            return "i32"
        if a in FP32:
            return "*fp32"
        if a in ("slots_ptr", "positions_ptr"):
            return "*i64"
        return "*fp8e4nv" if a == "q_ptr" and fn is not k._qk_norm_rope_kernel else "*bf16"
    signature = {a: kind(a) for a in fn.arg_names}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=consts)
    assert triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["cubin"]
print("ok")
"""


def test_fused_fp8_launches_compile_for_hopper_without_a_gpu() -> None:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    result = subprocess.run(
        [sys.executable, "-c", FUSED_COMPILE_SCRIPT], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
