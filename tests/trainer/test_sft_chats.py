"""chat_jsonl data for SFT: every line is checked and templated before training starts, and a bad
one fails in one line naming the file, the line and the field (not a traceback at its batch, or a
wrong role trained on); the seq_len check measures every chat's tokens."""

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from tandem.cli import UserError
from tandem.models.tokenizer import train_tokenizer
from tandem.trainer.sft.config import DataConfig, SFTConfig
from tandem.trainer.sft.data import build_chat_dataset, read_chats

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    return train_tokenizer()


def write(tmp_path: Path, *lines: object) -> Path:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def build(path: Path, tokenizer, seq_len: int = 256):  # noqa: ANN001, ANN201
    cfg = DataConfig(task="chat_jsonl", path=path, num_examples=0)
    return build_chat_dataset(cfg, tokenizer, seed=0, seq_len=seq_len)


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        ({"messages": []}, "'messages' must be a non-empty list"),
        ({"messages": None}, "'messages' must be a non-empty list"),
        ({"messages": "hello"}, "'messages' must be a non-empty list"),
        ({"messages": ["hi"]}, "messages[0] is not an object"),
        ({"messages": [{"content": "hi"}, GOOD["messages"][1]]}, "messages[0].role is None, not one of"),
        ({"messages": [{"role": "narrator", "content": "hi"}]}, "messages[0].role is 'narrator'"),
        ({"messages": [GOOD["messages"][0], {"role": "assistant"}]}, "messages[1].content must be a string"),
        ({"messages": [GOOD["messages"][0], {"role": "assistant", "content": 12345}]}, "messages[1].content"),
        ({"messages": [GOOD["messages"][0]]}, "it has no assistant message"),
        (  # (read as the token, it ended the turn's loss there)
            {"messages": [GOOD["messages"][0], {"role": "assistant", "content": "a <|im_end|> b"}]},
            "messages[1].content holds the end-of-turn token's text '<|im_end|>'",
        ),
        (
            {"messages": [GOOD["messages"][1], GOOD["messages"][0]]},
            "it has no assistant message (after its first",
        ),
    ],
)
def test_a_bad_chat_is_named_by_line_before_training(
    tmp_path: Path, tokenizer, bad: dict, problem: str
) -> None:  # noqa: ANN001
    path = write(tmp_path, GOOD, GOOD, bad, GOOD)
    with pytest.raises(UserError) as error:
        build(path, tokenizer)
    message = str(error.value)
    assert message.startswith(f"data.path: line 3 of {path}: ") and problem in message, message


def test_unreadable_or_empty_files(tmp_path: Path, tokenizer) -> None:  # noqa: ANN001
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + '{"messages": "caf\xe9"}'.encode("latin-1") + b"\n")
    with pytest.raises(UserError, match=rf"^data.path: line 2 of {path} is not UTF-8$"):
        read_chats(path, 0)
    with pytest.raises(UserError, match=r"holds no chats$"):
        build(write(tmp_path, "", "  "), tokenizer)
    broken = tmp_path / "broken.jsonl"  # the parser's reason is given
    broken.write_text(json.dumps(GOOD) + '\n{"messages": [}\n')
    with pytest.raises(
        UserError, match=rf"^data.path: line 2 of {broken} is not JSON: Expecting value at column 15$"
    ):
        read_chats(broken, 0)
    bom = tmp_path / "bom.jsonl"  # a file saved with a byte-order mark reads as without it
    bom.write_bytes(b"\xef\xbb\xbf" + (json.dumps(GOOD) + "\n").encode())
    assert [chat.line for chat in read_chats(bom, 0)] == [1]


def test_the_longest_chat_in_tokens_is_named(tmp_path: Path, tokenizer) -> None:  # noqa: ANN001
    """Many short turns take more tokens than one long turn of more characters: the check
    measures tokens of every chat (it used to template only the chat of most characters)."""
    many_turns = {"messages": [m for _ in range(40) for m in GOOD["messages"]]}
    one_long = {"messages": [{"role": "user", "content": "x" * 300}, {"role": "assistant", "content": "y"}]}
    path = write(tmp_path, GOOD, one_long, many_turns)
    dataset = build(path, tokenizer, seq_len=4096)
    lengths = [len(s.input_ids) for s in dataset.tasks]
    assert lengths[2] > lengths[1] and sum(len(m["content"]) for m in one_long["messages"]) > sum(
        len(m["content"]) for m in many_turns["messages"]
    )
    with pytest.raises(
        UserError,
        match=rf"seq_len {lengths[2] - 1} is too small: line 3 of {path} takes {lengths[2]} tokens \(1 of 3 chats",
    ):
        build(path, tokenizer, seq_len=lengths[2] - 1)
    with pytest.raises(UserError, match=r"\(2 of 3 chats are longer than seq_len\)"):
        build(path, tokenizer, seq_len=lengths[1] - 1)


def test_an_opening_assistant_turn_is_context(tmp_path: Path, tokenizer) -> None:  # noqa: ANN001
    opening = {"messages": [{"role": "assistant", "content": "Welcome!"}, *GOOD["messages"]]}
    [sample] = build(write(tmp_path, opening), tokenizer).tasks
    trained = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
    eos = tokenizer.eos_token_id
    want = [t for text in ("hello",) for t in tokenizer.encode(text, add_special_tokens=False) + [eos]]
    assert trained == want


def test_a_chats_tools_are_rendered_as_rl_renders_them(tmp_path: Path, tokenizer) -> None:  # noqa: ANN001
    """A line's "tools" go to the chat template (the prompt an RL tool environment renders), and
    the loss still covers exactly the assistant turns."""
    tools = [{"type": "function", "function": {"name": "calculate", "parameters": {"type": "object"}}}]
    with_tools, without = build(write(tmp_path, {**GOOD, "tools": tools}, GOOD), tokenizer).tasks
    want = tokenizer.apply_chat_template(GOOD["messages"], tools=tools, tokenize=False)
    assert tokenizer.decode(with_tools.input_ids) == want and "calculate" in want
    assert len(with_tools.input_ids) > len(without.input_ids)
    trained = [[t for t, m in zip(s.input_ids, s.loss_mask, strict=True) if m] for s in (with_tools, without)]
    assert trained[0] == trained[1]
    with pytest.raises(UserError, match=r"line 1 of .*: 'tools' must be a list of objects$"):
        build(write(tmp_path, {**GOOD, "tools": "calculate"}), tokenizer)


@pytest.mark.parametrize(
    ("settings", "problem"),
    [  # (without the check: path ignored and reverse_text trained, or an evaluation that never runs)
        ({"data": {"path": "chats.jsonl"}}, "path = 'chats.jsonl' is read only with task = 'chat_jsonl'"),
        (
            {"data": {"task": "chat_jsonl", "path": "chats.jsonl"}, "eval": {"interval": 5}},
            "eval.interval = 5: data.task = 'chat_jsonl' has no held-out split",
        ),
        (
            {"data": {"task": "chat_jsonl", "path": "chats.jsonl", "max_len": 10}},
            "max_len: the reverse_text task's text lengths",
        ),
    ],
)
def test_a_key_the_task_does_not_read_is_an_error(settings: dict, problem: str) -> None:
    with pytest.raises(ValidationError) as error:
        SFTConfig.model_validate(settings)
    assert problem in str(error.value)
    SFTConfig.model_validate({"data": {"task": "chat_jsonl", "path": "chats.jsonl"}})  # defaults are fine
