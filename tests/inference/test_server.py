"""The inference server in a subprocess on 127.0.0.1, through the official openai client, checked
against a transformers forward pass on the same fp32 tiny model."""

import asyncio
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.inference.responses import TokenTexts

MAX_MODEL_LEN = 1024
MAX_N = 8


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, launch_server):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    args = [
        "--model",
        str(tiny_model),
        "--engine.max-model-len",
        str(MAX_MODEL_LEN),
        "--engine.max-n",
        str(MAX_N),
    ]
    with launch_server(args, log) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> tuple[torch.nn.Module, object]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model)


def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def reference_logprobs(
    model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """log p(completion[i] | prefix) from one transformers forward pass, in float64."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double() / temperature
    return torch.log_softmax(logits, -1)


def reference_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def metrics(server: Any) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


# --- basic endpoints ----------------------------------------------------------------------------


def test_health_and_models(server: Any, client: openai.OpenAI, tiny_model: Path) -> None:
    health = httpx.get(server.url + "/health", timeout=10).json()
    assert health == {
        "status": "ok", "weight_version": 0, "paused": False, "weights": "filesystem", "pid": server.process.pid
    }  # fmt: skip
    models = client.models.list().data
    assert [m.id for m in models] == [str(tiny_model)]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert client.models.retrieve(str(tiny_model)).id == str(tiny_model)  # (the id is a path: slashes)
    with pytest.raises(openai.NotFoundError, match="the model 'gpt-4' does not exist"):
        client.models.retrieve("gpt-4")


# --- numerics against transformers -------------------------------------------------------------


def test_completion_greedy_tokens_and_logprobs_match_transformers(client: openai.OpenAI, reference) -> None:
    model, tokenizer = reference
    prompt = "Reverse the following text: hello"
    out = client.completions.create(
        model=model_name(client),
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        logprobs=3,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True},
    )
    choice = out.choices[0]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.token_ids]
    prompt_ids = tokenizer.encode(prompt)
    assert choice.prompt_token_ids == prompt_ids
    assert choice.token_ids == reference_greedy(model, prompt_ids, 12)
    ref = reference_logprobs(model, prompt_ids, choice.token_ids)
    served = torch.tensor(choice.logprobs.token_logprobs, dtype=torch.float64)
    sampled = ref.gather(1, torch.tensor(choice.token_ids)[:, None])[:, 0]
    assert torch.allclose(served, sampled, atol=1e-4), (served - sampled).abs().max()
    # the top-3 alternatives (plus the sampled token) are transformers' top 3
    for i, top in enumerate(choice.logprobs.top_logprobs):
        best = ref[i].topk(3)
        expected = {
            f"token_id:{t}": lp for t, lp in zip(best.indices.tolist(), best.values.tolist(), strict=True)
        }
        for text, logprob in expected.items():
            assert abs(top[text] - logprob) < 1e-4
    assert choice.finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == len(prompt_ids) and out.usage.completion_tokens == len(choice.token_ids)
    assert choice.model_extra["weight_versions"] == [0] and out.model_extra["weight_versions"] == [0]


def test_chat_renders_template_with_tools_and_matches_transformers(client: openai.OpenAI, reference) -> None:
    model, tokenizer = reference
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort: b a c"}]
    tools = [{"type": "function", "function": {"name": "sort", "parameters": {"type": "object"}}}]
    out = client.chat.completions.create(
        model=model_name(client),
        messages=messages,
        tools=tools,
        max_completion_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_token_ids": True},
    )
    expected_prompt = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert out.prompt_token_ids == tokenizer.encode(expected_prompt, add_special_tokens=False)
    assert '"name": "sort"' in tokenizer.decode(out.prompt_token_ids)
    choice = out.choices[0]
    assert choice.token_ids == reference_greedy(model, out.prompt_token_ids, 10)
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(choice.token_ids, skip_special_tokens=True)
    ref = reference_logprobs(model, out.prompt_token_ids, choice.token_ids)
    for i, entry in enumerate(choice.logprobs.content):
        assert abs(entry.logprob - ref[i, choice.token_ids[i]].item()) < 1e-4
        assert len(entry.top_logprobs) == 2
        assert abs(entry.top_logprobs[0].logprob - ref[i].max().item()) < 1e-4


def test_sampled_logprobs_are_of_the_tempered_distribution(client: openai.OpenAI, reference) -> None:
    model, _ = reference
    out = client.completions.create(
        model=model_name(client),
        prompt=[5, 6, 7, 8],
        max_tokens=16,
        temperature=0.7,
        seed=3,
        logprobs=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    choice = out.choices[0]
    ref = reference_logprobs(model, [5, 6, 7, 8], choice.token_ids, temperature=0.7)
    sampled = ref.gather(1, torch.tensor(choice.token_ids)[:, None])[:, 0]
    assert torch.allclose(
        torch.tensor(choice.logprobs.token_logprobs, dtype=torch.float64), sampled, atol=1e-4
    )
    assert len(choice.token_ids) == 16 and choice.finish_reason == "length"


# --- sampling features ----------------------------------------------------------------------------


def test_n_samples_and_seeds(client: openai.OpenAI) -> None:
    name = model_name(client)
    kwargs = dict(
        model=name, prompt="abc", max_tokens=8, temperature=1.0, n=4, extra_body={"return_token_ids": True}
    )
    first = client.completions.create(seed=11, **kwargs)
    again = client.completions.create(seed=11, **kwargs)
    other = client.completions.create(seed=12, **kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    ids = [c.token_ids for c in first.choices]
    assert ids == [c.token_ids for c in again.choices]  # seeded sampling is reproducible
    assert ids != [c.token_ids for c in other.choices]
    assert len({tuple(t) for t in ids}) > 1  # the n samples differ from each other
    greedy = client.completions.create(model=name, prompt="abc", max_tokens=8, temperature=0, n=3)
    assert len({c.text for c in greedy.choices}) == 1 and len(greedy.choices) == 3


def test_list_of_prompts(client: openai.OpenAI) -> None:
    name = model_name(client)
    prompts = ["one", "two words", "three"]
    together = client.completions.create(
        model=name, prompt=prompts, max_tokens=6, temperature=0, n=2, extra_body={"return_token_ids": True}
    )
    assert [c.index for c in together.choices] == list(range(6))
    for i, prompt in enumerate(prompts):
        alone = client.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0)
        assert together.choices[2 * i].text == alone.choices[0].text == together.choices[2 * i + 1].text
    streamed: dict[int, list[int]] = {}
    chunks = client.completions.create(
        model=name,
        prompt=prompts,
        max_tokens=6,
        temperature=0,
        n=2,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    for chunk in chunks:
        for c in chunk.choices:
            streamed.setdefault(c.index, []).extend(c.token_ids)
    assert sorted(streamed) == list(range(6))
    for i in range(6):
        assert streamed[i] == together.choices[i].token_ids
        assert streamed[i] == streamed[i - i % 2]  # greedy: both samples of a prompt agree


def sampled_text(client: openai.OpenAI, **extra) -> openai.types.Completion:
    return client.completions.create(
        model=model_name(client),
        prompt="The quick brown fox",
        max_tokens=48,
        temperature=1.0,
        seed=5,
        extra_body={"return_token_ids": True, "ignore_eos": True, **extra.pop("extra_body", {})},
        **extra,
    )


def test_stop_strings_cut_text_and_tokens(client: openai.OpenAI, reference) -> None:
    _, tokenizer = reference
    full = sampled_text(client).choices[0]
    # a stop string of two printable ASCII characters, not at the very start (random weights also
    # emit stray UTF-8 bytes, whose U+FFFD the detokeniser holds back until the next token)
    start = next(
        i
        for i in range(2, len(full.text) - 1)
        if full.text[i : i + 2].isascii() and full.text[i : i + 2].isprintable()
    )
    stop = full.text[start : start + 2]
    cut_at = full.text.find(stop)
    out = sampled_text(client, stop=[stop, "\u2603never"]).choices[0]
    assert out.text == full.text[:cut_at]
    assert out.finish_reason == "stop" and out.model_extra["stop_reason"] == stop
    assert out.token_ids == full.token_ids[: len(out.token_ids)]  # same seed, same tokens, up to the stop
    text_of = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    assert stop in text_of(out.token_ids) and stop not in text_of(out.token_ids[:-1])
    kept = sampled_text(client, stop=stop, extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.text == full.text[: cut_at + len(stop)]
    streamed = sampled_text(client, stop=[stop], stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == out.text


def test_stop_token_ids(client: openai.OpenAI) -> None:
    full = sampled_text(client).choices[0]
    tokenizer = AutoTokenizer.from_pretrained(client.models.list().data[0].id)
    stop_id = next(t for t in full.token_ids[5:] if tokenizer.decode([t]).strip())  # a token with text
    first = full.token_ids.index(stop_id)
    out = sampled_text(client, extra_body={"stop_token_ids": [stop_id]}).choices[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.model_extra["stop_reason"] == stop_id
    # the ending token's text is not part of the answer unless asked for (as in vLLM), with
    # special tokens kept in the text too (tool environments parse it)
    for extra, ids in [({}, out.token_ids[:-1]), ({"include_stop_str_in_output": True}, out.token_ids)]:
        body = {"stop_token_ids": [stop_id], "skip_special_tokens": False, **extra}
        kept = sampled_text(client, extra_body=body).choices[0]
        assert kept.text == tokenizer.decode(ids, skip_special_tokens=False)


# --- streaming -------------------------------------------------------------------------------------


def test_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    name = model_name(client)
    kwargs = dict(model=name, max_tokens=10, temperature=1.0, seed=9, extra_body={"return_token_ids": True})
    whole = client.completions.create(prompt="stream me", logprobs=1, n=2, **kwargs)
    text, ids, logprobs, offsets, finish = ["", ""], [[], []], [[], []], [[], []], [None, None]
    chunks = client.completions.create(
        prompt="stream me", logprobs=1, n=2, stream=True, stream_options={"include_usage": True}, **kwargs
    )
    usage = None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text[c.index] += c.text
            ids[c.index] += c.token_ids
            logprobs[c.index] += c.logprobs.token_logprobs
            offsets[c.index] += c.logprobs.text_offset  # counted on across chunks
            finish[c.index] = c.finish_reason or finish[c.index]
    for i, c in enumerate(whole.choices):
        assert (text[i], ids[i], logprobs[i], offsets[i], finish[i]) == (
            c.text,
            c.token_ids,
            c.logprobs.token_logprobs,
            c.logprobs.text_offset,
            c.finish_reason,
        )
    assert usage.completion_tokens == whole.usage.completion_tokens

    messages = [{"role": "user", "content": "hi"}]
    whole_chat = client.chat.completions.create(messages=messages, **kwargs)
    stream = client.chat.completions.create(messages=messages, stream=True, **kwargs)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].prompt_token_ids == whole_chat.prompt_token_ids
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    token_ids = [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert content == whole_chat.choices[0].message.content
    assert token_ids == whole_chat.choices[0].token_ids
    assert chunks[-1].choices[0].finish_reason == whole_chat.choices[0].finish_reason


def test_null_fields_mean_their_defaults(server: Any) -> None:
    """OpenAI's optional fields are nullable: a client that sends every parameter, unset ones as
    null, gets their defaults (these were 400s); a required field's null still names it."""
    nulls = dict.fromkeys(
        ("n", "stream", "presence_penalty", "frequency_penalty", "ignore_eos", "logit_bias")
    )
    completion = {"prompt": "x", "max_tokens": 2, "echo": None, "logprobs": None, **nulls}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": None, **nulls}
    for path, body in (("/completions", completion), ("/chat/completions", chat)):
        answer = httpx.post(server.base_url + path, json=body, timeout=30)
        assert answer.status_code == 200 and len(answer.json()["choices"]) == 1, answer.text
    answer = httpx.post(server.base_url + "/chat/completions", json={"messages": None}, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages", answer.text


def test_raw_sse_format(server: Any) -> None:
    body = {"prompt": "x", "max_tokens": 3, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


# --- concurrency -----------------------------------------------------------------------------------


def test_64_concurrent_requests_equal_one_by_one(server: Any, client: openai.OpenAI) -> None:
    name = model_name(client)
    prompts = [f"prompt number {i}: " + "ab" * (i % 7) for i in range(64)]
    kwargs = dict(model=name, max_tokens=12, temperature=0, extra_body={"return_token_ids": True})
    one_by_one = [client.completions.create(prompt=p, **kwargs).choices[0].token_ids for p in prompts]

    async def all_at_once() -> list[list[int]]:
        aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        outs = await asyncio.gather(*(aclient.completions.create(prompt=p, **kwargs) for p in prompts))
        await aclient.close()
        return [o.choices[0].token_ids for o in outs]

    assert asyncio.run(all_at_once()) == one_by_one


# --- bad input --------------------------------------------------------------------------------------

BAD_COMPLETIONS = [
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "n": MAX_N + 1}, 400, "n"),
    ({"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "x", "temperature": 1e-45}, 400, "temperature"),  # (was a 200 of NaN logprobs)
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "top_k": -2}, 400, "top_k"),
    ({"prompt": "x", "min_p": 2}, 400, "min_p"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
    (
        {"prompt": "x", "stop": [f"s{i}" for i in range(257)]},
        400,
        "stop",
    ),  # (each token is checked against all)
    ({"prompt": "x", "stop_token_ids": [-3]}, 400, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    # (refusals that depend on other fields, or of unimplemented features, name their field too)
    ({"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -1}, 400, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 1.2}, 400, "repetition_penalty"),
    ({"prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ({"prompt": "x", "prompt_logprobs": 0}, 400, "prompt_logprobs"),
    ({"prompt": "x", "best_of": 2}, 400, "best_of"),
    ({"prompt": "x", "echo": True}, 400, "echo"),
    ({"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, 10**6]}, 400, "prompt"),
    ({"prompt": [1, -1]}, 400, "prompt"),
    ({"prompt": 42}, 400, "prompt"),
    ({"prompt": "x" * (MAX_MODEL_LEN + 10)}, 400, "prompt"),
    ({"prompt": "x" * (MAX_MODEL_LEN - 20), "max_tokens": 100}, 400, "max_tokens"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "x", "model": "no-such-model"}, 404, "model"),
    ({"prompt": "x", "stream": 5}, 400, "stream"),
    (
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": 5}},
        400,
        "stream_options.include_usage",
    ),
]


def assert_names(error: dict, param: str) -> None:
    """`error` names the request field `param` (or a part of it: `messages.0.role`)."""
    assert error["param"] == param or str(error["param"]).startswith(param + "."), error


@pytest.mark.parametrize(("body", "status", "param"), BAD_COMPLETIONS)
def test_bad_completion_requests(server: Any, body: dict, status: int, param: str) -> None:
    response = httpx.post(server.base_url + "/completions", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == status
    assert_names(error, param)


USER_X = [{"role": "user", "content": "x"}]
BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages.0.role"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages",
    ),
    ({"messages": USER_X, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": USER_X, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": USER_X, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": USER_X, "max_completion_tokens": MAX_MODEL_LEN}, "max_completion_tokens"),
    ({"messages": USER_X, "tool_choice": "required"}, "tool_choice"),
    (
        {"messages": USER_X, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
        "tool_choice",
    ),
    ({"messages": USER_X, "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": USER_X, "continue_final_message": True}, "continue_final_message"),
    ({"messages": USER_X, "presence_penalty": 1}, "presence_penalty"),
    ({"messages": USER_X, "chat_template_kwargs": {"tokenize": "bad"}}, "messages"),
    # a template of the request's own: nested loops in it held the event loop (every request) for hours
    ({"messages": USER_X, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}, "chat_template_kwargs"),
    ({"messages": USER_X, "tools": [{"type": "function"}]}, "tools"),
    ({"messages": USER_X, "tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
]


@pytest.mark.parametrize(("body", "param"), BAD_CHATS)
def test_bad_chat_requests(server: Any, body: dict, param: str) -> None:
    response = httpx.post(server.base_url + "/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError"
    assert_names(error, param)


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_a_huge_prompt_does_not_hold_up_other_requests(server: Any, path: str) -> None:
    """(Tokenised in the event loop, an 8 MB prompt held every request and /health up for 23 s.)"""
    text = "x" * 3_000_000  # seconds to tokenise
    body = {"prompt": text, "messages": [{"role": "user", "content": text}], "max_tokens": 1}

    def send() -> tuple[httpx.Response, float]:
        response = httpx.post(server.base_url + path, json=body, timeout=120)
        return response, time.monotonic()

    with ThreadPoolExecutor(1) as pool:
        huge = pool.submit(send)
        time.sleep(0.5)  # (sent; being tokenised)
        health = httpx.get(server.url + "/health", timeout=120)
        answered = time.monotonic()
        response, refused = huge.result()
    assert health.status_code == 200 and response.status_code == 400, response.text
    assert answered < refused - 0.5, f"/health answered {answered - refused:.2f} s after the huge prompt"


LONG_CHAT = [{"role": "user", "content": "x " * MAX_MODEL_LEN}]
CONTEXT_ERRORS = [
    (
        "/chat/completions",
        {"messages": USER_X, "max_completion_tokens": MAX_MODEL_LEN},
        "max_completion_tokens",
    ),
    ("/chat/completions", {"messages": USER_X, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    # a prompt that fills the context: no max_tokens could fit; a chat's prompt is its messages
    ("/chat/completions", {"messages": LONG_CHAT}, "messages"),
    ("/chat/completions", {"messages": LONG_CHAT, "max_tokens": 5}, "messages"),
    ("/completions", {"prompt": [1] * MAX_MODEL_LEN, "max_tokens": 1}, "prompt"),
    ("/completions", {"prompt": [1] * (MAX_MODEL_LEN - 1), "max_tokens": 5}, "max_tokens"),
    ("/completions", {"prompt": [1] * (MAX_MODEL_LEN - 8)}, "prompt"),  # (max_tokens: the default 16)
]


@pytest.mark.parametrize(("path", "body", "param"), CONTEXT_ERRORS)
def test_context_errors_name_the_field_the_client_sent(
    server: Any, path: str, body: dict, param: str
) -> None:
    """(A chat without a limit printed a negative completion; max_completion_tokens was named max_tokens;
    a prompt that filled the context was blamed on max_tokens, a chat's on a field named prompt.)"""
    error = httpx.post(server.base_url + path, json=body, timeout=30).json()["error"]
    assert error["param"] == param and "maximum context length" in error["message"], error
    assert "-" not in error["message"].split("However")[1]  # no negative count
    if len(body.get("prompt", "")) >= MAX_MODEL_LEN or body.get("messages") is LONG_CHAT:
        assert "which leaves none for the completion" in error["message"], error


def test_malformed_json_and_unknown_routes(server: Any, client: openai.OpenAI) -> None:
    response = httpx.post(
        server.base_url + "/completions",
        content=b'{"prompt": "x", ',
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    for content, message in (
        (b"", "the request has no body"),
        (b"[1]", "the request body must be a JSON object"),
    ):
        response = httpx.post(server.base_url + "/completions", content=content)
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
    missing = httpx.get(server.base_url + "/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=model_name(client), prompt="x", max_tokens=10**6)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    # still serving
    assert (
        client.completions.create(model=model_name(client), prompt="x", max_tokens=2).choices[0].finish_reason
    )


def test_wrong_method_on_a_generation_path(server: Any) -> None:
    response = httpx.get(server.base_url + "/completions", timeout=30)
    assert response.status_code == 405 and response.json()["error"]["code"] == 405


def test_a_whole_response_tells_its_times_when_asked(server: Any) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
    plain = httpx.post(server.base_url + "/completions", json=body, timeout=30)
    assert plain.status_code == 200 and "x-tandem-timing" not in plain.headers
    sent = time.monotonic()
    timed = httpx.post(
        server.base_url + "/completions", json=body, headers={"x-tandem-timing": "1"}, timeout=30
    )
    got = time.monotonic()
    times = {k: float(v) for k, v in (kv.split("=") for kv in timed.headers["x-tandem-timing"].split(";"))}
    assert sent <= times["received"] <= times["admitted"] <= times["finished"] <= times["responded"] <= got
    assert times["admitted_step"] < times["finished_step"]  # 4 tokens take steps (clocks: same machine)
    assert timed.json()["choices"][0]["text"] is not None


# --- disconnects ------------------------------------------------------------------------------------


def wait_for_idle(server: Any, timeout_s: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(server)
        if m["tandem_requests_running"] == 0 and m["tandem_kv_cache_blocks_used"] == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine did not free its blocks: {m}")
        time.sleep(0.05)


def test_time_to_first_token_is_a_histogram_of_streaming_requests(server: Any) -> None:
    name = "tandem_time_to_first_token_seconds"
    before = metrics(server)
    body = {"prompt": "go on", "max_tokens": 4, "stream": True}
    sent = time.monotonic()
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=30) as response:
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    took = time.monotonic() - sent
    httpx.post(server.base_url + "/completions", json={"prompt": "go on", "max_tokens": 4}, timeout=30)
    after = metrics(server)
    assert after[f"{name}_count"] == before[f"{name}_count"] + 1  # the whole response is not counted
    assert 0 < after[f"{name}_sum"] - before[f"{name}_sum"] <= took
    buckets = [v for k, v in after.items() if k.startswith(f"{name}_bucket")]
    assert buckets == sorted(buckets) and after[f'{name}_bucket{{le="+Inf"}}'] == after[f"{name}_count"]


def test_engine_step_seconds_by_phase_grow_with_steps(server: Any) -> None:
    name = "tandem_engine_step_seconds_total"
    before = metrics(server)
    body = {"prompt": "go on", "max_tokens": 16, "ignore_eos": True}
    httpx.post(server.base_url + "/completions", json=body, timeout=30).raise_for_status()
    after = metrics(server)
    phases = {k[len(name) + len('{phase="') : -2]: v for k, v in after.items() if k.startswith(name)}
    assert set(phases) == {"schedule", "model", "sample", "append", "deliver", "commands"}
    grown = {p: v - before[f'{name}{{phase="{p}"}}'] for p, v in phases.items()}
    steps = after["tandem_engine_steps_total"] - before["tandem_engine_steps_total"]
    assert steps >= 16 and grown["model"] > 0 and grown["sample"] > 0 and grown["deliver"] > 0
    assert sum(grown.values()) < 30  # host seconds of these steps, not of the server's life


def test_disconnect_mid_stream_frees_blocks(server: Any) -> None:
    before = wait_for_idle(server)
    body = {"prompt": "go on", "max_tokens": 1000, "ignore_eos": True, "stream": True, "n": 4}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        assert metrics(server)["tandem_kv_cache_blocks_used"] > 0
    after = wait_for_idle(server)
    generated = after["tandem_generation_tokens_total"] - before["tandem_generation_tokens_total"]
    assert generated < 4 * 1000  # aborted, not run to the end
    assert after["tandem_http_requests_aborted_total"] == before["tandem_http_requests_aborted_total"] + 1


def test_disconnect_while_waiting_for_full_response_frees_blocks(server: Any) -> None:
    before = wait_for_idle(server)
    body = {"prompt": "go on", "max_tokens": 1000, "ignore_eos": True, "n": 8}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    after = wait_for_idle(server)
    assert after["tandem_generation_tokens_total"] - before["tandem_generation_tokens_total"] < 8 * 1000
    assert after["tandem_http_requests_aborted_total"] == before["tandem_http_requests_aborted_total"] + 1


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_a_client_gone_before_its_body_arrived_is_no_server_error(server: Any, path: str) -> None:
    """(It was a 500 and an 'Exception in ASGI application' traceback in the log.)"""
    logged = len(server.log())
    before = metrics(server)["tandem_http_requests_failed_total"]
    url = httpx.URL(server.base_url + path)
    head = f"POST {url.path} HTTP/1.1\r\nhost: {url.host}\r\ncontent-type: application/json\r\n"
    with socket.create_connection((url.host, url.port), timeout=10) as conn:
        conn.sendall(f"{head}content-length: 1000\r\n\r\n".encode() + b'{"prompt": "x", "messages": [')
        time.sleep(0.2)
    deadline = time.monotonic() + 10
    while metrics(server)["tandem_http_requests_failed_total"] == before:  # (answered to no one)
        assert time.monotonic() < deadline, "the server did not notice the client leaving"
        time.sleep(0.05)
    assert (
        httpx.post(server.base_url + "/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    )
    assert "Traceback" not in server.log()[logged:], server.log()[logged:][-3000:]


@pytest.mark.parametrize("narrowing", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_top_k_top_p_min_p_reach_the_sampler(client: openai.OpenAI, narrowing: dict) -> None:
    kwargs = dict(
        model=model_name(client), prompt="abc", max_tokens=12, extra_body={"return_token_ids": True}
    )
    greedy = client.completions.create(temperature=0, **kwargs).choices[0].token_ids
    sampled = client.completions.create(temperature=1.0, seed=1, **kwargs).choices[0].token_ids
    assert sampled != greedy
    kwargs["extra_body"] = {**kwargs["extra_body"], **narrowing}
    narrowed = client.completions.create(temperature=1.0, seed=1, **kwargs).choices[0].token_ids
    assert narrowed == greedy  # only the most likely token survives the filter


def test_chat_logprob_bytes_rebuild_characters_split_across_tokens(tiny_model: Path) -> None:
    """OpenAI's `bytes` are a token's own bytes: where a character spans tokens, each token's
    text is U+FFFD, and joining their bytes gives the character back (they were U+FFFD's bytes)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    texts = TokenTexts(tokenizer)
    text = "ʀé 漢字 🙂 naïve"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in texts(t) for t in ids)  # some token holds part of a character
    assert bytes(b for t in ids for b in texts.bytes(t)) == text.encode("utf-8")
    assert texts.bytes(tokenizer.eos_token_id) == list(tokenizer.eos_token.encode("utf-8"))
