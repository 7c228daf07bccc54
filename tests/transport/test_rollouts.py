"""Rollout micro-batch format: packing, balance, round trip through files, and errors."""

import random
import threading
import time
from pathlib import Path

import pytest
import torch

from tandem.transport.rollouts import (
    MicroBatch,
    RolloutError,
    RolloutTimeoutError,
    Sample,
    pack_samples,
    rank_path,
    read_rank,
    step_dir,
    write_step,
)


def make_samples(count: int, seed: int = 0, max_len: int = 60) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for i in range(count):
        p = rng.randint(1, 20)
        c = rng.randint(0, max_len - p)
        mask = [rng.random() > 0.2 for _ in range(c)]
        samples.append(
            Sample(
                prompt_ids=[rng.randint(3, 500) for _ in range(p)],
                completion_ids=[rng.randint(3, 500) for _ in range(c)],
                completion_mask=mask,
                completion_logprobs=[-rng.random() * 3 for _ in range(c)],
                reward=rng.random(),
                advantage=rng.uniform(-1, 1),
                policy_version=rng.randint(0, 3),
                task_id=f"t{i}",
                env="reverse_text",
                metrics={"len": float(c)},
            )
        )
    return samples


def unpack(per_rank: list[list[MicroBatch]]) -> dict[int, dict]:
    """Recover each sample's tokens, mask, logprobs and advantages from the packed tensors."""
    out: dict[int, dict] = {}
    for micro_batches in per_rank:
        for mb in micro_batches:
            metas = {m.index: m for m in mb.samples}
            for r in range(mb.input_ids.shape[0]):
                for i in mb.sample_index[r].unique().tolist():
                    if i < 0:
                        continue
                    assert i not in out, f"sample {i} appears twice"
                    sel = mb.sample_index[r] == i
                    p = metas[i].prompt_len
                    assert mb.position_ids[r][sel].tolist() == list(range(int(sel.sum())))
                    out[i] = {
                        "prompt": mb.input_ids[r][sel][:p].tolist(),
                        "completion": mb.input_ids[r][sel][p:].tolist(),
                        "mask": mb.loss_mask[r][sel][p:].tolist(),
                        "prompt_mask": mb.loss_mask[r][sel][:p].tolist(),
                        "logprobs": mb.sampler_logprobs[r][sel][p:].tolist(),
                        "advantages": mb.advantages[r][sel][p:].tolist(),
                        "meta": metas[i],
                    }
    return out


def check_unpacked(samples: list[Sample], per_rank: list[list[MicroBatch]]) -> None:
    got = unpack(per_rank)
    assert sorted(got) == list(range(len(samples)))
    for i, s in enumerate(samples):
        g = got[i]
        assert g["prompt"] == s.prompt_ids
        assert g["completion"] == s.completion_ids
        assert g["mask"] == s.completion_mask
        assert not any(g["prompt_mask"])
        want_lp = [lp if m else 0.0 for lp, m in zip(s.completion_logprobs, s.completion_mask, strict=True)]
        assert g["logprobs"] == pytest.approx(want_lp, abs=1e-6)
        want_adv = [s.advantage if m else 0.0 for m in s.completion_mask]
        assert g["advantages"] == pytest.approx(want_adv, abs=1e-6)
        meta = g["meta"]
        assert (meta.task_id, meta.env, meta.policy_version) == (s.task_id, s.env, s.policy_version)
        assert meta.reward == pytest.approx(s.reward)
        assert meta.num_loss_tokens == sum(s.completion_mask)
        assert meta.metrics == s.metrics


@pytest.mark.parametrize("num_ranks", [1, 2, 3])
def test_packing_recovers_every_sample(num_ranks: int) -> None:
    samples = make_samples(37)
    per_rank = pack_samples(samples, seq_len=64, num_ranks=num_ranks, micro_batch_tokens=128, step=5)
    assert len(per_rank) == num_ranks
    check_unpacked(samples, per_rank)
    total_loss_tokens = sum(sum(s.completion_mask) for s in samples)
    for micro_batches in per_rank:
        for mb in micro_batches:
            assert mb.input_ids.shape[0] <= 2 and mb.input_ids.shape[1] <= 64
            assert mb.num_loss_tokens == total_loss_tokens and mb.step == 5
            assert mb.num_loss_samples == sum(any(s.completion_mask) for s in samples)
            assert mb.loss_mask.dtype == torch.bool and mb.sampler_logprobs.dtype == torch.float32
            # loss tokens never sit on padding, and never at a row start (they need a context)
            assert not mb.loss_mask[mb.sample_index < 0].any()
            assert not mb.loss_mask[:, 0].any()


def test_balance_and_equal_micro_batch_counts() -> None:
    samples = make_samples(40, seed=1)
    per_rank = pack_samples(samples, seq_len=64, num_ranks=4, micro_batch_tokens=64)
    counts = {len(mbs) for mbs in per_rank}
    assert len(counts) == 1, f"ranks got different micro-batch counts {counts}"
    tokens = [sum(mb.num_tokens for mb in mbs) for mbs in per_rank]
    longest = max(len(s) for s in samples)
    assert max(tokens) - min(tokens) <= longest, tokens


def test_fewer_samples_than_ranks_get_empty_micro_batches() -> None:
    samples = make_samples(1, seed=2)
    per_rank = pack_samples(samples, seq_len=64, num_ranks=3, micro_batch_tokens=64)
    assert [len(mbs) for mbs in per_rank] == [1, 1, 1]
    empty = [mb for mbs in per_rank for mb in mbs if not mb.samples]
    assert len(empty) == 2
    for mb in empty:
        assert mb.num_tokens == 0 and not mb.loss_mask.any() and mb.input_ids.numel() >= 1
    check_unpacked(samples, per_rank)


def test_bad_samples_are_rejected_with_their_id() -> None:
    (s,) = make_samples(1)
    long = Sample(list(range(1, 40)), list(range(1, 40)), [True] * 39, [0.0] * 39, 0, 0, 0, task_id="long")
    with pytest.raises(ValueError, match="'long'.*exceed seq_len 64"):
        pack_samples([s, long], seq_len=64, num_ranks=1, micro_batch_tokens=64)
    ragged = Sample([1], [4, 5], [True], [0.0, 0.0], 0, 0, 0, task_id="ragged")
    with pytest.raises(ValueError, match="'ragged'.*differ in length"):
        pack_samples([ragged], seq_len=64, num_ranks=1, micro_batch_tokens=64)
    with pytest.raises(ValueError, match="empty prompt"):
        pack_samples(
            [Sample([], [4], [True], [0.0], 0, 0, 0)], seq_len=64, num_ranks=1, micro_batch_tokens=64
        )


def test_round_trip_through_files(tmp_path: Path) -> None:
    samples = make_samples(25, seed=3)
    per_rank = pack_samples(samples, seq_len=64, num_ranks=2, micro_batch_tokens=192, step=7, temperature=0.7)
    write_step(tmp_path, 7, per_rank)
    assert (step_dir(tmp_path, 7) / "READY").is_file()
    assert not [p for p in step_dir(tmp_path, 7).iterdir() if ".tmp" in p.name]
    read = [read_rank(tmp_path, 7, r, timeout_s=1, num_ranks=2) for r in range(2)]
    for got, want in zip(read, per_rank, strict=True):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            for name in (
                "input_ids",
                "position_ids",
                "loss_mask",
                "sampler_logprobs",
                "advantages",
                "sample_index",
            ):
                assert torch.equal(getattr(a, name), getattr(b, name)), name
            assert a.samples == b.samples
            assert (a.step, a.temperature, a.num_loss_tokens) == (7, 0.7, b.num_loss_tokens)
            assert a.num_loss_samples == b.num_loss_samples is not None
    check_unpacked(samples, read)


def test_read_waits_for_ready_written_later(tmp_path: Path) -> None:
    per_rank = pack_samples(make_samples(4), seq_len=64, num_ranks=1, micro_batch_tokens=64, step=0)
    writer = threading.Timer(0.3, write_step, args=(tmp_path, 0, per_rank))
    writer.start()
    t0 = time.monotonic()
    got = read_rank(tmp_path, 0, 0, timeout_s=5)
    assert time.monotonic() - t0 >= 0.25
    assert len(got) == len(per_rank[0])
    writer.join()


def test_timeout_names_the_marker(tmp_path: Path) -> None:
    with pytest.raises(RolloutTimeoutError, match=r"0\.2s waiting for .*rollouts/step_3/READY"):
        read_rank(tmp_path, 3, 0, timeout_s=0.2)


def test_missing_corrupt_and_mismatched_files(tmp_path: Path) -> None:
    per_rank = pack_samples(make_samples(6), seq_len=64, num_ranks=2, micro_batch_tokens=64, step=1)
    write_step(tmp_path, 1, per_rank)
    with pytest.raises(
        RolloutError,
        match="packed for 2 trainer data-parallel groups of cp = 1, but the trainer runs 4 of cp = 1",
    ):
        read_rank(tmp_path, 1, 0, timeout_s=1, num_ranks=4)

    path = rank_path(tmp_path, 1, 1)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(RolloutError, match=f"corrupt rollout file {path}"):
        read_rank(tmp_path, 1, 1, timeout_s=1)
    path.write_bytes(b"\x00" * 16)
    with pytest.raises(RolloutError, match="corrupt rollout file"):
        read_rank(tmp_path, 1, 1, timeout_s=1)

    path.unlink()
    with pytest.raises(RolloutError, match=f"missing rollout file {path}"):
        read_rank(tmp_path, 1, 1, timeout_s=1)

    # a file copied to the wrong step is caught
    (step_dir(tmp_path, 1) / "rank_1.bin").write_bytes(rank_path(tmp_path, 1, 0).read_bytes())
    with pytest.raises(RolloutError, match="expected format 1, step 1, rank 1"):
        read_rank(tmp_path, 1, 1, timeout_s=1)


def test_context_parallel_groups_share_files_of_padded_width(tmp_path: Path) -> None:
    """4 trainer ranks of cp = 2 (ring: widths a multiple of 4) are 2 data-parallel groups."""
    samples = make_samples(9, seed=4)
    per_group = pack_samples(
        samples, seq_len=64, num_ranks=2, micro_batch_tokens=128, step=2, width_multiple=4
    )
    assert len(per_group) == 2 and len(per_group[0]) == len(per_group[1])
    assert all(mb.input_ids.shape[1] % 4 == 0 for group in per_group for mb in group)
    assert sum(mb.num_tokens for group in per_group for mb in group) == sum(len(s) for s in samples)
    write_step(tmp_path, 2, per_group, cp=2)
    assert len(read_rank(tmp_path, 2, 1, timeout_s=1, num_ranks=2, cp=2)) == len(per_group[1])
    with pytest.raises(
        RolloutError,
        match="packed for 2 trainer data-parallel groups of cp = 2, but the trainer runs 4 of cp = 1",
    ):
        read_rank(tmp_path, 2, 0, timeout_s=1, num_ranks=4)
