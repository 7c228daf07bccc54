"""Runs the model over a scheduled batch: owns the KV cache, builds the flattened inputs and
attention metadata, and replays CUDA graphs for decode steps.

Decode graphs are captured lazily for (batch bucket, block-table width bucket) pairs; padded
rows write into block 0 (never handed out) and attend to one slot of it.
"""

import math
from dataclasses import dataclass

import torch

from tandem.inference.engine.attention import AttentionMetadata, Chunks, Decodes, Prompts
from tandem.inference.engine.block_manager import BlockManager
from tandem.inference.engine.scheduler import ScheduledBatch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def kv_bytes_per_block(config: object, block_size: int, dtype: torch.dtype) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    return per_token * block_size * torch.finfo(dtype).bits // 8


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
            src = torch.tensor([p[0] for p in pairs], device=self.device)
            dst = torch.tensor([p[1] for p in pairs], device=self.device)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, blocks: BlockManager) -> torch.Tensor:
        """Logits (float32) of the last token of every sequence whose uncached tokens all ran."""
        if batch.is_decode:
            return self.model.logits(self._decode(batch, blocks))
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        decodes: list[int] = []  # batch positions of each kind of sequence
        prompts: list[int] = []
        chunks: list[int] = []
        starts: list[int] = []
        for i, (seq, count) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            start, end = seq.num_cached, seq.num_cached + count
            starts.append(len(ids))
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
            meta.prompts = Prompts(index, valid, mask)
        if chunks:
            meta.chunks = Chunks(
                starts=[starts[i] for i in chunks],
                query_lens=[batch.num_new_tokens[i] for i in chunks],
                context_lens=[batch.seqs[i].num_cached + batch.num_new_tokens[i] for i in chunks],
                block_tables=[self._tensor(batch.seqs[i].block_table) for i in chunks],
            )
        hidden = self.model(self._tensor(ids), self._tensor(positions), self.kv_caches, meta)
        return self.model.logits(hidden[self._tensor(last_rows)])

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

    def _decode(self, batch: ScheduledBatch, blocks: BlockManager) -> torch.Tensor:
        seqs = batch.seqs
        real = len(seqs)
        width = max(len(s.block_table) for s in seqs)
        graphed = self.use_graphs and real <= self.max_graph_batch
        size = next(b for b in BATCH_BUCKETS if b >= real) if graphed else real
        if graphed:
            width = 8 * -(-width // 8) if width <= 64 else 1 << math.ceil(math.log2(width))
        pad = size - real
        positions = [s.num_tokens - 1 for s in seqs]
        host = torch.tensor(
            [
                [s.token_ids[-1] for s in seqs] + [0] * pad,
                positions + [0] * pad,
                [blocks.slot(s, p) for s, p in zip(seqs, positions, strict=True)] + [0] * pad,
                [s.num_tokens for s in seqs] + [1] * pad,
            ],
            dtype=torch.int64,
        )
        tables = torch.tensor(
            [s.block_table + [0] * (width - len(s.block_table)) for s in seqs] + [[0] * width] * pad,
            dtype=torch.int64,
        )
        if graphed:
            graph = self.graphs.get((size, width)) or self._capture(size, width)
            graph.inputs.copy_(host, non_blocking=True)
            graph.tables.copy_(tables, non_blocking=True)
            graph.graph.replay()
            return graph.hidden[:real]
        inputs = host.to(self.device, non_blocking=True)
        return self._decode_forward(inputs, tables.to(self.device, non_blocking=True))[:real]

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
