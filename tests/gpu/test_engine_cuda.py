"""CUDA paths of the native engine added for issue 11: the one-pass sampler, FP8 weights (all
three matmuls, quantize-at-update, refused updates), Qwen3-MoE with CUDA graphs and the
grouped GEMM, and the packed decode inputs with CUDA graphs under the overlapped loop; and for
issue 14 the GLM and MiniMax families with CUDA graphs.

Marked `gpu`; skipped where no CUDA device is visible: `pytest tests/gpu -m gpu`.
"""

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.inference.config import InferenceConfig
from tandem.inference.engine import AsyncEngine
from tandem.inference.engine.api import SampleUpdate, SamplingParams, WeightLoadError
from tandem.inference.engine.core import EngineCore
from tandem.inference.engine.fp8 import FP8_KERNELS, Fp8Weight
from tandem.inference.engine.sampler import SamplingBatch, sample, sample_key, sampling_rows
from tandem.inference.engine.triton_fp8 import fp8_matmul, quantize_groups, quantize_rows
from tandem.inference.engine.triton_sample import fused_sample
from tandem.models.tiny import build_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def test_fused_sampler_equals_the_torch_sampler_on_cuda() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 64, 151_936
    logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * 4).bfloat16()
    temps = [0.0 if i % 3 == 0 else 0.6 + 0.01 * i for i in range(rows)]
    batch = SamplingBatch(temps, [1.0] * rows, [0] * rows, [0.0] * rows,
                          [sample_key(11, i) for i in range(rows)], list(range(100, 100 + rows)))  # fmt: skip
    want = sample(logits.float(), batch)
    r = sampling_rows(batch, vocab, logits.device)
    tokens = torch.empty(rows, dtype=torch.int64, device="cuda")
    got = fused_sample(
        logits, r.temperatures, r.keys, torch.tensor(batch.positions, device="cuda"), 3, tokens
    )
    assert got[0].long().tolist() == want.token_ids == tokens.tolist()
    assert (got[1].cpu() - torch.tensor(want.logprobs, dtype=torch.float64)).abs().max() < 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(out=tmp_path_factory.mktemp("gpu11") / "step_0", num_layers=2)


def engine_config(path: Path, **engine: object) -> InferenceConfig:
    return InferenceConfig.model_validate(
        {
            "model": {"name": str(path), "dtype": "bfloat16", "device": "cuda"},
            "engine": {"kv_cache_memory_gb": 0.5, "max_num_seqs": 32, **engine},
        }
    )


def run(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> dict[str, SampleUpdate]:
    for i, ids in enumerate(prompts):
        core.add_request(str(i), ids, params, 1)
    out: dict[str, SampleUpdate] = {}
    while core.has_work():
        for rid, updates in core.step():
            for u in updates:
                out.setdefault(rid, SampleUpdate(0)).extend(u)
    return out


PROMPTS = [[5, 6, 7, 8], list(range(20, 60)), [9], list(range(100, 117))]


@pytest.mark.skipif(not FP8, reason="needs FP8 (compute capability 8.9+)")
@pytest.mark.parametrize("kernel", FP8_KERNELS)
def test_fp8_matmuls_against_the_dequantized_weight(kernel: str) -> None:
    if kernel == "blockwise" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the blockwise recipe runs on SM90 only")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((768, 1024), (512, 512), (2048, 512)):  # (and the blockwise engine test's K = 512)
        w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.05
        fp8 = Fp8Weight(n, k, kernel, torch.device("cuda"))
        fp8.load(0, w)
        for rows in (1, 3, 64, 256, 700):
            x = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            ref = x.float() @ fp8.dequantized(torch.float32).T
            out = fp8(x).float()
            assert out.shape == ref.shape
            error = ((out - ref).norm() / ref.norm()).item()
            assert error < (0.02 if kernel == "triton" else 0.06), (kernel, n, k, rows, error)


@pytest.mark.skipif(not FP8, reason="needs FP8 (compute capability 8.9+)")
def test_fp8_matmul_widens_every_e4m3_value_exactly() -> None:
    """The triton kernel widens e4m3 to bf16 with integer instructions: every value (subnormals
    too; not the NaNs) comes back exactly through an identity with scale 1."""
    codes = torch.arange(256, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn).float()
    codes = torch.where(codes.isnan(), 0.0, codes)
    w = torch.stack([codes.roll(i) for i in range(128)]).to(torch.float8_e4m3fn)  # [128, 256]
    for rows in (256, 5):  # full row blocks, and one block of 16 rows, partly masked
        x = torch.eye(256, device="cuda", dtype=torch.bfloat16)[:rows]
        out = fp8_matmul(x, w, torch.ones(1, 4, device="cuda"))
        assert torch.equal(out.float(), w.float().T[:rows])


@pytest.mark.skipif(not FP8, reason="needs FP8 (compute capability 8.9+)")
def test_activation_quantizers_round_as_torch_does() -> None:
    x = torch.randn(37, 512, device="cuda", dtype=torch.bfloat16)
    q, s = quantize_groups(x, 40)
    ref = (x.float().view(37, 4, 128) / s[:37, :, None]).to(torch.float8_e4m3fn).view(37, 512)
    assert torch.equal(q[:37].view(torch.uint8), ref.view(torch.uint8))
    q, s = quantize_rows(x, 48)
    ref = (x.float() / s[:37]).to(torch.float8_e4m3fn)
    assert torch.equal(q[:37].view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.skipif(not FP8, reason="needs FP8 (compute capability 8.9+)")
@pytest.mark.parametrize("kernel", FP8_KERNELS)
def test_fp8_engine_follows_bf16_and_refuses_a_mismatched_update(
    tiny: Path, tmp_path: Path, kernel: str
) -> None:
    if kernel == "blockwise" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the blockwise recipe runs on SM90 only")
    widths = {}
    if kernel == "blockwise":  # every K a multiple of 512
        widths = {"hidden_size": 512, "head_dim": 128, "intermediate_size": 1024}
        tiny = build_tiny_model(out=tmp_path / "step_0", num_layers=2, **widths)
    first = SamplingParams(temperature=0.0, max_tokens=1, top_logprobs=10)
    bf16 = run(EngineCore(engine_config(tiny)), PROMPTS, first)
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=5)

    async def main() -> None:
        engine = AsyncEngine(engine_config(tiny, quantization="fp8", fp8_kernel=kernel))
        try:
            # the first token's distribution follows bf16's. A random tiny model's is nearly flat
            # (its top logprobs ~0.01 apart), so quantization noise may reorder the top tokens:
            # fp8's greedy token is among bf16's top 5 and most of the two top-10 lists agree
            # (unrelated distributions over this vocabulary would share less than one token)
            for i, ids in enumerate(PROMPTS):
                [got] = [u async for u in engine.generate(f"g{i}", ids, first)]
                want = dict(bf16[str(i)].top_logprobs[0])
                shared = [t for t, _ in got.top_logprobs[0] if t in want]
                assert got.token_ids[0] in sorted(want, key=want.get)[-5:], (kernel, i, got, want)
                assert len(shared) >= 6, (kernel, i, got.top_logprobs, want)
            before = [t async for u in engine.generate("s", PROMPTS[1], params) for t in u.token_ids]
            wide = build_tiny_model(
                out=tmp_path / "wide", num_layers=2, **{**widths, "intermediate_size": 2048}
            )
            with pytest.raises(WeightLoadError, match="has shape"):
                await engine.update_weights(wide)
            after = [t async for u in engine.generate("t", PROMPTS[1], params) for t in u.token_ids]
            assert after == before and engine.weight_version == 0  # the old weights stay live
            other = build_tiny_model(out=tmp_path / "step_3", num_layers=2, seed=3, **widths)
            assert await engine.update_weights(other) == 3
            moved = [t async for u in engine.generate("u", PROMPTS[1], params) for t in u.token_ids]
            assert moved != before
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_moe_engine_with_graphs_and_grouped_gemm_matches_transformers(tmp_path: Path) -> None:
    path = build_tiny_model(out=tmp_path / "moe", num_layers=2, num_experts=8, moe_intermediate_size=128)
    core = EngineCore(engine_config(path, cuda_graphs=True))
    assert core.runner.use_graphs  # bf16 with the grouped GEMM: no host sync in a decode step
    got = run(core, PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    agree = 0
    for i, ids in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids], device="cuda"), max_new_tokens=8, min_new_tokens=8, do_sample=False
            )
        agree += got[str(i)].token_ids[:2] == ref[0, len(ids) : len(ids) + 2].tolist()
    assert agree >= 3  # bf16 on both sides, different kernels: the first tokens agree
    assert core.runner.graphs


@pytest.mark.parametrize("family", ["glm4_moe", "minimax_m2", "glm_moe_dsa"])
def test_glm_and_minimax_engines_capture_graphs_and_follow_transformers(tmp_path: Path, family: str) -> None:
    """GLM-4.5, MiniMax-M2 and GLM-5 (MLA over the compressed cache, an indexer keeping 16 keys)
    in bf16 on CUDA: decode steps are captured, and the sampled tokens' logprobs follow an fp32
    transformers forward (bf16 against fp32: a mean gap under 0.05)."""
    path = build_tiny_model(out=tmp_path / family, family=family, num_layers=2, num_experts=8,
                            moe_intermediate_size=128, index_topk=16)  # fmt: skip
    core = EngineCore(engine_config(path, cuda_graphs=True))
    assert core.runner.use_graphs
    prompts = [*PROMPTS, list(range(50, 90))]
    got = run(core, prompts, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=1))
    assert core.runner.graphs
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    gaps = []
    for i, ids in enumerate(prompts):
        completion = got[str(i)].token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids + completion], device="cuda")).logits[0, len(ids) - 1 : -1]
        want = (
            logits.double().log_softmax(-1).gather(1, torch.tensor(completion, device="cuda")[:, None])[:, 0]
        )
        gaps.append((torch.tensor(got[str(i)].logprobs, device="cuda") - want).abs().mean())
    assert float(torch.stack(gaps).mean()) < 0.05, gaps


def test_overlapped_graph_steps_equal_plain_steps(tiny: Path) -> None:
    """Packed inputs, fed tokens read inside the graph, the fused sampler: the same tokens as
    the plain loop (seeded sampling, greedy rows, stops at max_tokens)."""
    params = [SamplingParams(temperature=t, max_tokens=m, ignore_eos=True, seed=s)
              for t, m, s in [(1.0, 30, 1), (0.0, 17, None), (0.7, 41, 2)]]  # fmt: skip
    results = []
    for lookahead in (False, True):
        core = EngineCore(engine_config(tiny))
        for i, ids in enumerate(PROMPTS):
            core.add_request(str(i), ids, params[i % 3], 1)
        out: dict[str, list[int]] = {}
        while core.has_work():
            for rid, updates in core.step(lookahead=lookahead):
                out.setdefault(rid, []).extend(t for u in updates for t in u.token_ids)
        assert core.runner.graphs and core.blocks.num_free == core.blocks.num_usable
        results.append(out)
    assert results[0] == results[1]


def test_decode_graph_captures_do_not_grow_the_memory(tiny: Path) -> None:
    """Each new block-table width captures a graph per batch bucket; what stays allocated after
    that is the graphs' pool, not a library workspace per capture (a fresh warm-up stream per
    capture left cuBLAS 32 MiB each on Hopper: ~1 GiB after a server's first widths)."""
    core = EngineCore(engine_config(tiny))

    def generate(max_tokens: int) -> None:
        for i, ids in enumerate(PROMPTS):
            core.add_request(
                f"{max_tokens}-{i}", ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), 1
            )
        while core.has_work():
            core.step()

    generate(8)
    graphs, allocated = len(core.runner.graphs), torch.cuda.memory_allocated()
    generate(600)  # contexts up to ~640 tokens: the widths after the first
    new_graphs = len(core.runner.graphs) - graphs
    assert new_graphs >= 2 * graphs > 0, (graphs, new_graphs)
    grown = (torch.cuda.memory_allocated() - allocated) / 2**20
    assert grown < 16, f"{grown:.0f} MiB more allocated after {new_graphs} more graphs"


def test_prompt_attention_without_cudnn_matches_auto(tiny: Path) -> None:
    """engine.prompt_attention = flash: prompt steps run no cuDNN attention (equal lengths: the
    flash kernel; unequal: the masked memory-efficient one); varlen: the variable-length flash
    kernel for both. Each prompt's next-token distribution is torch's default choice's (top-5
    logprobs within bf16 kernel differences)."""
    from torch.profiler import ProfilerActivity, profile

    steps = [[list(range(20, 60)), list(range(70, 110))], [list(range(100, 117)), list(range(5, 35))]]
    params = SamplingParams(temperature=0.0, max_tokens=1, top_logprobs=5)
    tops, ops = {}, {}
    for attention in ("auto", "flash", "varlen"):
        core = EngineCore(engine_config(tiny, prompt_attention=attention))
        found: set[str] = set()
        for s, prompts in enumerate(steps):
            for i, ids in enumerate(prompts):
                core.add_request(f"{s}-{i}", ids, params, 1)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                done = core.step()
            found |= {e.key for e in prof.key_averages()}
            for rid, updates in done:
                tops[attention, rid] = dict(updates[0].top_logprobs[0])
        ops[attention] = found

    def ran(attention: str, kernel: str) -> bool:
        return any(kernel in op for op in ops[attention])

    for attention in ("flash", "varlen"):
        assert not ran(attention, "cudnn_attention"), ops[attention]
        assert ran(attention, "flash_attention"), ops[attention]
    assert ran("flash", "efficient_attention"), "flash, unequal lengths: no masked kernel"
    assert not ran("varlen", "efficient_attention"), "varlen: a padded batch ran"
    assert len(tops) == 12
    for attention in ("flash", "varlen"):
        for rid in ("0-0", "0-1", "1-0", "1-1"):
            auto, other = tops["auto", rid], tops[attention, rid]
            shared = auto.keys() & other.keys()
            assert len(shared) >= 4, (attention, auto, other)
            assert max(abs(auto[t] - other[t]) for t in shared) < 0.02, (attention, auto, other)


@pytest.mark.parametrize("variant", ["dense", "moe", "fp8"])
def test_prompt_step_graphs_replay_what_the_pieces_compute(tmp_path: Path, variant: str) -> None:
    """engine.prompt_graphs on CUDA: steps with prompts replay the pieces' graphs (buckets of 16 to
    128 rows, captured into one pool, replayed in turns) and give what the same pieces run eagerly
    give (to rounding: cuBLAS may pick other kernels under capture; a graph that read freed memory
    would give garbage); against the plain forward (other row counts, other bf16 kernels) each
    prompt's first-token distribution stays within bf16 differences."""
    from tandem.inference.engine.piecewise import PiecewiseForward

    if variant == "fp8" and not FP8:
        pytest.skip("needs FP8 (compute capability 8.9+)")
    shape = {"num_experts": 8, "moe_intermediate_size": 128} if variant == "moe" else {}
    quantization = {"quantization": "fp8"} if variant == "fp8" else {}  # (rowwise: fused launches)
    path = build_tiny_model(out=tmp_path / "model", num_layers=3, **shape)
    prompts = [list(range(3, 3 + n)) for n in (37, 5, 20, 50, 1, 33, 90, 12)]
    params = [SamplingParams(temperature=t, max_tokens=12, ignore_eos=True, seed=s, top_logprobs=5)
              for t, s in [(1.0, 1), (0.0, None)]]  # fmt: skip
    results = {}

    def step(core: EngineCore, out: dict[str, SampleUpdate]) -> None:
        for rid, updates in core.step():
            for u in updates:
                out.setdefault(rid, SampleUpdate(0)).extend(u)

    for mode in ("plain", "eager pieces", "graphs"):
        core = EngineCore(
            engine_config(path, max_num_batched_tokens=128, prompt_graphs=mode != "plain", **quantization)
        )
        if mode == "eager pieces":
            runner = core.runner
            runner.piecewise = PiecewiseForward(
                core.model, runner.kv_caches, runner.sampled, 128, use_graphs=False
            )
        out: dict[str, SampleUpdate] = {}
        for round_ in range(2):  # the second round extends the first's prompts: prefix-cache chunks
            for i, ids in enumerate(prompts):
                core.add_request(f"{round_}-{i}", ids + [7] * (round_ * 20), params[i % 2], 1)
            while core.has_work():
                step(core, out)
        for j in range(8):  # one arrival per step beside running decodes: smaller steps, other buckets
            core.add_request(
                f"t-{j}", [(7 * j + 3 * i) % 500 + 5 for i in range(4 + 9 * j)], params[j % 2], 1
            )
            step(core, out)
        while core.has_work():
            step(core, out)
        if mode == "graphs":
            buckets = core.runner.piecewise.buckets
            assert len(buckets) >= 3, sorted(buckets)  # (16, 32, 64 and 128 in the same run on CPU)
            assert all(b.graphs is not None for b in buckets.values())
        assert core.blocks.hit_tokens_total > 0
        results[mode] = out
    for rid, want in results["eager pieces"].items():  # (a graph reading freed memory: garbage, not rounding)
        got = results["graphs"][rid]
        assert got.token_ids[:4] == want.token_ids[:4], rid
        same = [abs(a - b) for a, b, t, u in zip(got.logprobs, want.logprobs, got.token_ids, want.token_ids, strict=True)
                if t == u]  # fmt: skip
        assert max(same) < 1e-2, (rid, same)
    for rid, want in results["plain"].items():
        got = results["graphs"][rid]
        first, other = dict(want.top_logprobs[0]), dict(got.top_logprobs[0])
        shared = first.keys() & other.keys()
        assert len(shared) >= 4 and max(abs(first[t] - other[t]) for t in shared) < 0.05, (rid, first, other)


def test_an_unowned_alias_sees_the_memory_without_holding_it() -> None:
    """piecewise.unowned: same address, strides and values (bf16, a strided view), and freeing the
    original returns its memory to the allocator even while the alias lives."""
    from tandem.inference.engine.piecewise import unowned

    base = torch.randn(64, 3, 32, device="cuda").bfloat16()
    view = base[8:40, 1]  # storage offset and strides of a view
    alias = unowned(view)
    assert alias.data_ptr() == view.data_ptr() and alias.stride() == view.stride()
    assert alias.dtype == torch.bfloat16 and torch.equal(alias, view)
    view.mul_(2)
    assert torch.equal(alias, view)
    before = torch.cuda.memory_allocated()
    del base, view
    assert torch.cuda.memory_allocated() < before
    assert alias.shape == (32, 32)


def test_a_prompt_moves_between_engines_on_cuda(tiny: Path) -> None:
    """Prefill on other servers (kv_prefix.py) with bf16 caches on the device: blocks gathered and
    copied to the host by one engine, copied into another's free blocks without a stream sync
    between its queued steps (a running request keeps it busy meanwhile). The adopting engine
    answers exactly as an engine that computed the prompts in the same batch and then served
    them from its own prefix cache, beside the same running request."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1)
    busy = SamplingParams(max_tokens=40, ignore_eos=True, seed=3)
    prompts = [list(range(200, 200 + n)) for n in (40, 70, 129)]
    prefiller, decoder, reference = (EngineCore(engine_config(tiny)) for _ in range(3))
    for core in (prefiller, reference):
        run(core, prompts, first)
    for core in (reference, decoder):
        core.add_request("busy", list(range(5, 30)), busy, 1)
        core.step()  # (a step stays queued on the device while the blocks arrive)
    for ids in prompts:
        data = prefiller.export_prompt(ids, skip_tokens=0)
        assert decoder.import_prompt(ids, data) == (len(ids) - 1) // 16 * 16
    hits = decoder.blocks.hit_tokens_total
    want, got = run(reference, prompts, greedy), run(decoder, prompts, greedy)
    assert decoder.blocks.hit_tokens_total - hits == sum((len(ids) - 1) // 16 * 16 for ids in prompts)
    assert {k: u.token_ids for k, u in got.items()} == {k: u.token_ids for k, u in want.items()}
