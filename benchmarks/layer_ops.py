"""Aten ops per decoder layer of the target's paged decode forward, counted on the CPU with
torch.profiler: a proxy for the CUDA kernels one layer launches (each non-view leaf op is one or
more kernels on the GPU).

    PYTHONPATH=src python benchmarks/layer_ops.py [--fused]

Two tiny layouts with the real models' structure (op counts do not depend on the sizes): Moonlight
(no q LoRA) and Kimi K2 / DeepSeek-V3 (q LoRA); layer 0 dense, layer 1 MoE. Wrappers mark each decoder
layer and its self_attn / mlp with profiler ranges; an op counts for the innermost range it runs in
("rest": the layer's norms and residual adds); the attention itself (paged.attend, the PyTorch
reference on the CPU, the tree-verify kernel on CUDA) is counted apart. --fused forces the Triton paths on (under
TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import collections
import os

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ddtree.models import TargetConfig, random_target
from ddtree.models import paged as paged_module
from ddtree.models import target as target_module
from ddtree.models.paged import ForwardMeta
from ddtree.ops import KERNELS, KernelPolicy
from ddtree.tree import pack_visibility

# Metadata-only ops: no kernel on the GPU.
VIEWS = {"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::slice", "aten::split",
         "aten::split_with_sizes", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::permute",
         "aten::transpose", "aten::t", "aten::unflatten", "aten::flatten", "aten::chunk", "aten::narrow",
         "aten::detach", "aten::alias", "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg",
         "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::unbind", "aten::_unsafe_view",
         "aten::contiguous", "aten::result_type", "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense",
         "aten::to", "aten::_to_copy", "aten::type_as", "aten::matmul", "aten::linear", "aten::einsum",
         "aten::dim", "aten::promote_types", "aten::size", "aten::stride", "aten::numel", "aten::broadcast_tensors"}

LAYOUTS = {
    "moonlight": dict(q_lora_rank=None),
    "kimi-k2": dict(q_lora_rank=48),
}


def config(layers: int, **overrides) -> TargetConfig:
    raw = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=layers,
               num_attention_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
               kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=24, n_group=4,
               topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1, norm_topk_prob=True,
               max_position_embeddings=512, topk_method="noaux_tc", scoring_func="sigmoid",
               rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    raw.update(overrides)
    return TargetConfig.from_dict(raw)


def _mark(module: torch.nn.Module, method: str, name: str) -> None:
    """Profiler range `name` around every call of module.<method> (an instance attribute wraps it)."""
    inner = getattr(module, method)

    def marked(*args, **kwargs):
        with record_function(name):
            return inner(*args, **kwargs)
    setattr(module, method, marked)


def _count_triton_launches() -> None:
    """Under TRITON_INTERPRET=1, one profiler range "triton::<kernel>" per launch."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def marked(self, *args, **kwargs):
        with record_function(f"triton::{self.fn.__name__}"):
            return run(self, *args, **kwargs)
    InterpretedFunction.run = marked


def _inside_triton(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("triton::"):
            return True
        parent = parent.cpu_parent
    return False


def kernel_ops(overrides: dict, dtype: torch.dtype, policy: KernelPolicy = KernelPolicy()) -> dict[str, collections.Counter]:
    """Non-view leaf aten ops of one decode forward (B = 1, N = 1) after a warm-up forward, per
    range: "layer<i>.attn", "layer<i>.mlp", "layer<i>.rest", "attend" (all layers), "outside"."""
    model = random_target(config(2, **overrides), dtype=dtype, policy=policy)
    for module in (target_module, paged_module):
        _mark(module, "attend", "attend")  # tree-verify attention: its own kernels on CUDA
    for i, layer in enumerate(model.layers):
        _mark(layer, "forward_paged", f"layer{i}.rest")
        _mark(layer.self_attn, "forward_paged", f"layer{i}.attn")
        _mark(layer.mlp, "forward", f"layer{i}.mlp")
    page, prefix = 4, 5
    caches = model.new_cache(4, page)
    bt = torch.arange(3, dtype=torch.int32)[None]
    meta = ForwardMeta.build(bt, torch.tensor([prefix], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                             torch.tensor([[prefix]]), pack_visibility(torch.ones(1, 1, 1, dtype=torch.bool)),
                             page_size=page, scratch_page=3)
    ids = torch.tensor([[7]])
    with torch.no_grad():
        model.forward_paged(ids, meta, caches)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model.forward_paged(ids, meta, caches)
    counts = collections.defaultdict(collections.Counter)
    for event in prof.events():
        if _inside_triton(event):
            continue  # the interpreter's own tensor traffic
        if event.name.startswith("triton::"):
            pass  # one kernel launch
        elif not event.name.startswith("aten::") or event.name in VIEWS:
            continue
        elif any(child.name.startswith("aten::") and child.name not in VIEWS for child in event.cpu_children):
            continue  # a composite op: its children are counted
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(("layer", "attend")):
            parent = parent.cpu_parent
        name = "outside" if parent is None else parent.name
        counts["attend" if name == "attend" else name][event.name] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fused", action="store_true", help="the kernel policy \"kernels\" (needs TRITON_INTERPRET=1)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--verbose", action="store_true", help="list the ops of each layer")
    args = parser.parse_args()
    if args.fused:
        _count_triton_launches()
    dtype = getattr(torch, args.dtype)
    for name, overrides in LAYOUTS.items():
        counts = kernel_ops(overrides, dtype, KERNELS if args.fused else KernelPolicy())
        for layer, kind in ((0, "dense"), (1, "MoE")):
            parts = {part: counts[f"layer{layer}.{part}"] for part in ("attn", "rest", "mlp")}
            total = sum(sum(c.values()) for c in parts.values())
            print(f"{name} {kind} layer: {total} ops = " + ", ".join(f"{p} {sum(c.values())}" for p, c in parts.items()))
            if args.verbose:
                for part in ("attn", "rest"):
                    print(f"  {part}:", dict(sorted(parts[part].items(), key=lambda kv: -kv[1])))
        print(f"{name} outside the layers: {sum(counts['outside'].values())} ops; "
              f"attend (all layers, reference path): {sum(counts['attend'].values())} ops")


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    main()
