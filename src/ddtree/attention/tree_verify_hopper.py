"""Tree-verify MLA attention for Hopper (sm_90) in Gluon: TMA-fed KV tiles, warpgroup MMAs.

Same contract and tiling as tree_verify.py (a 64-row tile of packed (node, head) rows is one work
item, split-KV merged by log-sum-exp), written one level lower so that no tensor-core work is
repeated and little time is spent outside the tensor cores:

- S = Q K^T is split by key columns between the two warpgroups (each computes 64 x BLOCK_N / 2),
  where plain Triton gives a product that feeds another product to every warp, so both
  warpgroups computed the whole S.
- P goes through shared memory once; each warpgroup multiplies it by its own half of V (the
  latent columns 0..255 or 256..511), so the [64, 512] float32 accumulator costs 128 registers
  per thread.
- KV tiles arrive by TMA (one copy per page-sized block of rows, located through the block
  table) into a two-stage ring, so tile i + 1 loads while tile i is computed. Q arrives by TMA
  too, while the first KV tiles load, and stays in shared memory as the A operand.
- Persistent: one program per multiprocessor (one fills it: 225 KB of shared memory, 255
  registers per thread) walks work items. The next item's first KV tile loads as soon as a
  stage frees up, its Q as soon as this item's last S product is done, so little of the next
  item's start waits on memory.
- The output tile leaves through shared memory, staged in the last tile's KV stage (a TMA store
  when whole 64-row tiles fit the request, else 16-byte stores); split-KV partials (float32) are
  stored directly.
Rows of the last tile past the sequence (stale slots of its page) are zeroed before the P.V
product, so garbage there, NaN included, never reaches the output. Q rows past a request's
valid rows (padding, possibly NaN, or the next request's rows) only ever produce masked scores.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

STAGES = gl.constexpr(2)  # KV tiles in flight: 2 x 72 KB of shared memory


@gluon.jit
def _wait_for_producers(PDL: gl.constexpr):
    """ops/launch.py's wait_for_producers in Gluon: with programmatic dependent launch, wait for the
    previous kernel (it writes the query and the cache entries), then let the next one launch."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def _issue_tile(kn_desc, kr_desc, kn_buf, kr_buf, bar, bt_row_ptr, k0, kv_len, page_size, past_end,
                BLOCK_N: gl.constexpr, PAGE_ROWS: gl.constexpr, D_V: gl.constexpr, D_ROPE: gl.constexpr):
    """Start the TMA copies of keys k0 .. k0 + BLOCK_N into one stage; `bar` counts their bytes.
    Blocks wholly past the sequence read row `past_end` (beyond the cache: TMA fills zeros)."""
    mbarrier.expect(bar, BLOCK_N * (D_V + D_ROPE) * 2)
    for r in gl.static_range(BLOCK_N // PAGE_ROWS):
        slot = k0 + r * PAGE_ROWS
        page = gl.load(bt_row_ptr + slot // page_size, mask=slot < kv_len, other=0)
        row = gl.where(slot < kv_len, page * page_size + slot % page_size, past_end)
        tma.async_copy_global_to_shared(kn_desc, [row, 0], bar, kn_buf.slice(r * PAGE_ROWS, PAGE_ROWS, dim=0))
        tma.async_copy_global_to_shared(kr_desc, [row, 0], bar, kr_buf.slice(r * PAGE_ROWS, PAGE_ROWS, dim=0))


@gluon.jit
def _zero_rows_from(buf, first, BLOCK_N: gl.constexpr, D_V: gl.constexpr):
    """buf[first:, :] = 0 for a [BLOCK_N, D_V] shared tile (generic stores; caller fences).
    Groups of 8 rows wholly past `first` are only written; the one it cuts is read and masked."""
    layout: gl.constexpr = gl.BlockedLayout([1, D_V // 32], [1, 32], [8, 1], [1, 0])  # 8 rows x D_V
    rows = gl.arange(0, 8, layout=gl.SliceLayout(1, layout))
    zeros = gl.zeros([8, D_V], buf.dtype, layout)
    for g in gl.static_range(BLOCK_N // 8):
        group = buf.slice(g * 8, 8, dim=0)
        if g * 8 >= first:
            group.store(zeros)
        elif g * 8 + 8 > first:
            vals = group.load(layout)
            group.store(gl.where((g * 8 + rows >= first)[:, None], zeros, vals))


@gluon.jit
def _work_item(item, n_row_tiles, num_splits, prefix_ptr, num_rows_ptr, block_table_ptr, stride_btb,
               rows_per_req, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Item -> its row tile, request, key range [k_start, k_end) and tile count. Items of one
    request are consecutive, so the programs running together share its KV tiles in L2."""
    pid_m = item % n_row_tiles
    split = (item // n_row_tiles) % num_splits
    b = (item // (n_row_tiles * num_splits)).to(gl.int64)
    prefix = gl.load(prefix_ptr + b)
    n_valid = gl.load(num_rows_ptr + b).to(gl.int32)
    kv_len = prefix + n_valid  # tree slots past num_rows may be stale: never read
    chunk = gl.cdiv(gl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    k_start = split * chunk
    k_end = gl.minimum(k_start + chunk, kv_len)
    n_tiles = gl.cdiv(gl.maximum(k_end - k_start, 0), BLOCK_N)
    q_row = (b * rows_per_req + pid_m * BLOCK_M).to(gl.int32)
    return pid_m, split, b, prefix, n_valid, k_start, k_end, n_tiles, block_table_ptr + b * stride_btb, q_row


@gluon.jit
def _issue_q(qn_desc, qr_desc, qn_smem, qr_smem, q_bar, q_row, BLOCK_M: gl.constexpr, D: gl.constexpr):
    mbarrier.expect(q_bar, BLOCK_M * D * 2)
    tma.async_copy_global_to_shared(qn_desc, [q_row, 0], q_bar, qn_smem)
    tma.async_copy_global_to_shared(qr_desc, [q_row, 0], q_bar, qr_smem)


@gluon.jit
def _issue_first_tiles(kn_desc, kr_desc, kn_smem, kr_smem, bars, slot, bt_row_ptr, k_start, k_end, n_tiles,
                       page_size, past_end, BLOCK_N: gl.constexpr, PAGE_ROWS: gl.constexpr,
                       D_V: gl.constexpr, D_ROPE: gl.constexpr, STAGES: gl.constexpr):
    """An item's KV tiles 0 .. min(n_tiles, STAGES) - 1 into the ring, tile 0 at position `slot`."""
    for t in gl.static_range(STAGES):
        if t < n_tiles:
            stage = (slot + t) % STAGES
            _issue_tile(kn_desc, kr_desc, kn_smem.index(stage), kr_smem.index(stage), bars.index(stage), bt_row_ptr,
                        k_start + t * BLOCK_N, k_end, page_size, past_end, BLOCK_N, PAGE_ROWS, D_V, D_ROPE)


@gluon.jit
def tree_verify_hopper_kernel(
    qn_desc, qr_desc, kn_desc, kr_desc, out_desc, block_table_ptr, prefix_ptr, num_rows_ptr, vis_ptr,
    out_ptr, lse_ptr,
    stride_btb, stride_visb, stride_visn,
    stride_ob, stride_on, stride_oh, stride_os,
    stride_lb, stride_ln, stride_lh, stride_ls,
    qk_scale, rows_per_req, heads, page_size, num_splits, past_end, n_row_tiles, n_items,
    D_V: gl.constexpr, D_ROPE: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_ROWS: gl.constexpr, EPILOGUE: gl.constexpr,
    PDL: gl.constexpr,
):
    """EPILOGUE: 0 = direct stores (split-KV float32 partials), 1 = staged in shared memory, then
    16-byte stores, 2 = staged in shared memory, then a TMA store (rows_per_req % BLOCK_M == 0).
    The staging buffer is the KV stage of the item's last tile, so the next item's last early
    tile waits for the epilogue, while its Q loads from the end of this item's last S product."""
    dtype: gl.constexpr = kn_desc.dtype
    # Next-item KV tiles loaded before this item's epilogue (one fewer when it stages in a stage).
    EARLY_TILES: gl.constexpr = STAGES if EPILOGUE == 0 else STAGES - 1
    # Warpgroup w computes S[:, w * BLOCK_N / 2 ...] and O[:, w * D_V / 2 ...].
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D_V // 2, 16])
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    smem_layout: gl.constexpr = gl.NVMMASharedLayout(128, 16)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    kn_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_V], kn_desc.layout)
    kr_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_ROPE], kr_desc.layout)
    qn_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D_V], qn_desc.layout)
    qr_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D_ROPE], qr_desc.layout)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], smem_layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES + 1, 1], mbarrier.MBarrierLayout())  # KV stages, Q
    for st in gl.static_range(STAGES + 1):
        mbarrier.init(bars.index(st), count=1)
    fence_async_shared()
    gl.thread_barrier()
    q_bar = bars.index(STAGES)
    _wait_for_producers(PDL)  # every global read below comes after it

    first = gl.program_id(0)
    step = gl.num_programs(0)
    _, _, _, _, _, k_start, k_end, n_tiles, bt_row_ptr, q_row = _work_item(
        first, n_row_tiles, num_splits, prefix_ptr, num_rows_ptr, block_table_ptr, stride_btb, rows_per_req, BLOCK_M, BLOCK_N)
    _issue_q(qn_desc, qr_desc, qn_smem, qr_smem, q_bar, q_row, BLOCK_M, D_V + D_ROPE)
    _issue_first_tiles(kn_desc, kr_desc, kn_smem, kr_smem, bars, 0, bt_row_ptr, k_start, k_end, n_tiles,
                       page_size, past_end, BLOCK_N, PAGE_ROWS, D_V, D_ROPE, STAGES)
    slot = 0  # ring position of this item's first KV tile (the ring runs on across items)
    done = 0  # items finished by this program: the phase of the Q barrier
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    for item in range(first, n_items, step):
        pid_m, split, b, prefix, n_valid, k_start, k_end, n_tiles, bt_row_ptr, q_row = _work_item(
            item, n_row_tiles, num_splits, prefix_ptr, num_rows_ptr, block_table_ptr, stride_btb, rows_per_req, BLOCK_M, BLOCK_N)
        rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
        node = rows // heads
        row_ok = (rows < rows_per_req) & (node < n_valid)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
        acc = gl.zeros([BLOCK_M, D_V], gl.float32, o_layout)
        l_acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        # The next item's first KV tiles go into ring positions slot + n_tiles + t as this item's
        # tiles free them; those this item never uses are free now.
        next_item = item + step
        has_next = next_item < n_items
        _, _, _, _, _, nk_start, nk_end, nn_tiles, nbt_row_ptr, nq_row = _work_item(
            gl.minimum(next_item, n_items - 1), n_row_tiles, num_splits, prefix_ptr, num_rows_ptr, block_table_ptr,
            stride_btb, rows_per_req, BLOCK_M, BLOCK_N)
        nn_tiles = gl.where(has_next, nn_tiles, 0)
        _issue_first_tiles(kn_desc, kr_desc, kn_smem, kr_smem, bars, slot + n_tiles, nbt_row_ptr, nk_start, nk_end,
                           gl.minimum(gl.minimum(nn_tiles, STAGES - n_tiles), EARLY_TILES), page_size, past_end,
                           BLOCK_N, PAGE_ROWS, D_V, D_ROPE, STAGES)
        mbarrier.wait(q_bar, done & 1)
        if has_next & (n_tiles == 0):  # no S product here: the Q buffer is free already
            _issue_q(qn_desc, qr_desc, qn_smem, qr_smem, q_bar, nq_row, BLOCK_M, D_V + D_ROPE)
        for i in range(n_tiles):
            stage = (slot + i) % STAGES
            k0 = k_start + i * BLOCK_N
            kn = kn_smem.index(stage)
            kr = kr_smem.index(stage)
            mbarrier.wait(bars.index(stage), ((slot + i) // STAGES) & 1)
            s = warpgroup_mma(qn_smem, kn.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), is_async=True)
            s = warpgroup_mma(qr_smem, kr.permute((1, 0)), s, is_async=True)
            # While the tensor cores run: the mask, and on the last tile the zeroing of the stale
            # rows past the sequence (V must be finite where P is 0; their scores are masked, so S
            # reading them mid-update is harmless). The fence and barrier before P.V publish them.
            keys = k0 + offs_n
            allowed = (keys < k_end)[None, :] & row_ok[:, None]
            if k0 + BLOCK_N > prefix:  # the tile reaches the tree slots: apply the ancestor mask
                j = keys - prefix
                in_tree = (j >= 0)[None, :]
                word = gl.load(vis_ptr + b * stride_visb + node[:, None] * stride_visn + (j >> 6)[None, :],
                               mask=in_tree & allowed, other=0)
                seen = ((word >> (j & 63)[None, :]) & 1) != 0
                allowed = allowed & (~in_tree | seen)
            if k0 + BLOCK_N > k_end:
                _zero_rows_from(kn, k_end - k0, BLOCK_N, D_V)
            s = warpgroup_mma_wait(0, deps=[s])
            s = gl.where(allowed, s * qk_scale, float("-inf"))  # log2 domain
            m_new = gl.maximum(m_i, gl.max(s, 1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(s - m_safe[:, None])
            # Row sums stay per key column until the item ends: no cross-warpgroup sum per tile.
            l_acc = l_acc * alpha[:, None] + p
            m_i = m_new
            p_smem.store(p.to(dtype))
            fence_async_shared()
            gl.thread_barrier()  # both halves of P (and any zeroed V rows) are in shared memory
            if has_next & (i == n_tiles - 1):  # both S products are done: Q is free
                _issue_q(qn_desc, qr_desc, qn_smem, qr_smem, q_bar, nq_row, BLOCK_M, D_V + D_ROPE)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            acc = warpgroup_mma(p_smem, kn, acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            gl.thread_barrier()  # every warp is done with this stage and with P
            if i + STAGES < n_tiles:
                _issue_tile(kn_desc, kr_desc, kn, kr, bars.index(stage), bt_row_ptr, k0 + STAGES * BLOCK_N, k_end,
                            page_size, past_end, BLOCK_N, PAGE_ROWS, D_V, D_ROPE)
            else:  # this stage's next ring position holds the next item's tile i + STAGES - n_tiles
                t = i + STAGES - n_tiles
                if t < gl.minimum(nn_tiles, EARLY_TILES):
                    _issue_tile(kn_desc, kr_desc, kn, kr, bars.index(stage), nbt_row_ptr, nk_start + t * BLOCK_N,
                                nk_end, page_size, past_end, BLOCK_N, PAGE_ROWS, D_V, D_ROPE)
        slot += n_tiles
        done += 1
        l_i = gl.sum(l_acc, 1)

        has_keys = l_i > 0.0
        lse = gl.where(has_keys, (m_i + gl.log2(gl.where(has_keys, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
        inv_l = gl.convert_layout(gl.where(has_keys, 1.0 / gl.where(has_keys, l_i, 1.0), 0.0), row_o)
        out = acc * inv_l[:, None]
        late_stage = (slot + STAGES - 1) % STAGES  # this item's last tile's, free; next item's tile STAGES - 1
        staging = kn_smem.index(late_stage)
        if EPILOGUE == 2:
            staging.store(out.to(dtype))
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(out_desc, [q_row, 0], staging)
            tma.store_wait(0)
        elif EPILOGUE == 1:
            staging.store(out.to(dtype))
            gl.thread_barrier()
            io_rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, io_layout))
            cols = gl.arange(0, D_V, layout=gl.SliceLayout(0, io_layout))
            io_out = out_ptr + b * stride_ob + (io_rows // heads)[:, None] * stride_on + (io_rows % heads)[:, None] * stride_oh
            gl.store(io_out + cols[None, :], staging.load(io_layout), mask=(io_rows < rows_per_req)[:, None])
        else:
            rows_o = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_o)
            cols_o = gl.arange(0, D_V, layout=gl.SliceLayout(0, o_layout))
            o_row = out_ptr + b * stride_ob + (rows_o // heads)[:, None] * stride_on + (rows_o % heads)[:, None] * stride_oh
            gl.store(o_row + split * stride_os + cols_o[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=(rows_o < rows_per_req)[:, None])
        l_ptrs = lse_ptr + b * stride_lb + node * stride_ln + (rows % heads) * stride_lh + split * stride_ls
        gl.store(l_ptrs, lse, mask=rows < rows_per_req)
        if EARLY_TILES < STAGES:
            fence_async_shared()  # the staging buffer's generic reads / writes before TMA refills it
            gl.thread_barrier()
            if EARLY_TILES < nn_tiles:
                _issue_tile(kn_desc, kr_desc, staging, kr_smem.index(late_stage), bars.index(late_stage), nbt_row_ptr,
                            nk_start + EARLY_TILES * BLOCK_N, nk_end, page_size, past_end, BLOCK_N, PAGE_ROWS, D_V,
                            D_ROPE)
    for st in gl.static_range(STAGES + 1):
        mbarrier.invalidate(bars.index(st))
