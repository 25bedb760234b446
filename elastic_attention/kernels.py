"""kernels.py — hybrid attention: every (sample, KV head) in its own mode (FULL, STREAMING or
BLOCK_SPARSE, see masks.py), as one fused Triton kernel with its backward, beside the naive twins
(METHOD.md §3, §7). Reads top to bottom:

    1. which code runs a call: the backend vocabulary every kernel family shares, the Triton limits
    2. tile sizes and block lists (host side)
    3. forward:  hybrid_attention_reference (naive twin) → the key-tile walk → _hybrid_attention_fwd
    4. backward: hybrid_attention_reference_grad (naive twin) → the query-tile walk → dk/dv and dq kernels
    5. fused_hybrid_attention (a torch.autograd.Function around 3 and 4)
    6. the torch backend: SDPA over the heads that share a mode (uniform_ and grouped_attention_sdpa)
    7. hybrid_attention, the entry point the model calls

Shape letters as in masks.py, plus the kernels' tile sizes: BLOCK_M query rows × BLOCK_N keys.
The tile walk, in one sentence: a program never visits a tile its mode cannot see, runs unmasked
where every (query, key) pair of a tile is visible, and evaluates the token-exact predicate
    j <= i and (j < sink or i - j < window)
only on the edge tiles (FULL and BLOCK_SPARSE heads pass sink = 0 and a window longer than S).
"""
import functools
import math
import os  # TRITON_INTERPRET=1 switches the kernels to Triton's CPU interpreter

import torch

from .masks import (BLOCK_SPARSE, FULL, STREAMING, check_block_mask, check_modes, check_qkv,
                   check_sparse_params, hybrid_mask, naive_attention, streaming)

# The one place that asks whether Triton is installed: decode.py and xattention.py import triton
# and tl from here, so a machine without Triton still runs every "reference" and "torch" path.
try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None
HAS_TRITON = triton is not None

# -----------------------------------------------------------------------------
# 1. Which code runs a call. One vocabulary for every kernel family (prefill here, decode in
# decode.py, XAttention scoring in xattention.py); Config.backend passes it to all three:
#     "reference"  the naive PyTorch twin, obviously right, any dtype (float64 too)
#     "torch"      the best plain-PyTorch path: SDPA for prefill heads that share one mode; the
#                  naive twin where a family has nothing better (decode, XAttention scoring)
#     "triton"     the Triton kernel; a ValueError naming the value outside its limits
#     "auto"       "triton" on CUDA when the kernel supports the call, else "torch"

BACKENDS = ("auto", "reference", "torch", "triton")
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")  # as Triton reads it, once


def interpreting():
    """Whether Triton runs this file's kernels on the CPU (TRITON_INTERPRET=1 when it was imported)."""
    return _INTERPRET


def check_backend(backend):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def check_int32_reach(**tensors):
    """The kernels offset each (sample, head) in int64 but rows and columns inside it in int32:
    refuse a tensor whose last two axes reach 2^31 elements (a transposed view of a long, wide input)."""
    for name, t in tensors.items():
        reach = (t.shape[-2] - 1) * t.stride(-2) + (t.shape[-1] - 1) * t.stride(-1)
        if reach >= 2 ** 31:
            raise ValueError(f"{name} {tuple(t.shape)} with strides {t.stride()} reaches {reach} elements inside "
                             "one (sample, head), past the Triton kernels' int32 offsets: pass it contiguous")


def triton_unsupported(dtype, on_cuda, head_dim, min_head_dim=1, block_size=None):
    """Why a Triton kernel of this project cannot run a call with these properties (a sentence
    naming the value), or None when it can. min_head_dim: the prefill kernel's tl.dot tiles need
    D >= 16 (the decode and scoring kernels pad D); block_size: a prefill call with a block mask.
    Pure: looks at no tensor, so the backend choice can be tested anywhere."""
    if not HAS_TRITON:
        return "triton is not installed"
    if dtype not in KERNEL_DTYPES:
        return f"the Triton kernel supports float16, bfloat16 and float32, got {dtype}"
    if not min_head_dim <= head_dim <= 256:
        return f"head dim D={head_dim} out of range: the Triton kernel supports {min_head_dim} <= D <= 256"
    if block_size is not None and block_size < 16:
        return (f"block_size={block_size}: a block_mask needs block_size >= 16 in the Triton kernel "
                "(tiles follow the mask's blocks; tl.dot needs 16 rows)")
    if not on_cuda and not interpreting():
        return ("tensors on the CPU: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 set "
                "before importing triton, to run it on the CPU)")
    if not on_cuda and dtype == torch.bfloat16:
        return "the Triton CPU interpreter does not support bfloat16; use float16/float32"
    return None


def resolve_backend(backend, dtype, on_cuda, head_dim, min_head_dim=1, block_size=None):
    """The backend that runs a call ("reference", "torch" or "triton"), for any kernel family:
    'auto' becomes 'triton' on CUDA when the kernel supports the call (triton_unsupported, same
    arguments), else 'torch'. Asking for 'triton' outside the kernel's limits is a ValueError."""
    check_backend(backend)
    if backend in ("reference", "torch"):
        return backend
    reason = triton_unsupported(dtype, on_cuda, head_dim, min_head_dim, block_size)
    if backend == "auto":
        return "triton" if on_cuda and reason is None else "torch"
    if reason is not None:
        raise ValueError(f"backend 'triton': {reason}")
    return backend


def prefill_backend(backend, q, block_mask=None, block_size=64):
    """The backend hybrid_attention runs for q (B, Hq, S, D): resolve_backend with the fused prefill
    kernel's own limits. "triton" runs every head in its own mode in one launch."""
    return resolve_backend(backend, q.dtype, q.is_cuda, q.shape[-1], **_prefill_limits(block_mask, block_size))


def _prefill_limits(block_mask, block_size):
    """The fused prefill kernel's own limits, as triton_unsupported's keywords."""
    return dict(min_head_dim=16, block_size=block_size if block_mask is not None else None)

# -----------------------------------------------------------------------------
# 2. Host side of the kernel: tile sizes and block lists.

@functools.lru_cache(maxsize=None)
def _shared_memory(device_index):
    """Shared memory one program may use on this CUDA device, in bytes (227 KB on an H100/H200)."""
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def _tile_config(D, dtype, block_size, has_block_sparse, interpret, shared_memory=None):
    """Forward tiles (BLOCK_M, BLOCK_N, num_warps, num_stages), fixed (no autotuning):
      - GPU, D <= 128, 16-bit: 128×128 tiles in 8 warps (two warpgroups of 64 query rows for Hopper's
        wgmma), 3 stages of K/V prefetch: 224 KB of shared memory at D = 128, under Hopper's 227 KB.
        A card with less shared memory (an A100 has 163 KB) gets 128×64 tiles and 4 stages (160 KB).
        shared_memory: the device's limit in bytes (_shared_memory); None = no limit.
      - D > 128 or fp32: the fp32 accumulator (BLOCK_M × D) and the K/V tiles double, so halve the tiles.
      - Interpreter: small tiles, so that short test sequences still cross several tiles and every
        edge case (partial sink / window / diagonal tiles) is exercised.
    BLOCK_SPARSE heads need every tile inside one block-mask row (query tile) and column (key
    tile): BLOCK_M, BLOCK_N <= block_size (all powers of two)."""
    if interpret:
        bm, bn, warps, stages = 32, 16, 4, 1
    elif D <= 128 and dtype != torch.float32:
        big = shared_memory is None or shared_memory >= 224 * 1024
        bm, bn, warps, stages = (128, 128, 8, 3) if big else (128, 64, 8, 4)
    else:
        bm, bn, warps, stages = 64, 32, 4, 2
    if has_block_sparse:
        bm, bn = min(bm, block_size), min(bn, block_size)
    return bm, bn, warps, stages


def _bwd_tile_config(D, dtype, block_size, has_block_sparse, interpret):
    """Backward tiles, one (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel, as in
    FlashAttention-2: the dk/dv program holds a tall key tile (BLOCK_N) and streams short query
    tiles (BLOCK_M) past it; the dq program holds a tall query tile (BLOCK_M) and streams short
    key tiles (BLOCK_N). Short streamed tiles keep the masked diagonal band narrow.
      - GPU, D <= 128, 16-bit: 8 warps for both. The dk/dv program's two fp32 accumulators
        (128 keys × D) alone take 256 registers per thread in 4 warps, more than the 255 a thread
        may hold, so they spill; in 8 warps they take half. With the score tiles on top the program
        still spills a little, which costs less than any smaller tile measured (RESULTS.md)."""
    if interpret:
        dkdv, dq = (16, 32, 4, 1), (32, 16, 4, 1)
    elif D <= 128 and dtype != torch.float32:
        dkdv, dq = (64, 128, 8, 3), (128, 64, 8, 3)
    else:
        dkdv, dq = (32, 64, 4, 2), (64, 32, 4, 2)
    if has_block_sparse:
        dkdv, dq = ((min(m, block_size), min(n, block_size), w, s) for m, n, w, s in (dkdv, dq))
    return dkdv, dq


def block_lists(block_mask, transpose=False):
    """Compact lists of the switched-on *off-diagonal* causal blocks, from a bool block mask
    (B, Hkv, nB, nB): idx (B, Hkv, nB, nB) int32 and cnt (B, Hkv, nB) int32, ascending.
    transpose=False: row r lists its key blocks c < r (the forward and dq walk them);
    transpose=True:  column c lists its query blocks r > c (the dk/dv walk).
    The diagonal blocks are not listed (the kernels read block_mask's diagonal apart). Entries past
    the count are padding, never read. Lists are nB wide, so no host sync sizes them."""
    nB = block_mask.shape[-1]
    keep = torch.ones(nB, nB, dtype=torch.bool, device=block_mask.device).tril(-1)   # (nB, nB): c < r
    on = (block_mask.transpose(-2, -1) & keep.T) if transpose else (block_mask & keep)
    cnt = on.sum(-1, dtype=torch.int32)                                            # (B, Hkv, nB)
    # Switched-on entry c of a row goes to slot (number of switched-on entries before it); the
    # others are scattered into a spare column nB that is cut off afterwards.
    slot = torch.where(on, on.cumsum(-1) - 1, nB)                                  # (B, Hkv, nB, nB)
    col = torch.arange(nB, dtype=torch.int32, device=block_mask.device).expand_as(slot)
    idx = torch.zeros(*on.shape[:-1], nB + 1, dtype=torch.int32, device=block_mask.device)
    idx.scatter_(-1, slot, col)
    return idx[..., :nB].contiguous(), cnt                                         # (B, Hkv, nB, nB), (B, Hkv, nB)


def _dot_precision(dtype):
    """tl.dot's input precision: float32 inputs multiply as true fp32 unless torch's matmuls may use
    TF32 (torch.backends.cuda.matmul.allow_tf32, off by default), as torch's own matmuls do."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"  # ignored for 16-bit inputs


def _block_sparse_args(block_mask, device):
    """(kv_idx, kv_cnt, q_idx, q_cnt, diag) for the kernels; stand-ins that are never read when
    there is no block mask."""
    if block_mask is None:
        z = torch.zeros(1, 1, 1, 1, dtype=torch.int32, device=device)
        return z, z[..., 0], z, z[..., 0], z[..., 0]
    kv_idx, kv_cnt = block_lists(block_mask)
    q_idx, q_cnt = block_lists(block_mask, transpose=True)
    diag = block_mask.diagonal(dim1=-2, dim2=-1).to(torch.int32).contiguous()      # (B, Hkv, nB)
    return kv_idx, kv_cnt, q_idx, q_cnt, diag

# -----------------------------------------------------------------------------
# 3. Forward.

def hybrid_attention_reference(q, k, v, modes, sink, window, block_mask=None, block_size=64, check=True):
    """The naive twin of the fused forward (same arguments): naive_attention on the dense
    hybrid_mask. Costs B·Hkv·S² bytes of mask plus B·Hq·S² floats of scores, written and read
    three times; the kernel below computes the same numbers from O(1) tile bounds per program."""
    mask = hybrid_mask(q.shape[2], modes, sink, window, block_mask, block_size, check=check)  # (B, Hkv, S, S)
    return naive_attention(q, k, v, mask)


if HAS_TRITON:
    # Module-level ints used inside @triton.jit code must be tl.constexpr.
    _STREAMING = tl.constexpr(STREAMING)
    _BLOCK_SPARSE = tl.constexpr(BLOCK_SPARSE)
    _LN2 = tl.constexpr(0.6931471805599453)    # ln 2: the log2-domain LSE back to natural log
    # The key-tile ranges a query tile walks (forward and dq), in walk order. Masked: SINK_EDGE,
    # WINDOW_EDGE, DIAGONAL. Gathered through the block list: LISTED.
    LISTED = tl.constexpr(0)       # BLOCK_SPARSE: the switched-on off-diagonal blocks
    SINK = tl.constexpr(1)         # STREAMING: whole tiles of sink keys
    SINK_EDGE = tl.constexpr(2)    #   the tile that holds the sink's end
    WINDOW_EDGE = tl.constexpr(3)  #   window tiles some, but not all, rows of the query tile reach
    WINDOW = tl.constexpr(4)       #   window tiles every row reaches (FULL: all tiles before the diagonal)
    DIAGONAL = tl.constexpr(5)     # every mode: the tiles that hold the query tile's own positions
    N_KEY_RANGES = tl.constexpr(6)
    # The query-tile ranges a key tile walks (dk/dv), in walk order. Masked: Q_DIAGONAL, Q_EDGE.
    Q_LISTED = tl.constexpr(0)     # BLOCK_SPARSE: the query blocks below that switch this key block on
    Q_DIAGONAL = tl.constexpr(1)   # the query tiles that hold the key tile's own positions
    Q_BODY = tl.constexpr(2)       # query tiles that see every key of the tile
    Q_EDGE = tl.constexpr(3)       # query tiles that see some of them (window end, partial sink tile)
    N_QUERY_RANGES = tl.constexpr(4)

    @triton.jit
    def _load_rows(ptrs, rows, seq_len, offs_d, HEAD_DIM: tl.constexpr, CHECK_ROWS: tl.constexpr):
        """Load a (rows, BLOCK_D) tile; masks only what can be out of bounds, so interior tiles
        of a power-of-two head dim are plain unmasked loads."""
        PAD_D: tl.constexpr = offs_d.shape[0] != HEAD_DIM
        if CHECK_ROWS and PAD_D:
            return tl.load(ptrs, mask=(rows[:, None] < seq_len) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        elif CHECK_ROWS:
            return tl.load(ptrs, mask=rows[:, None] < seq_len, other=0.0)
        elif PAD_D:
            return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            return tl.load(ptrs)

    @triton.jit
    def _visible(i, j, sink, window):
        """The hybrid predicate on broadcast query rows i and key positions j."""
        return (j <= i) & ((j < sink) | (i - j < window))

    @triton.jit
    def _key_tile_range(RANGE: tl.constexpr, m0, seq_len, sink, window, first_tile, n_listed,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Tiles [lo, hi) of one key range for query rows m0 … m0+BLOCK_M-1 (key tile t holds keys
        t·BLOCK_N …; LISTED counts gathered tiles instead). The ranges never overlap, and every
        tile outside them is invisible to every row. first_tile cuts the recent ranges (WINDOW_EDGE,
        WINDOW, DIAGONAL) for BLOCK_SPARSE heads: they start at the diagonal block, or not at all."""
        diag_lo = m0 // BLOCK_N
        # Window: row m0 reaches back furthest (to m0 - window + 1), the last row least far.
        win_start = tl.maximum(tl.maximum(m0 - window + 1, 0) // BLOCK_N, first_tile)
        win_full = tl.maximum(tl.minimum(tl.cdiv(tl.maximum(m0 + BLOCK_M - window, 0), BLOCK_N), diag_lo),
                              win_start)
        # Sink: whole tiles, then the partial one; both stop where the window tiles begin.
        sink_end = tl.minimum(tl.cdiv(sink, BLOCK_N), win_start)
        sink_full = tl.minimum(sink // BLOCK_N, sink_end)
        if RANGE == LISTED:
            lo, hi = 0, n_listed
        elif RANGE == SINK:
            lo, hi = 0, sink_full
        elif RANGE == SINK_EDGE:
            lo, hi = sink_full, sink_end
        elif RANGE == WINDOW_EDGE:
            lo, hi = win_start, win_full
        elif RANGE == WINDOW:
            lo, hi = win_full, diag_lo
        else:  # DIAGONAL
            lo, hi = tl.maximum(diag_lo, first_tile), tl.cdiv(tl.minimum(m0 + BLOCK_M, seq_len), BLOCK_N)
        return lo, hi

    @triton.jit
    def _key_tile_start(t, block_list, RANGE: tl.constexpr, BLOCK_N: tl.constexpr, TILES_PER_BLOCK: tl.constexpr):
        """First key of tile t of a range: listed tiles are sub-tile t % TILES_PER_BLOCK of mask block
        block_list[t // TILES_PER_BLOCK]."""
        if RANGE == LISTED:
            n0 = tl.load(block_list + t // TILES_PER_BLOCK) * (TILES_PER_BLOCK * BLOCK_N) \
                + (t % TILES_PER_BLOCK) * BLOCK_N
        else:
            n0 = t * BLOCK_N
        return n0

    @triton.jit
    def _attn_fwd_inner(acc, l_i, m_i, q, K_tile, V_tile, block_list, m0, seq_len, sink, window,
                        first_tile, n_listed, qk_scale, stride_ks, stride_vs,
                        RANGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        HEAD_DIM: tl.constexpr, TILES_PER_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """The inner loop: fold the key tiles of one range into the online softmax state
        (acc, l_i, m_i). K_tile / V_tile point at keys 0 … BLOCK_N-1 of this KV head.
        Unmasked ranges hold only tiles where every pair is visible and in bounds: no index math,
        no -inf, no load masks. This is where the FLOPs are."""
        MASKED: tl.constexpr = (RANGE == SINK_EDGE) | (RANGE == WINDOW_EDGE) | (RANGE == DIAGONAL)
        lo, hi = _key_tile_range(RANGE, m0, seq_len, sink, window, first_tile, n_listed, BLOCK_M, BLOCK_N)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, q.shape[1])
        for t in range(lo, hi):
            n0 = _key_tile_start(t, block_list, RANGE, BLOCK_N, TILES_PER_BLOCK)
            offs_kv = n0 + offs_n                                                     # (BLOCK_N,)

            # -- scores qk = q kᵀ in fp32 ----------------------------------------------------------
            k = _load_rows(K_tile + n0 * stride_ks, offs_kv, seq_len, offs_d, HEAD_DIM, MASKED)  # (BLOCK_N, BLOCK_D)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)                # (BLOCK_M, BLOCK_N)

            # -- online softmax in the log2 domain (qk_scale already holds 1/ln 2) -----------------
            if MASKED:
                # Keys past S only meet padding rows i >= S (causality), whose output is never
                # stored, and were loaded as zeros: no separate j < S test is needed.
                visible = _visible(offs_m[:, None], offs_kv[None, :], sink, window)   # (BLOCK_M, BLOCK_N)
                qk = tl.where(visible, qk * qk_scale, float("-inf"))
                m_ij = tl.maximum(m_i, tl.max(qk, 1))
                # A row that has seen no key yet keeps m = -inf; subtracting 0 instead avoids
                # exp2(-inf - (-inf)) = NaN (its p and alpha come out as exactly 0).
                m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
                qk = qk - m_sub[:, None]
            else:
                m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
                m_sub = m_ij
                qk = qk * qk_scale - m_sub[:, None]
            p = tl.math.exp2(qk)                                                      # (BLOCK_M, BLOCK_N)
            alpha = tl.math.exp2(m_i - m_sub)              # rescales what was summed under the old max
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]

            # -- acc += p v --------------------------------------------------------------------------
            v = _load_rows(V_tile + n0 * stride_vs, offs_kv, seq_len, offs_d, HEAD_DIM, MASKED)  # (BLOCK_N, BLOCK_D)
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)        # (BLOCK_M, BLOCK_D)
            m_i = m_ij
        return acc, l_i, m_i

    @triton.jit
    def _mode_walk(Modes, BlockCnt, BlockDiag, b, h_kv, r, n_k_tiles, seq_len, sink, window,
                   stride_mb, stride_mh, stride_cb, stride_ch, stride_db, stride_dh,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_BLOCK: tl.constexpr,
                   HAS_BLOCK_SPARSE: tl.constexpr):
        """What a query tile in block-mask row r of head (b, h_kv) walks, as the arguments of
        _key_tile_range: (sink, window, first_tile, n_listed). FULL is STREAMING with no sink and
        a window longer than any row looks back; BLOCK_SPARSE is FULL from the diagonal block's
        first tile (or nothing, when that block is off) plus n_listed gathered tiles."""
        mode = tl.load(Modes + b * stride_mb + h_kv * stride_mh)
        is_stream = mode == _STREAMING
        sink = tl.where(is_stream, sink, 0)
        window = tl.where(is_stream, window, seq_len + BLOCK_M)
        first_tile = 0
        n_listed = 0
        if HAS_BLOCK_SPARSE:
            is_bs = mode == _BLOCK_SPARSE
            n_blocks = tl.load(BlockCnt + b * stride_cb + h_kv * stride_ch + r)
            diag_on = tl.load(BlockDiag + b * stride_db + h_kv * stride_dh + r) != 0
            n_listed = tl.where(is_bs, n_blocks * (MASK_BLOCK // BLOCK_N), 0)
            first_tile = tl.where(is_bs, tl.where(diag_on, (r * MASK_BLOCK) // BLOCK_N, n_k_tiles), 0)
        return sink, window, first_tile, n_listed

    # Sizes that change from call to call are not specialised (Triton would otherwise compile one
    # variant per "divisible by 16" / "equal to 1" pattern of seq_len, sink, window, ...).
    @triton.jit(do_not_specialize=["seq_len", "n_q_tiles", "H_KV", "G", "sink", "window"])
    def _hybrid_attention_fwd(
        Q, K, V, Out, Lse, Modes, BlockIdx, BlockCnt, BlockDiag,           # pointers
        seq_len, n_q_tiles, H_KV, G, sink, window, qk_scale,               # sizes and scalars
        stride_qb, stride_qh, stride_qs, stride_qd,                        # strides
        stride_kb, stride_kh, stride_ks, stride_kd,
        stride_vb, stride_vh, stride_vs, stride_vd,
        stride_ob, stride_oh, stride_os, stride_od,
        stride_lb, stride_lh, stride_mb, stride_mh,
        stride_ib, stride_ih, stride_ir, stride_cb, stride_ch, stride_db, stride_dh,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
        MASK_BLOCK: tl.constexpr, HAS_BLOCK_SPARSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        """One program = one BLOCK_M-row query tile of one (sample, query head); it walks the key
        ranges of its mode (_key_tile_range) and stores o and the log-sum-exp."""
        # -- 1. program id -> (query tile, sample, KV head, query head) --------------------------------
        # Launch order, fastest-varying first: the G query heads of one KV head (they read the same
        # K/V tiles, which then come from L2), then the query tiles from the last (the most work
        # under causality) to the first, then the (sample, KV head) pairs.
        pid = tl.program_id(0)
        g = pid % G
        tile = n_q_tiles - 1 - (pid // G) % n_q_tiles
        bh = pid // (G * n_q_tiles)                           # b·H_KV + h_kv
        b = bh // H_KV
        h_kv = bh % H_KV
        h_q = h_kv * G + g
        m0 = tile * BLOCK_M                                   # first query row of this tile

        # -- 2. pointers (int64 bases: B·H·S·D can pass 2³¹) and the q tile ----------------------------
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        q_base = Q + b.to(tl.int64) * stride_qb + h_q.to(tl.int64) * stride_qh
        K_tile = K + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh \
            + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd      # keys 0 … BLOCK_N-1
        V_tile = V + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh \
            + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd
        q = _load_rows(q_base + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                       offs_m, seq_len, offs_d, HEAD_DIM, True)              # (BLOCK_M, BLOCK_D)

        # -- 3. what this mode walks -------------------------------------------------------------------
        r = m0 // MASK_BLOCK                                  # this tile's block-mask row
        block_list = BlockIdx + b * stride_ib + h_kv * stride_ih + r * stride_ir
        sink, window, first_tile, n_listed = _mode_walk(
            Modes, BlockCnt, BlockDiag, b, h_kv, r, tl.cdiv(seq_len, BLOCK_N), seq_len, sink, window,
            stride_mb, stride_mh, stride_cb, stride_ch, stride_db, stride_dh,
            BLOCK_M, BLOCK_N, MASK_BLOCK, HAS_BLOCK_SPARSE)

        # -- 4. fold every key range into (acc, l_i, m_i); the order does not change the result ----------
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")   # running max (log2 units)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                  # running Σ exp2(s - m_i)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)         # running Σ p v
        for RANGE in tl.static_range(N_KEY_RANGES):  # LISTED, SINK, SINK_EDGE, WINDOW_EDGE, WINDOW, DIAGONAL
            acc, l_i, m_i = _attn_fwd_inner(
                acc, l_i, m_i, q, K_tile, V_tile, block_list, m0, seq_len, sink, window, first_tile,
                n_listed, qk_scale, stride_ks, stride_vs, RANGE=RANGE, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                HEAD_DIM=HEAD_DIM, TILES_PER_BLOCK=MASK_BLOCK // BLOCK_N, DOT_PRECISION=DOT_PRECISION)

        # -- 5. normalise and store; a row that saw no key (an empty block row) is 0, not NaN ----------
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        o_ptrs = Out + b.to(tl.int64) * stride_ob + h_q.to(tl.int64) * stride_oh \
            + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od
        tl.store(o_ptrs, out.to(Out.dtype.element_ty),
                 mask=(offs_m[:, None] < seq_len) & (offs_d[None, :] < HEAD_DIM))
        # log Σ_j exp(s_ij) = ln 2 · (m_i + log2 l_i): m_i and l_i live in the log2 domain.
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * _LN2)
        tl.store(Lse + b.to(tl.int64) * stride_lb + h_q * stride_lh + offs_m, lse, mask=offs_m < seq_len)


def _hybrid_attention_fwd_launch(q, k, v, modes32, sink, window, bs_args, block_size, has_bs, config):
    """o (B, Hq, S, D) in q's dtype and lse (B, Hq, S) float32 from one launch (inputs checked)."""
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    BLOCK_M, BLOCK_N, num_warps, num_stages = config
    kv_idx, kv_cnt, _, _, diag = bs_args
    o = torch.empty(B, Hq, S, D, dtype=q.dtype, device=q.device)          # (B, Hq, S, D) contiguous
    lse = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)     # (B, Hq, S)
    if S == 0:
        return o, lse
    n_q_tiles = triton.cdiv(S, BLOCK_M)
    _hybrid_attention_fwd[(B * Hq * n_q_tiles,)](
        q, k, v, o, lse, modes32, kv_idx, kv_cnt, diag,
        S, n_q_tiles, Hkv, Hq // Hkv, sink, window, 1.4426950408889634 / math.sqrt(D),  # 1/√D · 1/ln 2: exp2
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        lse.stride(0), lse.stride(1), *modes32.stride(),
        kv_idx.stride(0), kv_idx.stride(1), kv_idx.stride(2), kv_cnt.stride(0), kv_cnt.stride(1),
        diag.stride(0), diag.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(D)), HEAD_DIM=D,
        MASK_BLOCK=block_size if has_bs else BLOCK_N, HAS_BLOCK_SPARSE=has_bs,
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return o, lse

# -----------------------------------------------------------------------------
# 4. Backward (FlashAttention-2): with P = softmax(S) recomputed from the saved LSE and
#    Δ_i = Σ_d dO_id O_id,   dV = Pᵀ dO,   dS = P ∘ (dO Vᵀ - Δ),   dQ = dS K / √D,   dK = dSᵀ Q / √D.
#    rows:  one program per (sample, query head, row tile): Δ and what the scales below need.
#    dk/dv: one program per (sample, KV head, key tile), summing over the G query heads of the KV head.
#    dq:    one program per (sample, query head, query tile), walking the forward's key ranges.
#    16-bit inputs: dS enters dQ and dK in fp16, with power-of-two scales (_backward_operands).

def hybrid_attention_reference_grad(q, k, v, modes, sink, window, block_mask, block_size, do):
    """The naive twin of the fused backward: (dq, dk, dv) by autograd through
    hybrid_attention_reference, for an upstream gradient do (B, Hq, S, D)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = hybrid_attention_reference(q, k, v, modes, sink, window, block_mask, block_size)
    return torch.autograd.grad(o, (q, k, v), do)


if HAS_TRITON:
    @triton.jit
    def _attn_bwd_rows(O, DO, Q, Lse, Delta, Lse2, DoNorm, QMax, seq_len, H,
                       stride_ob, stride_oh, stride_os, stride_od, stride_dob, stride_doh, stride_dos, stride_dod,
                       stride_qb, stride_qh, stride_qs, stride_qd,
                       BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
        """What the backward needs per query row, from one pass over o, dO and q (B, Hq, S, D):
        Δ_i = Σ_d dO_id O_id; the LSE in log2 units, an empty row's -inf turned to +inf (its
        p = exp2(s - lse) must be 0, not exp2(-inf + inf) = NaN); ‖dO_i‖ and max_d |q_id| for
        _backward_operands. Outputs are (B, Hq, S) float32, contiguous."""
        bh = tl.program_id(0)                                 # b·H + h (the long grid axis: B·Hq may pass 65535)
        b, h = bh // H, bh % H
        offs_m = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, BLOCK_D)
        rows = offs_m[:, None]
        o = _load_rows(O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + rows * stride_os
                       + offs_d[None, :] * stride_od, offs_m, seq_len, offs_d, HEAD_DIM, True).to(tl.float32)
        do = _load_rows(DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + rows * stride_dos
                        + offs_d[None, :] * stride_dod, offs_m, seq_len, offs_d, HEAD_DIM, True).to(tl.float32)
        q = _load_rows(Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + rows * stride_qs
                       + offs_d[None, :] * stride_qd, offs_m, seq_len, offs_d, HEAD_DIM, True).to(tl.float32)
        row = bh.to(tl.int64) * seq_len + offs_m
        inside = offs_m < seq_len
        lse = tl.load(Lse + row, mask=inside, other=0.0)
        tl.store(Delta + row, tl.sum(do * o, 1), mask=inside)
        tl.store(Lse2 + row, tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634), mask=inside)
        tl.store(DoNorm + row, tl.sqrt(tl.sum(do * do, 1)), mask=inside)
        tl.store(QMax + row, tl.max(tl.abs(q), 1), mask=inside)

    @triton.jit
    def _scaled_fp16(X, Scale, Out, seq_len, H, G, stride_xb, stride_xh, stride_xs, stride_xd,
                     BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
        """Out = X · Scale[b, h // G] in fp16, (B, H, S, D) contiguous: the scaled copies of
        _backward_operands in one pass (torch.mul into an fp16 out= runs a slow casting loop)."""
        bh = tl.program_id(0)                                 # b·H + h; Scale is (B, H / G)
        b, h = bh // H, bh % H
        offs_m = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, BLOCK_D)
        x = _load_rows(X + b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh + offs_m[:, None] * stride_xs
                       + offs_d[None, :] * stride_xd, offs_m, seq_len, offs_d, HEAD_DIM, True)
        out = Out + (bh.to(tl.int64) * seq_len + offs_m[:, None]) * HEAD_DIM + offs_d[None, :]
        tl.store(out, (x * tl.load(Scale + bh // G)).to(tl.float16),
                 mask=(offs_m[:, None] < seq_len) & (offs_d[None, :] < HEAD_DIM))

    @triton.jit
    def _query_tile_range(RANGE: tl.constexpr, n0, seq_len, full_end, any_end, n_listed,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Query tiles [lo, hi) of one range for keys n0 … n0+BLOCK_N-1 (query tile t holds rows
        t·BLOCK_M …; Q_LISTED counts gathered tiles). Rows below full_end see every key of the tile
        that causality allows, rows at or past any_end see none of them."""
        n_q_tiles = tl.cdiv(seq_len, BLOCK_M)
        diag_hi = tl.minimum(tl.minimum(tl.cdiv(n0 + BLOCK_N - 1, BLOCK_M), n_q_tiles), tl.cdiv(any_end, BLOCK_M))
        # Unmasked tiles end at a whole tile inside S: a partial last tile is walked as an edge.
        body_hi = tl.maximum(diag_hi, tl.minimum(full_end, seq_len) // BLOCK_M)
        if RANGE == Q_LISTED:
            lo, hi = 0, n_listed
        elif RANGE == Q_DIAGONAL:
            lo, hi = n0 // BLOCK_M, diag_hi
        elif RANGE == Q_BODY:
            lo, hi = diag_hi, body_hi
        else:  # Q_EDGE
            lo, hi = body_hi, tl.maximum(body_hi, tl.minimum(tl.cdiv(any_end, BLOCK_M), n_q_tiles))
        return lo, hi

    @triton.jit
    def _attn_bwd_dkdv_inner(dk, dv, k, v, Q_tile, DO_tile, Lse_row, Delta_row, query_list, n0,
                             seq_len, sink, window, full_end, any_end, n_listed, qk_scale, ds_scale,
                             stride_qs, stride_dos,
                             RANGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             HEAD_DIM: tl.constexpr, TILES_PER_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """Fold the query tiles of one range into dk, dv (BLOCK_N, BLOCK_D) of the key tile n0 … .
        Q_tile / DO_tile point at rows 0 … BLOCK_M-1 of one query head; Lse_row / Delta_row at its
        row 0. Works on transposed scores (keys × queries), so that dk and dv are plain row sums."""
        MASKED: tl.constexpr = (RANGE == Q_DIAGONAL) | (RANGE == Q_EDGE)
        CHECK_ROWS: tl.constexpr = MASKED | (RANGE == Q_LISTED)   # a listed last block may pass S
        lo, hi = _query_tile_range(RANGE, n0, seq_len, full_end, any_end, n_listed, BLOCK_M, BLOCK_N)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, k.shape[1])
        for t in range(lo, hi):
            if RANGE == Q_LISTED:
                m0 = tl.load(query_list + t // TILES_PER_BLOCK) * (TILES_PER_BLOCK * BLOCK_M) \
                    + (t % TILES_PER_BLOCK) * BLOCK_M
            else:
                m0 = t * BLOCK_M
            offs_m = m0 + tl.arange(0, BLOCK_M)                                        # (BLOCK_M,)
            q = _load_rows(Q_tile + m0 * stride_qs, offs_m, seq_len, offs_d, HEAD_DIM, CHECK_ROWS)
            do = _load_rows(DO_tile + m0 * stride_dos, offs_m, seq_len, offs_d, HEAD_DIM, CHECK_ROWS)
            if CHECK_ROWS:  # padding rows get lse = +inf, so their p is exactly 0
                lse2 = tl.load(Lse_row + offs_m, mask=offs_m < seq_len, other=float("inf"))
                delta = tl.load(Delta_row + offs_m, mask=offs_m < seq_len, other=0.0)
            else:
                lse2 = tl.load(Lse_row + offs_m)
                delta = tl.load(Delta_row + offs_m)
            delta = delta * ds_scale

            # -- pᵀ = exp(s - lse), recomputed from the forward's log-sum-exp ------------------------
            qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)                # (BLOCK_N, BLOCK_M)
            if MASKED:
                visible = _visible(offs_m[None, :], offs_n[:, None], sink, window)   # (BLOCK_N, BLOCK_M)
                qkT = tl.where(visible, qkT * qk_scale, float("-inf"))
            else:
                qkT = qkT * qk_scale
            pT = tl.math.exp2(qkT - lse2[None, :])                                      # (BLOCK_N, BLOCK_M)

            # -- dv += pᵀ dO;  dsᵀ = pᵀ ∘ (v dOᵀ - Δ), scaled;  dk += dsᵀ q ---------------------------
            dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)         # (BLOCK_N, BLOCK_D)
            dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)                # (BLOCK_N, BLOCK_M)
            dsT = pT * (dpT * ds_scale - delta[None, :])
            dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PRECISION)          # (BLOCK_N, BLOCK_D)
        return dk, dv

    @triton.jit(do_not_specialize=["seq_len", "n_k_tiles", "H_KV", "G", "sink", "window"])
    def _hybrid_attention_bwd_dkdv(
        Q, K, V, DO, Lse, Delta, Scales, DK, DV, Modes, QBlockIdx, QBlockCnt, BlockDiag,   # pointers
        seq_len, n_k_tiles, H_KV, G, sink, window, qk_scale, sm_scale,          # sizes and scalars
        stride_qb, stride_qh, stride_qs, stride_qd,                             # strides
        stride_kb, stride_kh, stride_ks, stride_kd,
        stride_vb, stride_vh, stride_vs, stride_vd,
        stride_dob, stride_doh, stride_dos, stride_dod,
        stride_dkb, stride_dkh, stride_dks, stride_dkd,
        stride_dvb, stride_dvh, stride_dvs, stride_dvd,
        stride_lb, stride_lh, stride_mb, stride_mh,
        stride_ib, stride_ih, stride_ic, stride_cb, stride_ch, stride_db, stride_dh,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
        MASK_BLOCK: tl.constexpr, HAS_BLOCK_SPARSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        """One program = one BLOCK_N-key tile of one (sample, KV head): dk, dv of those keys, summed
        over the G query heads, each walking only the query tiles that can see a key of the tile."""
        # -- 1. program id -> (key tile, sample, KV head): the tile outermost, so every head's first
        # tiles (most work: all later rows see them) start first and no long program starts last ------
        pid = tl.program_id(0)
        n_bh = tl.num_programs(0) // n_k_tiles                # B · H_KV
        tile = pid // n_bh
        bh = pid % n_bh
        b = bh // H_KV
        h_kv = bh % H_KV
        n0 = tile * BLOCK_N                                   # first key of this tile

        # -- 2. the k, v tile, held for the whole program ----------------------------------------------
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        k = _load_rows(K + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh
                       + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                       offs_n, seq_len, offs_d, HEAD_DIM, True)                     # (BLOCK_N, BLOCK_D)
        v = _load_rows(V + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh
                       + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                       offs_n, seq_len, offs_d, HEAD_DIM, True)                     # (BLOCK_N, BLOCK_D)

        # -- 3. which query rows see these keys, per mode ----------------------------------------------
        # FULL: every row from the diagonal on. STREAMING: a tile of sink keys is seen by every later
        # row (the tile holding the sink's end only in part: all of it is an edge); later keys only
        # by the next `window` rows. BLOCK_SPARSE: the rows of its own block when the diagonal
        # block is on, plus the listed query blocks below.
        mode = tl.load(Modes + b * stride_mb + h_kv * stride_mh)
        is_stream = mode == _STREAMING
        sink = tl.where(is_stream, sink, 0)
        window = tl.where(is_stream, window, seq_len + BLOCK_N)
        full_end = tl.where(n0 + BLOCK_N <= sink, seq_len, tl.where(n0 < sink, 0, n0 + window))
        any_end = tl.where(n0 < sink, seq_len, n0 + BLOCK_N - 1 + window)
        n_listed = 0
        c = n0 // MASK_BLOCK                                  # this tile's block-mask column
        query_list = QBlockIdx + b * stride_ib + h_kv * stride_ih + c * stride_ic
        if HAS_BLOCK_SPARSE:
            is_bs = mode == _BLOCK_SPARSE
            n_blocks = tl.load(QBlockCnt + b * stride_cb + h_kv * stride_ch + c)
            diag_on = tl.load(BlockDiag + b * stride_db + h_kv * stride_dh + c) != 0
            n_listed = tl.where(is_bs, n_blocks * (MASK_BLOCK // BLOCK_M), 0)
            block_end = tl.where(diag_on, (c + 1) * MASK_BLOCK, 0)
            full_end = tl.where(is_bs, block_end, full_end)
            any_end = tl.where(is_bs, block_end, any_end)

        # -- 4. sum over the G query heads of this KV head, each over its query ranges ------------------
        # (q and k here are the scaled copies of _backward_operands; s_dS scales dS before dsᵀ q)
        scales = Scales + (b * H_KV + h_kv) * 4
        ds_scale, inv_ds, inv_q, inv_k = tl.load(scales), tl.load(scales + 1), tl.load(scales + 2), tl.load(scales + 3)
        qk_scale = qk_scale * inv_q * inv_k
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        for g in range(G):
            h_q = h_kv * G + g
            Q_tile = Q + b.to(tl.int64) * stride_qb + h_q.to(tl.int64) * stride_qh \
                + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd        # rows 0 … BLOCK_M-1
            DO_tile = DO + b.to(tl.int64) * stride_dob + h_q.to(tl.int64) * stride_doh \
                + offs_m[:, None] * stride_dos + offs_d[None, :] * stride_dod
            Lse_row = Lse + b.to(tl.int64) * stride_lb + h_q * stride_lh          # log2-domain LSE
            Delta_row = Delta + b.to(tl.int64) * stride_lb + h_q * stride_lh
            for RANGE in tl.static_range(N_QUERY_RANGES):  # Q_LISTED, Q_DIAGONAL, Q_BODY, Q_EDGE
                dk, dv = _attn_bwd_dkdv_inner(
                    dk, dv, k, v, Q_tile, DO_tile, Lse_row, Delta_row, query_list, n0, seq_len, sink,
                    window, full_end, any_end, n_listed, qk_scale, ds_scale, stride_qs, stride_dos,
                    RANGE=RANGE, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM,
                    TILES_PER_BLOCK=MASK_BLOCK // BLOCK_M, DOT_PRECISION=DOT_PRECISION)

        # -- 5. store (scores were s = q kᵀ / √D, so dk picks up 1/√D; and the scales come off) ----------
        d_mask = (offs_n[:, None] < seq_len) & (offs_d[None, :] < HEAD_DIM)
        tl.store(DK + b.to(tl.int64) * stride_dkb + h_kv.to(tl.int64) * stride_dkh
                 + offs_n[:, None] * stride_dks + offs_d[None, :] * stride_dkd,
                 (dk * (sm_scale * inv_ds * inv_q)).to(DK.dtype.element_ty), mask=d_mask)
        tl.store(DV + b.to(tl.int64) * stride_dvb + h_kv.to(tl.int64) * stride_dvh
                 + offs_n[:, None] * stride_dvs + offs_d[None, :] * stride_dvd,
                 dv.to(DV.dtype.element_ty), mask=d_mask)

    @triton.jit
    def _attn_bwd_dq_inner(dq, q, do, lse2, delta, K_tile, V_tile, block_list, m0, seq_len, sink, window,
                           first_tile, n_listed, qk_scale, ds_scale, stride_ks, stride_vs,
                           RANGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           HEAD_DIM: tl.constexpr, TILES_PER_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """Fold the key tiles of one range (the forward's walk) into dq (BLOCK_M, BLOCK_D)."""
        MASKED: tl.constexpr = (RANGE == SINK_EDGE) | (RANGE == WINDOW_EDGE) | (RANGE == DIAGONAL)
        lo, hi = _key_tile_range(RANGE, m0, seq_len, sink, window, first_tile, n_listed, BLOCK_M, BLOCK_N)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, q.shape[1])
        for t in range(lo, hi):
            n0 = _key_tile_start(t, block_list, RANGE, BLOCK_N, TILES_PER_BLOCK)
            offs_kv = n0 + offs_n
            k = _load_rows(K_tile + n0 * stride_ks, offs_kv, seq_len, offs_d, HEAD_DIM, MASKED)  # (BLOCK_N, BLOCK_D)
            v = _load_rows(V_tile + n0 * stride_vs, offs_kv, seq_len, offs_d, HEAD_DIM, MASKED)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)                # (BLOCK_M, BLOCK_N)
            if MASKED:
                visible = _visible(offs_m[:, None], offs_kv[None, :], sink, window)
                qk = tl.where(visible, qk * qk_scale, float("-inf"))
            else:
                qk = qk * qk_scale
            p = tl.math.exp2(qk - lse2[:, None])                                      # (BLOCK_M, BLOCK_N)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)               # (BLOCK_M, BLOCK_N)
            ds = p * (dp * ds_scale - delta[:, None])                                 # delta: Δ·s_dS
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)         # (BLOCK_M, BLOCK_D)
        return dq

    @triton.jit(do_not_specialize=["seq_len", "n_q_tiles", "H_KV", "G", "sink", "window"])
    def _hybrid_attention_bwd_dq(
        Q, K, V, DO, Lse, Delta, Scales, DQ, Modes, BlockIdx, BlockCnt, BlockDiag,      # pointers
        seq_len, n_q_tiles, H_KV, G, sink, window, qk_scale, sm_scale,          # sizes and scalars
        stride_qb, stride_qh, stride_qs, stride_qd,                             # strides
        stride_kb, stride_kh, stride_ks, stride_kd,
        stride_vb, stride_vh, stride_vs, stride_vd,
        stride_dob, stride_doh, stride_dos, stride_dod,
        stride_dqb, stride_dqh, stride_dqs, stride_dqd,
        stride_lb, stride_lh, stride_mb, stride_mh,
        stride_ib, stride_ih, stride_ir, stride_cb, stride_ch, stride_db, stride_dh,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
        MASK_BLOCK: tl.constexpr, HAS_BLOCK_SPARSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        """One program = one BLOCK_M-row query tile of one (sample, query head): dq of those rows,
        walking the same key ranges as the forward."""
        # -- 1. program id, as in the forward ------------------------------------------------------------
        pid = tl.program_id(0)
        g = pid % G
        tile = n_q_tiles - 1 - (pid // G) % n_q_tiles
        bh = pid // (G * n_q_tiles)
        b = bh // H_KV
        h_kv = bh % H_KV
        h_q = h_kv * G + g
        m0 = tile * BLOCK_M

        # -- 2. the q, dO tiles and their rows' LSE and Δ, held for the whole program ---------------------
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        q = _load_rows(Q + b.to(tl.int64) * stride_qb + h_q.to(tl.int64) * stride_qh
                       + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                       offs_m, seq_len, offs_d, HEAD_DIM, True)                     # (BLOCK_M, BLOCK_D)
        do = _load_rows(DO + b.to(tl.int64) * stride_dob + h_q.to(tl.int64) * stride_doh
                        + offs_m[:, None] * stride_dos + offs_d[None, :] * stride_dod,
                        offs_m, seq_len, offs_d, HEAD_DIM, True)                    # (BLOCK_M, BLOCK_D)
        row = b.to(tl.int64) * stride_lb + h_q * stride_lh + offs_m
        lse2 = tl.load(Lse + row, mask=offs_m < seq_len, other=float("inf"))        # (BLOCK_M,) log2 domain
        delta = tl.load(Delta + row, mask=offs_m < seq_len, other=0.0)              # (BLOCK_M,)
        scales = Scales + (b * H_KV + h_kv) * 4         # q and k are _backward_operands' scaled copies
        ds_scale, inv_ds, inv_q, inv_k = tl.load(scales), tl.load(scales + 1), tl.load(scales + 2), tl.load(scales + 3)
        qk_scale = qk_scale * inv_q * inv_k
        delta = delta * ds_scale
        K_tile = K + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh \
            + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd
        V_tile = V + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh \
            + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd

        # -- 3. what this mode walks, as in the forward --------------------------------------------------
        r = m0 // MASK_BLOCK
        block_list = BlockIdx + b * stride_ib + h_kv * stride_ih + r * stride_ir
        sink, window, first_tile, n_listed = _mode_walk(
            Modes, BlockCnt, BlockDiag, b, h_kv, r, tl.cdiv(seq_len, BLOCK_N), seq_len, sink, window,
            stride_mb, stride_mh, stride_cb, stride_ch, stride_db, stride_dh,
            BLOCK_M, BLOCK_N, MASK_BLOCK, HAS_BLOCK_SPARSE)

        # -- 4. fold every key range into dq ---------------------------------------------------------------
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for RANGE in tl.static_range(N_KEY_RANGES):
            dq = _attn_bwd_dq_inner(
                dq, q, do, lse2, delta, K_tile, V_tile, block_list, m0, seq_len, sink, window, first_tile,
                n_listed, qk_scale, ds_scale, stride_ks, stride_vs, RANGE=RANGE, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                HEAD_DIM=HEAD_DIM, TILES_PER_BLOCK=MASK_BLOCK // BLOCK_N, DOT_PRECISION=DOT_PRECISION)

        # -- 5. store --------------------------------------------------------------------------------------
        tl.store(DQ + b.to(tl.int64) * stride_dqb + h_q.to(tl.int64) * stride_dqh
                 + offs_m[:, None] * stride_dqs + offs_d[None, :] * stride_dqd,
                 (dq * (sm_scale * inv_ds * inv_k)).to(DQ.dtype.element_ty),
                 mask=(offs_m[:, None] < seq_len) & (offs_d[None, :] < HEAD_DIM))


def _pow2_scale(bound):
    """2^(13 - e) for bound = m·2^e (m in [0.5, 1)): brings bound into [2^12, 2^13), built from the
    exponent bits, so multiplying by it (or by its inverse, also returned) changes no mantissa bit."""
    _, e = torch.frexp(bound.float().clamp(2.0**-60, 2.0**60))
    return ((140 - e) << 23).view(torch.float32), ((114 + e) << 23).view(torch.float32)


def _backward_operands(q, k, v, do_norms, q_max):
    """The backward multiplies dS (fp32 in the kernel) into dq and dk in fp16 when the inputs are
    16-bit: bf16's 8 bits of dS can double dq's error against the exact gradient, past twice torch
    SDPA's bf16 error, and fp16's 11 bits do not. An fp16 product needs fp16 tiles, so q and k are
    copied once here; powers of two, per (sample, KV head), keep every value inside fp16's range
    without rounding: q and k scaled to a largest entry below 2^13 (bf16 converts to fp16 exactly down
    to 2^-30 of it), dS by a bound on its largest entry, |dS_ij| = p_ij·|dO_i·v_j - Δ_i|
    <= 2·max‖dO_i‖·max‖v_j‖. do_norms, q_max: ‖dO_i‖ and max_d |q_id| per row (_attn_bwd_rows).
    Returns (q', k', scales (B, Hkv, 4) = [s_dS, 1/s_dS, 1/s_q, 1/s_k]); fp16 q and k pass through
    (s_q = s_k = 1), float32 inputs with every scale 1."""
    B, Hkv = k.shape[0], k.shape[1]
    one = torch.ones(B, Hkv, device=q.device)
    if q.dtype == torch.float32:
        return q, k, torch.stack([one] * 4, -1)
    largest = lambda x: x.reshape(B, Hkv, -1).amax(-1)                            # per (sample, KV head)
    v_norms = torch.linalg.vector_norm(v, dim=-1, dtype=torch.float32)
    s_ds, inv_ds = _pow2_scale(2 * largest(do_norms) * largest(v_norms))           # (B, Hkv) each
    if q.dtype == torch.float16:
        return q, k, torch.stack([s_ds, inv_ds, one, one], -1)
    s_q, inv_q = _pow2_scale(largest(q_max))
    s_k, inv_k = _pow2_scale(torch.linalg.vector_norm(k.reshape(B, Hkv, -1), float("inf"), -1, dtype=torch.float32))
    return _scaled_copy(q, s_q), _scaled_copy(k, s_k), torch.stack([s_ds, inv_ds, inv_q, inv_k], -1)


def _scaled_copy(x, scale):
    """x (B, H, S, D) 16-bit times scale (B, Hkv), a power of two per KV head, as a contiguous fp16
    tensor; exact for the scales _pow2_scale makes."""
    B, H, S, D = x.shape
    out = torch.empty(x.shape, dtype=torch.float16, device=x.device)
    _scaled_fp16[(B * H, triton.cdiv(S, 64))](x, scale.contiguous(), out, S, H, H // scale.shape[1], *x.stride(),
                                              BLOCK=64, BLOCK_D=max(16, triton.next_power_of_2(D)), HEAD_DIM=D,
                                              num_warps=4)
    return out


def _hybrid_attention_bwd_launch(do, q, k, v, o, lse, modes32, sink, window, bs_args, block_size, has_bs,
                                 bwd_config):
    """(dq, dk, dv) in the inputs' dtypes from two launches (dk/dv, then dq); bwd_config as
    _bwd_tile_config returns it."""
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if S == 0:
        return dq, dk, dv
    kv_idx, kv_cnt, q_idx, q_cnt, diag = bs_args
    (M1, N1, warps1, stages1), (M2, N2, warps2, stages2) = bwd_config
    BLOCK_D = max(16, triton.next_power_of_2(D))
    delta, lse2, do_norms, q_max = torch.empty(4, B, Hq, S, device=q.device)       # (B, Hq, S) each
    _attn_bwd_rows[(B * Hq, triton.cdiv(S, 64))](
        o, do, q, lse.contiguous(), delta, lse2, do_norms, q_max, S, Hq, *o.stride(), *do.stride(), *q.stride(),
        BLOCK=64, BLOCK_D=BLOCK_D, HEAD_DIM=D, num_warps=4)
    sm_scale = 1.0 / math.sqrt(D)
    q, k, scales = _backward_operands(q, k, v, do_norms, q_max)
    common = dict(BLOCK_D=BLOCK_D, HEAD_DIM=D, HAS_BLOCK_SPARSE=has_bs, DOT_PRECISION=_dot_precision(q.dtype))
    n_k_tiles = triton.cdiv(S, N1)
    _hybrid_attention_bwd_dkdv[(B * Hkv * n_k_tiles,)](
        q, k, v, do, lse2, delta, scales, dk, dv, modes32, q_idx, q_cnt, diag,
        S, n_k_tiles, Hkv, Hq // Hkv, sink, window, sm_scale * 1.4426950408889634, sm_scale,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
        lse2.stride(0), lse2.stride(1), *modes32.stride(),
        q_idx.stride(0), q_idx.stride(1), q_idx.stride(2), q_cnt.stride(0), q_cnt.stride(1),
        diag.stride(0), diag.stride(1),
        BLOCK_M=M1, BLOCK_N=N1, MASK_BLOCK=block_size if has_bs else M1, **common,
        num_warps=warps1, num_stages=stages1)
    n_q_tiles = triton.cdiv(S, M2)
    _hybrid_attention_bwd_dq[(B * Hq * n_q_tiles,)](
        q, k, v, do, lse2, delta, scales, dq, modes32, kv_idx, kv_cnt, diag,
        S, n_q_tiles, Hkv, Hq // Hkv, sink, window, sm_scale * 1.4426950408889634, sm_scale,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
        lse2.stride(0), lse2.stride(1), *modes32.stride(),
        kv_idx.stride(0), kv_idx.stride(1), kv_idx.stride(2), kv_cnt.stride(0), kv_cnt.stride(1),
        diag.stride(0), diag.stride(1),
        BLOCK_M=M2, BLOCK_N=N2, MASK_BLOCK=block_size if has_bs else N2, **common,
        num_warps=warps2, num_stages=stages2)
    return dq, dk, dv

# -----------------------------------------------------------------------------
# 5. The fused kernel as one differentiable function.

class _FusedHybridAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, modes32, sink, window, block_mask, block_size, config, bwd_config):
        has_bs = block_mask is not None
        bs_args = _block_sparse_args(block_mask, q.device)
        o, lse = _hybrid_attention_fwd_launch(q, k, v, modes32, sink, window, bs_args, block_size, has_bs, config)
        ctx.save_for_backward(q, k, v, o, lse, modes32, *bs_args)
        ctx.sink, ctx.window, ctx.block_size, ctx.has_bs = sink, window, block_size, has_bs
        ctx.bwd_config = bwd_config
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):  # the LSE is an output for callers, not differentiated through
        check_int32_reach(do=do)
        q, k, v, o, lse, modes32, *bs_args = ctx.saved_tensors
        dq, dk, dv = _hybrid_attention_bwd_launch(do, q, k, v, o, lse, modes32, ctx.sink, ctx.window,
                                                  bs_args, ctx.block_size, ctx.has_bs, ctx.bwd_config)
        return dq, dk, dv, None, None, None, None, None, None, None


def fused_hybrid_attention(q, k, v, modes, sink, window, block_mask=None, block_size=64, *,
                           return_lse=False, config=None, bwd_config=None, check=True):
    """Fused causal hybrid attention, forward and backward: each (sample, KV head) in its own mode.
    q (B, Hq, S, D); k, v (B, Hkv, S, D); modes (B, Hkv) int; block_mask (B, Hkv, nB, nB) bool at
    block_size, needed when a head is BLOCK_SPARSE. Returns o (B, Hq, S, D) in q's dtype, and with
    return_lse=True also the log-sum-exp (B, Hq, S) float32 (-inf for a row with no visible key).
    Same numbers as hybrid_attention_reference; gradients as hybrid_attention_reference_grad.

    Forward grid: one program per (sample, query head, BLOCK_M query rows), B·Hq·ceil(S/BLOCK_M)
    programs ordered (sample, KV head) → query tile (last first) → the G query heads of the KV head
    (adjacent, so the K/V tiles they share are read from L2). Each walks its mode's key tiles:
        FULL          tiles before the diagonal unmasked, then the diagonal band masked (causal).
        STREAMING     sink tiles (unmasked; the partial one masked), then the window tiles from
                      the first one any row reaches (masked until every row reaches them,
                      unmasked after), then the diagonal band; tiles in between are skipped.
        BLOCK_SPARSE  the listed off-diagonal blocks (block_lists, gathered, unmasked), then, if
                      the diagonal block is on, its tiles up to the band like FULL.
    Backward: dk/dv programs per (sample, KV head, key tile) walk the transposed ranges (a sink
    tile: every later query tile; a window tile: the next `window` rows; a block: its own block and
    the listed query blocks below), dq programs per query tile the forward's.
    Cost model (masks.attention_flops): 4·D FLOPs per visible pair per query head forward, 2.5×
    that backward; the kernels compute whole tiles, so about BLOCK_M/2 extra keys per row on each
    masked edge (window start, partial sink tile, diagonal).

    config=(BLOCK_M, BLOCK_N, num_warps, num_stages) overrides the forward's _tile_config, and
    bwd_config=(dk/dv config, dq config), each such a tuple, the backward's _bwd_tile_config. Passing a
    block_mask compiles the list walk in and sizes the tiles for its block_size, whatever the modes:
    pass None when no head is BLOCK_SPARSE (this avoids a host sync to look at the modes).
    Non-contiguous q/k/v are fine (the kernels take strides); the outputs are contiguous.
    check=False: the caller has checked modes and block_mask (hybrid_attention).
    """
    B, Hq, Hkv, S, D = check_qkv(q, k, v)
    check_int32_reach(q=q, k=k, v=v)
    check_sparse_params(sink, window, block_size)
    reason = triton_unsupported(q.dtype, q.is_cuda, D, **_prefill_limits(block_mask, block_size))
    if reason is not None:
        raise ValueError(reason)
    has_bs = block_mask is not None
    smem = _shared_memory(q.device.index) if q.is_cuda and not interpreting() else None
    config = config or _tile_config(D, q.dtype, block_size, has_bs, interpreting(), smem)
    bwd_config = bwd_config or _bwd_tile_config(D, q.dtype, block_size, has_bs, interpreting())
    for name, cfg in (("config", config), ("bwd_config dk/dv", bwd_config[0]), ("bwd_config dq", bwd_config[1])):
        if has_bs and max(cfg[0], cfg[1]) > block_size:
            raise ValueError(f"{name} BLOCK_M={cfg[0]}, BLOCK_N={cfg[1]} must not exceed "
                             f"block_size={block_size} for BLOCK_SPARSE heads")
    if check:   # last before the launch: reading the modes is a host sync, and the GPU idles until the next launch
        check_modes(modes, B, Hkv, device=q.device, block_mask_given=has_bs)
        check_block_mask(block_mask, modes, S, block_size)
    sink, window = min(sink, S), min(window, S)   # beyond S they change nothing; keeps int32 math safe
    o, lse = _FusedHybridAttention.apply(q, k, v, modes.to(torch.int32), sink, window, block_mask,
                                         block_size, tuple(config), tuple(map(tuple, bwd_config)))
    return (o, lse) if return_lse else o

# -----------------------------------------------------------------------------
# 6. The torch backend: SDPA over the heads that share a mode.

def uniform_attention_sdpa(q, k, v, mode, sink, window, block_mask=None, block_size=64):
    """Every head in one mode: torch's scaled_dot_product_attention. FULL uses is_causal (so the
    flash kernel applies), STREAMING one (S, S) mask shared by all heads, BLOCK_SPARSE one mask per
    KV head, (B, Hkv, S, S) bool, used by its G query heads in G calls (a (B, Hq, S, S) mask would
    copy it G times). Every row must see at least itself (hybrid_attention checks it for
    BLOCK_SPARSE), since SDPA returns NaN for a row that sees nothing."""
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if mode == FULL:
        return sdpa(q, k, v, is_causal=True, enable_gqa=Hq != Hkv)
    idx = torch.arange(S, device=q.device)
    if mode == STREAMING:
        mask = streaming(sink, window)(None, None, idx.view(S, 1), idx.view(1, S))  # (S, S)
        return sdpa(q, k, v, attn_mask=mask, enable_gqa=Hq != Hkv)
    # Blocks blown up to tokens: bools only (hybrid_mask's gather predicate would build int64 index
    # tensors of this size, 8 GB for 16 samples × 4 KV heads at 4K tokens).
    tok = block_mask.repeat_interleave(block_size, -2)[..., :S, :].repeat_interleave(block_size, -1)
    mask = tok[..., :S] & (idx.view(S, 1) >= idx.view(1, S))                     # (B, Hkv, S, S)
    qg = q.view(B, Hkv, Hq // Hkv, S, D)                                         # query heads by KV head
    out = torch.stack([sdpa(qg[:, :, g], k, v, attn_mask=mask) for g in range(Hq // Hkv)], dim=2)
    return out.view(B, Hq, S, D)


def grouped_attention_sdpa(q, k, v, modes, sink, window, block_mask=None, block_size=64):
    """Mixed modes through SDPA: the KV heads that share a mode, with their query heads, in one
    uniform_attention_sdpa call, per sample (the whole batch in one call when every head shares one
    mode, as in training's two branches). BLOCK_SPARSE heads with a diagonal block off take the
    reference: a row that sees nothing is 0 there, NaN in SDPA. A routed SmolLM2 prefill of 4K
    tokens on a CPU takes a quarter of the reference's time. Syncs with the host on the modes,
    which only the torch backend does."""
    B, Hq, S, D = q.shape
    G = Hq // k.shape[1]
    mode = int(modes.flatten()[0])
    if bool((modes == mode).all()):
        if mode == BLOCK_SPARSE and not bool(block_mask.diagonal(dim1=-2, dim2=-1).all()):
            return hybrid_attention_reference(q, k, v, modes, sink, window, block_mask, block_size, check=False)
        return uniform_attention_sdpa(q, k, v, mode, sink, window, block_mask, block_size)
    out = torch.empty_like(q)
    for i in range(B):
        for mode in modes[i].unique().tolist():
            kv = (modes[i] == mode).nonzero().flatten()                          # the sample's KV heads in it
            qh = (kv[:, None] * G + torch.arange(G, device=q.device)).flatten()  # and their query heads
            bm = None if block_mask is None else block_mask[i:i + 1, kv]
            out[i, qh] = grouped_attention_sdpa(q[i:i + 1, qh], k[i:i + 1, kv], v[i:i + 1, kv], modes[i:i + 1, kv],
                                                sink, window, bm, block_size)[0]
    return out

# -----------------------------------------------------------------------------
# 7. The one entry point the model calls.

def hybrid_attention(q, k, v, modes, sink, window, block_mask=None, block_size=64, backend="auto", check=True):
    """Causal attention where each (sample, KV head) runs its own mode. q (B, Hq, S, D),
    k/v (B, Hkv, S, D), modes int (B, Hkv). Returns (B, Hq, S, D) in q's dtype. backend as in
    section 1: "reference" is hybrid_attention_reference, "triton" fused_hybrid_attention, "torch"
    grouped_attention_sdpa (one SDPA call per mode and sample). Every backend is differentiable;
    the choice never depends on grad mode.
    check=False: the caller has checked the arguments (the model's layers: its forward did)."""
    if check:
        B, Hq, Hkv, S, D = check_qkv(q, k, v)
        check_sparse_params(sink, window, block_size)
        check_modes(modes, B, Hkv, device=q.device, block_mask_given=block_mask is not None)
        check_block_mask(block_mask, modes, S, block_size)
    backend = prefill_backend(backend, q, block_mask, block_size)
    if backend == "triton":
        return fused_hybrid_attention(q, k, v, modes, sink, window, block_mask, block_size, check=False)
    if backend == "torch" and modes.numel():
        return grouped_attention_sdpa(q, k, v, modes, sink, window, block_mask, block_size)
    return hybrid_attention_reference(q, k, v, modes, sink, window, block_mask, block_size, check=False)
