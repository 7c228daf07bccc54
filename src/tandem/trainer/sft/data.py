"""SFT examples: task chats rendered with the tokenizer's chat template, in a seeded order.

An example is the user prompt followed by the assistant answer. Its loss mask covers the
answer tokens and the closing end-of-turn token: the tokens after the templated prompt with
`add_generation_prompt=True`, up to and including the first eos. Anything the template adds
after the eos (ChatML's trailing newline) stays in the sequence without loss.

`data.task = "chat_jsonl"` reads whole chats (multi-turn transcripts) from a JSONL file instead;
every assistant turn but an opening one (context: nothing renders before it to say where it
begins) gets the loss in the same way. Every line is checked (roles, string contents, no
end-of-turn token text inside an assistant turn) and templated when the dataset is built, so bad
data fails before training, naming its line.
"""

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from tandem.cli import UserError
from tandem.envs.reverse_text import ReverseTextTask, make_tasks
from tandem.trainer.packing import Sample
from tandem.trainer.sft.config import DataConfig


def chat_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, str]],
    prompt: bool,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    encoded = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=True, add_generation_prompt=prompt
    )
    return list(encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded)


def chat_sample(tokenizer: PreTrainedTokenizerBase, prompt: list[dict[str, str]], answer: str) -> Sample:
    """Token ids of prompt + answer, with the loss on the answer and its end-of-turn token."""
    prompt_ids = chat_ids(tokenizer, prompt, prompt=True)
    full_ids = chat_ids(tokenizer, [*prompt, {"role": "assistant", "content": answer}], prompt=False)
    if full_ids[: len(prompt_ids)] != prompt_ids:
        raise UserError("the chat template renders the prompt differently with and without the answer")
    eos = tokenizer.eos_token_id
    try:
        end = full_ids.index(eos, len(prompt_ids)) + 1
    except ValueError:
        raise UserError(f"the chat template does not close the assistant turn with eos {eos}") from None
    mask = [False] * len(prompt_ids) + [True] * (end - len(prompt_ids)) + [False] * (len(full_ids) - end)
    return Sample(full_ids, mask)


def transcript_sample(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> Sample:
    """Token ids of a whole chat (rendered with its `tools`, as an RL environment renders its
    prompts), with the loss on every assistant turn and its end-of-turn token."""
    full_ids = chat_ids(tokenizer, messages, prompt=False, tools=tools)
    mask = [False] * len(full_ids)
    for k, message in enumerate(messages):
        if message.get("role") != "assistant" or k == 0:  # an opening assistant turn is context: no
            continue  # prompt renders before it, so where its tokens begin is the template's secret
        if tokenizer.eos_token and tokenizer.eos_token in (message.get("content") or ""):
            raise UserError(
                f"messages[{k}].content holds the end-of-turn token's text {tokenizer.eos_token!r}, which "
                "the tokenizer reads as the token: the turn's loss would end there; remove it from the data"
            )
        before = chat_ids(tokenizer, messages[:k], prompt=True, tools=tools)
        if full_ids[: len(before)] != before:
            raise UserError("the chat template renders earlier turns differently once later turns follow")
        try:
            end = full_ids.index(tokenizer.eos_token_id, len(before)) + 1
        except ValueError:
            raise UserError("the chat template does not close an assistant turn with eos") from None
        mask[len(before) : end] = [True] * (end - len(before))
    if not any(mask):
        raise UserError("it has no assistant message after its first")
    return Sample(full_ids, mask)


ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_problem(messages: Any) -> str | None:
    """What is wrong with one line's `messages` (one short phrase naming the field), or None."""
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list"
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{i}] is not an object"
        role = message.get("role")
        if role not in ROLES:
            return f"messages[{i}].role is {role!r}, not one of {', '.join(ROLES)}"
        content = message.get("content")
        if not isinstance(content, str) and not (
            role == "assistant" and content is None and message.get("tool_calls")
        ):
            return f"messages[{i}].content must be a string (null only for an assistant turn with tool_calls)"
    if not any(message["role"] == "assistant" for message in messages[1:]):
        return "it has no assistant message (after its first message: an opening one is context)"
    return None


class Chat(NamedTuple):
    line: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None  # the line's "tools": what the template shows the model


def read_chats(path: Path, limit: int) -> list[Chat]:
    """The first `limit` chats of a JSONL file of `{"messages": [...], "tools": [...]}` lines
    ("tools" optional; 0 = all), each checked (`chat_problem`); a bad line fails in one line
    naming it."""
    if not path.is_file():
        raise UserError(f"data.path: no such file {path}")
    chats = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"data.path: line {number} of {path}"
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # (a leading BOM is allowed)
            except UnicodeDecodeError:
                raise UserError(f"{where} is not UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{where} is not JSON: {e.msg} at column {e.colno}") from None
            try:
                messages, tools = row["messages"], row.get("tools")
            except (KeyError, TypeError, AttributeError):
                raise UserError(f"{where} is not a JSON object with 'messages'") from None
            if problem := chat_problem(messages):
                raise UserError(f"{where}: {problem}")
            if tools is not None and not (
                isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
            ):
                raise UserError(f"{where}: 'tools' must be a list of objects")
            chats.append(Chat(number, messages, tools))
            if len(chats) == limit:
                break
    if not chats:
        raise UserError(f"data.path: {path} holds no chats")
    return chats


class SFTDataset:
    """Examples in a seeded order that is a pure function of the position, so resume is exact.

    Position g is example `perm_e[g mod N]` of epoch e = g // N; each epoch has its own permutation.
    """

    def __init__(
        self, tasks: Sequence[Any], tokenizer: PreTrainedTokenizerBase, seed: int, shuffle: bool
    ) -> None:
        if not tasks:
            raise UserError("data.num_examples is 0: the training dataset is empty")
        self.tasks = tasks
        self.tokenizer = tokenizer
        self.seed = seed
        self.shuffle = shuffle
        self._order: tuple[int, list[int]] | None = None

    def __len__(self) -> int:
        return len(self.tasks)

    def sample(self, task: ReverseTextTask) -> Sample:
        return chat_sample(self.tokenizer, task.messages, task.answer)

    def index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.tasks))
        if not self.shuffle:
            return offset
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self.tasks)))
            random.Random(f"sft/{self.seed}/{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1][offset]

    def batch(self, start: int, size: int) -> list[Sample]:
        """The `size` examples at positions start, start+1, …"""
        return [self.sample(self.tasks[self.index(p)]) for p in range(start, start + size)]


class ChatDataset(SFTDataset):
    """Whole chats (e.g. multi-turn transcripts) as examples, loss on every assistant turn; every
    chat is templated once, here, so a template that fails on one names its line before training."""

    def __init__(
        self, chats: list[Chat], tokenizer: PreTrainedTokenizerBase, seed: int, shuffle: bool, path: Path
    ) -> None:
        samples = []
        for chat in chats:
            where = f"data.path: line {chat.line} of {path}"
            try:
                samples.append(transcript_sample(tokenizer, chat.messages, chat.tools))
            except UserError as e:
                raise UserError(f"{where}: {e}") from None
            except Exception as e:  # the template's own error (jinja2, transformers)
                raise UserError(f"{where}: the chat template failed: {e}") from None
        super().__init__(samples, tokenizer, seed, shuffle)
        self.lines = [chat.line for chat in chats]

    def sample(self, task: Any) -> Sample:
        return task  # templated at start


def build_chat_dataset(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int, seq_len: int
) -> SFTDataset:
    if cfg.path is None:
        raise UserError("data.path is required with data.task = 'chat_jsonl'")
    dataset = ChatDataset(read_chats(cfg.path, cfg.num_examples), tokenizer, seed, cfg.shuffle, cfg.path)
    lengths = [len(sample.input_ids) for sample in dataset.tasks]
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[longest] > seq_len:  # (no chat is truncated or dropped: either would train on other data)
        over = sum(n > seq_len for n in lengths)
        raise UserError(
            f"seq_len {seq_len} is too small: line {dataset.lines[longest]} of {cfg.path} takes "
            f"{lengths[longest]} tokens ({over} of {len(lengths)} chats are longer than seq_len)"
        )
    return dataset


def build_dataset(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int, seq_len: int) -> SFTDataset:
    """The task's train split; fails early if the longest possible example cannot fit seq_len."""
    if cfg.task == "chat_jsonl":
        return build_chat_dataset(cfg, tokenizer, seed, seq_len)
    if cfg.min_len > cfg.max_len:
        raise UserError(f"data.min_len {cfg.min_len} is greater than data.max_len {cfg.max_len}")
    dataset = SFTDataset(
        make_tasks("train", cfg.num_examples, seed, cfg.min_len, cfg.max_len), tokenizer, seed, cfg.shuffle
    )
    longest = dataset.sample(ReverseTextTask("probe", "a" * cfg.max_len))
    if len(longest.input_ids) > seq_len:
        raise UserError(
            f"seq_len {seq_len} is too small: an example of {cfg.max_len} letters takes "
            f"{len(longest.input_ids)} tokens"
        )
    return dataset
