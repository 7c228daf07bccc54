"""Prefill on other servers (`[inference.prefill]`, prefill.py): a decode server whose prompts a
prefill server computes, both real servers on 127.0.0.1 (tiny fp32 model). The decode server's
answers equal transformers' greedy ones; it computes only each prompt's last tokens; the blocks it
already holds do not travel; and every failure of the prefill server (other weights, gone) leaves
the answers right, computed locally and counted."""

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import start_servers
from test_server import metrics, reference_greedy
from transformers import AutoModelForCausalLM

from tandem.config.loader import ConfigError, parse_config
from tandem.inference.config import InferenceConfig
from tandem.net import free_ports

# its three slowest parts took 149 s in a CI run: handed out first (conftest.py)
pytestmark = pytest.mark.slow
BLOCK = 16


@pytest.fixture(scope="module")
def servers(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    logs = tmp_path_factory.mktemp("logs")
    common = ["--model", str(tiny_model), "--engine.block-size", str(BLOCK), "--engine.max-model-len", "512"]
    port = free_ports(2)  # the prefill server's, then the decode server's
    decode_args = [
        *common,
        "--engine.core-process", "true",  # (the engine calls cross the process pipe)
        "--prefill.servers", json.dumps([f"http://127.0.0.1:{port}"]),
        "--prefill.min-tokens", "32",
        "--prefill.timeout-s", "30",
    ]  # fmt: skip
    # started together: a decode server calls its prefill server only once requests come
    with start_servers([(common, logs / "prefill.log"), (decode_args, logs / "decode.log")], port) as both:
        yield tuple(both)


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_model).eval()


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 300 + 10 for i in range(length)]


def complete(server: Any, ids: list[int], max_tokens: int = 8) -> list[int]:
    body = {
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def delta(server: Any, before: dict[str, float], name: str) -> float:
    return metrics(server)[name] - before.get(name, 0.0)


def test_the_decode_server_computes_only_the_last_tokens(servers: Any, model: Any) -> None:
    prefill, decode = servers
    ids = prompt(1, 70)  # 4 reusable blocks, then 6 tokens
    before_p, before_d = metrics(prefill), metrics(decode)
    assert complete(decode, ids) == reference_greedy(model, ids, 8)
    assert delta(prefill, before_p, "tandem_kv_exports_total") == 1
    assert delta(decode, before_d, "tandem_prefill_remote_prompts_total") == 1
    assert delta(decode, before_d, "tandem_prefill_remote_tokens_total") == 4 * BLOCK
    assert delta(decode, before_d, "tandem_prefill_tokens_computed_total") == 6
    assert delta(decode, before_d, "tandem_prefill_remote_failures_total") == 0


def test_concurrent_requests_and_a_second_turn(servers: Any, model: Any) -> None:
    """16 requests at once; then each one's next turn, where only the new blocks travel."""
    prefill, decode = servers
    prompts = [prompt(10 + k, 40 + 5 * k) for k in range(16)]

    async def all_at_once(batch: list[list[int]]) -> list[list[int]]:
        return await asyncio.gather(*(asyncio.to_thread(complete, decode, ids) for ids in batch))

    before = metrics(decode)
    replies = asyncio.run(all_at_once(prompts))
    for ids, reply in zip(prompts, replies, strict=True):
        assert reply == reference_greedy(model, ids, 8)
    assert delta(decode, before, "tandem_prefill_remote_prompts_total") == 16
    turns = [
        ids + reply + prompt(40 + k, 36) for k, (ids, reply) in enumerate(zip(prompts, replies, strict=True))
    ]
    before = metrics(decode)
    for ids, reply in zip(turns, asyncio.run(all_at_once(turns)), strict=True):
        assert reply == reference_greedy(model, ids, 8)
    held = sum(
        (len(ids) + 8 - 1) // BLOCK * BLOCK for ids in prompts
    )  # turn 1 as the decode server cached it
    reusable = sum((len(ids) - 1) // BLOCK * BLOCK for ids in turns)
    assert delta(decode, before, "tandem_prefill_remote_tokens_total") == reusable - held
    assert delta(decode, before, "tandem_prefix_cache_hit_tokens_total") == reusable


def test_streamed_chat_with_several_samples(servers: Any) -> None:
    """A streamed chat completion of n = 2 greedy samples through the decode server: its prompt
    is computed by the prefill server, and both samples equal the prefill server's own answer."""
    prefill, decode = servers
    messages = [{"role": "user", "content": "reverse this text, please: " + "tandem " * 12}]
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "n": 2, "ignore_eos": True}
    want = httpx.post(prefill.url + "/v1/chat/completions", json=body, timeout=60).json()
    before = metrics(decode)
    texts = {0: "", 1: ""}
    with httpx.stream(
        "POST", decode.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] += choice["delta"].get("content") or ""
    assert texts[0] == texts[1] == want["choices"][0]["message"]["content"]
    assert delta(decode, before, "tandem_prefill_remote_prompts_total") == 1


def test_staging_buffers_on_one_machine(
    servers: Any, model: Any, tiny_model: Path, tmp_path: Path, launch_server
) -> None:
    """transport = shared: six prompts, one after another, through the prefill server's four
    staging buffers (shared memory on CPU), each released after its copy; the decode engine in a
    process of its own, as on GPUs."""
    prefill, _ = servers
    args = [
        "--model", str(tiny_model), "--engine.block-size", str(BLOCK), "--engine.max-model-len", "512",
        "--prefill.servers", json.dumps([prefill.url]), "--prefill.min-tokens", "32",
        "--prefill.transport", "shared", "--engine.core-process", "true",
    ]  # fmt: skip
    with launch_server(args, tmp_path / "shared.log") as decode:
        before = metrics(prefill)
        for k in range(6):
            ids = prompt(50 + k, 60 + k)
            assert complete(decode, ids) == reference_greedy(model, ids, 8)
        assert delta(prefill, before, "tandem_kv_exports_staged_total") == 6
        assert metrics(decode)["tandem_prefill_remote_prompts_total"] == 6


def test_p2p_links_between_servers(tiny_model: Path, tmp_path: Path, model: Any) -> None:
    """transport = p2p (gloo on CPU): the link forms in the background while the first prompts'
    blocks come in bodies; then 8 prompts at once are each sent over it; a link the prefill
    server dropped costs one prompt computed here, and bodies carry the blocks after that."""
    common = ["--model", str(tiny_model), "--engine.block-size", str(BLOCK), "--engine.max-model-len", "512"]
    prefill_args = [
        *common,
        "--engine.core-process",
        "true",
        "--prefill.staging-buffers",
        "8",
    ]  # one a prompt
    port = free_ports(2)  # the prefill server's, then the decode server's (started together)
    args = [
        *common, "--prefill.servers", json.dumps([f"http://127.0.0.1:{port}"]), "--prefill.min-tokens", "32",
        "--prefill.transport", "p2p", "--engine.core-process", "true",
    ]  # fmt: skip
    logs = [tmp_path / "prefill.log", tmp_path / "decode.log"]
    with start_servers([(prefill_args, logs[0]), (args, logs[1])], port) as (prefill, decode):
        for k in range(40):  # until the link is up
            ids = prompt(60 + k, 50)
            assert complete(decode, ids) == reference_greedy(model, ids, 8)
            if metrics(prefill).get("tandem_kv_sends_total"):
                break
            time.sleep(0.1)
        assert metrics(prefill)["tandem_kv_sends_total"] == 1
        assert "blocks come over a p2p link" in decode.log()

        prompts = [prompt(100 + k, 40 + 9 * k) for k in range(8)]
        before_p, before_d = metrics(prefill), metrics(decode)

        async def all_at_once() -> list[list[int]]:
            return await asyncio.gather(*(asyncio.to_thread(complete, decode, ids) for ids in prompts))

        for ids, reply in zip(prompts, asyncio.run(all_at_once()), strict=True):
            assert reply == reference_greedy(model, ids, 8)
        assert delta(prefill, before_p, "tandem_kv_sends_total") == 8
        computed = sum(len(ids) - (len(ids) - 1) // BLOCK * BLOCK for ids in prompts)  # the last tokens
        assert delta(decode, before_d, "tandem_prefill_tokens_computed_total") == computed
        assert delta(decode, before_d, "tandem_prefill_remote_prompts_total") == 8
        assert delta(decode, before_d, "tandem_prefill_remote_failures_total") == 0

        link = int(re.search(r"blocks come over a p2p link \(its link (\d+)\)", decode.log())[1])
        assert httpx.post(prefill.url + "/v1/kv/unlink", json={"link": link}, timeout=10).status_code == 200
        before_p, before_d = metrics(prefill), metrics(decode)
        for k in range(2):
            ids = prompt(200 + k, 60)
            assert complete(decode, ids) == reference_greedy(model, ids, 8)
        assert delta(decode, before_d, "tandem_prefill_remote_failures_total") == 1
        assert delta(decode, before_d, "tandem_prefill_remote_prompts_total") == 1  # by body
        assert delta(prefill, before_p, "tandem_kv_sends_total") == 0
        assert "p2p link: HTTP 400" in decode.log()
        assert "cannot be mapped" not in decode.log()  # (a link's failure is not the mapping's)


def test_short_prompts_are_computed_here(servers: Any, model: Any) -> None:
    prefill, decode = servers
    before = metrics(prefill)
    ids = prompt(2, 30)  # under prefill.min_tokens
    assert complete(decode, ids) == reference_greedy(model, ids, 8)
    assert delta(prefill, before, "tandem_kv_exports_total") == 0


def test_other_weights_on_the_prefill_server_fall_back_to_computing_here(
    servers: Any, model: Any, tiny_model: Path
) -> None:
    prefill, decode = servers
    update = {"path": str(tiny_model), "version": 7}
    assert httpx.post(decode.url + "/update_weights", json=update, timeout=60).status_code == 200
    try:
        before = metrics(decode)
        ids = prompt(3, 80)
        assert complete(decode, ids) == reference_greedy(model, ids, 8)
        assert delta(decode, before, "tandem_prefill_remote_failures_total") == 1
        assert delta(decode, before, "tandem_prefill_tokens_computed_total") == 80
        assert "weight version 0" in decode.log()
        assert httpx.post(prefill.url + "/update_weights", json=update, timeout=60).status_code == 200
        before = metrics(decode)
        ids = prompt(4, 80)
        assert complete(decode, ids) == reference_greedy(model, ids, 8)
        assert delta(decode, before, "tandem_prefill_remote_prompts_total") == 1
    finally:
        for server in servers:
            httpx.post(server.url + "/update_weights", json={**update, "version": 0}, timeout=60)


def test_bad_export_requests_are_4xx(servers: Any) -> None:
    prefill, _ = servers
    url = prefill.url + "/v1/kv/export"
    for body, param in (
        ({"prompt": [10**6] * 40}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": prompt(5, 40), "skip_tokens": 5}, "skip_tokens"),
        ({"prompt": prompt(5, 40), "extra": 1}, "extra"),
    ):
        response = httpx.post(url, json=body, timeout=60)
        assert response.status_code == 400, (body, response.text)
        assert param in response.text
    for body, param in (
        ({"link": 5, "buffer": 0, "lease": 99, "nbytes": 10}, "lease"),  # no such lease
        ({"link": 5, "buffer": 0, "lease": 99}, "nbytes"),
        ({"link": 0, "buffer": 0, "lease": 1, "nbytes": 10}, "link"),
    ):
        response = httpx.post(prefill.url + "/v1/kv/send", json=body, timeout=60)
        assert response.status_code == 400, (body, response.text)
        assert param in response.text


def test_a_prefill_server_that_is_gone_costs_nothing_but_time(
    tiny_model: Path, tmp_path: Path, launch_server, model: Any
) -> None:
    gone = "http://127.0.0.1:9"  # the discard port: nothing listens
    args = ["--model", str(tiny_model), "--prefill.servers", json.dumps([gone]), "--prefill.min-tokens", "16"]
    with launch_server(args, tmp_path / "decode.log") as decode:
        ids = prompt(6, 50)
        assert complete(decode, ids) == reference_greedy(model, ids, 8)
        assert complete(decode, prompt(7, 50)) == reference_greedy(model, prompt(7, 50), 8)
        assert metrics(decode)["tandem_prefill_remote_failures_total"] == 2
        assert decode.log().count(f"prefill server {gone} failed") == 1  # once per kind of failure


def test_prefill_servers_must_be_urls() -> None:
    with pytest.raises(ConfigError, match="prefill.servers.*not a base URL"):
        parse_config(InferenceConfig, ["--prefill.servers", '["localhost:8000"]'], prog="inference")
