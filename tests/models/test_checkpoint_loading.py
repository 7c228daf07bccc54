"""What the trainer makes of the checkpoints it is given: block-FP8 weights dequantized as they
are read, quantization it cannot read refused, routers kept in fp32 where transformers keeps
them, the generation config carried into exports, and broken checkpoint files named in one line.

Tiny random models on CPU, written by transformers (and quantized here block by block, as
published FP8 checkpoints are).
"""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from tandem.cli import UserError
from tandem.config.base import ModelConfig
from tandem.inference.engine.fp8 import E4M3_MAX
from tandem.models.hf_checkpoint import SafetensorsReader
from tandem.models.tiny import build_tiny_model
from tandem.models.tokenizer import train_tokenizer
from tandem.trainer.config import OptimConfig, ParallelConfig
from tandem.trainer.hf_export import write_hf_model
from tandem.trainer.model import build_trainer_model
from tandem.trainer.optim import build_optimizer
from tandem.trainer.parallel import init_distributed

sys.path.insert(0, str(Path(__file__).parent))
from test_families import CONFIGS  # noqa: E402

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


ROUTERS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


@pytest.fixture(scope="module")
def glm_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GLM-4.5 saved by transformers in bf16, which keeps the routers' weight and
    correction bias in fp32 (biases offset by 3, as trained ones are: bf16 keeps 2-3 digits there)."""
    root = tmp_path_factory.mktemp("glm")
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(CONFIGS["glm4_moe"]())
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0, 0.2)
        for name, b in reference.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.2).add_(3.0)
    reference.save_pretrained(root / "fp32")
    AutoModelForCausalLM.from_pretrained(root / "fp32", dtype=torch.bfloat16).save_pretrained(root / "bf16")
    return root / "bf16"


@pytest.mark.parametrize("impl", ["tandem", "hf"])
def test_bf16_model_keeps_fp32_routers_and_trains(glm_bf16: Path, impl: str, tmp_path: Path) -> None:
    """model.dtype = bfloat16: the routers' weight and correction bias stay the checkpoint's fp32
    tensors (as in transformers), exports write them as they were, and FSDP trains the block with
    the router in its own unit (one unit of mixed dtypes fails: "FSDP expects uniform original
    parameter dtype")."""
    world = init_distributed("cpu")
    source = load_file(glm_bf16 / "model.safetensors")
    assert {source[f"model.layers.1.{r}"].dtype for r in ROUTERS} == {torch.float32}
    model = build_trainer_model(
        ModelConfig(name=str(glm_bf16), device="cpu", dtype="bfloat16", impl=impl), world, ParallelConfig()
    )
    if impl == "tandem":
        router = model.layers[1].mlp.router
        assert router.weight.dtype == router.e_score_correction_bias.dtype == torch.float32
        assert torch.equal(full(router.weight), source["model.layers.1.mlp.gate.weight"])
        assert torch.equal(
            router.e_score_correction_bias, source["model.layers.1.mlp.gate.e_score_correction_bias"]
        )
        assert model.layers[1].attention.wo.weight.dtype == torch.bfloat16
    write_hf_model(model, train_tokenizer(), tmp_path / "out", world)
    written = load_file(tmp_path / "out/model.safetensors")
    for name, tensor in source.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), name
    assert json.loads((tmp_path / "out/config.json").read_text())["dtype"] == "bfloat16"

    optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
    ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(0))
    loss = -model.sequence_logprobs(ids, torch.arange(16)[None])[0].mean()
    loss.backward()
    optimizer.step()
    write_hf_model(model, train_tokenizer(), tmp_path / "step1", world)
    stepped = load_file(tmp_path / "step1/model.safetensors")
    gate = "model.layers.1.mlp.gate.weight"
    assert stepped[gate].dtype == torch.float32 and not torch.equal(stepped[gate], source[gate])


@pytest.mark.parametrize("impl", ["tandem", "hf"])
def test_exports_copy_the_generation_config(impl: str, tmp_path: Path) -> None:
    """The source's generation_config.json (a published model's: two stop ids, sampling defaults)
    is what exports carry; a source without one gets a greedy config ending at the EOS."""
    from transformers import GenerationConfig

    world = init_distributed("cpu")
    source = build_tiny_model(out=tmp_path / "source", num_layers=1)
    tokenizer = train_tokenizer()
    published = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],
        do_sample=True,
        temperature=0.6,
        top_p=0.95,
    )
    published.save_pretrained(source)
    model = build_trainer_model(
        ModelConfig(name=str(source), device="cpu", impl=impl), world, ParallelConfig()
    )
    write_hf_model(model, tokenizer, tmp_path / "out", world)
    assert (tmp_path / "out/generation_config.json").read_text() == (
        source / "generation_config.json"
    ).read_text()

    (source / "generation_config.json").unlink()
    model = build_trainer_model(
        ModelConfig(name=str(source), device="cpu", impl=impl), world, ParallelConfig()
    )
    write_hf_model(model, tokenizer, tmp_path / "bare", world)
    written = json.loads((tmp_path / "bare/generation_config.json").read_text())
    assert written["eos_token_id"] == tokenizer.eos_token_id and not written.get("do_sample", False)


@pytest.mark.parametrize("impl", ["tandem", "hf"])
def test_missing_and_truncated_shards_fail_naming_the_file(impl: str, tmp_path: Path) -> None:
    """An interrupted download: a shard the index lists is missing, or cut short."""
    world = init_distributed("cpu")
    source = build_tiny_model(out=tmp_path / "source", num_layers=2)
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(source).save_pretrained(sharded, max_shard_size="300KB")
    files = sorted(sharded.glob("model-*.safetensors"))
    assert len(files) > 2
    config = ModelConfig(name=str(sharded), device="cpu", impl=impl)
    data = files[1].read_bytes()
    files[1].unlink()
    with pytest.raises(UserError, match=f"{files[1]} is missing") as error:
        build_trainer_model(config, world, ParallelConfig())
    assert "\n" not in str(error.value)
    files[1].write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=rf"{files[1]} cannot be read \(.*\): a truncated file") as error:
        build_trainer_model(config, world, ParallelConfig())
    assert "\n" not in str(error.value)
