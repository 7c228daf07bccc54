"""Prefill on other servers on GPUs: a decode server takes a prefill server's blocks through its
staging buffers (CUDA IPC; kv_staging.py) and through HTTP bodies, on one GPU and, where there is
a second, peer to peer between two, and over a p2p link (NCCL; two GPUs); its greedy answers
equal the prefill server's own, and the prefill server handed every prompt over as asked.

Marked `gpu`; skipped without CUDA (the two-GPU case without a second GPU). Run with
`pytest tests/gpu -m gpu`.
"""

import json
import os
from pathlib import Path

import httpx
import pytest
import torch
from server_process import start_server

from tandem.models.tiny import build_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(out=tmp_path_factory.mktemp("prefill_gpu") / "tiny", num_layers=2)


def gpus(*indices: int) -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = (
        [g.strip() for g in visible.split(",")]
        if visible
        else [str(i) for i in range(torch.cuda.device_count())]
    )
    return ",".join(names[i] for i in indices)


def greedy(url: str, ids: list[int]) -> list[int]:
    body = {"prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))


@pytest.mark.parametrize(
    ("transport", "two_gpus"),
    [("shared", False), ("http", False), ("shared", True)],
    ids=["ipc", "http", "peer"],
)
def test_a_decode_server_answers_as_the_prefill_server(
    model: Path, tmp_path: Path, transport: str, two_gpus: bool
) -> None:
    if two_gpus and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    common = ["--model", str(model), "--model.dtype", "bfloat16", "--engine.kv-cache-memory-gb", "1"]
    prefill_gpu = 1 if two_gpus else 0
    with start_server(
        [*common, "--prefill.staging-mb", "64"],
        tmp_path / "prefill.log",
        env={"CUDA_VISIBLE_DEVICES": gpus(prefill_gpu)},
    ) as prefill:
        decode_args = [
            *common, "--prefill.servers", json.dumps([prefill.url]), "--prefill.min-tokens", "32",
            "--prefill.transport", transport,
        ]  # fmt: skip
        visible = gpus(0, 1) if two_gpus else gpus(0)
        with start_server(
            decode_args, tmp_path / "decode.log", env={"CUDA_VISIBLE_DEVICES": visible}
        ) as decode:
            prompts = [
                [(7 * i + k) % 300 + 10 for i in range(n)] for k, n in enumerate((40, 129, 300, 70, 64, 90))
            ]
            for ids in prompts:
                assert greedy(decode.url, ids) == greedy(prefill.url, ids)
            staged = counter(prefill.url, "tandem_kv_exports_staged_total")
            assert staged == (len(prompts) if transport == "shared" else 0)
            assert counter(decode.url, "tandem_prefill_remote_prompts_total") == len(prompts)
            assert counter(decode.url, "tandem_prefill_remote_failures_total") == 0


def test_a_p2p_link_between_two_gpus(model: Path, tmp_path: Path) -> None:
    """transport = p2p over NCCL (kv_link.py), each server seeing only its own GPU: once the link
    is up (the first prompts' blocks come in bodies meanwhile), every prompt's blocks are sent
    over it and the answers equal the prefill server's."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (NCCL puts no two ranks of a group on one GPU)")
    common = ["--model", str(model), "--model.dtype", "bfloat16", "--engine.kv-cache-memory-gb", "1"]
    with start_server(
        [*common, "--prefill.staging-mb", "64"],
        tmp_path / "prefill.log",
        env={"CUDA_VISIBLE_DEVICES": gpus(1)},
    ) as prefill:
        decode_args = [
            *common, "--prefill.servers", json.dumps([prefill.url]), "--prefill.min-tokens", "32",
            "--prefill.transport", "p2p",
        ]  # fmt: skip
        with start_server(
            decode_args, tmp_path / "decode.log", env={"CUDA_VISIBLE_DEVICES": gpus(0)}
        ) as decode:
            for k in range(100):  # until the link is up (NCCL's set-up included)
                ids = [(11 * i + k) % 300 + 10 for i in range(64)]
                assert greedy(decode.url, ids) == greedy(prefill.url, ids)
                if counter(prefill.url, "tandem_kv_sends_total"):
                    break
            else:
                pytest.fail("the p2p link did not come up within 100 prompts")
            sent = counter(prefill.url, "tandem_kv_sends_total")
            prompts = [
                [(7 * i + k) % 300 + 10 for i in range(n)] for k, n in enumerate((40, 129, 300, 70, 64, 90))
            ]
            for ids in prompts:
                assert greedy(decode.url, ids) == greedy(prefill.url, ids)
            assert counter(prefill.url, "tandem_kv_sends_total") == sent + len(prompts)
            assert counter(decode.url, "tandem_prefill_remote_failures_total") == 0
