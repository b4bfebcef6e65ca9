"""Tensor and expert parallelism on gloo (2 and 4 ranks, each a process loading only its part):
every rank's logits, captured layers and latent cache equal the single process's, for 16-bit and
INT4 experts, through the verify / decode form and the prefill form; the replicated drafter's draft
logits too."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from ddtree.models import load_drafter, load_target  # noqa: E402
from ddtree.models.paged import PrefillMeta  # noqa: E402
from ddtree.parallel.shard import SINGLE  # noqa: E402

from ..models.test_fused_target import PAGE, chain_meta  # noqa: E402
from .ranks import run_ranks  # noqa: E402


def forward_all(shard, target_dir, drafter_dir, out_path) -> None:
    """What one rank computes: a prefill chunk, then a verify of a tree-less chain, then a draft."""
    torch.manual_seed(0)
    target = load_target(target_dir, dtype=torch.float32, shard=shard)
    drafter = load_drafter(drafter_dir, target)
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    caches = target.new_cache(6, PAGE)
    table = torch.arange(6, dtype=torch.int32).view(2, 3)
    with torch.no_grad():
        prefill = PrefillMeta.build(table, [0, 0], [5, 4], 5, page_size=PAGE, scratch_page=6)
        first, first_hidden = target.forward_paged(ids, prefill, caches, hidden_layers=(0, 2))
        meta = chain_meta([5, 4], 3, [3, 2])
        more = torch.randint(0, 96, (2, 3), generator=torch.Generator().manual_seed(2))
        logits, hidden = target.forward_paged(more, meta, caches, hidden_layers=(1,))
        cache = drafter.new_cache(2, 16)
        drafter.append_context(cache, torch.cat(first_hidden, -1), torch.tensor([5, 4]))
        draft = drafter.draft_logits(target, torch.tensor([3, 7]), cache)
    result = {"first": first, "logits": logits, "hidden": hidden[0], "draft": draft, "caches": [c[:6] for c in caches]}
    if shard.rank == 0 or out_path.name.endswith("single.pt"):
        torch.save(result, out_path)
    else:
        torch.save(result, out_path.with_name(f"rank{shard.rank}.pt"))


@pytest.mark.parametrize("experts", ["bf16", "int4"])
@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_computes_what_one_process_computes(checkpoints, tmp_path, experts, world):
    target_dir, drafter_dir = checkpoints / experts, checkpoints / "drafter"
    forward_all(SINGLE, target_dir, drafter_dir, tmp_path / "single.pt")
    run_ranks(world, forward_all, target_dir, drafter_dir, tmp_path / "rank0.pt")
    want = torch.load(tmp_path / "single.pt")
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for key in ("first", "logits", "hidden", "draft"):
            torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5, msg=f"rank {rank} {key}")
        for layer, (g, w) in enumerate(zip(got["caches"], want["caches"])):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=f"rank {rank} cache {layer}")
