"""token_chunks: the token ranges one fused_moe call may take (the MoE layer and moe_paths split by it)."""


def test_token_chunks_cover_every_token_once_within_max_pairs():
    from ddtree.ops.moe_align import MAX_PAIRS, token_chunks

    for tokens, top_k in [(1, 8), (1024, 8), (2080, 8), (5, 0), (MAX_PAIRS + 1, 1), (3000, 6)]:
        parts = token_chunks(tokens, top_k)
        covered = [t for p in parts for t in range(p.start, p.stop)]
        assert covered == list(range(tokens))
        assert all((p.stop - p.start) * top_k <= MAX_PAIRS for p in parts)
    assert token_chunks(2080, 8) == [slice(0, 1024), slice(1024, 2048), slice(2048, 2080)]
