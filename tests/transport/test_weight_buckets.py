"""The pure parts of the in-memory transports: bucket layout, the spec check, route planning."""

import pytest
import torch

from tandem.transport.weight_buckets import TensorSpec, bucket_layout, slot_bytes, spec_mismatch
from tandem.transport.weight_link import LinkError, make_plan

F32, BF16 = torch.float32, torch.bfloat16


def test_buckets_hold_one_dtype_up_to_the_size_and_big_tensors_alone() -> None:
    specs = [
        TensorSpec("a", (4, 4), BF16),  # 32 bytes
        TensorSpec("b", (8,), BF16),  # 16
        TensorSpec("c", (100,), BF16),  # 200: larger than a bucket, alone
        TensorSpec("d", (2,), F32),  # 8: another dtype starts a bucket
        TensorSpec("e", (2,), F32),
    ]
    layout = bucket_layout(specs, bucket_bytes=64)
    assert [[s.name for s in b.specs] for b in layout] == [["a", "b"], ["c"], ["d", "e"]]
    assert [b.offsets for b in layout] == [(0, 16), (0,), (0, 2)]
    assert [b.nbytes for b in layout] == [48, 200, 16] and slot_bytes(layout) == 200

    buffer = torch.zeros(200, dtype=torch.uint8)
    views = dict(layout[0].views(buffer))
    views["b"].fill_(1.5)
    assert views["a"].shape == (4, 4) and torch.all(buffer[32:48].view(BF16) == 1.5)
    assert TensorSpec.from_json(specs[3].to_json()) == specs[3]


def test_spec_mismatch_names_what_differs() -> None:
    model = {s.name: s for s in [TensorSpec("embed", (8, 4), F32), TensorSpec("head", (8, 4), F32)]}
    assert spec_mismatch([model["embed"]], model, frozenset({"head"})) is None
    problem = spec_mismatch([TensorSpec("embed", (8, 2), BF16), TensorSpec("extra", (1,), F32)], model)
    assert problem == (
        "missing head; unexpected extra; 1 tensors differ in shape or dtype, e.g. embed is [8, 2] "
        "bfloat16, the model has [8, 4] float32"
    )


def server(transport: str, device: str, dtype: str = "bfloat16") -> dict:
    return {"transport": transport, "device": device, "dtype": dtype}


def test_plan_routes_auto_by_device() -> None:
    trainers = [{"device": "cuda:A"}, {"device": "cuda:B"}]
    plan = make_plan(
        [server("auto", "cuda:B"), server("auto", "cuda:C"), server("broadcast", "cuda:D")], trainers
    )
    assert plan["routes"] == [
        {"transport": "colocated", "trainer_rank": 1, "group_rank": 0},
        {"transport": "broadcast", "trainer_rank": 0, "group_rank": 1},
        {"transport": "broadcast", "trainer_rank": 0, "group_rank": 2},
    ]
    assert plan["group_size"] == 3 and plan["dtype"] == "bfloat16"
    cpu = make_plan([server("auto", "cpu:h"), server("auto", "cpu:h")], [{"device": "cpu:h"}] * 2)
    assert [r["trainer_rank"] for r in cpu["routes"]] == [0, 1] and cpu["group_size"] == 0


@pytest.mark.parametrize(
    ("servers", "message"),
    [
        ([server("colocated", "cuda:C")], "server 0 asks for transport colocated but no trainer rank shares"),
        ([server("broadcast", "cuda:A")], "server 0 shares its GPU with trainer rank 0"),
        ([server("broadcast", "cpu:h")], "a broadcast group is all GPUs (NCCL) or all CPUs (gloo)"),
        (
            [server("auto", "cuda:A", "bfloat16"), server("auto", "cuda:B", "float32")],
            "the servers serve different dtypes (server 0 bfloat16, server 1 float32)",
        ),
    ],
)
def test_plan_refuses_what_cannot_work(servers: list[dict], message: str) -> None:
    with pytest.raises(LinkError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_plan(servers, [{"device": "cuda:A"}])
