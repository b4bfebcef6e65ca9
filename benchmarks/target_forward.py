"""The target's verify / decode forward at real shapes, with random weights made on the GPU.

    python benchmarks/target_forward.py --config moonlight-16b-a3b            # all 27 layers
    python benchmarks/target_forward.py --config kimi-k2 --layers 2           # 1 dense + 1 MoE layer

Configs are the published config.json files under benchmarks/configs/ (Kimi K2's fp8
quantization_config dropped: ddtree loads bf16). --layers keeps the first L decoder layers, for
models that do not fit one GPU. Each request has a committed prefix of --prefix tokens in the paged
cache and verifies N new rows (N = 1: a decode step; N = 65: a budget-64 tree, here a chain).

Timed per shape: the forward replayed from a CUDA graph (what the engine runs) and the same forward
eager (what a plain PyTorch user runs), both median of many runs after warm-up. The floor is the
larger of bytes / measured copy bandwidth (weights read once, routed experts counted as touched
under uniform routing, plus the latent cache) and FLOPs / measured bf16 matmul rate.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, markdown_table, measure_ceilings, time_events_us, time_graph_us, write_results  # noqa: E402

from ddtree.models import TargetConfig, random_target  # noqa: E402
from ddtree.models.layers import MoE  # noqa: E402
from ddtree.models.paged import ForwardMeta  # noqa: E402
from ddtree.ops import PATHS, KernelPolicy, apply_policy  # noqa: E402
from ddtree.tree import pack_visibility  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"
PAGE = 64


def routed_expert_counts(cfg: TargetConfig) -> tuple[int, int]:
    """(parameters per routed expert, routed experts over all MoE layers)."""
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size, moe_layers * cfg.n_routed_experts


def floor_us(cfg: TargetConfig, dense: int, expert_bytes: float, batch: int, rows: int, prefix: int,
             ceilings: dict) -> tuple[float, str]:
    """dense: parameters read whole per forward (all but the embedding and the routed experts);
    expert_bytes: the bytes one routed expert is stored in (bf16, or INT4 words and scales)."""
    per_expert, routed = routed_expert_counts(cfg)
    tokens = batch * rows
    experts, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = routed * (1 - (1 - k / experts) ** tokens) if experts else 0  # expected, uniform routing
    layers = cfg.num_hidden_layers
    keys = prefix + rows
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    nbytes = 2 * (dense + layers * batch * keys * width) + touched * expert_bytes
    moe_layers = routed // experts if experts else 0
    flops = 2 * tokens * (dense + moe_layers * k * per_expert)
    flops += 2 * tokens * cfg.num_attention_heads * keys * (width + cfg.kv_lora_rank) * layers
    memory = nbytes / (ceilings["copy_bandwidth_GBps"] * 1e3)
    compute = flops / (ceilings["bf16_matmul_TFLOPs"] * 1e6)
    return max(memory, compute), ("memory" if memory >= compute else "compute")


def setup(model, batch: int, rows: int, prefix: int, device: str = "cuda"):
    """Caches holding a random committed prefix and the metadata of one verify forward."""
    pages = (prefix + rows + PAGE - 1) // PAGE
    gen = torch.Generator(device=device).manual_seed(0)
    caches = model.new_cache(batch * pages, PAGE)
    for cache in caches:
        cache.normal_(0, 1, generator=gen)
    prefix_lens = torch.full((batch,), prefix, dtype=torch.int32, device=device)
    chain = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()
    meta = ForwardMeta.build(
        torch.randperm(batch * pages, device=device, generator=gen).view(batch, pages).int(),
        prefix_lens,
        torch.full((batch,), rows, dtype=torch.int32, device=device),
        prefix + torch.arange(rows, device=device).expand(batch, rows),
        pack_visibility(chain.expand(batch, rows, rows)),
        page_size=PAGE, scratch_page=batch * pages,  # new_cache's extra last page
    )
    ids = torch.randint(0, model.cfg.vocab_size, (batch, rows), device=device, generator=gen)
    return ids, meta, caches


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="moonlight-16b-a3b", help="a name under benchmarks/configs/")
    parser.add_argument("--layers", type=int, default=None, help="keep the first L decoder layers")
    parser.add_argument("--prefix", type=int, default=4096)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 65])
    parser.add_argument("--kernels", default="auto", choices=PATHS, help="the kernel policy (ops/policy.py)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("target_forward.py needs a CUDA GPU")
    raw = json.loads((CONFIGS / f"{args.config}.json").read_text())
    if args.layers:
        raw["num_hidden_layers"] = args.layers
    cfg = TargetConfig.from_dict(raw)
    ceilings = measure_ceilings()
    model = random_target(cfg, dtype=torch.bfloat16, device="cuda")
    apply_policy(model, KernelPolicy(args.kernels))
    params = sum(p.numel() for p in model.parameters())
    stored = [p for layer in model.layers if isinstance(layer.mlp, MoE) for p in layer.mlp.parameters(recurse=False)]
    _, routed = routed_expert_counts(cfg)
    expert_bytes = sum(p.numel() * p.element_size() for p in stored) / max(1, routed)
    dense = params - model.embed_tokens.weight.numel() - sum(p.numel() for p in stored)  # the embedding is gathered
    print(f"{args.config}: {cfg.num_hidden_layers} layers, {params / 1e9:.2f} B parameters", ceilings, flush=True)
    results = []
    for batch in args.batches:
        for rows in args.rows:
            ids, meta, caches = setup(model, batch, rows, args.prefix)
            forward = lambda: model.forward_paged(ids, meta, caches)  # noqa: E731
            graph = time_graph_us(forward, launches_per_graph=2, trials=10)
            eager = time_events_us(forward, trials=10, warmup=2)
            floor, bound = floor_us(cfg, dense, expert_bytes, batch, rows, args.prefix, ceilings)
            row = {"B": batch, "N": rows, "prefix": args.prefix, "graph_us": graph, "eager_us": eager,
                   "floor_us": floor, "bound": bound, "graph_x_floor": graph / floor, "eager_over_graph": eager / graph}
            print(row, flush=True)
            results.append(row)
            forward = caches = None  # free this shape's cache before the next
            torch.cuda.empty_cache()
    table = markdown_table(
        ["B", "N", "prefix", "graph (ms)", "eager (ms)", "eager / graph", "floor (ms)", "bound", "graph x floor"],
        [[r["B"], r["N"], r["prefix"], f"{r['graph_us'] / 1e3:.2f}", f"{r['eager_us'] / 1e3:.2f}",
          f"{r['eager_over_graph']:.2f}", f"{r['floor_us'] / 1e3:.3f}", r["bound"], f"{r['graph_x_floor']:.1f}"]
         for r in results],
    )
    header = (f"{args.config}, first {cfg.num_hidden_layers} layer(s), {params / 1e9:.2f} B parameters, random bf16 "
              f"weights, page {PAGE}, kernel paths {args.kernels}. Measured ceilings: copy {ceilings['copy_bandwidth_GBps']:.0f} GB/s, bf16 matmul "
              f"{ceilings['bf16_matmul_TFLOPs']:.0f} TFLOP/s.\n\n")
    payload = {"environment": environment(), "config": args.config, "layers": cfg.num_hidden_layers,
               "kernels": args.kernels, "parameters": params, "ceilings": ceilings, "results": results}
    print(header + table)
    name = f"target_forward-{args.config}" + (f"-{cfg.num_hidden_layers}l" if args.layers else "")
    name += "" if args.kernels == "auto" else f"-{args.kernels}"
    print("wrote", write_results(name, payload, header + table, args.out))


if __name__ == "__main__":
    main()
