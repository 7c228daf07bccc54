"""The MoE layer's routing by row permutations: the same values and gradients as a plain loop
over tokens and their chosen experts, in float64."""

import torch

from tandem.models.layers.moe import dispatch_and_combine


def loop(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    rows = []
    for t in range(x.shape[0]):
        rows.append(
            sum(weights[t, s] * torch.tanh(x[t] * scales[indices[t, s]]) for s in range(indices.shape[1]))
        )
    return torch.stack(rows)


def test_routing_matches_a_loop_over_tokens_and_gradchecks() -> None:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    tokens, dim, experts, k = 11, 5, 4, 3
    x = torch.randn(tokens, dim, dtype=torch.float64, generator=gen, requires_grad=True)
    weights = torch.rand(tokens, k, dtype=torch.float64, generator=gen, requires_grad=True)
    indices = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    scales = torch.randn(experts, dtype=torch.float64, generator=gen)
    counts = torch.bincount(indices.flatten(), minlength=experts)

    def by_expert(pairs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each expert e maps its rows (the pairs arrive sorted by expert) through tanh(scale_e · x)."""
        return torch.tanh(pairs * scales.repeat_interleave(counts)[:, None])

    got = dispatch_and_combine(x, weights, indices, counts, by_expert)
    torch.testing.assert_close(got, loop(x, weights, indices, scales))
    assert torch.autograd.gradcheck(
        lambda x, w: dispatch_and_combine(x, w, indices, counts, by_expert), (x, weights)
    )
