"""Helpers shared by the orchestrator tests: the stand-in trainer (weight publishing, a whole run) and polling."""

import asyncio
import shutil
import time
from pathlib import Path

import httpx

from tandem.config.base import Section
from tandem.envs.base import RewardFunction, SingleTurnEnv, last_content
from tandem.orchestrator.config import OrchestratorConfig
from tandem.orchestrator.loop import Orchestrator
from tandem.transport.rollouts import step_dir


def served_version(url: str) -> int:
    return httpx.get(url + "/health", timeout=10).json()["weight_version"]


def publish_weights(model: Path, run_dir: Path, version: int, stable: bool = True) -> Path:
    """weights/step_N/ as the trainer writes it: files under a temporary name, renamed, STABLE last."""
    target = run_dir / "weights" / f"step_{version}"
    if not target.exists():
        tmp = run_dir / "weights" / f".step_{version}.tmp"
        shutil.copytree(model, tmp)
        tmp.rename(target)
    if stable:
        (target / "STABLE").write_text("")
    return target


async def wait_for_file(path: Path, timeout_s: float = 60.0) -> float:
    """Poll until `path` exists; returns the monotonic time it was seen."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:g}s")
        await asyncio.sleep(0.02)
    return time.monotonic()


def serve_base_model(url: str, model: Path, scratch: Path) -> None:
    """Put the server back on the initial model (version 0), whatever earlier tests loaded."""
    path = publish_weights(model, scratch, 0)
    response = httpx.post(url + "/update_weights", json={"path": str(path)}, timeout=60)
    assert response.json()["weight_version"] == 0, response.text


def run_with_trainer(cfg: OrchestratorConfig, model: Path, first: int) -> list[str]:
    """Run the orchestrator; after rollouts/step_N appears the stand-in trainer checks that step N+1
    has not been started early, then publishes weights/step_N+1 (STABLE last)."""
    problems: list[str] = []

    async def trainer() -> None:
        for step in range(first, cfg.max_steps):
            await wait_for_file(step_dir(cfg.run_dir, step) / "READY")
            await asyncio.sleep(0.3)  # training: the orchestrator must be waiting now
            if step_dir(cfg.run_dir, step + 1).exists():
                problems.append(f"step {step + 1} was started before weights/step_{step + 1} existed")
            publish_weights(model, cfg.run_dir, step + 1)

    async def scenario() -> None:
        stand_in = asyncio.ensure_future(trainer())
        await Orchestrator(cfg).run()
        await stand_in

    asyncio.run(scenario())
    return problems


class ParityTask:
    def __init__(self, task_id: str) -> None:
        self.task_id = task_id


def even(task: ParityTask, messages: list) -> float:
    return float(len(last_content(messages)) % 2 == 0)


class ParityEnv(SingleTurnEnv):
    """Success = an answer of even length: even odds for a random tiny model sampling at
    temperature 1, which gives pass@k something to measure."""

    name = "parity"
    success_metric = "even"

    class Args(Section):
        num_tasks: int = 6

    @property
    def reward_functions(self) -> list[RewardFunction]:
        return [RewardFunction("even", even, 1.0)]

    def dataset(self, split: str) -> list[ParityTask]:
        return [ParityTask(f"{split}-{i}") for i in range(self.args.num_tasks)]

    def prompt(self, task: ParityTask) -> list[dict]:
        return [{"role": "user", "content": f"Write something ({task.task_id})."}]


class NoHeldOutTasksEnv(ParityEnv):
    """Parity with an empty held-out split (`evaluate` must refuse it before starting a server)."""

    name = "no_held_out"

    def dataset(self, split: str) -> list[ParityTask]:
        return [] if split == "eval" else super().dataset(split)
