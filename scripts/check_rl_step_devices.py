"""One RL trainer step on the same rollouts under several devices, precisions and CUDA settings;
prints the logged loss, gradient norm, mismatch KL and masked fraction side by side.

For numerics on a GPU: which part of the CUDA step (bf16 compute, torch.compile, the attention
backend, cuBLAS's bf16 reductions) moves the step's figures away from CPU fp32; with fp32 compute
CUDA should give CPU's figures to ~1e-5. The rollouts are 12 samples of the tiny model with
random prompts and completions, the sampler's logprobs drawn around −6 (the tiny model's own lie
in −7.1…−5.5, so some tokens fall outside masked_is's region), advantages of both signs.

    PYTHONPATH=src python3 scripts/check_rl_step_devices.py --seeds 0 3 [--loss masked_is] [--cpu-only]

The steps run in this process one after another (`trainer.rl.train.train`), so a variant may also
set a torch flag around its step.
"""

import argparse
import tempfile
from pathlib import Path

import torch

from tandem.config import build_config
from tandem.models.tiny import build_tiny_model
from tandem.trainer.rl.config import RLTrainerConfig
from tandem.trainer.rl.train import train
from tandem.transport.rollouts import Sample, pack_samples, write_step

CUDA_FP32 = {"model.device": "cuda", "model.dtype": "float32"}
# name: (trainer overrides, whether cuBLAS may sum bf16 products in reduced precision, torch's default)
VARIANTS: dict[str, tuple[dict[str, object], bool]] = {
    "cpu fp32": ({"model.device": "cpu", "model.dtype": "float32"}, True),
    "cpu bf16": ({"model.device": "cpu", "model.dtype": "bfloat16"}, True),
    "cuda (defaults)": (CUDA_FP32, True),
    "cuda, fp32 compute": ({**CUDA_FP32, "compute_dtype": "float32"}, True),
    "cuda, no compile": ({**CUDA_FP32, "parallel.compile": "off"}, True),
    "cuda, sdpa": ({**CUDA_FP32, "model.attention": "sdpa"}, True),
    "cuda, sdpa, no compile": ({**CUDA_FP32, "model.attention": "sdpa", "parallel.compile": "off"}, True),
    "cuda, cuBLAS bf16 reductions in fp32": (CUDA_FP32, False),
}
KEYS = ("loss", "grad_norm", "mismatch_kl", "masked_fraction")


def step(tiny: Path, run_dir: Path, loss: str, overrides: dict[str, object], reduced_bf16_sums: bool) -> dict:
    cfg = build_config(
        RLTrainerConfig,
        overrides=[("model.name", str(tiny)), ("run_dir", str(run_dir)), ("max_steps", 1),
                   ("rollout_timeout_s", 60), ("loss.type", loss), *overrides.items()],
    )  # fmt: skip
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = reduced_bf16_sums
    try:
        return train(cfg)
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before


def rollouts(seed: int) -> list[Sample]:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(12):
        prompt, completion = 4 + i % 3, 5 + 2 * i
        samples.append(
            Sample(
                prompt_ids=torch.randint(3, 400, (prompt,), generator=generator).tolist(),
                completion_ids=torch.randint(3, 400, (completion,), generator=generator).tolist(),
                completion_mask=[k % 6 != 5 for k in range(completion)],
                completion_logprobs=(-6.0 + 0.1 * torch.randn(completion, generator=generator)).tolist(),
                reward=float(i % 2),
                advantage=(-1) ** i * float(torch.rand(1, generator=generator) + 0.1),
                policy_version=0,
            )
        )
    return samples


def run_variants(work: Path, variants: dict, seeds: range, loss: str) -> None:
    tiny = build_tiny_model(out=work / "tiny")
    print(f"| seed | variant | {' | '.join(KEYS)} |")
    for seed in seeds:
        samples = rollouts(seed)
        for name, (overrides, reduced_bf16_sums) in variants.items():
            run_dir = work / str(seed) / name.replace(" ", "_").replace(",", "")
            write_step(run_dir, 0, pack_samples(samples, 256, 1, micro_batch_tokens=512, temperature=1.0))
            try:
                result = step(tiny, run_dir, loss, overrides, reduced_bf16_sums)
            except Exception as e:  # a variant this machine cannot run: say so, go on
                print(f"| {seed} | {name} | failed: {type(e).__name__}: {str(e)[:200]} |", flush=True)
                continue
            print(f"| {seed} | {name} | " + " | ".join(f"{result[k]:.5f}" for k in KEYS) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs=2, default=[0, 3], metavar=("FIRST", "END"))
    parser.add_argument("--loss", default="masked_is")
    parser.add_argument("--cpu-only", action="store_true")
    args = parser.parse_args()
    variants = {k: v for k, v in VARIANTS.items() if k.startswith("cpu") or not args.cpu_only}
    with tempfile.TemporaryDirectory(prefix="rl-step-devices-") as tmp:
        run_variants(Path(tmp), variants, range(*args.seeds), args.loss)


if __name__ == "__main__":
    main()
