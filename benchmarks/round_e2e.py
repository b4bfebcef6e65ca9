"""End to end with acceptance forced to a known length L: tokens/s of `ar`, `chain`, `ddtree`.

The engine (rounds replayed from CUDA graphs on a GPU unless --eager-e2e; eager on the CPU) generates for B prompts of `prefix` random tokens.
`ar` runs first; its greedy continuation is what an OracleDrafter (benchmarks/oracle.py) proposes:
the random drafter's pass still runs and is timed, then its first L - 1 drafted positions are
replaced by the continuation, so every round commits L - 1 accepted nodes + the bonus. The
target's next choice could sit in the random rest of a tree only by chance, so the measured
acceptance is reported beside each row, with the share of rounds that committed exactly L (a
request's last round commits fewer when max_new_tokens - 1 is not a multiple of L). The target
is round_setup's successor target, whose greedy choice no bf16 path flips, so `chain` and
`ddtree` must reproduce `ar` exactly (equal_to_ar).

tokens/s: generated tokens (B x new) over the wall time of generate (prefill included);
decode tokens/s leaves out the first token and the prefill's measured GPU time.
"""

from __future__ import annotations

import time

import torch

from ddtree import Engine
from oracle import OracleDrafter


def _timed(engine: Engine, prompts, new: int, mode: str, budget: int):
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = engine.generate(prompts, max_new_tokens=new, mode=mode, budget=budget, temperature=0.0)
    seconds = time.perf_counter() - start
    prefill = max(o.stats.stage_seconds["prefill"] for o in outs)
    tokens = sum(len(o.token_ids) for o in outs)
    lengths = [n for o in outs for n in o.stats.acceptance_lengths]
    row = {"mode": mode, "batch": len(prompts), "cuda_graphs": engine.graphs is not None, "new_tokens": new, "seconds": seconds, "prefill_seconds": prefill,
           "tokens_per_s": tokens / seconds,
           "decode_tokens_per_s": (tokens - len(prompts)) / max(seconds - prefill, 1e-9),
           "mean_acceptance_length": sum(lengths) / max(1, len(lengths)), "rounds": len(lengths) // len(prompts)}
    return outs, row, lengths


@torch.no_grad()
def forced_acceptance(target, drafter, perm: torch.Tensor, *, batches: list[int], lengths: list[int], prefix: int,
                      new: int, budget: int, seed: int = 5, cuda_graphs: bool = False) -> list[dict]:
    """One row per (B, mode, L); `ar` rows have L = 1. speedup_vs_ar compares tokens/s at one B.
    cuda_graphs: the engine replays its rounds from CUDA graphs (Engine(cuda_graphs=True))."""
    gen = torch.Generator().manual_seed(seed)
    vocab = target.cfg.vocab_size
    pool = [torch.randint(0, vocab - 1, (prefix,), generator=gen).tolist() for _ in range(max(batches))]
    max_len = prefix + new + drafter.cfg.block_size + 1
    oracle = OracleDrafter(drafter, max_batch=max(batches), max_len=max_len)
    engine = Engine(target, oracle, max_batch=max(batches), max_model_len=prefix + new + 64, max_budget=budget,
                    stop_token_ids=(), cuda_graphs=cuda_graphs)
    successor = perm.cpu().tolist()
    rows = []
    for batch in batches:
        prompts = pool[:batch]
        oracle.sequences.fill_(-1)
        for mode in ("ar", "chain", "ddtree"):  # warm-up: kernels compiled, graphs captured for this bucket
            engine.generate(prompts, max_new_tokens=8, mode=mode, budget=budget)
        ar_outs, ar, _ = _timed(engine, prompts, new, "ar", budget)
        ar.update(L=1, budget=0, equal_to_ar=batch, speedup_vs_ar=1.0)
        chains = [p[-1:] + o.token_ids for p, o in zip(prompts, ar_outs)]
        ar["successor_match"] = sum(successor[a] == b for c in chains for a, b in zip(c, c[1:])) / (batch * new)
        rows.append(ar)
        print(f"  e2e B={batch} ar: {ar['tokens_per_s']:.1f} tokens/s (successor match {ar['successor_match']:.3f})",
              flush=True)
        for slot, (p, o) in enumerate(zip(prompts, ar_outs)):  # generate fills free slots in order
            oracle.set_sequence(slot, p + o.token_ids)
        for length in lengths:
            oracle.depth = length - 1
            for mode in ("chain", "ddtree"):
                outs, row, taus = _timed(engine, prompts, new, mode, budget)
                row.update(L=length, budget=budget if mode == "ddtree" else drafter.cfg.block_size - 1,
                           rounds_at_L=sum(t == length for t in taus) / max(1, len(taus)),
                           equal_to_ar=sum(o.token_ids == a.token_ids for o, a in zip(outs, ar_outs)),
                           speedup_vs_ar=row["tokens_per_s"] / ar["tokens_per_s"])
                rows.append(row)
                print(f"  e2e B={batch} {mode} L={length}: {row['tokens_per_s']:.1f} tokens/s, "
                      f"{row['speedup_vs_ar']:.2f}x ar, acceptance {row['mean_acceptance_length']:.2f}", flush=True)
    del engine
    return rows
