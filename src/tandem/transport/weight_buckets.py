"""Tensor specs and the bucket layout both sides of an in-memory weight transfer agree on.

An update is a list of `TensorSpec`s (Hugging Face name, shape, dtype) in the order the trainer
yields the tensors. `bucket_layout` cuts that list into buckets: consecutive tensors of one dtype,
packed end to end, up to `bucket_bytes` (a larger tensor gets a bucket of its own). Trainer and
server compute the layout from the same specs, so only the specs travel as metadata; each bucket
then travels as one flat byte buffer.

Imports only torch and the standard library: vLLM's worker extension uses it too.
"""

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    def to_json(self) -> list:
        return [self.name, list(self.shape), str(self.dtype).removeprefix("torch.")]

    @classmethod
    def from_json(cls, item: list) -> "TensorSpec":
        name, shape, dtype = item
        return cls(name, tuple(shape), getattr(torch, dtype))

    def describe(self) -> str:
        return f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class Bucket:
    dtype: torch.dtype
    specs: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]  # element offset of each tensor in the bucket
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def views(self, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """The bucket's tensors as views of `buffer` (uint8, at least `nbytes` long)."""
        flat = buffer[: self.nbytes].view(self.dtype)
        for spec, offset in zip(self.specs, self.offsets, strict=True):
            yield spec.name, flat[offset : offset + spec.numel].view(spec.shape)


def bucket_layout(specs: list[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    buckets: list[Bucket] = []
    current: list[TensorSpec] = []

    def close() -> None:
        if current:
            offsets, total = [], 0
            for spec in current:
                offsets.append(total)
                total += spec.numel
            buckets.append(Bucket(current[0].dtype, tuple(current), tuple(offsets), total))
            current.clear()

    used = 0
    for spec in specs:
        size = spec.numel * spec.dtype.itemsize
        if current and (spec.dtype != current[0].dtype or used + size > bucket_bytes):
            close()
            used = 0
        current.append(spec)
        used += size
    close()
    return buckets


def slot_bytes(layout: list[Bucket]) -> int:
    """Bytes one buffer needs to hold any bucket of `layout`."""
    return max((b.nbytes for b in layout), default=0)


def spec_mismatch(
    offered: list[TensorSpec], expected: Mapping[str, TensorSpec], optional: frozenset[str] = frozenset()
) -> str | None:
    """Why `offered` cannot load into a model whose tensors are `expected` (None if it can).

    `optional` names tensors the offer may leave out (a head tied to the embedding)."""
    names = [s.name for s in offered]
    unknown = sorted(set(names) - expected.keys())
    missing = sorted(expected.keys() - set(names) - optional)
    wrong = [
        f"{s.name} is {s.describe()}, the model has {expected[s.name].describe()}"
        for s in offered
        if s.name in expected and (s.shape != expected[s.name].shape or s.dtype != expected[s.name].dtype)
    ]
    problems = []
    if len(set(names)) != len(names):
        problems.append("some tensors are offered twice")
    if missing:
        problems.append(f"missing {_first(missing)}")
    if unknown:
        problems.append(f"unexpected {_first(unknown)}")
    if wrong:
        problems.append(f"{len(wrong)} tensors differ in shape or dtype, e.g. {'; '.join(wrong[:2])}")
    return "; ".join(problems) or None


def _first(names: list[str]) -> str:
    shown = ", ".join(names[:3])
    return f"{shown} (+{len(names) - 3} more)" if len(names) > 3 else shown
