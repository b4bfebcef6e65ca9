"""tree_verify_mla: checks at the boundary, split-KV choice, launch."""

from __future__ import annotations

import torch
import triton
from triton import knobs

from ..ops.launch import launch_flags, multiprocessors, require_kernel_device
from .tree_verify import LOG2E, merge_splits_kernel, tree_verify_kernel

BACKENDS = ("auto", "hopper", "triton")

VALUE_DIM = 512  # kv_lora_rank of DeepSeek-V3 / Kimi K2: the latent, which is also V
BLOCK_M = 64  # query rows (node, head) per program
BLOCK_N = 64  # keys per KV tile
MAX_SPLITS = 32
MERGE_BLOCK_V = 128  # value columns per program of the split merge: 4 programs per (node, head) row
assert VALUE_DIM % MERGE_BLOCK_V == 0, "the merge kernel has no column mask"
MIN_KEYS_PER_SPLIT = 256


def choose_num_splits(batch: int, rows: int, max_keys: int, device: torch.device, backend: str = "triton") -> int:
    """Split the key range when row tiles alone cannot fill the GPU. From shapes only.

    triton: about two programs per multiprocessor, at least MIN_KEYS_PER_SPLIT keys per split.
    hopper: one program fills a multiprocessor (its shared memory and registers), so split only
    while the programs still fit in one wave, at least one KV tile per split (measured on the
    H200: dev/split_sweep.py; a second wave costs more than the split saves).
    """
    tiles = max(batch * triton.cdiv(rows, BLOCK_M), 1)
    if backend == "hopper":
        want, min_keys = multiprocessors(device) // tiles, BLOCK_N
    else:
        want, min_keys = triton.cdiv(2 * multiprocessors(device), tiles), MIN_KEYS_PER_SPLIT
    return max(1, min(want, MAX_SPLITS, max_keys // min_keys))


def _check(q, kv_cache, block_table, prefix_lens, num_rows, visibility) -> None:
    if q.dim() != 4:
        raise ValueError(f"q must be [B, N, H, D], got shape {tuple(q.shape)}")
    batch, rows, _, dim = q.shape
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"q must be bf16 or fp16, got {q.dtype}")
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != dim:
        raise ValueError(f"kv_cache must be [num_pages, page_size, {dim}] to match q, got {tuple(kv_cache.shape)}")
    if kv_cache.dtype != q.dtype:
        raise TypeError(f"kv_cache dtype {kv_cache.dtype} != q dtype {q.dtype}")
    rope = dim - VALUE_DIM
    if rope < 16 or rope & (rope - 1):
        raise ValueError(f"q's last dim must be {VALUE_DIM} + a power-of-two rope dim >= 16, got {dim}")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("q and kv_cache must be contiguous in their last dimension")
    for name, t, dtypes, shape in (
        ("block_table", block_table, (torch.int32,), None),
        ("prefix_lens", prefix_lens, (torch.int32,), (batch,)),
        ("num_rows", num_rows, (torch.int32, torch.int64), (batch,)),
        ("visibility", visibility, (torch.int64,), (batch, rows, triton.cdiv(rows, 64))),
    ):
        if t.dtype not in dtypes:
            raise TypeError(f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
        if shape is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must be [B={batch}, max_pages], got {tuple(block_table.shape)}")
    if kv_cache.device != q.device:
        raise ValueError(f"kv_cache is on {kv_cache.device} but q is on {q.device}")
    require_kernel_device(q.device, "tree_verify_mla")


def _check_values(kv_cache, block_table, prefix_lens, num_rows, visibility, rows) -> None:
    """Checks that read the metadata back (a host sync): lengths, pages and block table."""
    if (num_rows < 0).any() or (num_rows > rows).any():
        raise ValueError(f"num_rows must be in [0, N={rows}], got {num_rows.tolist()}")
    # The first padding row of a builder's tree is all zero; a set row there means the caller
    # counted the root out (passed DraftTrees.num_nodes) and the last node would be dropped.
    short = (num_rows < rows).nonzero().flatten().tolist()
    for b in short:
        n = int(num_rows[b])
        if bool((visibility[b, n] != 0).any()):
            raise ValueError(
                f"visibility row {n} of request {b} is set but num_rows[{b}] = {n}: num_rows counts the root "
                "(1 + DraftTrees.num_nodes) and rows past it must be zero"
            )
    if (prefix_lens < 0).any():
        raise ValueError(f"prefix_lens must be >= 0, got {prefix_lens.tolist()}")
    page_size = kv_cache.shape[1]
    pages_needed = (prefix_lens.long() + num_rows.long() + page_size - 1) // page_size
    if (pages_needed > block_table.shape[1]).any():
        b = int((pages_needed > block_table.shape[1]).nonzero()[0])
        raise ValueError(
            f"block_table has {block_table.shape[1]} pages per request but request {b} needs "
            f"{int(pages_needed[b])} (prefix {int(prefix_lens[b])} + {int(num_rows[b])} rows, page size {page_size})"
        )
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < pages_needed[:, None]
    bad = used & ((block_table < 0) | (block_table >= kv_cache.shape[0]))
    if bad.any():
        b, p = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"block_table[{b}, {p}] = {int(block_table[b, p])} is not a page of kv_cache (0..{kv_cache.shape[0] - 1})")


def hopper_unsupported(q: torch.Tensor, kv_cache: torch.Tensor) -> str | None:
    """Why the Hopper (Gluon, TMA + wgmma) kernel cannot take these inputs, or None if it can."""
    if knobs.runtime.interpret or not q.is_cuda:
        return "it needs a CUDA device (not the interpreter)"
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return f"it needs an sm_90 GPU, this is {torch.cuda.get_device_name(q.device)}"
    if q.shape[-1] != VALUE_DIM + 64:
        return f"it is built for 576-dim rows (512 latent + 64 rope), got {q.shape[-1]}"
    page_size = kv_cache.shape[1]
    if page_size < 8 or page_size & (page_size - 1):
        return f"it needs a power-of-two page size >= 8, got {page_size}"
    if kv_cache.stride(1) != kv_cache.shape[2] or kv_cache.stride(0) != page_size * kv_cache.shape[2]:
        return "it needs a contiguous kv_cache (read by TMA)"
    if not q.is_contiguous():
        return "it needs a contiguous q (read by TMA)"
    if kv_cache.data_ptr() % 16 or q.data_ptr() % 16:
        return "it needs 16-byte aligned q and kv_cache"
    return None


def hopper_epilogue(rows_per_req: int, num_splits: int) -> int:
    """The Hopper kernel's output path (its EPILOGUE) for requests of rows_per_req (node, head)
    rows: 0, float32 partials stored directly (several splits); 2, staged in shared memory and
    stored by TMA, which writes whole BLOCK_M-row boxes and so needs whole row tiles per request
    (a partial tile's box would spill into the next request's rows); else 1, staged and stored
    with masked 16-byte stores."""
    if num_splits > 1:
        return 0
    return 2 if rows_per_req % BLOCK_M == 0 else 1


def _launch_hopper(q, kv_cache, block_table, prefix_lens, num_rows, visibility, part, part_lse,
                   softmax_scale, num_splits, pdl: bool = True) -> None:
    """Launch the Gluon kernel; its output path (EPILOGUE) follows from the splits and the shapes."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .tree_verify_hopper import tree_verify_hopper_kernel

    batch, rows, heads, dim = q.shape
    page_size = kv_cache.shape[1]
    layout = gl.NVMMASharedLayout(128, 16)

    def split_latent_rope(t: torch.Tensor, box_rows: int):
        """TMA descriptors of a [R, 576] matrix's latent and rope columns, boxes of box_rows rows."""
        return (TensorDescriptor(t, [t.shape[0], VALUE_DIM], [dim, 1], [box_rows, VALUE_DIM], layout),
                TensorDescriptor(t[:, VALUE_DIM:], [t.shape[0], dim - VALUE_DIM], [dim, 1],
                                 [box_rows, dim - VALUE_DIM], layout))

    page_rows = min(page_size, BLOCK_N)  # one TMA copy per page-sized run of a KV tile
    kn, kr = split_latent_rope(kv_cache.view(-1, dim), page_rows)
    qn, qr = split_latent_rope(q.view(-1, dim), BLOCK_M)
    out_desc = qn  # a placeholder where the epilogue does not use it
    epilogue = hopper_epilogue(rows * heads, num_splits)
    if epilogue == 2:
        flat = part.view(-1, VALUE_DIM)
        out_desc = TensorDescriptor(flat, list(flat.shape), [VALUE_DIM, 1], [BLOCK_M, VALUE_DIM], layout)
    n_row_tiles = triton.cdiv(rows * heads, BLOCK_M)
    n_items = n_row_tiles * batch * num_splits
    grid = (min(n_items, multiprocessors(q.device)),)  # persistent: one program per multiprocessor
    tree_verify_hopper_kernel[grid](
        qn, qr, kn, kr, out_desc, block_table, prefix_lens, num_rows, visibility,
        part, part_lse,
        block_table.stride(0), visibility.stride(0), visibility.stride(1),
        *part.stride()[:4], *part_lse.stride(),
        softmax_scale * LOG2E, rows * heads, heads, page_size, num_splits, kv_cache.shape[0] * page_size,
        n_row_tiles, n_items, D_V=VALUE_DIM, D_ROPE=dim - VALUE_DIM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, PAGE_ROWS=page_rows,
        EPILOGUE=epilogue, num_warps=8, **launch_flags(q.device, pdl),
    )


def tree_verify_mla(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    num_rows: torch.Tensor,
    visibility: torch.Tensor,
    softmax_scale: float,
    *,
    num_splits: int | None = None,
    check: bool = True,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: str = "auto",
    block_n: int = BLOCK_N,
    num_warps: int = 8,
    num_stages: int = 2,
    pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed-form MLA attention of every draft-tree node over its prefix and its ancestors.

    q:            bf16/fp16 [B, N, H, 576]: row (b, n, h) is tree row n (0 = root) for head h;
                  576 = 512 latent dims (also the value) + 64 rotary dims.
    kv_cache:     same dtype [num_pages, page_size, 576], one entry per token shared by all heads.
    block_table:  int32 [B, max_pages], page ids of each request's tokens in order.
    prefix_lens:  int32 [B], committed tokens; tree row n's own entry is at slot prefix_lens + n.
    num_rows:     int32/int64 [B], valid rows per request, the root included (<= N): for a draft
                  tree 1 + DraftTrees.num_nodes (the tree's count leaves the root out); rows past it
                  are padding and come back as zeros (lse -inf); their cache slots are never read.
    visibility:   int64 [B, N, ceil(N / 64)], the builder's ancestor bitmask (bit j of word j // 64
                  of row n: row n sees tree row j).
    softmax_scale: multiplies q.k (for DeepSeek-V3 / Kimi K2: (qk_nope + qk_rope)^-0.5 * mscale^2).
    num_splits:   key-range splits (flash-decoding); None picks from the shapes alone.
    check:        validate lengths and page ids against the block table (reads them back: a host
                  sync; pass False inside CUDA graphs once the metadata is known to be valid).
    out:          optional (out, lse) buffers to write into, e.g. a CUDA graph's static outputs.
    backend:      "hopper" (Gluon: TMA + warpgroup MMAs, sm_90 only), "triton" (portable, and the
                  one the interpreter runs) or "auto" (hopper where hopper_unsupported says it can).
    block_n, num_warps, num_stages: tuning of the triton backend (keys per tile, warps, stages).
    pdl:          programmatic dependent launch where the GPU has it (ops/launch.py).
    Returns out [B, N, H, 512] in q's dtype and lse float32 [B, N, H] (natural log).
    """
    _check(q, kv_cache, block_table, prefix_lens, num_rows, visibility)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    use_hopper = False
    if backend != "triton":
        why_not = hopper_unsupported(q, kv_cache)
        if backend == "hopper" and why_not:
            raise ValueError(f"the hopper backend cannot run here: {why_not}")
        use_hopper = why_not is None
    batch, rows, heads, dim = q.shape
    if check:
        _check_values(kv_cache, block_table, prefix_lens, num_rows, visibility, rows)
    if num_splits is None:
        num_splits = choose_num_splits(batch, rows * heads, block_table.shape[1] * kv_cache.shape[1], q.device,
                                       "hopper" if use_hopper else "triton")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if out is None:
        out = (
            torch.empty(batch, rows, heads, VALUE_DIM, dtype=q.dtype, device=q.device),
            torch.empty(batch, rows, heads, dtype=torch.float32, device=q.device),
        )
    out, lse = out
    for name, t, shape, dtype in (("out", out, (batch, rows, heads, VALUE_DIM), q.dtype),
                                  ("lse", lse, (batch, rows, heads), torch.float32)):
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != q.device or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {shape} on {q.device}")
    if batch * rows * heads == 0:
        return out, lse
    if num_splits == 1:
        part, part_lse = out.unsqueeze(3), lse.unsqueeze(3)
    else:
        part = torch.empty(batch, rows, heads, num_splits, VALUE_DIM, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, rows, heads, num_splits, dtype=torch.float32, device=q.device)
    if use_hopper:
        _launch_hopper(q, kv_cache, block_table, prefix_lens, num_rows, visibility, part, part_lse,
                       softmax_scale, num_splits, pdl=pdl)
    else:
        _launch_triton(q, kv_cache, block_table, prefix_lens, num_rows, visibility, part, part_lse,
                       softmax_scale, num_splits, block_n, num_warps, num_stages)
    if num_splits > 1:
        merge_splits_kernel[(batch * rows * heads, VALUE_DIM // MERGE_BLOCK_V)](
            part, part_lse, out, lse, num_splits,
            D_V=VALUE_DIM, SPLITS=triton.next_power_of_2(num_splits), BLOCK_V=MERGE_BLOCK_V, num_warps=4,
            **launch_flags(q.device, pdl),
        )
    return out, lse


def _launch_triton(q, kv_cache, block_table, prefix_lens, num_rows, visibility, part, part_lse,
                   softmax_scale, num_splits, block_n, num_warps, num_stages) -> None:
    batch, rows, heads, dim = q.shape
    grid = (triton.cdiv(rows * heads, BLOCK_M), batch, num_splits)
    tree_verify_kernel[grid](
        q, kv_cache, block_table, prefix_lens, num_rows, visibility,
        part, part_lse,
        q.stride(0), q.stride(1), q.stride(2),
        kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0), visibility.stride(0), visibility.stride(1),
        *part.stride()[:4], *part_lse.stride(),
        softmax_scale * LOG2E, rows * heads, heads, kv_cache.shape[1], num_splits,
        D_V=VALUE_DIM, D_ROPE=dim - VALUE_DIM, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        DOT_F32=q.dtype == torch.bfloat16 and knobs.runtime.interpret,
        num_warps=num_warps, num_stages=num_stages,
    )
