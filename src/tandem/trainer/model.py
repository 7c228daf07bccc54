"""The trainer's model: tandem's own implementation or transformers', sharded and ready to train.

`model.impl` chooses: "tandem" builds the checkpoint's family from models/<model_type>/ on the
meta device, parallelises it (expert and context parallelism, activation checkpointing or
offload, compile, FSDP2) and then fills each rank's shards straight from the safetensors files;
"hf" loads transformers' model and shards it; "auto" is tandem's when the model type has an
implementation. Either way the result is an FSDP2 module with `sequence_logprobs(input_ids,
position_ids, temperature, chunk_size)` as a forward method and `hf_config`, the checkpoint's
transformers config.

With `[trainer.lora]` the adapters (models/lora.py) are put on the linear layers before the
model is sharded, so FSDP2 shards them with their block; the base is frozen, and the adapters
are initialised after the base weights are loaded, identically on any number of ranks.
"""

from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoConfig, PretrainedConfig

from tandem.cli import UserError
from tandem.config.base import ModelConfig
from tandem.models.hf_checkpoint import (
    CheckpointError,
    SafetensorsReader,
    check_sources,
    expected_sources,
    read_region,
    sources_read,
)
from tandem.models.layers.attention import resolve_backend
from tandem.models.layers.moe import Router
from tandem.models.layers.transformer import CausalLM
from tandem.models.loading import DTYPES, load_model
from tandem.models.lora import Part, adapter_config, init_lora, inject_lora, is_adapter_tensor, linear_parts
from tandem.models.parallelism import ParallelPlan
from tandem.models.registry import FAMILIES, UnsupportedConfig, family
from tandem.models.source import model_source
from tandem.trainer.base_identity import base_identity
from tandem.trainer.config import LoRAConfig, MasterWeights, ParallelConfig
from tandem.trainer.logprobs import attach_sequence_logprobs
from tandem.trainer.parallel import (
    World,
    apply_fsdp,
    build_cp_mesh,
    build_mesh,
    compute_dtype_of,
    master_in_optimizer_policy,
    mixed_precision,
)
from tandem.trainer.weight_stream import persistent_tensors


def load_hf_config(name: str) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(model_source(name))
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load the config of model '{name}': {str(e).splitlines()[0]}") from None


def resolve_impl(cfg: ModelConfig, config: PretrainedConfig) -> str:
    """ "tandem" or "hf" for this checkpoint; impl = tandem on an unimplemented type is an error."""
    has_own = config.model_type in FAMILIES
    if cfg.impl == "tandem" and not has_own:
        raise UserError(
            f"model.impl = 'tandem' but model type '{config.model_type}' of {cfg.name} has no tandem "
            f"implementation (have: {', '.join(FAMILIES)}); use model.impl = 'hf' or 'auto'"
        )
    return "tandem" if cfg.impl in ("tandem", "auto") and has_own else "hf"


def build_trainer_model(
    cfg: ModelConfig,
    world: World,
    parallel: ParallelConfig,
    compute_dtype: str = "auto",
    load_weights: bool = True,
    lora: LoRAConfig | None = None,
    seed: int = 0,
    master_weights: MasterWeights = "model",
) -> nn.Module:
    """The model of `cfg.name`, sharded over the world; weights loaded unless `load_weights` is off
    (a resume then fills them from its checkpoint). With `lora` (enabled) only its adapters train;
    `seed` draws their initial values. master_weights = "optimizer": the parameters are held in the
    compute dtype, and the optimizer (trainer/master_weights.py) keeps their fp32 masters."""
    if parallel.activation_offload and world.device.type != "cuda":
        raise UserError(
            f"trainer.parallel.activation_offload needs a CUDA device: on {world.device.type} the activations "
            "are in host memory already"
        )
    config = load_hf_config(cfg.name)
    weights = torch.float32 if cfg.dtype == "auto" else DTYPES[cfg.dtype]
    lora = lora if lora_enabled(lora) else None
    impl = resolve_impl(cfg, config)
    master = master_weights == "optimizer"
    if master:
        _check_master_in_optimizer(weights, lora, impl)
        policy = master_in_optimizer_policy(world)
    else:
        policy = mixed_precision(world.device, weights, compute_dtype, adapters=lora is not None)
    if impl == "hf":
        for key in ("ep", "cp"):
            if getattr(parallel, key) > 1:
                raise UserError(
                    f"trainer.parallel.{key} > 1 needs tandem's model implementation (model.impl = 'tandem')"
                )
        if parallel.activation_checkpointing != "none" or parallel.activation_offload:
            raise UserError(
                "trainer.parallel.activation_checkpointing and activation_offload need tandem's model "
                "implementation (model.impl = 'tandem')"
            )
        if not parallel.reshard_after_forward:
            raise UserError(
                "trainer.parallel.reshard_after_forward = false needs tandem's model implementation "
                "(model.impl = 'tandem')"
            )
        if quantization(config) is not None:
            raise UserError(
                f"{cfg.name} is quantized (quantization_config quant_method = "
                f"{quantization(config).get('quant_method')!r}): model.impl = 'hf' trains unquantized "
                "checkpoints only; tandem's implementation (model.impl = 'tandem') dequantizes block-FP8 ones"
            )
        if Path(cfg.name).expanduser().is_dir():  # a missing or truncated file: one line naming it
            try:
                SafetensorsReader(Path(cfg.name).expanduser()).check_files()
            except CheckpointError as e:
                raise UserError(str(e)) from None
        model = load_model(
            cfg.model_copy(update={"dtype": str(weights).removeprefix("torch.")}), world.device
        )
        model.config.use_cache = False
        if lora is not None:
            _inject(model, linear_parts(None, model), lora, cfg.name, world)
        apply_fsdp(model, policy)
        if lora is not None:
            init_lora(model, seed, _fill_local)
        attach_sequence_logprobs(model)
        model.keep_head_logits = cfg.head_logits == "keep"
        model.hf_config = model.config
        model.train()
        return model

    fam = family(config.model_type)
    compute = compute_dtype_of(world.device, weights, compute_dtype)
    try:
        with torch.device("meta"):
            model = fam.build(config, resolve_backend(cfg.attention, world.device, compute)).to(weights)
        keep_fp32(model)
    except UnsupportedConfig as e:
        raise UserError(f"{cfg.name}: {e}; use model.impl = 'hf'") from None
    except ValueError as e:
        raise UserError(f"{cfg.name}: {e}") from None
    if master:
        _cast_parameters(model, compute)
    layouts = fam.hf_layout(config)
    if lora is not None:
        _inject(model, linear_parts(layouts, model), lora, cfg.name, world)
    compile_blocks = parallel.compile == "on" or (parallel.compile == "auto" and world.device.type == "cuda")
    plan = ParallelPlan(
        build_mesh(world, parallel.ep),
        policy,
        parallel.activation_checkpointing,
        compile_blocks,
        cp_mesh=build_cp_mesh(world, parallel.cp),
        cp_style=parallel.cp_style,
        activation_offload=parallel.activation_offload,
        reshard_after_forward=parallel.reshard_after_forward,
        fsdp=world.size > 1 or not master,  # one rank, bf16 parameters: nothing to shard or cast
    )
    try:
        fam.parallelize(model, plan)
    except ValueError as e:
        raise UserError(str(e)) from None
    model.to_empty(device=world.device)
    model.reset_buffers()
    if load_weights:
        load_hf_weights(
            model,
            layouts,
            local_checkpoint_dir(cfg.name),
            fam.hf_ignored(config),
            world,
            quantization(config),
        )
    _drop_quantization(config)  # the model holds dequantized weights: so do its exports
    if lora is not None:
        init_lora(model, seed, _fill_local)
    register_fsdp_forward_method(model, "sequence_logprobs")
    model.keep_head_logits = cfg.head_logits == "keep"
    model.dense_short_documents = cfg.sparse_attention == "long_documents"
    model.hf_config = config
    model.train()
    return model


def lora_enabled(lora: LoRAConfig | None) -> bool:
    """Whether the base weights are frozen (LoRA): checkpoints then hold only what trains, and a
    resume loads the base from the model's checkpoint first."""
    return lora is not None and lora.enabled


def _check_master_in_optimizer(weights: torch.dtype, lora: LoRAConfig | None, impl: str) -> None:
    key = "optim.master_weights = 'optimizer'"
    if weights != torch.float32:
        raise UserError(f"{key} keeps fp32 masters: model.dtype must be auto or float32, not {weights}")
    if lora is not None:
        raise UserError(f"{key} does not support LoRA; use optim.master_weights = 'model'")
    if impl == "hf":
        raise UserError(f"{key} needs tandem's model implementation (model.impl = 'tandem')")


def keep_fp32(model: nn.Module) -> None:
    """The routers' correction biases (and the weights of those transformers keeps in fp32) back
    to float32 after the model was cast to model.dtype: rounded to bf16 they chose other experts
    than the checkpoint's fp32 values, and exports wrote them rounded."""
    for module in model.modules():
        if isinstance(module, Router):
            module.keep_fp32()


def _cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Parameters (not buffers: router biases and counters stay fp32) to `dtype`, before sharding."""
    for param in model.parameters():
        param.data = param.data.to(dtype)


def _inject(
    model: nn.Module, parts: dict[str, list[Part]], lora: LoRAConfig, base: str, world: World
) -> None:
    """Adapters on the targeted linear layers; `model.adapter_config` is their adapter_config.json,
    `model.base_identity` the record of `base` that checkpoints keep (trainer/base_identity.py)."""
    try:
        adapted = inject_lora(
            model, parts, lora.target_modules, lora.rank, lora.alpha, lora.dropout, "lm_head"
        )
    except ValueError as e:
        raise UserError(str(e)) from None
    model.adapter_config = adapter_config(base, lora.rank, lora.alpha, lora.dropout, lora.target_modules)
    model.base_identity = base_identity(base, local_checkpoint_dir, world)
    mlp = sorted({m.rsplit(".", 1)[-1] for m in adapted} & {"gate_proj", "up_proj", "down_proj"})
    if world.is_main and mlp and any(name.endswith(".experts") for name, _ in model.named_modules()):
        print(
            f"trainer: warning: LoRA on {', '.join(mlp)} of a MoE model: peft maps those targets onto "
            "the fused experts and drops these adapters when it loads the PEFT export (docs/trainer.md, "
            "LoRA); final-merged/, tandem's engine and vLLM apply them",
            flush=True,
        )


def _fill_local(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's region of the full tensor `full` into `param` (a shard or a whole tensor)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    region = local_region(param)
    local.copy_(full[tuple(slice(a, b) for a, b in region)])


def local_checkpoint_dir(name: str) -> Path:
    """A local directory holding the checkpoint's safetensors (downloaded once for a hub name)."""
    if Path(name).expanduser().is_dir():
        return Path(name).expanduser()
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name, allow_patterns=["*.safetensors", "*.json"]))


def local_region(tensor: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """The (start, stop) of each dimension of the full tensor that this rank's shard holds."""
    if not isinstance(tensor, DTensor):
        return tuple((0, n) for n in tensor.shape)
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple((o, o + n) for o, n in zip(offset, shape, strict=True))


def quantization(config: PretrainedConfig) -> dict | None:
    """The checkpoint's quantization_config (config.json's), or None."""
    found = getattr(config, "quantization_config", None)
    return found.to_dict() if hasattr(found, "to_dict") else found


def _drop_quantization(config: PretrainedConfig) -> None:
    """Forget the checkpoint's quantization: the trainer's weights are not quantized, and a
    config.json written with them must not say they are."""
    if hasattr(config, "quantization_config"):
        del config.quantization_config


@torch.no_grad()
def load_hf_weights(
    model: CausalLM,
    layouts: dict,
    directory: Path,
    ignored: tuple[str, ...],
    world: World,
    quantization: dict | None = None,
) -> None:
    """Fill every parameter shard of `model` from the checkpoint in `directory` (each rank reads its
    part); `quantization` is its config's quantization_config (block-FP8 weights are dequantized)."""
    tensors = {n: t for n, t in persistent_tensors(model).items() if not is_adapter_tensor(n)}
    if set(layouts) != set(tensors):
        raise RuntimeError(
            f"state-dict adapter and model disagree: {sorted(set(layouts) ^ set(tensors))[:5]}"
        )
    try:
        reader = SafetensorsReader(directory, quantization)
        check_sources(reader, layouts, {name: tuple(t.shape) for name, t in tensors.items()})
        for name, tensor in tensors.items():
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            region = local_region(tensor)
            local.copy_(read_region(reader, layouts[name], region))
    except CheckpointError as e:
        raise UserError(str(e)) from None
    if world.is_main:
        used = {
            read
            for name, t in tensors.items()
            for s, _ in expected_sources(layouts[name], tuple(t.shape))
            for read in sources_read(reader, s)
        }
        unused = sorted(n for n in set(reader.weight_map) - used if not _is_ignored(n, ignored))
        if unused:
            print(
                f"trainer: {len(unused)} checkpoint tensors are not used by the model, e.g. {unused[0]}",
                flush=True,
            )


def _is_ignored(name: str, ignored: tuple[str, ...]) -> bool:
    """Whether `name` is one of `ignored`, or starts with one of its prefixes (ending in ".")."""
    return any(name == i or (i.endswith(".") and name.startswith(i)) for i in ignored)
