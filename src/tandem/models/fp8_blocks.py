"""Block-FP8 weights as published checkpoints store them (DeepSeek-V3, Qwen3-*-FP8): e4m3 values
and one float32 `scale_inv` per block of the weight (128 × 128 by default), so that a block's
values times its scale are the weight. Shared by the trainer's checkpoint reader
(models/hf_checkpoint.py) and the inference engine's FP8 weights (inference/engine/fp8.py).
"""

import torch


def dequantize_blocks(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    block: tuple[int, int] = (128, 128),
    offset: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """e4m3 `q` [n, k] times the scale of each element's block, in fp32, then cast to `dtype`.

    `q` may be a region of a larger weight: the one starting at element `offset` (row, column),
    `scale_inv` then holding the scales of the blocks that region touches (from block
    offset // `block` on). Blocks at the weight's end may be partial (published checkpoints
    crop them: a [300, 200] weight has [3, 2] scales of 128×128 blocks)."""
    n, k = q.shape
    (bn, bk), (r0, c0) = block, (offset[0] % block[0], offset[1] % block[1])
    if (r0, c0) == (0, 0) and (n % bn, k % bk) == (0, 0):  # whole blocks: one broadcast
        blocks = q.float().reshape(n // bn, bn, k // bk, bk) * scale_inv[:, None, :, None].float()
        return blocks.reshape(n, k).to(dtype)
    scale = scale_inv.float().repeat_interleave(bn, 0)[r0 : r0 + n].repeat_interleave(bk, 1)[:, c0 : c0 + k]
    return (q.float() * scale).to(dtype)
