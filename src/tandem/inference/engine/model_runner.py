"""Runs the model over a scheduled batch: owns the KV cache, builds the flattened inputs and
attention metadata, and replays CUDA graphs for decode steps.

A decode step's inputs travel as one int64 array (token ids, positions, cache slots, context
lengths, feed rows, then the block tables): one host→device copy, built with numpy from the
block manager's table array. A sequence whose input token is still on the device (drawn by the
step before, not yet read back: core.py) takes it from `sampled`, the buffer every step's draws
are written to, by an index into it; that gather is part of the step (and of its graph), so
nothing waits for the host. Decode graphs are captured lazily, per block-table width bucket:
the first step at a width captures every batch bucket's graph for it. Padded rows write into
block 0 (never handed out) and attend to one slot of it. On CPU a decode step and the output
head run at least MIN_CPU_ROWS rows (padded the same way): CPU matrix products of 1–3 rows
round differently from larger ones (measured with MKL), which would make a sequence's logits
depend on how many others share its step.

Steps with prompts run (`engine.prompt_graphs`, by default on CUDA) as CUDA graphs of the work
between attention calls at a padded token count (piecewise.py), or the model's forward as it is.

Prompt steps can run their SDPA calls under a chosen set of kernels (`prompt_attention`):
PyTorch's cuDNN attention keeps the execution graph it builds for each input shape in a
thread-local cache, and prompt batches take a new shape at most steps. With `varlen` whole
prompts skip the padded batch: one variable-length flash call over their rows.
"""

import logging
import math
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tandem.cli import UserError
from tandem.inference.engine.attention import AttentionMetadata, Chunks, Decodes, Prompts, VarlenPrompts
from tandem.inference.engine.block_manager import BlockManager
from tandem.inference.engine.models import model_class
from tandem.inference.engine.piecewise import PiecewiseForward
from tandem.inference.engine.scheduler import ScheduledBatch
from tandem.inference.engine.sequence import PLACEHOLDER, Sequence
from tandem.inference.engine.transfer import copy_to, host_to_device, to_device

if TYPE_CHECKING:
    from tandem.inference.config import InferenceConfig

log = logging.getLogger("tandem.inference")
GiB = 1 << 30
CPU_DEFAULT_KV_GB = 1.0
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
MIN_CPU_ROWS = 4  # on CPU: matrix products of at least this many rows give each row the same bits
CHUNK_GATHER_TOKENS = 1 << 16  # most cached keys one chunk-attention call gathers (batch × context)
ID, POSITION, SLOT, CONTEXT, FEED = range(5)  # rows of a decode step's packed inputs
NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# engine.prompt_attention → the SDPA backends of prompt steps on CUDA (None: torch's own choice)
PROMPT_KERNELS = {"auto": None, "flash": NO_CUDNN, "varlen": NO_CUDNN}


def rows_round_alike(model: torch.nn.Module, min_rows: int = MIN_CPU_ROWS) -> bool:
    """Whether this machine's matrix products give a row the same bits whatever batch of at least
    `min_rows` rows it sits in, and wherever in it: what MIN_CPU_ROWS relies on for batch-independent
    logprobs on one CPU thread. No BLAS promises it; measured true with MKL on the 2-core AMD EPYC
    machines here. Probed on the model's own 2-D weights (one per shape), with a few batch sizes
    and positions: milliseconds for the tiny models, ~2 s for a Qwen3-0.6B shape on one thread."""
    weights = {tuple(p.shape): p for p in model.parameters() if p.dim() == 2 and p.is_floating_point()}
    generator = torch.Generator(device="cpu").manual_seed(0)
    batches = sorted({min_rows + 1, 2 * min_rows + 1, 4 * min_rows, 8 * min_rows + 1})
    for weight in weights.values():
        rows = torch.randn(batches[-1] + 1, weight.shape[1], generator=generator).to(weight)
        alone = torch.nn.functional.linear(rows[:min_rows], weight)[0]
        for batch in batches:
            for position in (0, batch - 1):
                x = rows[1 : batch + 1].clone()
                x[position] = rows[0]
                if not torch.equal(torch.nn.functional.linear(x, weight)[position], alone):
                    return False
    return True


def kv_bytes_per_block(config: object, block_size: int, dtype: torch.dtype) -> int:
    per_layer = sum(math.prod(shape) for shape in model_class(config).cache_shapes(config))
    return config.num_hidden_layers * per_layer * block_size * torch.finfo(dtype).bits // 8


def kv_cache_blocks(
    config: "InferenceConfig",
    model_config: object,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
) -> int:
    """Blocks of the KV cache (the scratch block included): `engine.kv_cache_memory_gb`, else on
    CUDA what `gpu_memory_utilization` leaves free after a reserve for activations and logits,
    else on CPU what `max_num_seqs` full contexts need, at most 1 GiB."""
    cfg = config.engine
    per_block = kv_bytes_per_block(model_config, cfg.block_size, dtype)
    if cfg.kv_cache_memory_gb is not None:
        budget = cfg.kv_cache_memory_gb * GiB
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserve = 2 * GiB + cfg.max_num_batched_tokens * model_config.vocab_size * 4  # activations, logits
        budget = free - (1 - cfg.gpu_memory_utilization) * total - reserve
    else:
        needed = cfg.max_num_seqs * (max_model_len + cfg.block_size) * per_block / cfg.block_size
        budget = min(CPU_DEFAULT_KV_GB * GiB, needed)
    num_blocks = int(budget // per_block) + 1  # + the scratch block
    if num_blocks < 2 or (num_blocks - 1) * cfg.block_size < min(max_model_len, 256):
        raise UserError(
            f"the KV-cache budget ({budget / GiB:.3f} GiB) holds too few tokens for this model: "
            "raise engine.kv_cache_memory_gb or engine.gpu_memory_utilization"
        )
    return num_blocks


@dataclass
class Feed:
    """The previous step's draws: row i of `ModelRunner.sampled` was drawn for `seqs[i]` (None:
    a sample forked off at that step)."""

    seqs: list[Sequence | None]
    _rows: dict[int, int] | None = None

    def row(self, seq: Sequence) -> int:
        if self._rows is None:
            self._rows = {s.seq_id: i for i, s in enumerate(self.seqs) if s is not None}
        return self._rows[seq.seq_id]


@dataclass
class RunOutput:
    logits: (
        torch.Tensor
    )  # [rows, vocab] (model dtype): the last token of each sequence whose uncached tokens all ran
    lens: np.ndarray | None = None  # decode steps: each sequence's token count (= the drawn token's position)
    positions: torch.Tensor | None = None  # the same on the device


@dataclass
class _DecodeGraph:
    graph: torch.cuda.CUDAGraph
    packed: torch.Tensor  # the packed inputs: [5, batch] rows, then the [batch, width] tables
    inputs: torch.Tensor
    tables: torch.Tensor
    hidden: torch.Tensor


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        cuda_graphs: bool,
        max_num_seqs: int,
        max_rows: int,
        prompt_attention: str,
        prompt_graphs: bool | None,
        max_tokens: int,
    ) -> None:
        self.model = model
        self.prompt_kernels = PROMPT_KERNELS[prompt_attention] if device.type == "cuda" else None
        self.varlen_prompts = prompt_attention == "varlen"
        self.device = device
        self.block_size = block_size
        config = model.config
        layers = config.num_hidden_layers
        self.kv_cache = [  # per cache part (keys, values; or a latent and indexer keys): [layers, blocks, ...]
            torch.zeros((layers, num_blocks, block_size, *shape), dtype=dtype, device=device)
            for shape in model.cache_shapes(config)
        ]
        self.kv_caches = [tuple(part[i] for part in self.kv_cache) for i in range(layers)]
        self.prompts_from_cache = getattr(model, "prompts_from_cache", False)
        self.sampled = torch.zeros(max_rows, dtype=torch.int64, device=device)  # the last step's draws
        self.use_graphs = cuda_graphs and device.type == "cuda" and model.graph_safe(dtype)
        self.max_graph_batch = (
            max(b for b in BATCH_BUCKETS if b <= max(max_num_seqs, 1)) if self.use_graphs else 0
        )
        self.graphs: dict[tuple[int, int], _DecodeGraph] = {}
        self.graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.min_rows = MIN_CPU_ROWS if device.type == "cpu" else 1
        if device.type == "cpu" and torch.get_num_threads() == 1 and not rows_round_alike(model):
            log.warning(
                "this CPU's matrix products round a row differently by batch size even at %d or more "
                "rows: a sequence's logprobs depend on what shares its steps, so seeded runs repeat "
                "their tokens but not their bits (docs/async.md, 'Reproducible runs')",
                MIN_CPU_ROWS,
            )
        self.replay_events: list | None = None  # set to a list to time every graph replay (benchmarks)
        self.piecewise = self._piecewise(prompt_graphs, cuda_graphs, dtype, max_tokens)

    def _piecewise(
        self, wanted: bool | None, cuda_graphs: bool, dtype: torch.dtype, max_tokens: int
    ) -> PiecewiseForward | None:
        """Steps with prompts as pieces between attention calls (`engine.prompt_graphs`): graphed on
        CUDA, eager on CPU (piecewise.py); None where the model or the settings do not allow it
        (with a warning when they were asked for), or by default on CPU."""
        cuda = self.device.type == "cuda"
        if wanted is False or (wanted is None and not cuda):
            return None
        why_not = (
            "the model's layers do not split at attention" if not self.model.splits_at_attention()
            else "engine.cuda_graphs is off" if cuda and not cuda_graphs
            else "the model's steps cannot be captured in this dtype" if cuda and not self.model.graph_safe(dtype)
            else None
        )  # fmt: skip
        if why_not is not None:
            (log.warning if wanted else log.info)(
                "engine.prompt_graphs: steps with prompts run without graphs (%s)", why_not
            )
            return None
        return PiecewiseForward(self.model, self.kv_caches, self.sampled, max_tokens, use_graphs=cuda)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src, dst = self._tensor([[p[0] for p in pairs], [p[1] for p in pairs]])
            for part in self.kv_cache:
                part[:, dst] = part[:, src]

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, blocks: BlockManager, feed: Feed | None = None) -> RunOutput:
        """Logits of the last token of every sequence whose uncached tokens all ran. An input
        token that is still a placeholder is taken from `sampled` at its row in `feed`."""
        if batch.all_decodes:
            return self._decode(batch, blocks, feed)
        seqs, counts = batch.seqs, batch.num_new_tokens
        n = len(seqs)
        cached = np.fromiter((s.num_cached for s in seqs), np.int64, n)
        lens = np.asarray(counts, dtype=np.int64)
        decodes: list[int] = []  # batch positions of each kind of sequence
        prompts: list[int] = []
        chunks: list[int] = []
        for i, (seq, count) in enumerate(zip(seqs, counts, strict=True)):
            # a prompt with nothing cached is attended by itself, else as a chunk over the cache
            whole = seq.num_cached == 0 and not self.prompts_from_cache
            (decodes if count == 1 else prompts if whole else chunks).append(i)
        # the step's rows: the decodes, then the whole prompts, then the chunks (so each kind is one
        # run of rows that attention takes as a view); `starts` is each sequence's first row
        order = np.asarray(decodes + prompts + chunks, dtype=np.int64)
        starts = np.empty(n, dtype=np.int64)
        starts[order] = np.cumsum(lens[order]) - lens[order]
        ids: list[int] = []
        fed: list[tuple[int, Sequence]] = []  # (row, sequence) of placeholder input tokens
        for i in order.tolist():
            seq, start = seqs[i], seqs[i].num_cached
            if counts[i] == 1 and seq.token_ids[start] == PLACEHOLDER:
                fed.append((len(ids), seq))
                ids.append(0)
            else:
                ids += seq.token_ids[start : start + counts[i]]
        # every row's position and cache slot, from the block manager's table array
        of_row = np.repeat(order, lens[order])
        positions = np.arange(len(ids)) - (starts - cached)[of_row]
        table_rows = np.fromiter((s.table_row for s in seqs), np.int64, n)
        size = self.block_size
        slots = blocks.tables[table_rows[of_row], positions // size] * size + positions % size
        done = cached + lens == np.fromiter((s.num_tokens for s in seqs), np.int64, n)
        last_rows = (starts + lens - 1)[done]  # sequences whose uncached tokens all run now
        piecewise = self.piecewise is not None and self.piecewise.fits(len(ids))
        meta = AttentionMetadata(slot_mapping=None if piecewise else self._array(slots))
        if decodes:
            width = max(len(seqs[i].block_table) for i in decodes)
            meta.decodes = Decodes(
                rows=slice(0, len(decodes)),
                block_tables=self._array(blocks.tables[table_rows[decodes], :width]),
                context_lens=self._array(cached[decodes] + 1),
            )
        if prompts:
            first = int(starts[prompts[0]])
            span = slice(first, first + int(lens[prompts].sum()))
            if self.varlen_prompts:
                meta.prompts = self._varlen_prompts(lens[prompts], span, every_row=len(prompts) == n)
            else:
                meta.prompts = self._padded_prompts(starts[prompts], lens[prompts], span)
        meta.chunks = self._chunks(batch, blocks, chunks, starts, table_rows)
        src = None
        if fed:
            src = np.full(len(ids), -1, dtype=np.int64)
            for row, seq in fed:
                src[row] = _feed_row(feed, seq)
        with self._prompt_kernels():
            if piecewise:
                hidden = self.piecewise.forward(ids, positions, slots, src, meta)
            else:
                input_ids = self._tensor(ids)
                if src is not None:
                    input_ids = self._feed(input_ids, self._array(src))
                hidden = self.model(input_ids, self._array(positions), self.kv_caches, meta)
        return RunOutput(self._logits(hidden[self._array(last_rows)]))

    def _prompt_kernels(self) -> AbstractContextManager:
        # sdpa_kernel sets process-wide flags: only the engine's own thread runs SDPA in a server
        return nullcontext() if self.prompt_kernels is None else sdpa_kernel(self.prompt_kernels)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head over `hidden`'s rows, run over at least `min_rows` rows (when any)."""
        rows = hidden.shape[0]
        if rows == 0 or rows >= self.min_rows:
            return self.model.logits(hidden)
        padded = torch.cat([hidden, hidden[-1:].expand(self.min_rows - rows, -1)])
        return self.model.logits(padded)[:rows]

    def _tensor(self, values: list) -> torch.Tensor:
        return to_device(values, torch.int64, self.device)

    def _array(self, values: np.ndarray) -> torch.Tensor:
        """An int64 numpy array on the device (no stream sync)."""
        return host_to_device(torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)), self.device)

    def _padded(
        self, starts: np.ndarray, lens: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Runs of the step's token rows (`lens[i]` rows from `starts[i]`) as a padded [B, L]
        index (padding repeats a valid row), the valid rows in order, and their positions in
        the flattened [B * L] batch."""
        j = np.arange(lens.max())[None, :]
        index = starts[:, None] + np.minimum(j, lens[:, None] - 1)
        valid = j < lens[:, None]
        return self._array(index), self._array(index[valid]), self._array(np.flatnonzero(valid))

    def _padded_prompts(self, starts: np.ndarray, lens: np.ndarray, span: slice) -> Prompts:
        """Whole prompts (`lens[i]` rows from `starts[i]`, together the rows `span`) as one padded
        batch; prompts of one length are a view of their rows, without padding or mask."""
        longest = int(lens.max())
        if lens.min() == longest:
            return Prompts(None, None, span, None, longest)
        index, token_rows, picks = self._padded(starts, lens)
        valid = torch.arange(longest, device=self.device)[None, :] < self._array(lens)[:, None]
        causal = torch.ones(longest, longest, dtype=torch.bool, device=self.device).tril()
        return Prompts(index, (causal[None] & valid[:, None, :])[:, None], token_rows, picks, longest)

    def _varlen_prompts(self, lens: np.ndarray, span: slice, every_row: bool) -> VarlenPrompts:
        """Prompts of `lens[i]` rows, side by side in the rows `span`, as segments of one run."""
        offsets = np.zeros(len(lens) + 1, dtype=np.int32)
        np.cumsum(lens, out=offsets[1:])
        cu_seqlens = host_to_device(torch.from_numpy(offsets), self.device)
        return VarlenPrompts(None if every_row else span, cu_seqlens, int(lens.max()))

    def _chunks(
        self,
        batch: ScheduledBatch,
        blocks: BlockManager,
        chunks: list[int],
        starts: np.ndarray,
        table_rows: np.ndarray,
    ) -> list[Chunks]:
        """Chunks continuing a cached prefix, in groups whose gathered keys stay under CHUNK_GATHER_TOKENS."""
        groups: list[list[int]] = []
        widest = 0
        for i in chunks:
            seq = batch.seqs[i]
            width = -(-(seq.num_cached + batch.num_new_tokens[i]) // self.block_size)
            if groups and (len(groups[-1]) + 1) * max(widest, width) * self.block_size <= CHUNK_GATHER_TOKENS:
                groups[-1].append(i)
                widest = max(widest, width)
            else:
                groups.append([i])
                widest = width
        out = []
        for group in groups:
            seqs = [batch.seqs[i] for i in group]
            query_lens = [batch.num_new_tokens[i] for i in group]
            context_lens = [s.num_cached + n for s, n in zip(seqs, query_lens, strict=True)]
            width = -(-max(context_lens) // self.block_size)
            tables = blocks.tables[table_rows[group], :width]  # (fancy indexing: a copy)
            index, token_rows, picks = self._padded(starts[group], np.asarray(query_lens))
            firsts = [c - q for c, q in zip(context_lens, query_lens, strict=True)]
            context, first = self._tensor([context_lens, firsts])
            query_pos = first[:, None] + torch.arange(index.shape[1], device=self.device)[None, :]
            keys = torch.arange(width * self.block_size, device=self.device)[None, None, :]
            mask = (keys <= query_pos[:, :, None]) & (keys < context[:, None, None])
            table_tensor = host_to_device(torch.from_numpy(tables), self.device)
            out.append(Chunks(index, table_tensor, mask[:, None], token_rows, picks))
        return out

    def _feed(self, ids: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """`ids` with the rows whose `src` ≥ 0 taken from `sampled[src]` (on the device)."""
        return torch.where(src >= 0, self.sampled[src.clamp(min=0)], ids)

    def _decode(self, batch: ScheduledBatch, blocks: BlockManager, feed: Feed | None) -> RunOutput:
        seqs = batch.seqs
        real = len(seqs)
        lens = np.fromiter((len(s.token_ids) for s in seqs), np.int64, real)
        last = np.fromiter((s.token_ids[-1] for s in seqs), np.int64, real)
        table_rows = np.fromiter((s.table_row for s in seqs), np.int64, real)
        width = -(-int(lens.max()) // self.block_size)
        graphed = self.use_graphs and real <= self.max_graph_batch
        size = next(b for b in BATCH_BUCKETS if b >= real) if graphed else max(real, self.min_rows)
        if graphed:
            width = 8 * -(-width // 8) if width <= 64 else 1 << math.ceil(math.log2(width))
        packed = np.zeros(5 * size + size * width, dtype=np.int64)
        host, tables = packed[: 5 * size].reshape(5, size), packed[5 * size :].reshape(size, width)
        host[CONTEXT, real:] = 1  # padded rows attend to one slot of block 0
        host[FEED, real:] = -1
        positions = lens - 1
        fed = last == PLACEHOLDER
        host[ID, :real] = np.where(fed, 0, last)
        host[POSITION, :real] = positions
        host[SLOT, :real] = (
            blocks.tables[table_rows, positions // self.block_size] * self.block_size
            + positions % self.block_size
        )
        host[CONTEXT, :real] = lens
        host[FEED, :real] = -1
        if fed.any():
            fed_rows = np.flatnonzero(fed)
            if feed is not None and feed.seqs == seqs:  # the same batch as the step before
                host[FEED, fed_rows] = fed_rows
            else:
                host[FEED, fed_rows] = [_feed_row(feed, seqs[i]) for i in fed_rows]
        cols = min(width, blocks.tables.shape[1])
        tables[:real, :cols] = blocks.tables[table_rows, :cols]
        graph = (self.graphs.get((size, width)) or self._capture_width(size, width)) if graphed else None
        if graph is not None:
            copy_to(graph.packed, torch.from_numpy(packed))
            if self.replay_events is not None:
                events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                events[0].record()
                graph.graph.replay()
                events[1].record()
                self.replay_events.append(events)
            else:
                graph.graph.replay()
            hidden, inputs = graph.hidden[:real], graph.inputs
        else:
            device_packed = host_to_device(torch.from_numpy(packed), self.device)
            inputs = device_packed[: 5 * size].view(5, size)
            hidden = self._decode_forward(inputs, device_packed[5 * size :].view(size, width))[:real]
        return RunOutput(self._logits(hidden), lens, inputs[CONTEXT, :real])

    def _decode_forward(self, inputs: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        ids = self._feed(inputs[ID], inputs[FEED])
        meta = AttentionMetadata(slot_mapping=inputs[SLOT], decodes=Decodes(None, tables, inputs[CONTEXT]))
        return self.model(ids, inputs[POSITION], self.kv_caches, meta)

    def _capture_width(self, size: int, width: int) -> _DecodeGraph | None:
        """The graph for (`size`, `width`), with those of every other batch bucket at `width`
        (largest first: the pool grows once). A run pays its captures the first time a step
        needs a width, not again whenever a new batch size turns up at it (each capture then
        held up a step by tens to hundreds of ms, as requests finished)."""
        start = time.perf_counter()
        buckets = [b for b in BATCH_BUCKETS if b <= self.max_graph_batch and (b, width) not in self.graphs]
        for bucket in sorted(buckets, reverse=True):
            if self._capture(bucket, width) is None:
                return None
        log.info(
            "decode graphs for contexts up to %d tokens: %d batch sizes captured in %.2f s",
            width * self.block_size,
            len(buckets),
            time.perf_counter() - start,
        )
        return self.graphs[(size, width)]

    def _capture(self, size: int, width: int) -> _DecodeGraph | None:
        """A new decode graph; None (and no graphs from now on, with a warning) if the model's
        decode step cannot be captured."""
        try:
            return self._try_capture(size, width)
        except RuntimeError as e:
            torch.cuda.synchronize()
            log.warning("decode steps run without CUDA graphs: capturing one failed (%s)", str(e)[:300])
            self.use_graphs = False
            return None

    def _try_capture(self, size: int, width: int) -> _DecodeGraph:
        packed = torch.zeros(5 * size + size * width, dtype=torch.int64, device=self.device)
        inputs, tables = packed[: 5 * size].view(5, size), packed[5 * size :].view(size, width)
        inputs[CONTEXT].fill_(1)  # context length 1: padded rows attend to one slot of block 0
        inputs[FEED].fill_(-1)
        # warm-up (kernel compilation) outside the graph, on the step's own stream: a fresh side
        # stream per capture left cuBLAS a workspace for each (32 MiB on Hopper, never freed: ~1 GiB
        # in a server after its first widths, measured on an H100), and its cached memory unusable
        self._decode_forward(inputs, tables)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            hidden = self._decode_forward(inputs, tables)
        captured = _DecodeGraph(graph, packed, inputs, tables, hidden)
        self.graphs[(size, width)] = captured
        return captured


def _feed_row(feed: Feed | None, seq: Sequence) -> int:
    if feed is None:
        raise RuntimeError("a placeholder input token without the step that draws it")
    return feed.row(seq)
