"""Rollouts for RL trainer tests: reverse-text samples drawn from a tiny model with transformers."""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch
from server_process import start_server
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from tandem.envs.reverse_text import make_tasks, reward
from tandem.models.tiny import build_tiny_model
from tandem.transport.rollouts import Sample, pack_samples, write_step

SMALL = {"num_layers": 2, "hidden_size": 64, "head_dim": 16, "intermediate_size": 128}


def small_model(out: Path) -> Path:
    return build_tiny_model(out=out, **SMALL)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


@torch.no_grad()
def sample_reverse_text(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    num_prompts: int,
    group_size: int,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    policy_version: int = 0,
) -> list[Sample]:
    """`group_size` sampled completions per prompt, with the sampler's logprobs log softmax(z/T)
    of each sampled token, the reward and the group-relative advantage."""
    torch.manual_seed(seed)
    samples = []
    for task in make_tasks("train", num_prompts, seed=seed):
        prompt = prompt_ids(tokenizer, task.messages)
        out = model.generate(
            torch.tensor([prompt]),
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            num_return_sequences=group_size,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        logprobs = torch.stack(out.logits, 1).float().div(temperature).log_softmax(-1)
        group = []
        for i in range(group_size):
            ids = out.sequences[i, len(prompt) :].tolist()
            if tokenizer.eos_token_id in ids:
                ids = ids[: ids.index(tokenizer.eos_token_id) + 1]
            lps = [float(logprobs[i, t, tok]) for t, tok in enumerate(ids)]
            r = reward(tokenizer.decode(ids, skip_special_tokens=True), task)
            group.append(
                Sample(
                    prompt, ids, [True] * len(ids), lps, r, 0.0, policy_version, task.task_id, "reverse_text"
                )
            )
        mean = sum(s.reward for s in group) / group_size
        for s in group:
            s.advantage = s.reward - mean
        samples.extend(group)
    return samples


def write_rollouts(
    run_dir: Path, step: int, samples: list[Sample], temperature: float, num_ranks: int = 1
) -> None:
    per_rank = pack_samples(
        samples, 256, num_ranks, micro_batch_tokens=512, step=step, temperature=temperature
    )
    write_step(run_dir, step, per_rank)


@contextmanager
def inference_server(args: list[str], log_path: Path, timeout_s: float = 180) -> Iterator[str]:
    """`inference ARGS` as a real process until /health answers; yields its URL."""
    with start_server(args, log_path, timeout_s) as running:
        yield running.url


def sample_from_server(
    url: str, num_prompts: int, group_size: int, temperature: float, max_tokens: int, seed: int
) -> list[Sample]:
    """Reverse-text samples from a real inference server: its token ids, logprobs and weight versions."""
    samples = []
    for k, task in enumerate(make_tasks("train", num_prompts, seed=seed)):
        body = {
            "model": "policy",
            "messages": task.messages,
            "n": group_size,
            "temperature": temperature,
            "max_tokens": max_tokens,
            "logprobs": True,
            "return_token_ids": True,
            "seed": seed * 1000 + k,
        }
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        out = response.json()
        group = []
        for choice in out["choices"]:
            ids = choice["token_ids"]
            lps = [item["logprob"] for item in choice["logprobs"]["content"]]
            versions = sorted(set(choice.get("weight_versions") or [choice["weight_version"]]))
            r = reward(choice["message"]["content"] or "", task)
            sample = Sample(out["prompt_token_ids"], ids, [True] * len(ids), lps, r, 0.0, versions[0])
            sample.task_id, sample.env, sample.policy_versions = task.task_id, "reverse_text", versions
            group.append(sample)
        mean = sum(s.reward for s in group) / group_size
        for s in group:
            s.advantage = s.reward - mean
        samples.extend(group)
    return samples
