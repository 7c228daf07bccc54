"""Wordle: word lists, feedback, every reward function on hand-made games, the environment's
replies, and real games against an inference server serving a tiny random model."""

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.cli import UserError
from tandem.client.config import ClientConfig, SamplingConfig
from tandem.client.inference import InferenceClient
from tandem.envs.base import Message
from tandem.envs.multi_turn import environment_ids, render_ids
from tandem.envs.registry import load_environment
from tandem.envs.wordle import (
    WordleEnv,
    WordleTask,
    allowed_guesses,
    answers,
    feedback,
    invalid_guesses,
    partial_credit,
    win,
)
from tandem.models.loading import load_tokenizer
from tandem.models.tiny import build_tiny_model
from tandem.models.tokenizer import train_tokenizer
from tandem.trainer.sft.data import read_chats, transcript_sample

TASK = WordleTask("t", "cigar")


def game(*answers_: str) -> list[Message]:
    """A transcript after the prompt: the model's answers with the environment's replies between."""
    env = WordleEnv()
    messages: list[Message] = []
    for text in answers_:
        messages.append({"role": "assistant", "content": text})
        if len(messages) // 2 + 1 < env.args.max_turns:  # MultiTurnEnv stops after the last try
            messages += asyncio.run(env.env_response(TASK, messages)) or []
    return messages


def test_word_lists() -> None:
    assert 500 <= len(answers()) <= 2000 and len(set(answers())) == len(answers())
    assert set(answers()) <= allowed_guesses()
    assert all(re.fullmatch(r"[a-z]{5}", w) for w in allowed_guesses())
    env = WordleEnv()
    train = {t.secret for t in env.dataset("train")}
    held_out = {t.secret for t in env.dataset("eval")}
    assert not train & held_out and train | held_out == set(answers())
    assert len(held_out) > 100
    assert [t.secret for t in env.dataset("eval")] == [t.secret for t in WordleEnv().dataset("eval")]


@pytest.mark.parametrize(
    ("guess", "secret", "marks"),
    [
        ("cigar", "cigar", "GGGGG"),
        ("crane", "cigar", "GYYXX"),
        ("speed", "abide", "XXYXY"),  # two e's, one in the secret: only the first is yellow
        ("geese", "eerie", "XGYXG"),  # greens first, then yellows up to the remaining count
        ("lolly", "hello", "XYGGX"),
        ("zzzzz", "cigar", "XXXXX"),
    ],
)
def test_feedback(guess: str, secret: str, marks: str) -> None:
    assert feedback(guess, secret) == marks


def score(messages: list[Message]) -> tuple[float, dict[str, float]]:
    return WordleEnv().score(TASK, messages)


def test_rewards_of_a_first_try_win() -> None:
    reward, values = score(game("cigar"))
    assert values == {"win": 1.0, "speed_bonus": 1.0, "partial_credit": 1.0, "invalid_guesses": 0.0}
    assert reward == 2.0


def test_rewards_of_a_third_try_win_with_an_invalid_guess() -> None:
    messages = game("crane", "ci gar", " Cigar. ")  # the answer is trimmed and lowercased
    assert [m["content"] for m in messages if m["role"] == "user"] == [
        "c:G r:Y a:Y n:X e:X",
        '"ci gar" is not one five-letter word.',
    ]
    reward, values = score(messages)
    assert values == {"win": 1.0, "speed_bonus": 0.6, "partial_credit": 1.0, "invalid_guesses": 1.0}
    assert reward == pytest.approx(1.0 + 0.5 * 0.6 + 0.5)


def test_partial_credit_takes_the_best_valid_guess() -> None:
    messages = game("crane", "about", "zebra", "qwert", "cigars", "civic")
    assert messages[-1]["role"] == "assistant"  # the sixth try ends the game without a reply
    assert [m["content"] for m in messages if m["role"] == "user"][3:] == [
        '"qwert" is not in the word list.',
        '"cigars" is not one five-letter word.',
    ]
    assert feedback("civic", "cigar") == "GGXXX"
    reward, values = score(messages)
    # crane GYYXX = 0.4, civic GGXXX = 0.4, zebra XXXYY = 0.2: best 0.4
    assert values == {"win": 0.0, "speed_bonus": 0.0, "partial_credit": 0.4, "invalid_guesses": 2.0}
    assert reward == pytest.approx(0.2)


def test_malformed_and_empty_answers_earn_nothing() -> None:
    for text in ["", "   ", "I think it is cigar", "CIGAR!!", "<tool_call>", "c i g a r"]:
        messages = [{"role": "assistant", "content": text}]
        if text == "CIGAR!!":
            assert win(TASK, messages) == 1.0  # shouting is fine: trimmed and lowercased
            continue
        assert win(TASK, messages) == 0.0 and partial_credit(TASK, messages) == 0.0
        assert invalid_guesses(TASK, messages) == 1.0
    assert score([])[0] == 0.0


def test_game_ends_on_the_secret() -> None:
    messages = game("crane", "cigar")
    assert len(messages) == 3 and messages[-1]["content"] == "cigar"


def test_bad_args_name_the_key() -> None:
    with pytest.raises(Exception, match=r"env.args.max_turns"):
        load_environment("wordle", {"max_turns": 1})
    assert load_environment("wordle", {"max_turns": 4}).args.max_turns == 4


def test_real_games_against_a_server(server: str, model: Path) -> None:
    """A random model plays: every answer is judged, replies sit between turns, metrics add up."""
    env = load_environment("wordle", {"max_turns": 4})
    env.setup(load_tokenizer(str(model)), 512)

    async def run() -> tuple[list, list]:
        client = InferenceClient(server, ClientConfig(request_timeout=60))
        try:
            await client.connect()
            group = await env.rollout_group(env.dataset("train")[0], client, SamplingConfig(max_tokens=8), 3)
            greedy = SamplingConfig(temperature=0.0, max_tokens=8)
            held_out = [await env.rollout(task, client, greedy) for task in env.dataset("eval")[:2]]
            return group, held_out
        finally:
            await client.close()

    group, held_out = asyncio.run(run())
    for t in group + held_out:
        guesses = [m for m in t.messages if m["role"] == "assistant"]
        replies = [m for m in t.messages if m["role"] == "user"]
        assert len(t.turns) == len(guesses) and len(replies) == len(guesses) - 1
        assert t.metrics["turns"] == len(guesses)
        assert t.metrics["invalid_guesses"] == sum(not info["valid"] for info in t.turns)
        assert [info["guess"] for info in t.turns] == [
            g["content"].strip().strip("\"'`*.!").strip().lower() for g in guesses
        ]
        assert t.reward == pytest.approx(
            t.metrics["win"] + 0.5 * t.metrics["speed_bonus"] + 0.5 * t.metrics["partial_credit"]
        )
        assert t.metrics["win"] == 0.0 and len(guesses) == 4  # a random 2-layer model does not win
        assert all(info["env_tokens"] > 0 for info in t.turns[1:])
        assert t.task_id.startswith("wordle-")
    assert {t.task_id for t in held_out} == {t.task_id for t in env.dataset("eval")[:2]}


def test_synthetic_games_train_on_the_tokens_that_rl_samples(tmp_path: Path) -> None:
    """The SFT transcripts (chat_jsonl) of solver games: the loss covers exactly the guesses and
    their <|im_end|>, and the ids equal the trajectory MultiTurnEnv stitches for the same game."""
    out = tmp_path / "games.jsonl"
    script = Path(__file__).parents[2] / "examples" / "wordle" / "synthetic_games.py"
    done = subprocess.run(
        [sys.executable, str(script), "--out", str(out), "--games", "40", "--seed", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"wrote \d+ games to .* \(solver win rate [01]\.\d+\)\n", done.stdout)
    chats = [json.loads(line)["messages"] for line in out.read_text().splitlines()]
    assert len(chats) >= 35
    train_secrets = {t.secret for t in WordleEnv().dataset("train")}
    tokenizer = train_tokenizer()
    for chat in chats[:10]:
        assert chat[0] == WordleEnv().prompt(TASK)[0] and chat[-1]["content"] in train_secrets
        sample = transcript_sample(tokenizer, chat)
        guesses = [m["content"] for m in chat if m["role"] == "assistant"]
        trained = [i for i, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
        eos = [tokenizer.eos_token_id]
        assert trained == [t for g in guesses for t in tokenizer.encode(g, add_special_tokens=False) + eos]
        # what MultiTurnEnv would stitch for this game (model ids = canonical ids of each guess + eos)
        prompt_ids = render_ids(tokenizer, chat[:1])
        ids, last = list(prompt_ids), []
        for message in chat[1:]:
            if message["role"] == "assistant":
                last = tokenizer.encode(message["content"], add_special_tokens=False) + eos
                ids += last
            else:
                ids += environment_ids(tokenizer, last, [message])
        assert sample.input_ids[: len(ids)] == ids and len(sample.input_ids) == len(ids) + 1  # + "\n"
    with pytest.raises(UserError, match="line 2 of"):
        (tmp_path / "bad.jsonl").write_text(out.read_text().splitlines()[0] + "\n{oops\n")
        read_chats(tmp_path / "bad.jsonl", 0)


def test_sft_on_synthetic_games_runs(tmp_path: Path) -> None:
    """Three SFT steps on chat_jsonl data with the sft command (tiny model, CPU)."""
    games = tmp_path / "games.jsonl"
    script = Path(__file__).parents[2] / "examples" / "wordle" / "synthetic_games.py"
    subprocess.run(
        [sys.executable, str(script), "--out", str(games), "--games", "30"], check=True, timeout=120
    )
    model = build_tiny_model(
        out=tmp_path / "m", num_layers=1, hidden_size=32, head_dim=8, intermediate_size=64
    )
    args = [
        "--model.name",
        str(model),
        "--run-dir",
        str(tmp_path / "sft"),
        "--max-steps",
        "3",
        "--seq-len",
        "512",
    ]
    args += ["--data.task", "chat_jsonl", "--data.path", str(games), "--data.num-examples", "0"]
    args += ["--data.batch-size", "8", "--data.micro-batch-size", "4", "--model.device", "cpu"]
    done = subprocess.run(
        [sys.executable, "-m", "tandem.trainer.sft.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    metrics = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == 3 and all(0 < loss < 10 for loss in losses)
    assert (tmp_path / "sft" / "final" / "config.json").is_file()
    chats = len(games.read_text().splitlines())  # how many chats, and that eval.final has nothing to run
    assert (
        f"sft: {chats} chats from {games}; no held-out evaluation (chat_jsonl has no held-out split)"
        in done.stdout
    )
