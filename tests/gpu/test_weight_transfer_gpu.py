"""The in-memory weight transports on GPUs: a native server process (bf16, CUDA graphs, Triton
kernels) that receives a model by CUDA IPC from a trainer-side WeightSender on the same GPU, or by
NCCL broadcast from another GPU, must then answer exactly as after loading that model from disk.

Marked `gpu`; skipped without CUDA (the broadcast test without a second GPU: NCCL cannot put two
processes of one group on one GPU). Run with `pytest tests/gpu -m gpu`.
"""

import os
from pathlib import Path

import httpx
import pytest
import torch
from server_process import start_server
from weight_link_helpers import hf, send_while, transfer_models

from tandem.net import free_port
from tandem.trainer.weight_stream import hf_weight_specs
from tandem.transport.weight_link import LinkSettings
from tandem.transport.weight_sender import WeightSender

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
PROMPT = {
    "prompt": [5, 9, 14, 20, 3],
    "max_tokens": 12,
    "temperature": 0,
    "logprobs": 1,
    "return_token_ids": True,
}
BUCKET_BYTES = 1 << 20  # the tiny model in several buckets: both buffers take turns


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return transfer_models(tmp_path_factory.mktemp("gpu_link"))


def completion(url: str) -> tuple[list[int], list[float]]:
    choice = httpx.post(url + "/v1/completions", json=PROMPT, timeout=60).json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def load(url: str, path: Path) -> None:
    httpx.post(url + "/update_weights", json={"path": str(path)}, timeout=60).raise_for_status()


def gpu_name(index: int) -> str:
    """This process's cuda:`index` as CUDA_VISIBLE_DEVICES names it (for the server's environment;
    the trainer side stays on cuda:0)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index].strip() if visible else str(index)


def check_transfer_equals_disk(
    transport: str, server_gpu: int, models: dict[str, Path], tmp_path: Path, core_process: bool = False
) -> None:
    port = free_port()
    args = [
        "--model.name", str(models["a"]), "--model.dtype", "bfloat16", "--model.device", "cuda",
        "--engine.max_num_seqs", "8", "--engine.kv_cache_memory_gb", "1", "--engine.max_model_len", "256",
        "--weights.transport", transport, "--weights.port", str(port),
        "--engine.core_process", str(core_process).lower(),
    ]  # fmt: skip
    settings = LinkSettings("127.0.0.1", port, 60.0, 300.0, BUCKET_BYTES)
    model = hf(models["b"], "cuda")
    env = {"CUDA_VISIBLE_DEVICES": gpu_name(server_gpu)}
    with start_server(args, tmp_path / "server.log", timeout_s=300, env=env) as server:
        sender = WeightSender(settings, 1, 0, 1, torch.device("cuda", 0))
        assert sender.connect(lambda dtype: hf_weight_specs(model, dtype)) == torch.bfloat16
        before = completion(server.url)
        load(server.url, models["b"])
        from_disk = completion(server.url)
        load(server.url, models["a"])
        assert completion(server.url) == before != from_disk

        post = lambda: httpx.post(server.url + "/update_weights", json={"step": 1}, timeout=120)  # noqa: E731
        answer, failure = send_while(sender, 1, model, post)
        assert failure is None and answer is not None, failure
        assert answer.status_code == 200 and answer.json()["weight_version"] == 1, answer.text
        assert completion(server.url) == from_disk  # the same bf16 tensors reached the engine
        sender.close()


@pytest.mark.parametrize("core_process", [False, True], ids=["engine-thread", "engine-process"])
def test_colocated_cuda_ipc_equals_disk_load(
    models: dict[str, Path], tmp_path: Path, core_process: bool
) -> None:
    check_transfer_equals_disk("colocated", 0, models, tmp_path, core_process)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL broadcast needs a second GPU")
def test_nccl_broadcast_equals_disk_load(models: dict[str, Path], tmp_path: Path) -> None:
    check_transfer_equals_disk("broadcast", 1, models, tmp_path)
