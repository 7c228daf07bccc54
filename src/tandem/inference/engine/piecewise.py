"""Steps with prompts as CUDA graphs of the model's work between attention calls ("piecewise").

A pure decode step is one CUDA graph (model_runner.py). A step with prompts or prompt chunks
cannot be: its attention depends on how its rows divide into sequences, which changes from step
to step. The rest of a layer works row by row, so it is captured per token-count bucket, in
pieces that end where attention begins:

    piece 0    the embedding, layer 0 up to attention (norm, q|k|v projection, q/k norm,
               rotary, keys and values written to their cache slots)
    piece i    layer i-1 after attention (output projection, norm, MLP), layer i up to attention
    piece L    layer L-1 after attention, the final norm

A step of T rows runs at the smallest bucket of at least T rows: its rows, then padding rows
(token 0 at position 0, written to slot 0 of block 0, which is never handed out). Between two
pieces, attention runs eagerly over the T real rows with the step's metadata (attention.py) and
writes its result into the buffer the next piece reads. So a step's host work is L + 1 graph
replays and L attention calls rather than every launch of the forward: prompt steps of a
Qwen3-0.6B shape were host-bound without it (docs/benchmarks.md).

Memory: the pieces of all buckets share one graph pool. A piece's outputs are held until the
next piece has been captured, and from then on only through aliases that do not own their
memory, so the pool holds about what one eager forward at the largest bucket allocates, not
every layer's q, k and v. This is sound because a bucket's pieces always replay in the order
they were captured, nothing else allocates from the pool, and nothing a piece leaves there is
read after the step that wrote it (the runner gathers the rows it needs from the hidden states
before anything replays again).

Without graphs (on CPU) the same pieces run eagerly over the padded rows: the layout without
the speed-up, which the CPU tests check against the plain forward.
"""

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from tandem.inference.engine.attention import AttentionMetadata, paged_attention
from tandem.inference.engine.models.layers import CausalLM
from tandem.inference.engine.transfer import copy_to

log = logging.getLogger("tandem.inference")
ID, POSITION, SLOT, FEED = range(4)  # rows of a bucket's packed inputs
SMALL_BUCKETS = (16, 32, 64, 128, 256, 512)
BUCKET_STEP = 512  # above the small buckets: every this many rows


def token_buckets(max_tokens: int) -> list[int]:
    """Row counts the pieces are captured at: SMALL_BUCKETS, then every BUCKET_STEP rows, up to
    the first that holds `max_tokens` (a step's token budget)."""
    buckets = [b for b in SMALL_BUCKETS if b < max_tokens]
    size = SMALL_BUCKETS[-1]
    while size + BUCKET_STEP < max_tokens:
        size += BUCKET_STEP
        buckets.append(size)
    return [*buckets, max_tokens]


@dataclass
class _Bucket:
    inputs: torch.Tensor  # [4, rows] int64: token ids, positions, cache slots, feed rows (-1: none)
    outputs: list[tuple[torch.Tensor, ...]]  # per piece: (q, k, v, residual), the last (hidden,)
    graphs: list[torch.cuda.CUDAGraph] | None = None  # None: the pieces run eagerly


class PiecewiseForward:
    """The model's forward over a step's rows as pieces between attention calls. Invariants:
    the pieces of a bucket run in order 0…L within one `forward`; `attended` and each bucket's
    `inputs` live outside the graph pool, for as long as the graphs."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, ...]],
        sampled: torch.Tensor,
        max_tokens: int,
        use_graphs: bool,
    ) -> None:
        self.model = model
        self.layers = list(model.model.layers)
        self.kv_caches = kv_caches
        self.sampled = sampled  # the last step's draws (model_runner.py): fed input tokens come from here
        self.sizes = token_buckets(max_tokens)
        attention = self.layers[0].self_attn
        embedding = model.model.embed_tokens.weight
        self.attended = torch.zeros(  # attention's result, read by the piece after it
            self.sizes[-1],
            attention.num_heads,
            attention.head_dim,
            dtype=embedding.dtype,
            device=embedding.device,
        )
        self.device = embedding.device
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.capture_stream = torch.cuda.Stream() if use_graphs else None
        self.buckets: dict[int, _Bucket] = {}
        self.failed = False  # a capture failed: steps with prompts run the plain forward from then on

    def fits(self, rows: int) -> bool:
        """Whether a step of `rows` rows runs as pieces (not after a capture failed)."""
        return rows <= self.sizes[-1] and not self.failed

    def forward(
        self,
        ids: list[int],
        positions: np.ndarray,
        slots: np.ndarray,
        feed: np.ndarray | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of a step's T rows (`feed[r]` ≥ 0: row r's input token is
        `sampled[feed[r]]`); `meta` is the step's attention metadata over those rows."""
        rows = len(ids)
        size = next(b for b in self.sizes if b >= rows)
        host = np.zeros((4, size), dtype=np.int64)  # padding: token 0 at position 0, slot 0
        host[ID, :rows] = ids
        host[POSITION, :rows] = positions
        host[SLOT, :rows] = slots
        host[FEED] = -1
        if feed is not None:
            host[FEED, :rows] = feed
        bucket = self.buckets.get(size) or self._bucket(size)
        copy_to(bucket.inputs, torch.from_numpy(host))
        self._run(bucket, 0)
        for index, layer in enumerate(self.layers):
            q, k, v = (t[:rows] for t in bucket.outputs[index][:3])
            paged_attention(
                q, k, v, *self.kv_caches[index], meta, layer.self_attn.scale, out=self.attended[:rows]
            )
            self._run(bucket, index + 1)
        return bucket.outputs[-1][0][:rows]

    def _run(self, bucket: _Bucket, index: int) -> None:
        if bucket.graphs is None:
            bucket.outputs[index] = self._piece(index, bucket)
        else:
            bucket.graphs[index].replay()

    def _piece(self, index: int, bucket: _Bucket) -> tuple[torch.Tensor, ...]:
        """The model's work of piece `index` over the bucket's rows (a new Rope each time: a
        piece keeps nothing another piece computed, outside its outputs)."""
        inputs = bucket.inputs
        size = inputs.shape[1]
        if index == 0:
            feed = inputs[FEED]
            ids = torch.where(feed >= 0, self.sampled[feed.clamp(min=0)], inputs[ID])
            x, residual = self.model.model.embed_tokens(ids), None
        else:
            residual = bucket.outputs[index - 1][3]
            x, residual = self.layers[index - 1].after_attention(self.attended[:size], residual)
        if index == len(self.layers):
            return (self.model.model.norm(x, residual)[0],)
        meta = AttentionMetadata(slot_mapping=inputs[SLOT])
        rope = self.model.rotary(inputs[POSITION])
        return self.layers[index].attention_inputs(x, residual, rope, self.kv_caches[index], meta)

    def _bucket(self, size: int) -> _Bucket:
        inputs = torch.zeros(4, size, dtype=torch.int64, device=self.device)
        inputs[FEED] = -1
        bucket = _Bucket(inputs, [()] * (len(self.layers) + 1))
        if self.pool is not None:
            start = time.perf_counter()
            try:
                self._capture(bucket)
            except RuntimeError as e:  # this step runs its pieces eagerly; later ones the plain forward
                torch.cuda.synchronize()
                log.warning(
                    "steps with prompts run without graphs: capturing a piece failed (%s)", str(e)[:300]
                )
                self.failed = True
                bucket.outputs = [()] * len(bucket.outputs)
                return bucket
            log.info(
                "prompt-step graphs for %d rows: %d pieces captured in %.2f s",
                size,
                len(bucket.outputs),
                time.perf_counter() - start,
            )
        self.buckets[size] = bucket
        return bucket

    def _capture(self, bucket: _Bucket) -> None:
        """Each piece once eagerly (kernel compilation, library setup), then each captured in
        order into the shared pool; a piece's outputs lose their hold on the pool once the next
        piece is captured (module docstring). The eager run allocates on the step's own stream,
        whose cached memory later steps reuse, and every capture runs on one side stream: memory
        cached for a stream serves only that stream."""
        pieces = len(bucket.outputs)
        for index in range(pieces):
            bucket.outputs[index] = self._piece(index, bucket)
        bucket.outputs = [()] * pieces
        torch.cuda.synchronize()
        graphs = []
        stream = self.capture_stream
        with torch.cuda.stream(stream):
            for index in range(pieces):
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(pool=self.pool)
                try:
                    bucket.outputs[index] = self._piece(index, bucket)
                finally:
                    graph.capture_end()
                graphs.append(graph)
                if index > 0:
                    bucket.outputs[index - 1] = tuple(map(unowned, bucket.outputs[index - 1]))
            bucket.outputs[-1] = tuple(map(unowned, bucket.outputs[-1]))
        torch.cuda.current_stream().wait_stream(stream)
        bucket.graphs = graphs


class _DeviceMemory:
    """A span of device memory under the CUDA array interface, for `torch.as_tensor`."""

    def __init__(self, pointer: int, size: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (pointer, False),
            "strides": None,
            "version": 2,
        }


def unowned(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over `tensor`'s memory that does not keep that memory allocated: once `tensor` is
    freed the allocator may hand the memory out again, and the alias sees whatever is written
    there (for graph outputs whose memory later captures reuse; CUDA only)."""
    storage = tensor.untyped_storage()
    raw = torch.as_tensor(_DeviceMemory(storage.data_ptr(), storage.nbytes()), device=tensor.device)
    return raw.view(tensor.dtype).as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
