"""Synthetic Wordle games for SFT: a solver plays the training secrets and every game is written
as one chat transcript (JSON line `{"messages": [...]}`), in exactly the environment's format.

    uv run python examples/wordle/synthetic_games.py --out runs/wordle/games.jsonl --games 20000

The solver opens with one of a few common openers, then guesses a random secret-list word that is
consistent with all feedback so far (it wins ~98% of games within 6 tries). Only train-split
secrets are played, so the eval split stays held out.
"""

import json
import random
from functools import cache
from pathlib import Path

from pydantic import Field

from tandem.cli import run_cli
from tandem.config import Section, parse_config
from tandem.envs.base import Message
from tandem.envs.wordle import WordleEnv, WordleTask, answers, feedback, judge, reply

OPENERS = ("slate", "crane", "trace", "arise", "stare")


class GamesConfig(Section):
    out: Path = Field(Path("runs/wordle/games.jsonl"), description="JSONL file to write.")
    games: int = Field(20_000, gt=0, description="Games to play (secrets cycle through the train split).")
    max_turns: int = Field(6, ge=2, description="Tries per game, as the environment's max_turns.")
    seed: int = Field(0, description="Seed of the solver's choices.")
    wins_only: bool = Field(True, description="Keep only games the solver won.")


@cache
def after_opener(opener: str) -> dict[str, list[str]]:
    """The secrets grouped by the marks they give the opener (saves most of the solver's work)."""
    groups: dict[str, list[str]] = {}
    for word in answers():
        groups.setdefault(feedback(opener, word), []).append(word)
    return groups


def solve(env: WordleEnv, task: WordleTask, rng: random.Random) -> list[Message]:
    """One game: the prompt, then guesses and the environment's replies."""
    messages = env.prompt(task)
    played: list[Message] = []
    candidates = list(answers())
    guess = rng.choice(OPENERS)
    for turn in range(1, env.args.max_turns + 1):
        played.append({"role": "assistant", "content": guess})
        if guess == task.secret or turn == env.args.max_turns:
            break
        played.append({"role": "user", "content": reply(judge(guess, task.secret))})
        marks = feedback(guess, task.secret)
        if turn == 1:
            candidates = after_opener(guess)[marks]
        candidates = [w for w in candidates if w != guess and feedback(guess, w) == marks]
        guess = rng.choice(candidates)
    return messages + played


def write_games(cfg: GamesConfig) -> tuple[int, float]:
    """Writes the games; returns (games written, the solver's win rate)."""
    env = WordleEnv(WordleEnv.Args(max_turns=cfg.max_turns))
    tasks = list(env.dataset("train"))
    rng = random.Random(f"wordle-games/{cfg.seed}")
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    written = wins = 0
    tmp = cfg.out.with_suffix(".tmp")
    with tmp.open("w") as f:
        for i in range(cfg.games):
            task = tasks[i % len(tasks)]
            messages = solve(env, task, rng)
            won = messages[-1]["content"] == task.secret
            wins += won
            if won or not cfg.wins_only:
                f.write(json.dumps({"messages": messages}) + "\n")
                written += 1
    tmp.rename(cfg.out)
    return written, wins / cfg.games


def main() -> None:
    def run() -> None:
        cfg = parse_config(GamesConfig, prog="wordle-games")
        written, win_rate = write_games(cfg)
        print(f"wrote {written} games to {cfg.out} (solver win rate {win_rate:.3f})")

    run_cli(run, "wordle-games")


if __name__ == "__main__":
    main()
