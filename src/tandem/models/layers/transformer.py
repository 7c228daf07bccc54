"""The decoder shell every family shares: embeddings, pre-norm blocks, final norm, output head.

    x = embed(ids)
    for each block:  x = x + attention(norm₁(x));  x = x + mlp(norm₂(x))
    hidden = norm(x);  logits = hidden · headᵀ     (head = the embedding when tied)

A family's model.py only chooses the attention and MLP (dense, MoE) of each block. Inputs are
packed rows: `input_ids` and `position_ids` [rows, width], documents separated where the
position ids restart at 0 (layers/attention.py). There is no KV cache: this is the trainer's
model; the inference engine has its own.

Under context parallelism (`context_parallel`, set by models/context_parallel.py) the model is
still given the whole rows of the micro-batch, and runs on this rank's columns of them only:
`hidden_states` and `sequence_logprobs` then return [rows, this rank's columns].
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.layers.attention import PackedDocs
from tandem.models.layers.chunked_head import chunked_logprobs, next_token_logprobs
from tandem.models.layers.norm import RMSNorm
from tandem.models.layers.rotary import RotaryEmbedding, apply_rotary


class Attention(nn.Module):
    """Grouped-query attention with q, k and v as one matmul and optional QK RMSNorm.

    qk_norm = "head" normalises each head (Qwen3), "full" the whole projection (MiniMax-M2).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qk_norm: str | None,
        eps: float,
        qkv_bias: bool = False,
        out_bias: bool = False,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.wqkv = nn.Linear(dim, (num_heads + 2 * num_kv_heads) * head_dim, bias=qkv_bias)
        self.wo = nn.Linear(num_heads * head_dim, dim, bias=out_bias)
        self.qk_norm = qk_norm
        if qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)
        elif qk_norm == "full":
            self.q_norm, self.k_norm = (
                RMSNorm(num_heads * head_dim, eps),
                RMSNorm(num_kv_heads * head_dim, eps),
            )
        elif qk_norm is not None:
            raise ValueError(f"unknown qk_norm {qk_norm!r}")

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: PackedDocs
    ) -> torch.Tensor:
        rows, width, _ = x.shape
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_width, kv_width, kv_width], dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(rows, width, self.num_heads, self.head_dim)
        k = k.view(rows, width, self.num_kv_heads, self.head_dim)
        v = v.view(rows, width, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = docs.attend(q, k, v, self.head_dim**-0.5)
        return self.wo(out.reshape(rows, width, q_width))


class DecoderLayer(nn.Module):
    def __init__(self, attention: nn.Module, mlp: nn.Module, dim: int, eps: float) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim, eps)
        self.attention = attention
        self.mlp_norm = RMSNorm(dim, eps)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: PackedDocs
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, docs)
        return x + self.mlp(self.mlp_norm(x))


class CausalLM(nn.Module):
    """A decoder-only language model over packed rows (see the module docstring)."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        layers: list[DecoderLayer],
        rotary: RotaryEmbedding,
        eps: float,
        tie_embeddings: bool,
        attention_backend: str = "sdpa",
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(dim, eps)
        self.head = None if tie_embeddings else nn.Linear(dim, vocab_size, bias=False)
        self.rotary = rotary
        self.attention_backend = attention_backend
        self.context_parallel = None  # a ContextParallel when the rows are split over ranks
        self.shared_prompts = False  # the rows may hold shared prompts (layers/attention.py); set per batch
        self.keep_head_logits = False  # model.head_logits = "keep" (layers/chunked_head.py)
        # set by an optimizer whose step runs on a stream of its own (trainer/step_stream.py):
        # called with a `weight_units` index before that unit is used, with None before all of them
        self.weights_barrier: Callable[[int | None], None] | None = None

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.head is None else self.head.weight

    @property
    def supports_shared_prompts(self) -> bool:
        """Whether rows with shared prompts can be attended as they must (layers/attention.py)."""
        return self.attention_backend in ("sdpa", "flex") and self.context_parallel is None

    def weight_units(self) -> list[list[nn.Parameter]]:
        """The parameters in the order a forward first uses them, one list per `await_weights`
        unit: the embedding (with a tied head), each block, then the final norm and an untied head."""
        last = [*self.norm.parameters(), *(self.head.parameters() if self.head is not None else ())]
        return [list(self.embed.parameters()), *(list(layer.parameters()) for layer in self.layers), last]

    def await_weights(self, unit: int | None = None) -> None:
        """Before unit `unit` of `weight_units` (None: any weight) is read: wait for an optimizer
        step still running on a stream of its own (trainer/step_stream.py); nothing otherwise."""
        if self.weights_barrier is not None:
            self.weights_barrier(unit)

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if self.context_parallel is None:
            docs = self.documents(position_ids)
        else:
            input_ids, position_ids, docs = self.context_parallel.shard(
                input_ids, position_ids, self.attention_backend
            )
        self.await_weights(0)
        x = self.embed(input_ids)
        cos, sin = self.rotary(position_ids, x.dtype)
        x = self.blocks(x, cos, sin, docs, position_ids)
        self.await_weights(len(self.layers) + 1)
        return self.norm(x)

    def documents(self, position_ids: torch.Tensor) -> PackedDocs:
        """What every layer's attention needs to know of the rows' documents (a family whose
        attention finds them otherwise overrides this)."""
        return PackedDocs.from_positions(
            position_ids, self.attention_backend, shared_prompts=self.shared_prompts
        )

    def blocks(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        docs: PackedDocs,
        position_ids: torch.Tensor,
    ) -> torch.Tensor:
        """The decoder layers over x (a family that passes more between layers overrides this)."""
        for index, layer in enumerate(self.layers, start=1):
            self.await_weights(index)
            x = layer(x, cos, sin, docs)
        return x

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Full logits [rows, width, vocab] (for tests and small batches; training uses sequence_logprobs)."""
        return F.linear(self.hidden_states(input_ids, position_ids), self.head_weight)

    def sequence_logprobs(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        temperature: float = 1.0,
        chunk_size: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token logprob of each token given those before it, and the entropy there, [rows, width];
        column 0 is 0. The head runs chunk by chunk (layers/chunked_head.py).

        Under context parallelism: [rows, this rank's columns], entry j the prediction made at
        column j of the shard, i.e. of the token after it; `context_parallel.tokens` takes the
        same entries of any tensor aligned with the tokens (loss mask, sampler logprobs...)."""
        hidden = self.hidden_states(input_ids, position_ids)
        if self.context_parallel is None:
            return next_token_logprobs(
                hidden, self.head_weight, input_ids, temperature, chunk_size, self.keep_head_logits
            )
        targets = self.context_parallel.tokens(input_ids)
        logprobs, entropy = chunked_logprobs(
            hidden, self.head_weight, targets, temperature, chunk_size, self.keep_head_logits
        )
        return logprobs.clone(), entropy.clone()  # not views: FSDP's backward hook must see them

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Random init like transformers' (normal(0, std) matrices, unit norms, zero biases)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (RMSNorm, nn.LayerNorm)):
                module.reset_parameters()
            elif hasattr(module, "init_weights") and module is not self:
                module.init_weights(std)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (after materialising from the meta device)."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_buffers"):
                module.reset_buffers()
