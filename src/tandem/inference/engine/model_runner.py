"""Runs the model over a scheduled batch: owns the KV cache, builds the flattened inputs and
attention metadata, and replays CUDA graphs for decode steps.

Decode graphs are captured lazily for (batch bucket, block-table width bucket) pairs; padded
rows write into block 0 (never handed out) and attend to one slot of it.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch

from tandem.inference.engine.attention import AttentionMetadata, Chunks, Decodes, Prompts
from tandem.inference.engine.block_manager import BlockManager
from tandem.inference.engine.scheduler import ScheduledBatch
from tandem.inference.engine.sequence import PLACEHOLDER, Sequence
from tandem.inference.engine.transfer import copy_to, host_to_device, to_device

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def kv_bytes_per_block(config: object, block_size: int, dtype: torch.dtype) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    return per_token * block_size * torch.finfo(dtype).bits // 8


@dataclass
class Feed:
    """Input tokens still on the device: the previous step's samples, for sequences whose last
    token is a PLACEHOLDER because the step that sampled it has not reached the host yet."""

    token_ids: torch.Tensor  # [rows] the previous step's sampled ids
    rows: dict[int, int]  # seq_id → its row in token_ids


def _feed(ids: torch.Tensor, positions: list[int], seqs: list[Sequence], feed: Feed | None) -> None:
    """Write the fed tokens of `seqs` into `ids` at `positions` (device-side, no host sync)."""
    if feed is None:
        raise RuntimeError("a placeholder input token without the step that samples it")
    src = [feed.rows[s.seq_id] for s in seqs]
    n = len(src)
    if positions == src == list(range(n)) and n == len(feed.token_ids):
        ids[:n].copy_(feed.token_ids)
        return
    index = to_device([positions, src], torch.int64, ids.device)
    ids.index_copy_(0, index[0], feed.token_ids.index_select(0, index[1]))


@dataclass
class _DecodeGraph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [4, batch]: token ids, positions, cache slots, context lengths
    tables: torch.Tensor  # [batch, width]
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
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (2, config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads, head_dim)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.kv_caches = [(self.kv_cache[0, i], self.kv_cache[1, i]) for i in range(config.num_hidden_layers)]
        self.use_graphs = cuda_graphs and device.type == "cuda"
        self.max_graph_batch = (
            max(b for b in BATCH_BUCKETS if b <= max(max_num_seqs, 1)) if self.use_graphs else 0
        )
        self.graphs: dict[tuple[int, int], _DecodeGraph] = {}
        self.graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src, dst = self._tensor([[p[0] for p in pairs], [p[1] for p in pairs]])
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, blocks: BlockManager, feed: Feed | None = None) -> torch.Tensor:
        """Logits (float32) of the last token of every sequence whose uncached tokens all ran.
        A decode whose input token is still a placeholder takes it from `feed`."""
        if batch.is_decode:
            return self.model.logits(self._decode(batch, blocks, feed))
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        decodes: list[int] = []  # batch positions of each kind of sequence
        prompts: list[int] = []
        chunks: list[int] = []
        starts: list[int] = []
        fed: list[tuple[int, Sequence]] = []  # (row, sequence) of placeholder input tokens
        for i, (seq, count) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            start, end = seq.num_cached, seq.num_cached + count
            starts.append(len(ids))
            if count == 1 and seq.token_ids[start] == PLACEHOLDER:
                fed.append((len(ids), seq))
                ids.append(0)
            else:
                ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [blocks.slot(seq, p) for p in range(start, end)]
            if end == seq.num_tokens:
                last_rows.append(len(ids) - 1)
            (decodes if count == 1 else prompts if start == 0 else chunks).append(i)
        meta = AttentionMetadata(slot_mapping=self._tensor(slots))
        if decodes:
            seqs = [batch.seqs[i] for i in decodes]
            width = max(len(s.block_table) for s in seqs)
            meta.decodes = Decodes(
                rows=self._tensor([starts[i] for i in decodes]),
                block_tables=self._tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs]),
                context_lens=self._tensor([s.num_cached + 1 for s in seqs]),
            )
        if prompts:
            lens = [batch.num_new_tokens[i] for i in prompts]
            longest = max(lens)
            index = self._tensor(
                [
                    [starts[i] + min(j, n - 1) for j in range(longest)]
                    for i, n in zip(prompts, lens, strict=True)
                ]
            )
            valid = torch.arange(longest, device=self.device)[None, :] < self._tensor(lens)[:, None]
            causal = torch.ones(longest, longest, dtype=torch.bool, device=self.device).tril()
            mask = None if min(lens) == longest else (causal[None] & valid[:, None, :])[:, None]
            rows, picks = self._tensor(
                [
                    [starts[i] + j for i, n in zip(prompts, lens, strict=True) for j in range(n)],
                    [b * longest + j for b, n in enumerate(lens) for j in range(n)],
                ]
            )
            meta.prompts = Prompts(index, mask, rows, picks)
        if chunks:
            meta.chunks = Chunks(
                starts=[starts[i] for i in chunks],
                query_lens=[batch.num_new_tokens[i] for i in chunks],
                context_lens=[batch.seqs[i].num_cached + batch.num_new_tokens[i] for i in chunks],
                block_tables=[self._tensor(batch.seqs[i].block_table) for i in chunks],
            )
        input_ids = self._tensor(ids)
        if fed:
            _feed(input_ids, [row for row, _ in fed], [seq for _, seq in fed], feed)
        hidden = self.model(input_ids, self._tensor(positions), self.kv_caches, meta)
        return self.model.logits(hidden[self._tensor(last_rows)])

    def _tensor(self, values: list) -> torch.Tensor:
        return to_device(values, torch.int64, self.device)

    def _decode(self, batch: ScheduledBatch, blocks: BlockManager, feed: Feed | None) -> torch.Tensor:
        """Inputs built with numpy from the block manager's table array (no per-sequence lists)."""
        seqs = batch.seqs
        real = len(seqs)
        lens = np.fromiter((len(s.token_ids) for s in seqs), np.int64, real)
        table_rows = np.fromiter((s.table_row for s in seqs), np.int64, real)
        width = -(-int(lens.max()) // self.block_size)
        graphed = self.use_graphs and real <= self.max_graph_batch
        size = next(b for b in BATCH_BUCKETS if b >= real) if graphed else real
        if graphed:
            width = 8 * -(-width // 8) if width <= 64 else 1 << math.ceil(math.log2(width))
        host = np.zeros((4, size), dtype=np.int64)  # token ids, positions, cache slots, context lengths
        host[3, real:] = 1
        positions = lens - 1
        host[0, :real] = [s.token_ids[-1] for s in seqs]
        host[1, :real] = positions
        host[2, :real] = (
            blocks.tables[table_rows, positions // self.block_size] * self.block_size
            + positions % self.block_size
        )
        host[3, :real] = lens
        fed = host[0, :real] == PLACEHOLDER
        host[0, :real][fed] = 0
        tables = np.zeros((size, width), dtype=np.int64)
        cols = min(width, blocks.tables.shape[1])
        tables[:real, :cols] = blocks.tables[table_rows, :cols]
        if graphed:
            graph = self.graphs.get((size, width)) or self._capture(size, width)
            copy_to(graph.inputs, torch.from_numpy(host))
            copy_to(graph.tables, torch.from_numpy(tables))
            if fed.any():
                rows = np.flatnonzero(fed).tolist()
                _feed(graph.inputs[0], rows, [seqs[i] for i in rows], feed)
            graph.graph.replay()
            return graph.hidden[:real]
        inputs = host_to_device(torch.from_numpy(host), self.device)
        if fed.any():
            rows = np.flatnonzero(fed).tolist()
            _feed(inputs[0], rows, [seqs[i] for i in rows], feed)
        return self._decode_forward(inputs, host_to_device(torch.from_numpy(tables), self.device))[:real]

    def _decode_forward(self, inputs: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """inputs rows: token ids, positions, cache slots, context lengths."""
        ids, positions, slots, lens = inputs
        meta = AttentionMetadata(slot_mapping=slots, decodes=Decodes(None, tables, lens))
        return self.model(ids, positions, self.kv_caches, meta)

    def _capture(self, size: int, width: int) -> _DecodeGraph:
        inputs = torch.zeros(4, size, dtype=torch.int64, device=self.device)
        inputs[3].fill_(1)  # context length 1: padded rows attend to one slot of block 0
        tables = torch.zeros(size, width, dtype=torch.int64, device=self.device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._decode_forward(inputs, tables)  # warm-up (kernel compilation) outside the graph
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            hidden = self._decode_forward(inputs, tables)
        captured = _DecodeGraph(graph, inputs, tables, hidden)
        self.graphs[(size, width)] = captured
        return captured
