"""FP8 weights (`engine.quantization = "fp8"`): e4m3 with 128×128 block scales, quantized at load
and at every weight update.

Layout: a linear layer's weight [N, K] is held as `weight` e4m3 [N, K] and `weight_scale_inv`
float32 [N/128, K/128], the dequantized weight being each element times the scale of its
128×128 block: the layout of published FP8 checkpoints (`quantization_config.weight_block_size =
[128, 128]`, DeepSeek-V3 and Qwen3-*-FP8), so their tensors are taken as they are. Quantized are
the decoder layers' projections (q|k|v, o, gate|up and down of dense MLPs); not the embedding,
the output head, the norms, the MoE router or the experts. Every part's N and K must be
multiples of 128, or the engine refuses the model at start.

The matmul (`engine.fp8_kernel`; benchmarks/fp8_decode.py measures all four on the device;
rowwise, the fastest there in total on an H200, 2026-12-02, is the default):
- "triton": triton_fp8.fp8_matmul reads the stored weight and block scales; bf16 activations
  (weight-only: the weight is widened to bf16 in the kernel).
- "w8a8": the same Triton matmul with e4m3 activations, quantized per token and 128 channels
  (DeepSeek's recipe, as "blockwise"), multiplied on the tensor cores in FP8: the stored layout
  as is, any K that is a multiple of 128.
- "blockwise": torch._scaled_mm with DeepSeek's recipe (activations quantized per token and 128
  channels, weights per 128×128 block; cuBLAS, SM90 and CUDA ≥ 12.9): the stored layout as is.
  Every K must be a multiple of 512: cuBLAS reads the scales' rows 16-byte aligned, and torch
  2.11's `_scaled_mm` accepts unaligned ones (K/128 not a multiple of 4) and then computes
  garbage (measured on an H200: a K = 256 model's greedy tokens all wrong), so the engine refuses
  such a model at start.
- "rowwise": torch._scaled_mm with one scale per token and one per output channel (CUTLASS,
  SM89+): the weight is re-quantized per row at load and update, a conversion that drops the
  block scales (coarser: one scale for a whole row). Up to UNIT_SCALED_ROWS rows the product is
  taken with unit scales (cuBLAS's tensor-wise kernel) and the two scales applied after it.
Batches of more than PREFILL_ROWS rows (prefill) widen the weight to bf16 and use the bf16 matmul.

Fused launches (row-wise kernel, CUDA): a quantizer before and a scaling pass after every matmul
would be two more launches each, at decode sizes as long as the matmul itself. So the kernels
around the matmuls (kernels.py) do that work: RMSNorm and SiLU·mul hand the matmul e4m3 rows
(`Quantized`), and a product taken with unit scales can be handed on before its scales
(`Unscaled`, `defer_scales`) to the q/k norm, the next RMSNorm or SiLU·mul, which apply them as
they read it. Only the attention output is quantized by a launch of its own. The bits are those
of the separate launches.

Weight updates: `fp8_slots` holds, for every quantized layer's checkpoint name, a `Slot`
that a checkpoint or transfer tensor is copied into (weights.py reads them through
`CausalLM.checkpoint_tensors`): the copy quantizes it into that layer's rows.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tandem.cli import UserError
from tandem.models.fp8_blocks import dequantize_blocks

BLOCK = 128
E4M3_MAX = 448.0
FP8_KERNELS = ("triton", "w8a8", "blockwise", "rowwise")
PREFILL_ROWS = 512
# rowwise up to this many rows: `_scaled_mm` with unit (tensor-wise) scales, which cuBLAS runs
# 1.6-1.9x faster than its row-wise-scaled kernel at 16-128 rows (Qwen3-8B's layers, H200,
# 2026-12-04), and the scales applied after, by the kernels that read the product (fused
# launches). With those, decode at 256 concurrent requests ran 1.26x bf16 up to 256 rows against
# 1.23x up to 128 (and 1.22x against 1.21x in an earlier call); before them the row-wise kernel
# was the faster one at 256 (1.19x against 1.08x). Prefill batches take the row-wise kernel.
UNIT_SCALED_ROWS = 256


class Quantized(NamedTuple):
    """Activations in e4m3 for the row-wise matmul: `q` [padded_rows(rows), K], `scale`
    [padded_rows(rows), 1] float32, one per row; the padding rows are zeros with scale 1."""

    q: torch.Tensor
    scale: torch.Tensor
    rows: int


class Unscaled(NamedTuple):
    """A product x·Wᵀ taken with unit scales: its value is `raw` [rows, N] times `row_scale`
    [≥ rows, 1] (the activations') times `col_scale` [1, N] (the weight's), in fp32."""

    raw: torch.Tensor
    row_scale: torch.Tensor
    col_scale: torch.Tensor

    def value(self) -> torch.Tensor:
        """The scaled product (in `raw`'s place)."""
        from tandem.inference.engine import triton_fp8

        return triton_fp8.scale_outer_(self.raw, self.row_scale, self.col_scale)

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.row_scale, self.col_scale


def padded_rows(rows: int) -> int:
    """Rows of the e4m3 activations for `rows` tokens: cuBLAS's FP8 GEMM wants multiples of 16."""
    return -(-rows // 16) * 16


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] → (e4m3 [N, K], float32 scale_inv [N/128, K/128]); N and K multiples of 128."""
    n, k = weight.shape
    blocks = weight.float().reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale_inv = (blocks.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp(min=1e-12)
    q = (blocks / scale_inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(n, k), scale_inv


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] → (e4m3 [N, K], float32 scale [N]): one scale per row."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / E4M3_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


class Fp8Weight:
    """One projection's FP8 weight, and the matmul that reads it (Projection.matmul)."""

    def __init__(
        self, rows: int, cols: int, kernel: str, device: torch.device, dtype: torch.dtype = torch.bfloat16
    ) -> None:
        self.kernel = kernel
        self.dtype = dtype  # the activations' (and the product's)
        self.weight = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=device)
        if kernel == "rowwise":
            self.scale = torch.empty(1, rows, dtype=torch.float32, device=device)  # scale_b of _scaled_mm
            self.one = torch.ones((), dtype=torch.float32, device=device)
        else:  # [N/128, K/128], K/128 padded to a multiple of 4 (16-byte rows, as cuBLAS reads them)
            groups = cols // BLOCK
            self.scale = torch.ones(rows // BLOCK, -(-groups // 4) * 4, dtype=torch.float32, device=device)
        self.groups = cols // BLOCK

    def load(self, start: int, weight: torch.Tensor) -> None:
        """Quantize `weight` ([rows, K], any float dtype) into rows start… of this weight."""
        end = start + weight.shape[0]
        if self.kernel == "rowwise":
            q, scale = quantize_rows(weight)
            self.weight[start:end], self.scale[0, start:end] = q, scale
        else:
            q, scale_inv = quantize_blocks(weight)
            self.weight[start:end], self.scale[start // BLOCK : end // BLOCK, : self.groups] = q, scale_inv

    def load_quantized(self, start: int, q: torch.Tensor, scale_inv: torch.Tensor) -> None:
        """Take a checkpoint's e4m3 rows and their 128×128 scales as they are (re-quantized per
        row for the row-wise kernel)."""
        if self.kernel == "rowwise":
            self.load(start, dequantize_blocks(q, scale_inv))
            return
        end = start + q.shape[0]
        self.weight[start:end], self.scale[start // BLOCK : end // BLOCK, : self.groups] = q, scale_inv

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if self.kernel == "rowwise":
            return (self.weight.float() * self.scale[0, :, None]).to(dtype)
        return dequantize_blocks(self.weight, self.scale[:, : self.groups], dtype)

    def takes_quantized(self, rows: int) -> bool:
        """Whether, for a batch of `rows`, this matmul takes its input as `Quantized` rows."""
        return self.kernel == "rowwise" and rows <= PREFILL_ROWS and self.weight.is_cuda

    def __call__(self, x: torch.Tensor | Quantized, defer_scales: bool = False) -> torch.Tensor | Unscaled:
        """x·Wᵀ; with `defer_scales`, an `Unscaled` product where the kernel takes it that way."""
        if isinstance(x, Quantized):
            return self._rowwise(x, defer_scales)
        rows = x.shape[0]
        if rows > PREFILL_ROWS or not x.is_cuda:
            return F.linear(x, self.dequantized(x.dtype))
        from tandem.inference.engine import triton_fp8

        if self.kernel == "triton":
            return triton_fp8.fp8_matmul(x, self.weight, self.scale)
        if self.kernel == "w8a8":
            xq, xs = triton_fp8.quantize_groups(x, rows)
            return triton_fp8.fp8_matmul(xq, self.weight, self.scale, xs).to(x.dtype)
        if self.kernel == "blockwise":  # cuBLASLt wants the rows padded to a multiple of 4
            xq, xs = triton_fp8.quantize_groups(x, -(-rows // 4) * 4)
            # scale_b must be [K/128, N/128] exactly; the padded columns only align its stride
            out = torch._scaled_mm(
                xq, self.weight.t(), scale_a=xs, scale_b=self.scale[:, : self.groups].t(), out_dtype=x.dtype
            )
        else:
            return self._rowwise(
                Quantized(*triton_fp8.quantize_rows(x, padded_rows(rows)), rows), defer_scales
            )
        return out[:rows]

    def _rowwise(self, x: Quantized, defer_scales: bool) -> torch.Tensor | Unscaled:
        if x.rows > UNIT_SCALED_ROWS:
            out = torch._scaled_mm(
                x.q, self.weight.t(), scale_a=x.scale, scale_b=self.scale, out_dtype=self.dtype
            )
            return out[: x.rows]
        # cuBLAS's unit-scaled product; the scales applied after it (by the consumer, or here)
        out = torch._scaled_mm(x.q, self.weight.t(), scale_a=self.one, scale_b=self.one, out_dtype=self.dtype)
        product = Unscaled(out[: x.rows], x.scale, self.scale)
        return product if defer_scales else product.value()


class Slot:
    """What a weight update copies one quantized layer's tensor into: `copy_` quantizes it into
    the layer's rows of the fused FP8 weight. Shaped and typed as the layer's weight was."""

    is_meta = False

    def __init__(self, fp8: Fp8Weight, start: int, rows: int, cols: int, dtype: torch.dtype) -> None:
        self.fp8, self.start = fp8, start
        self.shape = torch.Size([rows, cols])
        self.dtype = dtype
        self.is_cuda = fp8.weight.is_cuda

    def copy_(self, tensor: torch.Tensor, non_blocking: bool = False) -> "Slot":
        self.fp8.load(self.start, tensor.to(self.fp8.weight.device, non_blocking=non_blocking))
        return self


def check_device(device: torch.device, kernel: str) -> None:
    """Refuse, in one line naming the setting, a device the FP8 kernel cannot run on."""
    if device.type != "cuda":
        raise UserError(
            f"engine.quantization = 'fp8' needs a CUDA GPU (compute capability 8.9+); the device is {device}"
        )
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if (major, minor) < (8, 9):
        raise UserError(
            f"engine.quantization = 'fp8' needs compute capability 8.9+ (FP8); {name} has {major}.{minor}"
        )
    if kernel == "blockwise" and (major, minor) != (9, 0):
        raise UserError(
            f"engine.fp8_kernel = 'blockwise' runs on SM90 (Hopper) only; {name} has {major}.{minor}"
        )


def quantize_model(
    model: nn.Module, kernel: str, scales: dict[str, torch.Tensor], dtype: torch.dtype
) -> None:
    """Give every decoder projection of `model` (after `prepare`) an FP8 weight and drop its
    `dtype` one. A projection whose weight is already e4m3 (a published FP8 checkpoint) takes
    its `weight_scale_inv` from `scales` (by checkpoint name) as it is."""
    plan = []
    for name, projection in model.projections():
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        rows, cols = projection.weight.shape
        for part, _, part_rows in projection.parts:
            if part_rows % BLOCK or cols % BLOCK:
                raise UserError(
                    f"engine.quantization = 'fp8': cannot quantize {name.rsplit('.', 1)[0]}.{part} "
                    f"[{part_rows}, {cols}]: both sizes must be multiples of {BLOCK}"
                )
            if kernel == "blockwise" and cols % (4 * BLOCK):
                raise UserError(
                    f"engine.fp8_kernel = 'blockwise': {name.rsplit('.', 1)[0]}.{part} has K = {cols}; "
                    f"cuBLAS's 128×128 scales need K to be a multiple of {4 * BLOCK} (use 'rowwise' or 'triton')"
                )
        plan.append((name, owner, projection))
    slots: dict[str, Slot] = {}
    activations = model.model.embed_tokens.weight.dtype  # what the products are taken in
    for name, owner, projection in plan:
        weight = projection.weight
        rows, cols = weight.shape
        prefix = name.rsplit(".", 1)[0]
        fp8 = Fp8Weight(rows, cols, kernel, weight.device, activations)
        for part, start, part_rows in projection.parts:
            key = f"{prefix}.{part}"
            if weight.dtype == torch.float8_e4m3fn:
                if f"{key}_scale_inv" not in scales:
                    raise UserError(f"the checkpoint holds {key} in FP8 without its {key}_scale_inv")
                fp8.load_quantized(start, weight[start : start + part_rows], scales[f"{key}_scale_inv"])
            else:
                fp8.load(start, weight[start : start + part_rows])
            slots[key] = Slot(fp8, start, part_rows, cols, dtype)
            linear = owner.get_submodule(part.rsplit(".", 1)[0])
            linear.weight = nn.Parameter(
                torch.empty(part_rows, cols, dtype=dtype, device="meta"), requires_grad=False
            )
        projection.weight, projection.matmul = None, fp8
    model.fp8_slots = slots
    if kernel == "rowwise" and getattr(model, "use_kernels", False):
        fuse_launches(model)


def fuse_launches(model: nn.Module) -> None:
    """Let each decoder layer's norms quantize for the FP8 matmul that reads them, and its
    attention and MLP hand o_proj's and down_proj's products on before their scales (the next
    norm applies them): see "Fused launches" above. Only where the reader is that norm — a
    shared expert's output, for one, is added to the routed experts' and keeps its own scaling."""

    for layer in model.model.layers:
        parts = (
            (layer.self_attn, layer.input_layernorm, "qkv", "out"),
            (getattr(layer, layer.mlp_name), layer.post_attention_layernorm, "gate_up", "down"),
        )
        for module, norm, first, last in parts:
            if hasattr(module, "defer_out"):  # layers.Attention and GatedMLP
                norm.quantize_for = getattr(module, first).matmul
                module.defer_out = getattr(module, last).matmul is not None
