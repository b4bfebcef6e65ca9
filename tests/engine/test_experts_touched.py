"""experts_touched counts, per request and MoE layer, the distinct experts its valid rows chose."""

import torch

from ddtree.engine.round import experts_touched


def test_counts_distinct_experts_of_valid_rows_only():
    gen = torch.Generator().manual_seed(0)
    b, n, k, experts, layers = 3, 5, 2, 7, 4
    router_ids = [torch.randint(0, experts, (b * n, k), generator=gen) for _ in range(layers)]
    valid = torch.arange(n)[None, :] < torch.tensor([5, 2, 0])[:, None]
    got = experts_touched(router_ids, valid, experts)
    want = [[len({e for row in range(n) if valid[r, row] for e in ids.view(b, n, k)[r, row].tolist()})
             for ids in router_ids] for r in range(b)]
    assert got.tolist() == want and got.dtype == torch.int64
    assert got[2].tolist() == [0] * layers  # a request with no valid rows touched none


def test_no_moe_layers():
    assert experts_touched([], torch.ones(2, 3, dtype=torch.bool), 8).shape == (2, 0)
