"""The RL loss on a hand-computed example: values, gradients w.r.t. log π, and metrics.

Five tokens. The first four are loss tokens with ratios r = π/μ = [1, 1.5, 3, 0.25] and
advantages A = [1, −1, 1, 2]; the fifth is masked out of the loss and has a huge ratio that must
change nothing (and produce no NaN). The step has 8 loss tokens in total (other micro-batches).
"""

import math
import textwrap
from pathlib import Path

import pytest
import torch

from tandem.cli import UserError
from tandem.config import ConfigError, build_config
from tandem.trainer.rl.config import RLTrainerConfig
from tandem.trainer.rl.loss import LossInputs, LossTerms, build_objective, policy_loss

RATIOS = [1.0, 1.5, 3.0, 0.25, math.exp(30)]
ADV = [1.0, -1.0, 1.0, 2.0, 5.0]
N_STEP = 8
# k3 = r − 1 − ln r of the four loss tokens
K3 = [0.0, 0.5 - math.log(1.5), 2.0 - math.log(3.0), -0.75 + math.log(4.0)]


def run(loss_table: dict) -> tuple[float, list[float], dict]:
    cfg = build_config(RLTrainerConfig, overrides=[(f"loss.{k}", v) for k, v in loss_table.items()]).loss
    sampler = torch.tensor([[-1.0, -1.2, -2.0, -0.5, -40.0]])
    logprobs = (sampler + torch.tensor([RATIOS]).log()).requires_grad_()
    inputs = LossInputs(
        logprobs=logprobs,
        sampler_logprobs=sampler,
        advantages=torch.tensor([ADV]),
        loss_mask=torch.tensor([[True, True, True, True, False]]),
        entropy=torch.tensor([[0.5, 1.0, 1.5, 2.0, 99.0]]),
    )
    loss, stats = policy_loss(build_objective(cfg), cfg, inputs, N_STEP)
    loss.backward()
    assert torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[0, 4] == 0
    return loss.item(), logprobs.grad[0, :4].tolist(), stats.means()


def test_masked_is_default() -> None:
    loss, grad, m = run({})
    # region [0.5, 2]: tokens 3 (r=3) and 4 (r=0.25) are masked; −r·A = [−1, 1.5, 0, 0]
    assert loss == pytest.approx((-1.0 + 1.5) / 8)
    assert grad == pytest.approx([-1.0 / 8, 1.5 / 8, 0.0, 0.0])
    assert m["masked_fraction"] == pytest.approx(0.5)
    assert m["mismatch_kl"] == pytest.approx(sum(K3) / 4)
    assert m["max_abs_logprob_diff"] == pytest.approx(math.log(4.0))
    assert m["entropy"] == pytest.approx(1.25)
    assert m["loss_tokens"] == 4


def test_masked_is_custom_bounds() -> None:
    # [0.2, 3.5] keeps all four: −r·A = [−1, 1.5, −3, −0.5]
    loss, grad, m = run({"low": 0.2, "high": 3.5})
    assert loss == pytest.approx((-1.0 + 1.5 - 3.0 - 0.5) / 8)
    assert grad == pytest.approx([-1.0 / 8, 1.5 / 8, -3.0 / 8, -0.5 / 8])
    assert m["masked_fraction"] == 0


def test_ppo_clip() -> None:
    # min(r·A, clip(r, 0.8, 1.28)·A): token 3 takes the clipped 1.28 (no gradient), the rest r·A
    loss, grad, m = run({"type": "ppo_clip"})
    assert loss == pytest.approx((-1.0 + 1.5 - 1.28 - 0.5) / 8)
    assert grad == pytest.approx([-1.0 / 8, 1.5 / 8, 0.0, -0.5 / 8])
    assert m["masked_fraction"] == pytest.approx(0.25)


def test_tis() -> None:
    # weight min(r, 2) = [1, 1.5, 2, 0.25], detached; d/dlogπ of −w·A·logπ = −w·A
    _, grad, m = run({"type": "tis", "cap": 2.0})
    assert grad == pytest.approx([-1.0 / 8, 1.5 / 8, -2.0 / 8, -0.5 / 8])
    assert m["masked_fraction"] == pytest.approx(0.25)


def test_kl_terms() -> None:
    # k3 adds 0.1·(r − 1 − ln r) to each loss token; its gradient is 0.1·(r − 1)
    loss, grad, _ = run({"kl_coef": 0.1})
    assert loss == pytest.approx((0.5 + 0.1 * sum(K3)) / 8)
    assert grad == pytest.approx([-1.0 / 8, 1.55 / 8, 0.2 / 8, -0.075 / 8])
    # (ln r)² has gradient 2·ln r
    _, grad, _ = run({"kl_coef": 0.1, "kl_estimator": "sq_log_ratio"})
    want = [(-1.0 + 0.2 * math.log(1.0)) / 8, (1.5 + 0.2 * math.log(1.5)) / 8]
    want += [0.2 * math.log(3.0) / 8, 0.2 * math.log(0.25) / 8]
    assert grad == pytest.approx(want)


def test_custom_objective(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_loss.py").write_text(
        textwrap.dedent(
            """
            from tandem.trainer.rl.loss import LossInputs, LossTerms

            def reinforce(inputs: LossInputs, scale: float = 1.0) -> LossTerms:
                return LossTerms(-scale * inputs.advantages * inputs.logprobs, inputs.advantages < 0)

            def broken(inputs: LossInputs) -> float:
                return 1.0
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    _, grad, m = run({"type": "custom", "import_path": "my_loss:reinforce", "options": {"scale": 2.0}})
    assert grad == pytest.approx([-2.0 / 8, 2.0 / 8, -2.0 / 8, -4.0 / 8])
    assert m["masked_fraction"] == pytest.approx(0.25)
    with pytest.raises(UserError, match="must return LossTerms"):
        run({"type": "custom", "import_path": "my_loss:broken"})
    with pytest.raises(UserError, match="'my_loss:missing' cannot be imported"):
        run({"type": "custom", "import_path": "my_loss:missing"})
    with pytest.raises(UserError, match=r"unexpected keyword argument 'scal' \(it takes: scale\)"):
        run({"type": "custom", "import_path": "my_loss:reinforce", "options": {"scal": 2.0}})
    with pytest.raises(
        UserError,
        match=r"'my_loss:broken': got an unexpected keyword argument 'scale' \(it takes: no options\)",
    ):
        run({"type": "custom", "import_path": "my_loss:broken", "options": {"scale": 2.0}})
    assert LossTerms  # the documented return type is importable from the loss module


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match="loss"):
        build_config(RLTrainerConfig, overrides=[("loss.type", "nope")])
    with pytest.raises(ConfigError, match="unknown key 'loss.delta'"):
        build_config(RLTrainerConfig, overrides=[("loss.type", "ppo_clip"), ("loss.delta", 0.3)])
    with pytest.raises(ConfigError, match=r"'loss.high': Input should be greater than or equal to 1"):
        build_config(RLTrainerConfig, overrides=[("loss.low", 0.9), ("loss.high", 0.95)])
    # past e^20 the clamped log ratio kept tokens with no gradient (and a loss of e^20·A)
    with pytest.raises(ConfigError, match=r"ratio bounds \[0.5, 1e\+10\] .* clamped at ±20"):
        build_config(RLTrainerConfig, overrides=[("loss.high", 1e10)])
    assert build_config(RLTrainerConfig, overrides=[("loss.high", 1e6)]).loss.bounds() == (0.5, 1e6)


def test_defaults_survive_the_loader() -> None:
    cfg = build_config(RLTrainerConfig, overrides=[("model.name", "m")])
    assert cfg.loss.type == "masked_is" and cfg.loss.bounds() == (0.5, 2.0)
    assert (cfg.optim.lr, cfg.optim.schedule) == (3e-6, "constant")


def test_an_entropy_bonus_in_a_custom_objective_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LossInputs.entropy carries its gradient through the trainer's own micro-batch loss: a
    bonus −c·H moves the parameters' gradient by exactly −c·∂H̄/∂θ (checked against a finite
    difference of the mean entropy along that gradient), where a detached entropy moved nothing."""
    (tmp_path / "bonus_loss.py").write_text(
        textwrap.dedent(
            """
            from tandem.trainer.rl.loss import LossInputs, LossTerms

            def with_bonus(inputs: LossInputs, coef: float = 0.0) -> LossTerms:
                return LossTerms(-inputs.advantages * inputs.logprobs - coef * inputs.entropy, inputs.advantages < 0)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from test_shared_prompts import tiny_model

    from tandem.trainer.rl.train import micro_batch_loss
    from tandem.transport.rollouts import Sample, pack_samples

    model = tiny_model()  # float64
    samples = [Sample([3, 4, 5], [7, 8, 9], [True] * 3, [-4.0] * 3, 1.0, 0.5, 0),
               Sample([3, 4, 5], [10, 11], [True] * 2, [-4.0] * 2, 0.0, -0.5, 0)]  # fmt: skip
    mb = pack_samples(samples, 16, 1, 64)[0][0]

    def gradient(coef: float) -> tuple[float, list[torch.Tensor]]:
        cfg = build_config(
            RLTrainerConfig,
            overrides=[("loss.type", "custom"), ("loss.import_path", "bonus_loss:with_bonus"), ("loss.options", {"coef": coef})],
        )  # fmt: skip
        model.zero_grad()
        loss, _ = micro_batch_loss(model, build_objective(cfg.loss), mb, cfg, torch.device("cpu"))
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    loss_0, grad_0 = gradient(0.0)
    loss_1, grad_1 = gradient(1.0)
    bonus_grad = [a - b for a, b in zip(grad_0, grad_1, strict=True)]  # = ∂(mean entropy)/∂θ
    direction = [g / torch.cat([b.flatten() for b in bonus_grad]).norm() for g in bonus_grad]
    mean_entropy = loss_0 - loss_1  # the bonus's value at θ

    def mean_entropy_at(eps: float) -> float:
        with torch.no_grad():
            for p, d in zip(model.parameters(), direction, strict=True):
                p.add_(eps * d)
        value = gradient(0.0)[0] - gradient(1.0)[0]
        with torch.no_grad():
            for p, d in zip(model.parameters(), direction, strict=True):
                p.sub_(eps * d)
        return value

    slope = (mean_entropy_at(1e-6) - mean_entropy_at(-1e-6)) / 2e-6
    along = sum(float((b * d).sum()) for b, d in zip(bonus_grad, direction, strict=True))
    assert mean_entropy > 0 and along > 1e-3
    assert slope == pytest.approx(along, rel=1e-4)
