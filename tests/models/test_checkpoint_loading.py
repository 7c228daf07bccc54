"""What the trainer makes of the checkpoints it is given: block-FP8 weights dequantized as they
are read, quantization it cannot read refused, routers kept in fp32 where transformers keeps
them, the generation config carried into exports, and broken checkpoint files named in one line.

Tiny random models on CPU, written by transformers (and quantized here block by block, as
published FP8 checkpoints are).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from tandem.cli import UserError
from tandem.config.base import ModelConfig
from tandem.inference.engine.fp8 import E4M3_MAX
from tandem.models.hf_checkpoint import SafetensorsReader
from tandem.models.tiny import build_tiny_model
from tandem.trainer.config import ParallelConfig
from tandem.trainer.model import build_trainer_model
from tandem.trainer.parallel import init_distributed

BLOCK = [128, 128]


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def quantize(weight: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] → e4m3 [N, K] and float32 scale_inv [⌈N/bn⌉, ⌈K/bk⌉]: each (possibly partial) block's
    largest magnitude mapped to e4m3's."""
    (n, k), (bn, bk) = weight.shape, block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk)
    padded[:n, :k] = weight.float()
    blocks = padded.view(rows, bn, cols, bk)
    scale_inv = blocks.abs().amax(dim=(1, 3)) / E4M3_MAX
    q = (blocks / scale_inv[:, None, :, None]).to(torch.float8_e4m3fn).view(rows * bn, cols * bk)
    return q[:n, :k].contiguous(), scale_inv


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: list[int]) -> torch.Tensor:
    """The reference: every element times its block's scale, in fp32 (elementwise, no reshapes)."""
    rows = torch.arange(q.shape[0]) // block[0]
    cols = torch.arange(q.shape[1]) // block[1]
    return q.float() * scale_inv[rows[:, None], cols[None, :]]


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny Qwen3 whose layers' projections are block-FP8 (sizes 192 and 320: partial blocks at
    the ends), with the quantization_config of a published FP8 checkpoint; and the dequantized
    weights it holds, by checkpoint name."""
    root = tmp_path_factory.mktemp("fp8")
    source = build_tiny_model(
        out=root / "bf16", num_layers=2, hidden_size=192, head_dim=64, intermediate_size=320
    )
    quantized = root / "fp8"
    shutil.copytree(source, quantized)
    tensors, written, dequantized = load_file(source / "model.safetensors"), {}, {}
    for name, weight in tensors.items():
        if ".layers." in name and name.endswith("proj.weight"):
            weight = weight * 5  # larger than e4m3's smallest normals, so the scales matter
            q, scale_inv = quantize(weight, BLOCK)
            written[name], written[f"{name}_scale_inv"] = q, scale_inv
            dequantized[name] = dequantize(q, scale_inv, BLOCK)
        else:
            written[name] = dequantized[name] = weight
    save_file(written, quantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": BLOCK,
    }
    (quantized / "config.json").write_text(json.dumps(config))
    return quantized, dequantized


def test_block_fp8_checkpoint_loads_dequantized(
    fp8_checkpoint: tuple[Path, dict[str, torch.Tensor]], capsys: pytest.CaptureFixture
) -> None:
    """Each weight is its e4m3 values times its block's scale, exactly in fp32; the scales are read
    (not reported unused), and the model's exports say nothing of quantization."""
    path, dequantized = fp8_checkpoint
    world = init_distributed("cpu")
    model = build_trainer_model(ModelConfig(name=str(path), device="cpu"), world, ParallelConfig())
    assert "not used by the model" not in capsys.readouterr().out
    attention = model.layers[1].attention
    o_proj = dequantized["model.layers.1.self_attn.o_proj.weight"]
    assert torch.equal(full(attention.wo.weight), o_proj)
    qkv = torch.cat([dequantized[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(full(attention.wqkv.weight), qkv)
    gate_up = [dequantized[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up")]
    assert torch.equal(full(model.layers[0].mlp.w_gate_up.weight), torch.cat(gate_up))
    assert torch.equal(
        full(model.layers[0].mlp.w_down.weight), dequantized["model.layers.0.mlp.down_proj.weight"]
    )
    assert not hasattr(model.hf_config, "quantization_config")
    # the e4m3 values alone would be off by the scales (~0.001-0.01 here)
    assert not torch.allclose(o_proj, load_file(path / "model.safetensors")[
        "model.layers.1.self_attn.o_proj.weight"].float(), atol=0.5)  # fmt: skip


def test_fp8_regions_read_as_the_same_region_of_the_whole(
    fp8_checkpoint: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """A shard (a rank's rows, an uneven split crossing blocks) reads only its rows and scales and
    equals that region of the dequantized tensor."""
    path, dequantized = fp8_checkpoint
    reader = SafetensorsReader(path, {"quant_method": "fp8", "weight_block_size": BLOCK})
    name = "model.layers.0.mlp.down_proj.weight"  # [192, 320]
    whole = dequantized[name]
    for region in (
        ((0, 192), (0, 320)),
        ((50, 140), (0, 320)),
        ((130, 192), (100, 300)),
        ((0, 1), (319, 320)),
    ):
        got = reader.read(name, region)
        assert got.dtype == torch.float32
        assert torch.equal(got, whole[region[0][0] : region[0][1], region[1][0] : region[1][1]]), region


def test_unreadable_quantization_fails_naming_the_method_or_tensor(
    fp8_checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    path, _ = fp8_checkpoint
    world = init_distributed("cpu")
    config = json.loads((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")

    def build(quantization: dict | None, weights: dict[str, torch.Tensor] = tensors) -> None:
        broken = tmp_path / "broken"
        shutil.rmtree(broken, ignore_errors=True)
        broken.mkdir()
        save_file(weights, broken / "model.safetensors")
        written = {k: v for k, v in config.items() if k != "quantization_config"}
        if quantization is not None:
            written["quantization_config"] = quantization
        (broken / "config.json").write_text(json.dumps(written))
        build_trainer_model(ModelConfig(name=str(broken), device="cpu"), world, ParallelConfig())

    cases = [
        (
            {"quant_method": "awq", "bits": 4},
            tensors,
            "quantization_config quant_method = 'awq' is not supported",
        ),
        (
            {"quant_method": "fp8", "weight_block_size": None},
            tensors,
            "quantization_config fp8 with fmt = 'e4m3', weight_block_size = None is not supported",
        ),
        (
            None,
            tensors,
            r"tensor model.layers.0.self_attn.q_proj.weight is FP8 \(F8_E4M3\) but .* no quantization_config",
        ),
        (
            config["quantization_config"],
            {k: v for k, v in tensors.items() if k != "model.layers.0.mlp.down_proj.weight_scale_inv"},
            "down_proj.weight is FP8 .* without its scales model.layers.0.mlp.down_proj.weight_scale_inv",
        ),
        (
            config["quantization_config"],
            {**tensors, "model.norm.weight": tensors["model.norm.weight"].to(torch.int32)},
            "tensor model.norm.weight is I32: tandem's trainer reads float tensors",
        ),
        (  # one scale for the whole [192, 320] tensor, not one per 128×128 block
            config["quantization_config"],
            {**tensors, "model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(1, 1)},
            r"o_proj.weight_scale_inv is F32 \[1, 1\], the scales of .* must be float \[2, 2\]",
        ),
    ]
    for quantization, weights, message in cases:
        with pytest.raises(UserError, match=message) as error:
            build(quantization, weights)
        assert "\n" not in str(error.value)
    with pytest.raises(UserError, match="quant_method = 'fp8'.*model.impl = 'hf' trains unquantized"):
        build_trainer_model(ModelConfig(name=str(path), device="cpu", impl="hf"), world, ParallelConfig())


def test_fp8_checkpoint_reads_full_precision_bf16(
    fp8_checkpoint: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """model.dtype = bfloat16: the dequantized fp32 weight rounded once to bf16."""
    path, dequantized = fp8_checkpoint
    model = build_trainer_model(
        ModelConfig(name=str(path), device="cpu", dtype="bfloat16"), init_distributed("cpu"), ParallelConfig()
    )
    got = full(model.layers[0].attention.wo.weight)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, dequantized["model.layers.0.self_attn.o_proj.weight"].bfloat16())
