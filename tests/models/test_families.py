"""tandem's model families equal transformers' reference, and checkpoints go in and out exactly.

Tiny random configs in fp32, built with transformers' own classes (no downloads). Weights (and
the routers' score-correction biases) are drawn large enough (std 0.2) that every layer
matters; documents are packed into rows and compared with running each document alone through
the reference.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    Glm4MoeConfig,
    GlmMoeDsaConfig,
    LlamaConfig,
    MiniMaxM2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from tandem.cli import UserError
from tandem.config.base import ModelConfig
from tandem.models.hf_checkpoint import split_full
from tandem.models.lora import inject_lora, linear_parts
from tandem.models.registry import family
from tandem.trainer.config import ParallelConfig
from tandem.trainer.hf_export import write_hf_model
from tandem.trainer.model import build_trainer_model, load_hf_weights
from tandem.trainer.parallel import World, init_distributed

CPU_WORLD = World(rank=0, size=1, local_rank=0, device=torch.device("cpu"))
COMMON = dict(
    vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)  # fmt: skip
CONFIGS = {
    "qwen3": lambda: Qwen3Config(**COMMON, tie_word_embeddings=True),
    # layer 1 dense (mlp_only_layers), 6 experts, top-3: both block kinds and uneven routing
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **COMMON,
        moe_intermediate_size=16,
        num_experts=6,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    ),  # fmt: skip
    # layer 0 dense; 8 experts in 2 groups (the best group only), top-3, scaled, a shared expert;
    # biased q/k/v with per-head QK norm; half the head rotates
    "glm4_moe": lambda: Glm4MoeConfig(
        **{**COMMON, "rope_parameters": {**COMMON["rope_parameters"], "partial_rotary_factor": 0.5}},
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        use_qk_norm=True,
        attention_bias=True,
        tie_word_embeddings=False,
    ),
    # 6 experts top-2 in every layer, QK norm over the whole projection, half the head rotates
    "minimax_m2": lambda: MiniMaxM2Config(
        **{
            **COMMON,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        },
        num_local_experts=6,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
    # MLA (v narrower than q/k) with the sparse-attention indexer choosing 4 keys per query in
    # layers 0 and 2 (layer 1 shares layer 0's choice); layer 0 dense, then GLM-4.5's MoE
    "glm_moe_dsa": lambda: GlmMoeDsaConfig(
        **{**COMMON, "num_key_value_heads": 4},
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_rope_head_dim=4,
        qk_nope_head_dim=8,
        v_head_dim=6,
        index_topk=4,
        index_head_dim=8,
        index_n_heads=4,
        indexer_types=["full", "shared", "full"],
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        tie_word_embeddings=False,
    ),
}
UNSUPPORTED = {  # per family, a config field (with a value) its implementation refuses
    "qwen3": ("hidden_act", "gelu"),
    "qwen3_moe": ("hidden_act", "gelu"),
    "glm4_moe": ("n_shared_experts", 0),
    "minimax_m2": ("qk_norm_type", "per_head"),
    "glm_moe_dsa": ("num_key_value_heads", 2),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(len(request.param))
    reference = AutoModelForCausalLM.from_config(CONFIGS[request.param]())
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0, 0.2)
        for name, b in reference.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.2)
    out = tmp_path_factory.mktemp(request.param) / "model"
    reference.save_pretrained(out)
    return out


def tandem_model(path: Path, attention: str = "sdpa") -> torch.nn.Module:
    reference = AutoModelForCausalLM.from_pretrained(path)
    fam = family(reference.config.model_type)
    model = fam.build(reference.config, attention)
    load_hf_weights(model, fam.hf_layout(reference.config), path, fam.hf_ignored(reference.config), CPU_WORLD)
    return model, reference


def documents(vocab: int, lengths: list[int], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]


def model_type(checkpoint: Path) -> str:
    return json.loads((checkpoint / "config.json").read_text())["model_type"]


ROWS = [[5, 11, 3], [19]]  # two rows of 19 tokens: three documents, then one


def packed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The documents of ROWS packed: ids and position ids [2, 19]."""
    docs = [documents(97, lengths, seed=i) for i, lengths in enumerate(ROWS)]
    ids = torch.stack([torch.cat(d) for d in docs])
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in ROWS])
    return ids, positions


def hf_grad(reference: torch.nn.Module, name: str) -> torch.Tensor:
    """The reference's gradient of a checkpoint tensor; transformers keeps experts fused in memory
    (and names MiniMax-M2's `block_sparse_moe` `mlp`, its w1/w3/w2 gate/up/down)."""
    params = dict(reference.named_parameters())
    name = name.replace(".block_sparse_moe.", ".mlp.")
    if name in params:
        return params[name].grad
    layer, rest = name.split(".experts.")
    expert, proj = int(rest.split(".")[0]), rest.split(".")[1]
    if proj in ("down_proj", "w2"):
        return params[f"{layer}.experts.down_proj"].grad[expert]
    gate, up = params[f"{layer}.experts.gate_up_proj"].grad[expert].chunk(2)
    return gate if proj in ("gate_proj", "w1") else up


@pytest.mark.parametrize("backend", ["sdpa", "sdpa_docs"])
def test_packed_logits_and_gradients_equal_transformers(checkpoint: Path, backend: str) -> None:
    if backend != "sdpa" and model_type(checkpoint) not in ("qwen3", "qwen3_moe"):
        pytest.skip("the other families' attention backends are the Qwen families' code (or unused)")
    model, reference = tandem_model(checkpoint, backend)
    ids, positions = packed_batch()
    weights = torch.randn(2, 19, 97, generator=torch.Generator().manual_seed(7))
    docs = [documents(97, lengths, seed=i) for i, lengths in enumerate(ROWS)]

    logits = model(ids, positions)
    (logits * weights).sum().backward()
    alone = torch.cat([torch.cat([reference(input_ids=d[None]).logits[0] for d in row]) for row in docs])
    (alone.view(2, 19, 97) * weights).sum().backward()

    torch.testing.assert_close(logits, alone.view(2, 19, 97), rtol=0, atol=1e-5)
    layouts = family(reference.config.model_type).hf_layout(reference.config)
    compared = 0
    for name, param in model.named_parameters():
        if param.grad is None:  # GLM-5's indexer: frozen here and in the reference
            assert ".indexer." in name and not param.requires_grad, name
            compared += sum(hf_grad(reference, n) is None for n, _ in split_full(layouts[name], param))
            continue
        for hf_name, grad in split_full(layouts[name], param.grad):
            want = hf_grad(reference, hf_name)
            torch.testing.assert_close(
                grad, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()), msg=hf_name
            )
            compared += 1
    assert compared >= len(dict(reference.named_parameters()))


@pytest.mark.parametrize("lora", [False, True])
def test_glm5_sparse_attention_equals_the_dense_mask(checkpoint: Path, lora: bool) -> None:
    """GLM-5's sparse path (chosen keys gathered in the latent space, chunk by chunk, recomputed
    in backward) gives the dense mask's logits and gradients; chunks of 3 queries (indexer) and
    2 (attention) so that every chunk boundary is crossed. With LoRA on kv_b_proj (which the
    sparse path absorbs into its queries and outputs) the adapters' gradients agree too."""
    if model_type(checkpoint) != "glm_moe_dsa":
        pytest.skip("GLM-5 only")
    ids, positions = packed_batch()
    weights = torch.randn(2, 19, 97, generator=torch.Generator().manual_seed(7))
    results = []
    for backend in ("sdpa", "varlen"):  # dense, sparse (the backend is not used otherwise)
        model, reference = tandem_model(checkpoint, backend)
        if lora:
            parts = linear_parts(family("glm_moe_dsa").hf_layout(reference.config), model)
            inject_lora(
                model, parts, ["kv_b_proj", "q_b_proj"], rank=2, alpha=4.0, dropout=0.0, head="lm_head"
            )
            torch.manual_seed(3)
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.data.normal_(0, 0.5)  # (B starts at zero: a nonzero adapter changes the logits)
        for layer in model.layers:
            layer.attention.sparse_chunk_elements = 2 * 2 * 4 * (12 + 4)  # rows · 2 · k · (L + r)
            if layer.attention.indexer is not None:
                layer.attention.indexer.chunk_elements = 2 * 4 * 19 * 3  # rows · heads · width · 3
        assert model.layers[0].attention.sparse == (backend == "varlen")
        logits = model(ids, positions)
        (logits * weights).sum().backward()
        results.append(logits_and_grads(model, logits))
    assert_same_step(*results)


def logits_and_grads(model: torch.nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
    return logits, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_same_step(reference: tuple[torch.Tensor, dict], got: tuple[torch.Tensor, dict]) -> None:
    """Logits within 1e-5, every gradient within 1e-5 of its tensor's scale."""
    torch.testing.assert_close(got[0], reference[0], rtol=0, atol=1e-5)
    assert reference[1].keys() == got[1].keys()
    for name, grad in reference[1].items():
        torch.testing.assert_close(
            got[1][name], grad, rtol=1e-5, atol=1e-5 * float(grad.abs().max()), msg=name
        )


@pytest.mark.parametrize("backend", ["sdpa", "sdpa_docs"])
def test_glm5_short_documents_skip_the_indexer_exactly(checkpoint: Path, backend: str) -> None:
    """sparse_attention = "long_documents": with no document longer than the indexers' top-k (19
    here) the indexers do not run and attention reads every visible key through the packed backend,
    which gives the logits and gradients of running them (they would choose every visible key);
    with a longer document (top-k 10) the indexers run as always."""
    if model_type(checkpoint) != "glm_moe_dsa":
        pytest.skip("GLM-5 only")
    ids, positions = packed_batch()
    weights = torch.randn(2, 19, 97, generator=torch.Generator().manual_seed(8))
    for topk, skipped in ((19, True), (10, False)):
        results = []
        for short in (False, True):
            model, _ = tandem_model(checkpoint, backend)
            model.dense_short_documents = short
            calls = []
            for layer in model.layers:
                if layer.attention.indexer is not None:
                    layer.attention.indexer.topk = topk
                    layer.attention.indexer.register_forward_hook(lambda *_, calls=calls: calls.append(1))
            logits = model(ids, positions)
            (logits * weights).sum().backward()
            assert (not calls) == (short and skipped)
            results.append(logits_and_grads(model, logits))
        assert_same_step(*results)


def test_checkpoint_round_trip_is_exact(checkpoint: Path, tmp_path: Path) -> None:
    """HF checkpoint → tandem's sharded trainer model → write_hf_model → the same tensors, which
    transformers loads into the same model."""
    world = init_distributed("cpu")
    model = build_trainer_model(ModelConfig(name=str(checkpoint), device="cpu"), world, ParallelConfig())
    from tandem.models.tokenizer import train_tokenizer

    write_hf_model(model, train_tokenizer(), tmp_path / "out", world)
    original, written = (
        load_file(checkpoint / "model.safetensors"),
        load_file(tmp_path / "out/model.safetensors"),
    )
    if model.hf_config.tie_word_embeddings:
        original.pop("lm_head.weight", None)
    assert original.keys() == written.keys()
    for name, tensor in original.items():
        assert torch.equal(written[name], tensor), name
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = torch.randint(0, 97, (1, 12))
    torch.testing.assert_close(
        reloaded(input_ids=ids).logits, AutoModelForCausalLM.from_pretrained(checkpoint)(input_ids=ids).logits
    )


def test_sharded_export_writes_an_index(checkpoint: Path, tmp_path: Path) -> None:
    world = init_distributed("cpu")
    model = build_trainer_model(ModelConfig(name=str(checkpoint), device="cpu"), world, ParallelConfig())
    from tandem.models.tokenizer import train_tokenizer

    write_hf_model(model, train_tokenizer(), tmp_path / "out", world, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "out/model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for name, tensor in AutoModelForCausalLM.from_pretrained(checkpoint).state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_missing_and_misshaped_tensors_fail_naming_the_tensor(checkpoint: Path, tmp_path: Path) -> None:
    world = init_distributed("cpu")
    tensors = load_file(checkpoint / "model.safetensors")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((checkpoint / "config.json").read_text())
    name = "model.layers.2.self_attn.o_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, broken / "model.safetensors")
    with pytest.raises(UserError, match=f"tensor {name} is missing"):
        build_trainer_model(ModelConfig(name=str(broken), device="cpu"), world, ParallelConfig())
    save_file({**tensors, name: tensors[name][:, :-1].contiguous()}, broken / "model.safetensors")
    rows, cols = tensors[name].shape
    with pytest.raises(
        UserError, match=rf"{name} has shape \[{rows}, {cols - 1}\], the model needs \[{rows}, {cols}\]"
    ):
        build_trainer_model(ModelConfig(name=str(broken), device="cpu"), world, ParallelConfig())


def test_bad_config_and_parallel_settings_fail_with_one_line(checkpoint: Path, tmp_path: Path) -> None:
    world = init_distributed("cpu")
    config = json.loads((checkpoint / "config.json").read_text())
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "model.safetensors").symlink_to(checkpoint / "model.safetensors")
    field, value = UNSUPPORTED[config["model_type"]]
    (odd / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(UserError, match=rf"config field {field} = {value!r} is not supported") as error:
        build_trainer_model(ModelConfig(name=str(odd), device="cpu"), world, ParallelConfig())
    assert "\n" not in str(error.value)
    with pytest.raises(UserError, match="ep = 2 does not divide the world size 1"):
        build_trainer_model(ModelConfig(name=str(checkpoint), device="cpu"), world, ParallelConfig(ep=2))
    for attention in ("cudnn", "flash"):
        with pytest.raises(UserError, match=f"model.attention = '{attention}' trains on CUDA only"):
            build_trainer_model(
                ModelConfig(name=str(checkpoint), device="cpu", attention=attention), world, ParallelConfig()
            )


def test_half_precision_attention_refuses_a_float32_trainer() -> None:
    """varlen, cudnn and flash run bf16/fp16 kernels only: a trainer computing in float32 on CUDA
    (compute_dtype = "float32") is told at build, not by a kernel at the first forward."""
    from tandem.models.layers.attention import resolve_backend

    cuda = torch.device("cuda")  # named only: resolve_backend checks, it runs nothing there
    with pytest.raises(
        ValueError, match="'varlen' computes in bfloat16 or float16 only, .* computes in float32"
    ):
        resolve_backend("varlen", cuda, torch.float32)
    assert resolve_backend("varlen", cuda, torch.bfloat16) == "varlen"
    assert resolve_backend("flex", cuda, torch.float32) == "flex"


@pytest.mark.parametrize(
    ("backend", "module", "install"),
    [
        ("cudnn", "cudnn", "pip install nvidia-cudnn-frontend"),
        ("flash", "flash_attn", "pip install flash-attn-4"),
    ],
)
def test_attention_without_its_package_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, backend: str, module: str, install: str
) -> None:
    from tandem.models.layers import cudnn_attention, flash_attention

    imports = {"cudnn": cudnn_attention._register_operator, "flash": flash_attention._interface}[backend]
    require = {
        "cudnn": cudnn_attention.require_cudnn_frontend,
        "flash": flash_attention.require_flash_attention,
    }
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    imports.cache_clear()
    with pytest.raises(ValueError, match=f"model.attention = '{backend}' needs .*: {install}"):
        require[backend]()
    imports.cache_clear()


def test_weight_units_hold_every_parameter_once(checkpoint: Path) -> None:
    """The units an overlapped optimizer step updates in turn (trainer/step_stream.py) cover the
    model, in the order a forward reads them, so `optim.overlap_step` applies to every family."""
    model, _ = tandem_model(checkpoint)
    units = model.weight_units()
    assert len(units) == len(model.layers) + 2
    assert units[0] == [model.embed.weight]
    assert units[1] == list(model.layers[0].parameters())
    assert sorted(id(p) for unit in units for p in unit) == sorted(id(p) for p in model.parameters())


def test_keeping_gathered_weights_trains_as_resharding(checkpoint: Path) -> None:
    """reshard_after_forward = false gives the same steps as FSDP's default, also after forwards
    that no backward follows (with grad and under no_grad), which leave the weights gathered."""
    from tandem.trainer.config import OptimConfig
    from tandem.trainer.optim import build_optimizer

    world = init_distributed("cpu")
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    ids = documents(vocab, [48], seed=3)[0][None]
    positions = torch.arange(48)[None]
    runs = []
    for reshard in (True, False):
        model = build_trainer_model(
            ModelConfig(name=str(checkpoint), device="cpu"),
            world,
            ParallelConfig(reshard_after_forward=reshard),
        )
        # a graph dropped without backward, before the optimizer takes the model's parameters
        # (those are then the gathered weights, which the next gather replaces)
        model.sequence_logprobs(ids, positions)
        optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
        losses = []
        for _ in range(3):
            with torch.no_grad():
                model.sequence_logprobs(ids, positions)
            loss = -model.sequence_logprobs(ids, positions)[0].mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        with torch.no_grad():
            losses.append(-model.sequence_logprobs(ids, positions)[0].mean().item())
        runs.append(losses)
    assert runs[0] == runs[1] and len(set(runs[0])) == len(runs[0]), runs


def test_glm5_accepts_the_published_layer_type_name(checkpoint: Path, tmp_path: Path) -> None:
    """Published GLM-5 config.json files name the layers `deepseek_sparse_attention`."""
    config = json.loads((checkpoint / "config.json").read_text())
    if config["model_type"] != "glm_moe_dsa":
        pytest.skip("GLM-5 only")
    published = tmp_path / "published"
    published.mkdir()
    (published / "model.safetensors").symlink_to(checkpoint / "model.safetensors")
    layers = ["deepseek_sparse_attention"] * config["num_hidden_layers"]
    (published / "config.json").write_text(json.dumps({**config, "layer_types": layers}))
    model = build_trainer_model(
        ModelConfig(name=str(published), device="cpu"), init_distributed("cpu"), ParallelConfig()
    )
    assert len(model.layers) == config["num_hidden_layers"]


def test_experts_that_ep_cannot_split_fail() -> None:
    from tandem.models.expert_parallel import apply_expert_parallel

    with torch.device("meta"):
        model = family("qwen3_moe").build(CONFIGS["qwen3_moe"](), "sdpa")  # 6 experts

    class FourRanks:
        def size(self) -> int:
            return 4

    with pytest.raises(ValueError, match="ep = 4 does not divide the 6 experts"):
        apply_expert_parallel(model, FourRanks())


def test_impl_tandem_needs_a_family_and_auto_falls_back(tmp_path: Path) -> None:
    world = init_distributed("cpu")
    llama = AutoModelForCausalLM.from_config(
        LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1)
    )  # fmt: skip
    llama.save_pretrained(tmp_path / "llama")
    with pytest.raises(UserError, match="model type 'llama' .* has no tandem implementation"):
        build_trainer_model(
            ModelConfig(name=str(tmp_path / "llama"), device="cpu", impl="tandem"), world, ParallelConfig()
        )
    model = build_trainer_model(
        ModelConfig(name=str(tmp_path / "llama"), device="cpu"), world, ParallelConfig()
    )
    assert model.hf_config.model_type == "llama" and hasattr(model, "sequence_logprobs")
    for key, value in (("activation_checkpointing", "full"), ("reshard_after_forward", False)):
        with pytest.raises(UserError, match=f"trainer.parallel.{key}.* needs? tandem's model implementation"):
            build_trainer_model(
                ModelConfig(name=str(tmp_path / "llama"), device="cpu"), world, ParallelConfig(**{key: value})
            )


def test_glm5_sparse_scores_are_not_rounded_to_bf16() -> None:
    """The sparse path's attention scores from bf16 queries and keys are the fp32 products of
    those bf16 values (float64 within fp32 rounding), where a bf16 matmul rounds them to 8 bits
    before the softmax; their gradients come back in bf16 and equal the float64 ones."""
    from tandem.models.layers.dsa import fp32_scores

    generator = torch.Generator().manual_seed(7)
    q = (torch.randn(6, 4, 72, generator=generator) * 2).bfloat16().requires_grad_()
    k = (torch.randn(6, 40, 72, generator=generator) * 2).bfloat16().requires_grad_()
    scores = fp32_scores(q, k)
    exact = torch.bmm(q.double(), k.double().transpose(1, 2))
    assert scores.dtype == torch.float32
    assert (scores.double() - exact).abs().max() < 1e-6 * exact.abs().max()
    rounded = torch.bmm(q, k.transpose(1, 2)).double()
    assert (rounded - exact).abs().max() > 100 * (scores.double() - exact).abs().max()
    grad = torch.randn(scores.shape, generator=generator)
    scores.backward(grad)
    assert q.grad.dtype == k.grad.dtype == torch.bfloat16
    g = grad.double()
    for got, want in ((q.grad, torch.bmm(g, k.double())), (k.grad, torch.bmm(g.transpose(1, 2), q.double()))):
        assert (got.double() - want).abs().max() < 1e-2 * want.abs().max()
