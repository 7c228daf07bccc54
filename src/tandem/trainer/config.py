"""Config sections shared by the SFT and RL trainers. Imports no torch: the launcher reads them."""

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tandem.config.base import CPStyle, Section

MasterWeights = Literal["model", "optimizer"]
ComputeDtype = Annotated[
    Literal["auto", "float32", "bfloat16"],
    Field(
        description="Dtype of forward/backward (FSDP2 mixed precision; grads reduced in fp32). "
        "auto = bfloat16 on GPU with fp32 weights, else the weights' dtype; float32 on GPU (with fp32 "
        "weights: model.dtype = float32) computes as on CPU, for numerics checks, at a fraction of the speed."
    ),
]
Beta = Annotated[float, Field(ge=0, lt=1)]
"""An AdamW beta: a moment's decay per step, in [0, 1) (torch refuses others when the trainer starts)."""


class OptimConfig(Section):
    """AdamW with linear warmup, then cosine, linear or constant decay."""

    lr: float = Field(3e-4, gt=0, description="Peak learning rate, reached after warmup.")
    weight_decay: float = Field(
        0.0, ge=0, description="AdamW weight decay, applied to matrices only (not norms or biases)."
    )
    betas: tuple[Beta, Beta] = Field((0.9, 0.999), description="AdamW betas (beta1, beta2), each in [0, 1).")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    warmup_steps: int = Field(0, ge=0, description="Steps of linear warmup from 0 to lr.")
    schedule: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Decay after warmup, down to min_lr_ratio × lr at max_steps."
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final learning rate as a fraction of lr.")
    max_grad_norm: float = Field(
        1.0, ge=0, description="Clip the global gradient norm to this; 0 = measure but do not clip."
    )
    master_weights: MasterWeights = Field(
        "model",
        description="Where the fp32 master weights live. model: the model's sharded parameters are fp32 "
        "and FSDP casts them to the compute dtype for every forward and backward; optimizer: the "
        "parameters are held in the compute dtype (bf16 on GPU) and the optimizer keeps an fp32 copy "
        "of each shard, updated with the fp32 moments in one fused pass that writes the parameter "
        "(no casts in FSDP; 2 more bytes a parameter). Not with LoRA or model.impl = 'hf' "
        "(docs/trainer.md, 'Master weights').",
    )
    moments_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Dtype AdamW stores its two moments in (master_weights = 'optimizer' only). bfloat16: "
        "8 bytes of optimizer state a parameter instead of 12 (20 GB less at 5 B parameters) and about "
        "20 instead of 28 bytes moved per parameter by the optimizer pass; the moments are computed in "
        "fp32 and stored with stochastic rounding (rounded to nearest, the second moment's small steps "
        "would be lost).",
    )

    overlap_step: bool = Field(
        True,
        description="With master_weights = 'optimizer' on one CUDA GPU (no FSDP): run the optimizer step on a "
        "CUDA stream of its own, block by block in the order the next forward reads the weights, so that "
        "forward starts while the later blocks are still being updated (0.4-1.7 % faster a step at the "
        "Qwen3-1.7B shape on H100s; docs/trainer.md, 'Master weights'). Elsewhere, or with false, the "
        "step runs in line.",
    )

    @model_validator(mode="after")
    def check_moments(self) -> "OptimConfig":
        if self.moments_dtype != "float32" and self.master_weights != "optimizer":
            raise PydanticCustomError(
                "moments",
                "moments_dtype = '{dtype}' needs master_weights = 'optimizer' (got '{where}'): "
                "torch's AdamW keeps fp32 moments",
                {"dtype": self.moments_dtype, "where": self.master_weights},
            )
        return self


class ParallelConfig(Section):
    """How the trainer's model is split over its ranks and how its blocks run (tandem's models)."""

    ep: int = Field(
        1,
        ge=1,
        description="Expert parallelism: split each MoE layer's experts over this many ranks (must divide "
        "the expert count and the world size); tokens move to their experts by all-to-all.",
    )
    cp: int = Field(
        1,
        ge=1,
        description="Context parallelism: split every packed row along the sequence over this many ranks "
        "(must divide the world size); they share each micro-batch, each holding 1/cp of its tokens.",
    )
    cp_style: CPStyle = Field(
        "ulysses",
        description="ulysses: all-to-all from sequence- to head-sharded around attention (query heads must "
        "be a multiple of cp; KV heads a multiple or divisor of it); ring: keys and values gathered "
        "from the cp ranks, rows split in 2·cp zigzag chunks for causal balance (any head counts). "
        "GLM-5's latent attention gathers its compressed keys in both styles; ring balances it.",
    )
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none",
        description="Recompute activations in backward to save memory: full = each block keeps only its "
        "input; selective = keeps its matmul and attention outputs, recomputes the rest.",
    )
    activation_offload: bool = Field(
        False,
        description="Keep what each block saves for backward in pinned host memory instead of on the GPU: "
        "with activation_checkpointing = none all its activations, with full only its input (the "
        "longest rows on one GPU). CUDA only; not with selective.",
    )
    compile: Literal["auto", "on", "off"] = Field(
        "auto", description="torch.compile each decoder block; auto = on for CUDA, off on CPU."
    )
    reshard_after_forward: bool = Field(
        True,
        description="FSDP frees each block's gathered compute-dtype weights after its forward and gathers "
        "them again for backward (FSDP's default). false keeps them from forward to backward: one "
        "gather (on one GPU: one fp32-to-bf16 cast) per step instead of two, for 2 bytes a parameter "
        "held through the step. tandem's models only.",
    )

    @model_validator(mode="after")
    def check_offload(self) -> "ParallelConfig":
        if self.activation_offload and self.activation_checkpointing == "selective":
            raise PydanticCustomError(
                "offload",
                "activation_offload works with activation_checkpointing = 'none' or 'full', not "
                "'selective' (what selective keeps bypasses the offload hooks)",
            )
        return self

    @property
    def recomputes(self) -> bool:
        """Whether backward runs each block's forward again (MoE load counters see it twice)."""
        return self.activation_checkpointing != "none"


PEFT_DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoRAConfig(Section):
    """Low-rank adapters (LoRA): only they train; the base weights stay frozen (docs/trainer.md, "LoRA").

    A targeted linear layer W computes W·x + (alpha / rank)·B·A·dropout(x), A [rank, in] and
    B [out, rank], B starting at zero. Modules are named as in the Hugging Face checkpoint, for
    tandem's models (whose fused q|k|v and gate|up get one adapter per projection) as for
    transformers' models; saved adapters are in the PEFT layout."""

    enabled: bool = Field(True, description="Train adapters; the section's presence turns LoRA on.")
    rank: int = Field(16, gt=0, description="Rank r of each adapter.")
    alpha: float = Field(32.0, gt=0, description="Scale numerator: the update is (alpha / rank)·B·A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input (training only).")
    target_modules: list[str] | str = Field(
        default_factory=lambda: list(PEFT_DEFAULT_TARGETS),
        description="Linear modules to adapt, by Hugging Face module name, as PEFT matches them: a list "
        "matches a module whose name is an entry or ends with '.' + an entry; a string is a regular "
        "expression the whole name must match. Not the output head, the embedding or MoE experts.",
    )

    @field_validator("target_modules")
    @classmethod
    def some_modules(cls, targets: list[str] | str) -> list[str] | str:
        """An empty list adapts nothing: the trainer would fail at start, after the servers."""
        if targets == []:
            raise PydanticCustomError("empty", "is empty: name a module, or leave the key out (the default)")
        return targets
