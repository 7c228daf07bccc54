"""`engine.core_process`: the engine core in a process of its own behaves as the thread engine.

Two real servers in this process (uvicorn in threads) over the same tiny model, one with the core
in a background thread (AsyncEngine), one with it in a spawned process (ProcessEngine), answer
the same requests with the same tokens and logprobs; aborts, pauses and weight updates reach the
engine process; a killed engine process fails the open requests and takes the server down
instead of leaving it hanging; in-memory weights (broadcast, over gloo on the CPU) are received
by the engine process, their errors answered as by the thread engine."""

import itertools
import json
import os
import pickle
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from server_process import serve_in_thread, start_server
from weight_link_helpers import hf, send_while, server_weights, transfer_models

from tandem.cli import UserError
from tandem.inference.config import InferenceConfig
from tandem.inference.engine import AsyncEngine
from tandem.inference.engine.api import SampleUpdate
from tandem.inference.engine.process import ProcessEngine, _decode, _encode
from tandem.inference.server import build_app
from tandem.models.tiny import build_tiny_model
from tandem.net import free_port
from tandem.trainer.weight_stream import hf_weight_specs, iter_hf_weights
from tandem.transport.weight_link import LinkSettings, TransferError, TransferRefused
from tandem.transport.weight_sender import WeightSender

PROMPT = [5, 9, 14, 20, 3]


def same(a: object, b: object) -> bool:
    """Equal, floats (logprobs) within 1e-5: the child's CPU matmuls may split their work over
    another number of threads than this process's, which moves the last bits."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-5
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def config(model: Path, core_process: bool, **engine: object) -> InferenceConfig:
    return InferenceConfig.model_validate(
        {
            "model": {"name": str(model)},
            "engine": {"max_model_len": 256, "core_process": core_process, **engine},
        }
    )


@dataclass
class Served:
    url: str
    engine: AsyncEngine | ProcessEngine

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=60)

    def complete(self, body: dict) -> list[dict]:
        response = self.post("/v1/completions", {"prompt": PROMPT, "return_token_ids": True, **body})
        assert response.status_code == 200, response.text
        return response.json()["choices"]

    def stream(self, body: dict) -> dict[int, dict[str, list]]:
        """Each choice's token ids, logprobs and top logprobs, joined over the chunks."""
        body = {"prompt": PROMPT, "return_token_ids": True, "stream": True, **body}
        joined: dict[int, dict[str, list]] = {}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    entry = joined.setdefault(choice["index"], {"ids": [], "logprobs": [], "top": []})
                    entry["ids"] += choice.get("token_ids") or []
                    if choice.get("logprobs"):
                        entry["logprobs"] += choice["logprobs"]["token_logprobs"]
                        entry["top"] += choice["logprobs"]["top_logprobs"]
        return joined

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        values = (line.split() for line in text.splitlines() if line and not line.startswith("#"))
        return {name: float(value) for name, value in values}

    def wait_for_idle(self, timeout_s: float = 10.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if m["tandem_requests_running"] == 0 and m["tandem_kv_cache_blocks_used"] == 0:
                return m
            assert time.monotonic() < deadline, f"the engine did not free its blocks: {m}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def servers(tiny_model: Path) -> Iterator[tuple[Served, Served]]:
    """(thread engine, process engine) over the same model."""
    thread_config, process_config = config(tiny_model, False), config(tiny_model, True)
    thread_engine, process_engine = AsyncEngine(thread_config), ProcessEngine(process_config)
    thread_app = build_app(thread_engine, thread_engine.tokenizer, thread_config)
    process_app = build_app(process_engine, process_engine.tokenizer, process_config)
    with serve_in_thread(thread_app) as thread_url, serve_in_thread(process_app) as process_url:
        yield Served(thread_url, thread_engine), Served(process_url, process_engine)
    assert not Path(f"/proc/{process_engine.pid}").exists()  # stopped and reaped by the shutdown


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0}, {"temperature": 1.0, "seed": 7, "top_k": 20}],
    ids=["greedy", "seeded"],
)
def test_same_tokens_and_logprobs_as_the_thread_engine(
    servers: tuple[Served, Served], sampling: dict
) -> None:
    thread, process = servers
    body = {"max_tokens": 24, "n": 3, "logprobs": 2, "ignore_eos": True, **sampling}
    whole = process.complete(body)
    assert same(whole, thread.complete(body))
    assert len(whole) == 3 and all(len(c["token_ids"]) == 24 for c in whole)
    streamed = process.stream(body)
    assert same(streamed, thread.stream(body))
    assert [streamed[i]["ids"] for i in range(3)] == [c["token_ids"] for c in whole]
    assert process.engine.stats().generated_tokens_total == thread.engine.stats().generated_tokens_total


def test_disconnects_abort_the_request_in_the_engine_process(servers: tuple[Served, Served]) -> None:
    _, process = servers
    before = process.wait_for_idle()
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True, "n": 2}
    with httpx.stream("POST", process.url + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        assert process.metrics()["tandem_kv_cache_blocks_used"] > 0
    with pytest.raises(httpx.ReadTimeout):  # a whole response whose client gives up
        httpx.post(
            process.url + "/v1/completions",
            json={**body, "stream": False, "n": 4},
            timeout=httpx.Timeout(30, read=0.3),
        )
    after = process.wait_for_idle()
    generated = after["tandem_generation_tokens_total"] - before["tandem_generation_tokens_total"]
    assert generated < 2 * 200 + 4 * 200  # both aborted, not run to the end
    assert after["tandem_http_requests_aborted_total"] == before["tandem_http_requests_aborted_total"] + 2


def test_pause_resume_and_weight_updates_from_a_path(
    servers: tuple[Served, Served], tiny_model: Path, tmp_path: Path
) -> None:
    thread, process = servers
    greedy = {"max_tokens": 12, "temperature": 0, "logprobs": 1}
    before = process.complete(greedy)
    assert process.post("/pause", {}).json()["paused"] is True
    assert process.metrics()["tandem_paused"] == 1
    other = build_tiny_model(out=tmp_path / "other", seed=1)
    for served in (thread, process):
        answer = served.post("/update_weights", {"path": str(other)})
        assert answer.status_code == 200 and answer.json()["weight_version"] == 1, answer.text
    assert process.engine.weight_version == 1 and process.metrics()["tandem_paused"] == 1
    process.post("/resume", {})
    assert process.metrics()["tandem_paused"] == 0
    after = process.complete(greedy)
    assert same(after, thread.complete(greedy)) and after != before
    assert after[0]["weight_versions"] == [1]

    missing = process.post("/update_weights", {"path": str(tmp_path / "missing")})
    assert missing.status_code == 400, missing.text
    assert "the old weights stay live" in missing.json()["error"]["message"]
    assert process.engine.weight_version == 1 and process.complete(greedy) == after

    for served in (thread, process):  # back to the first weights, for the other tests
        answer = served.post("/update_weights", {"path": str(tiny_model), "version": 0})
        assert answer.status_code == 200 and answer.json()["weight_version"] == 0, answer.text
    assert process.complete(greedy) == before
    assert httpx.get(process.url + "/health").json()["weight_version"] == 0


@pytest.mark.filterwarnings("ignore::FutureWarning")  # peft on this transformers
def test_lora_adapters_from_a_path(servers: tuple[Served, Served], tiny_model: Path, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model  # (a dev dependency)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, lora).save_pretrained(tmp_path / "adapter")
    thread, process = servers
    greedy = {"max_tokens": 12, "temperature": 0, "logprobs": 1}
    before = process.complete(greedy)
    for served in (thread, process):
        answer = served.post("/update_weights", {"path": str(tmp_path / "adapter"), "version": 7})
        assert answer.status_code == 200 and answer.json()["weight_version"] == 7, answer.text
    merged = process.complete(greedy)
    assert same(merged, thread.complete(greedy)) and merged != before
    for served in (thread, process):  # back to the first weights, for the other tests
        assert served.post("/update_weights", {"path": str(tiny_model), "version": 0}).status_code == 200
    assert process.complete(greedy) == before


def test_updates_cross_the_pipe_unchanged() -> None:
    top = ((7, -0.5), (9, -1.5))
    updates = [
        SampleUpdate(0, [7], [-0.5], [3], [top]),
        SampleUpdate(1, [4, 5], [-0.25, -2.0], [3, 3], None, "length"),
        SampleUpdate(2, [4, 5], [-0.25, -2.0], [3, 4], [top, top], "stop"),
        SampleUpdate(3, finish_reason="abort"),
    ]
    wire = [_encode(update) for update in updates]
    assert wire[1][3] == 3 and wire[2][3] == [3, 4]  # one version where all tokens share it
    assert [_decode(*pickle.loads(pickle.dumps(w))) for w in wire] == updates


def test_a_start_failure_in_the_engine_process_is_the_thread_engines_error(tiny_model: Path) -> None:
    failing = {"quantization": "fp8"}  # refused on a CPU when the core is built
    with pytest.raises(UserError) as in_thread:
        AsyncEngine(config(tiny_model, False, **failing))
    with pytest.raises(UserError) as in_process:
        ProcessEngine(config(tiny_model, True, **failing))
    assert str(in_process.value) == str(in_thread.value)


def test_a_killed_engine_process_fails_open_requests_and_health(tiny_model: Path) -> None:
    engine_config = config(tiny_model, True)
    engine = ProcessEngine(engine_config)
    died = threading.Event()
    engine.on_death = died.set
    with serve_in_thread(build_app(engine, engine.tokenizer, engine_config)) as url:
        body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            os.kill(engine.pid, signal.SIGKILL)
            rest = list(lines)  # ends: an error event, then [DONE]
        errors = [json.loads(line[6:]) for line in rest if line.startswith('data: {"error"')]
        assert errors and "engine process died" in errors[0]["error"]["message"], rest[-3:]
        assert died.wait(10), "on_death was not called"
        assert engine.dead_reason == "exit code -9"
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503 and "exit code -9" in health.json()["error"]["message"]
        later = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=10)
        assert later.status_code == 503, later.text


FAULTY_SERVER = """
import sys
from tandem.inference.engine.core import EngineCore

def broken_step(self, lookahead=True):
    raise RuntimeError("injected step fault")

EngineCore.step = broken_step  # (also in the engine process, which imports this file as __mp_main__)
if __name__ == "__main__":
    from tandem.inference.cli import main

    main(sys.argv[1:])
"""


def test_the_server_exits_when_its_engine_process_dies(tiny_model: Path, tmp_path: Path) -> None:
    script = tmp_path / "faulty_server.py"
    script.write_text(FAULTY_SERVER)
    args = ["--model.name", str(tiny_model), "--engine.max-model-len", "128", "--engine.core-process", "true"]
    with start_server(args, tmp_path / "server.log", entry=(str(script),)) as server:
        completion = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        response = httpx.post(server.url + "/v1/completions", json=completion, timeout=30)
        assert response.status_code == 503, response.text
        assert "injected step fault" in response.json()["error"]["message"]
        try:
            code = server.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server kept running after its engine process died:\n{server.log()[-2000:]}")
    assert code == 2
    log = server.log()
    assert "the inference engine died (exit code 1: RuntimeError('injected step fault')" in log
    assert "the engine loop died" in log  # the engine process's traceback


LINK_TIMEOUT_S = 4.0  # weights.transfer_timeout_s: how long the half-sent transfer below waits


def tokens(choices: list[dict]) -> list[tuple[list[int], list[float]]]:
    return [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in choices]


def broadcast_engine(model: Path) -> tuple[ProcessEngine, WeightSender, InferenceConfig]:
    """An engine process serving `model` that receives weights by broadcast (gloo), and the
    trainer-side sender of that link."""
    link = LinkSettings("127.0.0.1", free_port(), LINK_TIMEOUT_S, 60.0, bucket_bytes=64 << 10)
    engine_config = InferenceConfig.model_validate(
        {
            "model": {"name": str(model)},
            "engine": {"max_model_len": 256, "core_process": True},
            "weights": server_weights("broadcast", link),
        }
    )
    return ProcessEngine(engine_config), WeightSender(link, 1, 0, 1, torch.device("cpu")), engine_config


def test_in_memory_weights_reach_the_engine_process(tmp_path: Path) -> None:
    """The receiver lives in the engine process: a transfer serves exactly what loading the same
    weights from disk serves, under the transfer's version; one that does not fit is refused
    (400) with the old weights live; one broken midway (TransferError with `partial`, rebuilt from
    the pipe) takes the server out (503)."""
    models = transfer_models(tmp_path)
    engine, sender, engine_config = broadcast_engine(models["a"])
    greedy = {"max_tokens": 8, "temperature": 0, "logprobs": 1}
    with serve_in_thread(build_app(engine, engine.tokenizer, engine_config)) as url:
        served = Served(url, engine)
        trainer_model = hf(models["a"])
        sender.connect(lambda dtype: hf_weight_specs(trainer_model, dtype))
        try:
            route = "broadcast group rank 1"
            assert httpx.get(url + "/health").json()["weights"] == route
            live = served.complete(greedy)
            assert served.post("/update_weights", {"path": str(models["b"])}).status_code == 200
            from_disk = served.complete(greedy)
            assert served.post("/update_weights", {"path": str(models["a"]), "version": 0}).status_code == 200
            assert served.complete(greedy) == live and tokens(from_disk) != tokens(live)

            receive = lambda version: lambda: served.post("/update_weights", {"step": version})  # noqa: E731
            answer, failure = send_while(sender, 5, hf(models["b"]), receive(5))
            assert failure is None and answer is not None, failure
            assert answer.json() == {"weight_version": 5, "transport": route}, answer.text
            received = served.complete(greedy)
            assert tokens(received) == tokens(from_disk)  # bit for bit: the same tensors reached the model
            assert received[0]["weight_versions"] == [5] and engine.weight_version == 5

            answer, failure = send_while(sender, 6, hf(models["wide"]), receive(6))
            assert isinstance(failure, TransferRefused) and answer is not None and answer.status_code == 400
            message = answer.json()["error"]["message"]
            assert "policy version 6 does not fit this server's model" in message
            assert "the old weights stay live" in message
            assert served.complete(greedy) == received and engine.weight_version == 5

            count = len(hf_weight_specs(trainer_model, torch.float32))
            half = itertools.islice(iter_hf_weights(trainer_model, torch.float32), count // 2)
            answer, failure = send_while(sender, 7, trainer_model, receive(7), tensors=half)
            assert isinstance(failure, TransferError) and answer is not None and answer.status_code == 503
            message = answer.json()["error"]["message"]
            assert "server 0: policy version 7: bucket " in message and " did not arrive" in message
            assert "the weights now mix two versions: this server must be restarted" in message
            assert httpx.get(url + "/health").status_code == 503
        finally:
            sender.close()
    assert not Path(f"/proc/{engine.pid}").exists()  # its receiver closed, the process reaped


def test_a_receiver_killed_mid_broadcast_ends_the_senders_transfer_in_one_line(tmp_path: Path) -> None:
    """The trainer's side of a broadcast whose receiving engine process is killed halfway: the
    next bucket's broadcast fails (a closed peer or the group's timeout) and the sender raises a
    TransferError naming the version and the bucket, not torch's own error."""
    models = transfer_models(tmp_path)
    engine, sender, engine_config = broadcast_engine(models["a"])
    model = hf(models["b"])
    halfway, killed = threading.Event(), threading.Event()

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        tensors = list(iter_hf_weights(model, torch.float32))
        for i, item in enumerate(tensors):
            if i == len(tensors) // 2:
                halfway.set()
                assert killed.wait(60), "the test did not kill the engine process"
            yield item

    with serve_in_thread(build_app(engine, engine.tokenizer, engine_config)) as url:
        sender.connect(lambda dtype: hf_weight_specs(model, dtype))
        answers: list[httpx.Response | BaseException] = []

        def ask() -> None:
            try:
                answers.append(httpx.post(url + "/update_weights", json={"step": 4}, timeout=60))
            except httpx.HTTPError as e:
                answers.append(e)

        def kill_halfway() -> None:
            asking = threading.Thread(target=ask)
            asking.start()
            assert halfway.wait(60), "the sender never got halfway"
            os.kill(engine.pid, signal.SIGKILL)
            killed.set()
            asking.join(60)

        try:
            start = time.monotonic()
            _, failure = send_while(sender, 4, model, kill_halfway, tensors=stream())
        finally:
            sender.close()
    assert isinstance(failure, TransferError), repr(failure)
    message = str(failure)
    assert re.search(r"trainer: policy version 4: bucket \d+ of \d+ was not sent: \w", message), message
    assert "\n" not in message and ".cc:" not in message, message  # torch's own error, in one line
    assert time.monotonic() - start < LINK_TIMEOUT_S + 30
    assert answers and (not isinstance(answers[0], httpx.Response) or answers[0].status_code == 503)


def test_the_engine_process_is_the_default_on_cuda_only(tiny_model: Path) -> None:
    """Unset, `engine.core_process` follows the model's device; set, it is what it says."""
    from tandem.inference.engine import uses_core_process

    def on(device: str, core_process: bool | None) -> bool:
        engine = {} if core_process is None else {"core_process": core_process}
        return uses_core_process(
            InferenceConfig.model_validate(
                {"model": {"name": str(tiny_model), "device": device}, "engine": engine}
            )
        )

    assert not on("cpu", None) and on("cpu", True)
    if torch.cuda.is_available():
        assert on("cuda", None) and not on("cuda", False)
