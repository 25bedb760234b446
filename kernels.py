"""kernels.py — hybrid attention: every (sample, KV head) in its own mode (FULL, STREAMING or
BLOCK_SPARSE, see masks.py), as one fused Triton kernel beside its naive twin (METHOD.md §3, §7).

Shape letters as in masks.py, plus BLOCK_M / BLOCK_N kernel tile sizes.
"""
import math
import os  # TRITON_INTERPRET=1 switches the kernels to Triton's CPU interpreter

import torch

from masks import (BLOCK_SPARSE, FULL, STREAMING, check_block_mask, check_modes, check_qkv,
                   check_sparse_params, hybrid_mask, kept_pairs, naive_attention, streaming)

try:
    import triton
    import triton.language as tl
    _HAS_TRITON = True
except ImportError:  # the reference path needs only torch
    _HAS_TRITON = False

# -----------------------------------------------------------------------------
# The one entry point the model calls.

def hybrid_attention(q, k, v, modes, sink, window, block_mask=None, block_size=64, backend="auto"):
    """Causal attention where each (sample, KV head) runs its own mode. q (B, Hq, S, D),
    k/v (B, Hkv, S, D), modes int (B, Hkv). Returns (B, Hq, S, D) in q's dtype.

    backend: "reference" (naive_attention on hybrid_mask, differentiable), "triton" (the fused
    kernel below; forward only), "sdpa" (torch's fused attention, differentiable; only when every
    head has the same mode — the training mix computes O_full and O_sparse exactly this way — and,
    for BLOCK_SPARSE, every diagonal block is on), "auto" = triton on CUDA when no gradient
    is needed, else sdpa where it applies, else reference.
    """
    B, Hq, Hkv, S, D = check_qkv(q, k, v)
    check_sparse_params(sink, window, block_size)
    check_modes(modes, B, Hkv, device=q.device)
    check_block_mask(block_mask, modes, S, block_size)
    if backend not in ("auto", "reference", "triton", "sdpa"):
        raise ValueError(f"backend must be 'auto', 'reference', 'triton' or 'sdpa', got {backend!r}")
    def uniform():  # one mode for every head (host syncs, so asked only when needed)
        if not modes.numel() or not bool((modes == modes.flatten()[0]).all()):
            return False
        # BLOCK_SPARSE rows see themselves iff every diagonal block is on (XAttention always keeps it)
        return int(modes.flatten()[0]) != BLOCK_SPARSE or bool(block_mask.diagonal(dim1=-2, dim2=-1).all())
    if backend == "auto":
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        if q.is_cuda and not needs_grad and _HAS_TRITON:
            backend = "triton"
        else:
            backend = "sdpa" if q.dtype != torch.float64 and uniform() else "reference"
    if backend == "triton":
        return fused_hybrid_attention(q, k, v, modes, sink, window, block_mask, block_size)
    if backend == "sdpa":
        if not uniform():
            raise ValueError(f"backend 'sdpa' needs one mode for all heads (BLOCK_SPARSE: with every diagonal "
                             f"block on), got modes {modes.unique().tolist()}")
        return uniform_attention_sdpa(q, k, v, int(modes.flatten()[0]), sink, window, block_mask, block_size)
    mask = hybrid_mask(S, modes, sink, window, block_mask, block_size)  # (B, Hkv, S, S), per KV head
    return naive_attention(q, k, v, mask)


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


# -----------------------------------------------------------------------------
# Triton: fused hybrid attention.


def hybrid_attention_reference(q, k, v, modes, sink, window, block_mask=None, block_size=64):
    """The naive twin of fused_hybrid_attention (same signature): naive_attention on the dense
    hybrid_mask. Costs B·Hkv·S² bytes of mask plus B·Hq·S² floats of scores, written and read
    three times; the kernel below computes the same numbers from O(S) tile bounds instead."""
    mask = hybrid_mask(q.shape[2], modes, sink, window, block_mask, block_size)  # (B, Hkv, S, S)
    return naive_attention(q, k, v, mask)


def attention_flops(seq_len, modes, sink, window, block_mask=None, block_size=64, head_dim=128, group=1):
    """Cost model of the forward pass: 4·D FLOPs per visible (query, key) pair per query head
    (QKᵀ and PV, each one multiply-add = 2 FLOPs per element of D). Summed over (B, Hkv) heads
    times group = G query heads each. Per head mode, with P = visible pairs:
        FULL          P = S(S+1)/2
        STREAMING     P = Σ_i min(i+1, window) + clamp(i+1-window, 0, sink)   (≈ S·(window+sink))
        BLOCK_SPARSE  P = Σ over switched-on causal blocks (block_size² off the diagonal, a triangle on it)
    Masked-out pairs inside a computed tile are not counted: this is the *useful* work, the number
    the benchmark's TFLOP/s and ideal speedups are based on (the same convention as FlashAttention's
    causal TFLOP/s)."""
    kept = kept_pairs(seq_len, modes, sink, window, block_mask, block_size)  # (B, Hkv) float64
    return float(4 * head_dim * group * kept.sum())


def block_lists(block_mask):
    """Compact per-row key-block lists from a bool block mask (B, Hkv, nB, nB):
    kv_block_idx (B, Hkv, nB, max_blocks) int32 and kv_block_cnt (B, Hkv, nB) int32, so that query
    block r walks kv_block_idx[b, h, r, :kv_block_cnt[b, h, r]]. Only causal blocks (c <= r) are
    kept, in ascending order: the diagonal block, when on, is the last entry. Entries past the count
    are padding and never read. max_blocks = nB, so that no host sync is needed to size the lists
    (4 bytes per block-mask entry; the mask itself is never S×S)."""
    nB = block_mask.shape[-1]
    below_diag = torch.ones(nB, nB, dtype=torch.bool, device=block_mask.device).tril()  # (nB, nB)
    on = block_mask & below_diag                                   # (B, Hkv, nB, nB)
    kv_block_cnt = on.sum(-1, dtype=torch.int32)                   # (B, Hkv, nB)
    # Switched-on block c of a row goes to slot (number of switched-on blocks before it); the
    # others are scattered into a spare column nB that is cut off afterwards.
    slot = torch.where(on, on.cumsum(-1) - 1, nB)                   # (B, Hkv, nB, nB)
    col = torch.arange(nB, dtype=torch.int32, device=block_mask.device).expand_as(slot)
    kv_block_idx = torch.zeros(*on.shape[:-1], nB + 1, dtype=torch.int32, device=block_mask.device)
    kv_block_idx.scatter_(-1, slot, col)
    return kv_block_idx[..., :nB].contiguous(), kv_block_cnt      # (B, Hkv, nB, nB), (B, Hkv, nB)


if _HAS_TRITON:
    # Module-level ints used inside @triton.jit code must be tl.constexpr.
    _STREAMING = tl.constexpr(STREAMING)
    _BLOCK_SPARSE = tl.constexpr(BLOCK_SPARSE)
    _LN2 = tl.constexpr(0.6931471805599453)  # ln 2: converts the log2-domain LSE back to natural log

    @triton.jit
    def _load_tile(ptrs, rows, seq_len, offs_d,
                   HEAD_DIM: tl.constexpr, CHECK_ROWS: tl.constexpr, PAD_D: tl.constexpr):
        """Load a (rows, BLOCK_D) tile; masks only what can be out of bounds, so interior tiles
        of a power-of-two head dim are plain unmasked loads."""
        if CHECK_ROWS and PAD_D:
            return tl.load(ptrs, mask=(rows[:, None] < seq_len) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        elif CHECK_ROWS:
            return tl.load(ptrs, mask=rows[:, None] < seq_len, other=0.0)
        elif PAD_D:
            return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            return tl.load(ptrs)

    @triton.jit
    def _attn_tiles(acc, l_i, m_i, q, k_tile, v_tile, block_list, lo, hi, offs_m,
                    seq_len, sink, window, qk_scale, stride_ks, stride_vs,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                    MASKED: tl.constexpr, GATHER: tl.constexpr, TILES_PER_BLOCK: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
        """The inner loop: fold key tiles lo … hi-1 into the online softmax state (acc, l_i, m_i).
        k_tile / v_tile point at keys 0 … BLOCK_N-1 of this KV head; tile t adds n0·stride.

        GATHER=False: tile t holds keys t·BLOCK_N … (t+1)·BLOCK_N - 1.
        GATHER=True:  tile t is sub-tile t % TILES_PER_BLOCK of mask block block_list[t // TILES_PER_BLOCK].
        MASKED=False: the caller guarantees every (query, key) pair of every tile is visible and in
                      bounds: no index math, no -inf, no load masks. This is where the FLOPs are.
        MASKED=True:  the token-exact hybrid predicate  j <= i and (j < sink or i - j < window)
                      (FULL and BLOCK_SPARSE heads pass sink = 0 and a window longer than S).
        """
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
        for t in range(lo, hi):
            # -- which keys this tile holds ----------------------------------------------------------
            if GATHER:
                n0 = tl.load(block_list + t // TILES_PER_BLOCK) * (TILES_PER_BLOCK * BLOCK_N) \
                    + (t % TILES_PER_BLOCK) * BLOCK_N
            else:
                n0 = t * BLOCK_N
            offs_kv = n0 + offs_n                                                   # (BLOCK_N,)

            # -- scores qk = q kᵀ in fp32 ------------------------------------------------------------
            k = _load_tile(k_tile + n0 * stride_ks, offs_kv, seq_len, offs_d,
                           HEAD_DIM, MASKED, PAD_D)                                 # (BLOCK_N, BLOCK_D)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)              # (BLOCK_M, BLOCK_N)

            # -- online softmax in the log2 domain (qk_scale already holds 1/ln 2) -------------------
            if MASKED:
                i = offs_m[:, None]
                j = offs_kv[None, :]
                # Keys past S only meet padding rows i >= S (causality), whose output is never stored,
                # and were loaded as zeros: no separate j < S test is needed.
                visible = (j <= i) & ((j < sink) | (i - j < window))                # (BLOCK_M, BLOCK_N)
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
            p = tl.math.exp2(qk)                                                    # (BLOCK_M, BLOCK_N)
            alpha = tl.math.exp2(m_i - m_sub)            # rescales what was summed under the old max
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]

            # -- acc += p v ----------------------------------------------------------------------------
            v = _load_tile(v_tile + n0 * stride_vs, offs_kv, seq_len, offs_d,
                           HEAD_DIM, MASKED, PAD_D)                                 # (BLOCK_N, BLOCK_D)
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)      # (BLOCK_M, BLOCK_D)
            m_i = m_ij
        return acc, l_i, m_i

    # Sizes that change from call to call are not specialised (Triton would otherwise compile one
    # variant per "divisible by 16" / "equal to 1" pattern of seq_len, sink, window, ...).
    @triton.jit(do_not_specialize=["seq_len", "n_q_tiles", "H_KV", "G", "sink", "window"])
    def _hybrid_attention_fwd(
        Q, K, V, Out, Lse, Modes, HeadOrder, BlockIdx, BlockCnt,          # pointers
        seq_len, n_q_tiles, H_KV, G, sink, window, qk_scale,               # sizes and scalars
        stride_qb, stride_qh, stride_qs, stride_qd,                        # strides
        stride_kb, stride_kh, stride_ks, stride_kd,
        stride_vb, stride_vh, stride_vs, stride_vd,
        stride_ob, stride_oh, stride_os, stride_od,
        stride_lb, stride_lh, stride_mb, stride_mh,
        stride_ib, stride_ih, stride_ir, stride_cb, stride_ch,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
        MASK_BLOCK: tl.constexpr, HAS_BLOCK_SPARSE: tl.constexpr, RETURN_LSE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """One program = one BLOCK_M-row query tile of one (sample, query head). The grid, the tile
        walk per mode and the cost model are in fused_hybrid_attention's docstring."""
        # -- 1. program id -> (query tile, sample, KV head, query head) --------------------------------
        # Launch order, fastest-varying first: the G query heads of one KV head (they read the same
        # K/V tiles, which then come from L2), then the query tiles from the last (the most work
        # under causality) to the first, then the (sample, KV head) slots in HeadOrder's order.
        pid = tl.program_id(0)
        g = pid % G
        tile = n_q_tiles - 1 - (pid // G) % n_q_tiles
        bh = tl.load(HeadOrder + pid // (G * n_q_tiles))   # b·H_KV + h_kv
        b = bh // H_KV
        h_kv = bh % H_KV
        h_q = h_kv * G + g
        m0 = tile * BLOCK_M                                   # first query row of this tile
        mode = tl.load(Modes + b * stride_mb + h_kv * stride_mh)

        # -- 2. offsets and pointers (int64 bases: B·H·S·D can pass 2³¹) -------------------------------
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
        q_base = Q + b.to(tl.int64) * stride_qb + h_q.to(tl.int64) * stride_qh
        k_tile = K + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh \
            + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd      # keys 0 … BLOCK_N-1
        v_tile = V + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh \
            + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd
        q = _load_tile(q_base + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                       offs_m, seq_len, offs_d, HEAD_DIM, True, PAD_D)       # (BLOCK_M, BLOCK_D)

        # -- 3. the key tiles this mode needs, as tile-index ranges (keys t·BLOCK_N …) ---------------
        # FULL is STREAMING with no sink and a window longer than any row can look back.
        is_stream = mode == _STREAMING
        eff_sink = tl.where(is_stream, sink, 0)
        eff_window = tl.where(is_stream, window, seq_len + BLOCK_M)
        diag_lo = m0 // BLOCK_N                                        # first tile of the diagonal band
        band_hi = tl.cdiv(tl.minimum(m0 + BLOCK_M, seq_len), BLOCK_N)  # one past its last tile
        # Window: tiles from win_start are reached by some row of the tile; from win_full on by every
        # row (the last row, m0+BLOCK_M-1, still reaches back to them) and they end before row m0.
        win_start = tl.maximum(m0 - eff_window + 1, 0) // BLOCK_N
        win_full = tl.minimum(tl.cdiv(tl.maximum(m0 + BLOCK_M - eff_window, 0), BLOCK_N), diag_lo)
        # Sink: the whole sink tiles, then the partial one; both stop where the window tiles begin.
        sink_end = tl.minimum(tl.cdiv(eff_sink, BLOCK_N), win_start)
        sink_full = tl.minimum(eff_sink // BLOCK_N, sink_end)
        # BLOCK_SPARSE: the listed off-diagonal blocks (gathered, unmasked); the diagonal block, when
        # listed, is walked like FULL from its first key tile (window ranges start there).
        n_off = 0
        block_list = BlockIdx
        if HAS_BLOCK_SPARSE:
            is_bs = mode == _BLOCK_SPARSE
            r = m0 // MASK_BLOCK                                       # this tile's block-mask row
            block_list = BlockIdx + b * stride_ib + h_kv * stride_ih + r * stride_ir
            cnt = tl.where(is_bs, tl.load(BlockCnt + b * stride_cb + h_kv * stride_ch + r), 0)
            last = tl.load(block_list + cnt - 1, mask=cnt > 0, other=-1)
            has_diag = last == r                           # lists are ascending: the diagonal is last
            n_off = cnt - has_diag.to(tl.int32)
            diag_start = tl.where(has_diag, (r * MASK_BLOCK) // BLOCK_N, diag_lo)
            win_start = tl.where(is_bs, diag_start, win_start)
            win_full = tl.where(is_bs, diag_start, win_full)
            band_hi = tl.where(is_bs & (cnt == n_off), diag_lo, band_hi)  # diagonal off: no band

        # -- 4. the tile loops: unmasked where every pair is visible, masked only on the edges ---------
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")   # running max (log2 units)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                  # running Σ exp2(s - m_i)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)         # running Σ p v
        TPB: tl.constexpr = MASK_BLOCK // BLOCK_N                     # key tiles per mask block
        # Each call: (..., lo, hi, ..., MASKED, GATHER, ...). Order does not change the result.
        acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q, k_tile, v_tile, block_list, 0, n_off * TPB, offs_m,
                                    seq_len, eff_sink, eff_window, qk_scale, stride_ks, stride_vs,
                                    BLOCK_N, BLOCK_D, HEAD_DIM, False, True, TPB, DOT_PRECISION)   # listed blocks
        acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q, k_tile, v_tile, block_list, 0, sink_full, offs_m,
                                    seq_len, eff_sink, eff_window, qk_scale, stride_ks, stride_vs,
                                    BLOCK_N, BLOCK_D, HEAD_DIM, False, False, TPB, DOT_PRECISION)  # whole sink
        acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q, k_tile, v_tile, block_list, sink_full, sink_end, offs_m,
                                    seq_len, eff_sink, eff_window, qk_scale, stride_ks, stride_vs,
                                    BLOCK_N, BLOCK_D, HEAD_DIM, True, False, TPB, DOT_PRECISION)   # sink edge
        acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q, k_tile, v_tile, block_list, win_start, win_full, offs_m,
                                    seq_len, eff_sink, eff_window, qk_scale, stride_ks, stride_vs,
                                    BLOCK_N, BLOCK_D, HEAD_DIM, True, False, TPB, DOT_PRECISION)   # window edge
        acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q, k_tile, v_tile, block_list, win_full, diag_lo, offs_m,
                                    seq_len, eff_sink, eff_window, qk_scale, stride_ks, stride_vs,
                                    BLOCK_N, BLOCK_D, HEAD_DIM, False, False, TPB, DOT_PRECISION)  # window body
        acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q, k_tile, v_tile, block_list, diag_lo, band_hi, offs_m,
                                    seq_len, eff_sink, eff_window, qk_scale, stride_ks, stride_vs,
                                    BLOCK_N, BLOCK_D, HEAD_DIM, True, False, TPB, DOT_PRECISION)   # diagonal band

        # -- 5. normalise and store; a row that saw no key (an empty block row) is 0, not NaN ----------
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        o_ptrs = Out + b.to(tl.int64) * stride_ob + h_q.to(tl.int64) * stride_oh \
            + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od
        tl.store(o_ptrs, out.to(Out.dtype.element_ty),
                 mask=(offs_m[:, None] < seq_len) & (offs_d[None, :] < HEAD_DIM))
        if RETURN_LSE:
            # log Σ_j exp(s_ij) = ln 2 · (m_i + log2 l_i): m_i and l_i live in the log2 domain.
            lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * _LN2)
            tl.store(Lse + b.to(tl.int64) * stride_lb + h_q * stride_lh + offs_m, lse, mask=offs_m < seq_len)


def _tile_config(D, dtype, block_size, has_block_sparse, interpret):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Fixed choices, no autotuning (NOTES_kernels.md
    has the measurements behind them):
      - H200, D <= 128, 16-bit: 128×64 tiles, 8 warps (two warpgroups of 64 query rows each for
        Hopper's wgmma), 4 stages of K/V prefetch (~160 KB of shared memory at D = 128). On the
        H200 at S = 32K this measured 472 TF/s all-FULL; 3 stages 462-476, 128×128 tiles (2 stages)
        442, 64×64 (4 warps) 444: the differences between 64-wide configs are within run-to-run noise.
      - D > 128 or fp32: the accumulator (BLOCK_M × D fp32) and K/V tiles double, so halve the tiles.
      - Interpreter: small tiles so short test sequences still cross several tiles and every
        edge case (partial sink/window/diagonal tiles) is exercised.
    BLOCK_SPARSE heads need every query tile inside one block-mask row and every key tile inside
    one block-mask column: BLOCK_N <= BLOCK_M <= block_size (all powers of two)."""
    if interpret:
        bm, bn, warps, stages = 32, 16, 4, 1
    elif D <= 128 and dtype != torch.float32:
        bm, bn, warps, stages = 128, 64, 8, 4
    else:
        bm, bn, warps, stages = 64, 32, 4, 2
    if has_block_sparse:
        bm = min(bm, block_size)
        bn = min(bn, bm)
    return bm, bn, warps, stages


def fused_hybrid_attention(q, k, v, modes, sink, window, block_mask=None, block_size=64, *,
                           return_lse=False, heavy_first=False, config=None):
    """Fused causal hybrid attention: one Triton launch, each (sample, KV head) in its own mode.
    q (B, Hq, S, D); k, v (B, Hkv, S, D); modes (B, Hkv) int; block_mask (B, Hkv, nB, nB) bool at
    block_size, needed when a head is BLOCK_SPARSE. Returns o (B, Hq, S, D) in q's dtype, and with
    return_lse=True also the log-sum-exp (B, Hq, S) float32 (-inf for a row with no visible key).
    Same numbers as hybrid_attention_reference; forward only.

    Grid: one program per (sample, query head, BLOCK_M query rows): B·Hq·ceil(S/BLOCK_M) programs
    in a 1-d launch ordered (sample, KV head) → query tile (last first) → the G query heads of the
    KV head (adjacent, so the K/V tiles they share are read from L2). heavy_first=True puts FULL
    heads first; on the H200 it made no difference beyond noise (7.12 vs 7.00 ms, S = 32K,
    f = 0.75), so the default is plain index order.
    Tile walk of the program that owns rows m0 … m0+BLOCK_M-1 (key tiles of BLOCK_N):
        FULL          tiles 0 … m0-1 unmasked, then the diagonal band masked (causal).
        STREAMING     sink tiles (unmasked; the partial one masked), then the window tiles from
                      the first one any row reaches (masked until every row reaches them,
                      unmasked after), then the diagonal band; tiles in between are skipped.
        BLOCK_SPARSE  the listed off-diagonal blocks (from block_lists, gathered, unmasked),
                      then, if the diagonal block is on, its tiles up to the band like FULL.
    Cost model (attention_flops): 4·D FLOPs per visible pair per query head. FULL ~ 2·D·S² per
    head; STREAMING ~ 4·D·S·(window + sink), linear in S; BLOCK_SPARSE ~ 4·D·(kept blocks)·block².
    The kernel computes whole tiles, so it spends a little more: about BLOCK_M/2 extra keys per row
    on each masked edge (window start, partial sink tile, diagonal).

    Keyword extras: return_lse; heavy_first (above); config=(BLOCK_M, BLOCK_N, num_warps,
    num_stages) overrides _tile_config. Passing a block_mask compiles the list walk in and sizes
    the tiles for its block_size (BLOCK_M <= block_size), whatever the modes: pass None when no
    head is BLOCK_SPARSE (this avoids a host sync to look at the modes).
    Non-contiguous q/k/v are fine (the kernel takes strides); the output is contiguous.
    """
    if not _HAS_TRITON:
        raise RuntimeError("fused_hybrid_attention needs triton; use backend='reference'")
    B, Hq, Hkv, S, D = check_qkv(q, k, v)
    check_sparse_params(sink, window, block_size)
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"fused_hybrid_attention supports float16, bfloat16 and float32, got {q.dtype}")
    if not 16 <= D <= 256:
        raise ValueError(f"head dim D={D} out of range: the Triton kernel supports 16 <= D <= 256")
    check_modes(modes, B, Hkv, device=q.device)
    check_block_mask(block_mask, modes, S, block_size)
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if not q.is_cuda and not interpret:
        raise ValueError(f"q is on {q.device}: the Triton kernel needs CUDA tensors "
                         "(or TRITON_INTERPRET=1 set before importing triton, to run it on the CPU)")
    if interpret and q.dtype == torch.bfloat16:
        raise ValueError("the Triton CPU interpreter does not support bfloat16; use float16/float32")
    has_bs = block_mask is not None  # compile the list walk in; no host sync to look at the modes
    if has_bs and block_size < 16:
        raise ValueError(f"block_size={block_size}: a block_mask needs block_size >= 16 in the "
                         "Triton kernel (tiles follow the mask's blocks; tl.dot needs 16 rows)")

    o = torch.empty(B, Hq, S, D, dtype=q.dtype, device=q.device)     # (B, Hq, S, D) contiguous
    lse = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device) if return_lse else o
    if S == 0:
        return (o, lse) if return_lse else o
    BLOCK_M, BLOCK_N, num_warps, num_stages = config or _tile_config(D, q.dtype, block_size, has_bs, interpret)
    if has_bs and not (BLOCK_N <= BLOCK_M <= block_size):
        raise ValueError(f"config BLOCK_M={BLOCK_M}, BLOCK_N={BLOCK_N} must satisfy "
                         f"BLOCK_N <= BLOCK_M <= block_size={block_size} for BLOCK_SPARSE heads")
    BLOCK_D = max(16, triton.next_power_of_2(D))  # a non-power-of-two D is padded and masked

    modes32 = modes.to(torch.int32)                                   # (B, Hkv)
    if heavy_first:  # FULL (the longest programs) first, so no long program starts last
        head_order = torch.argsort((modes32 != FULL).flatten().to(torch.int32), stable=True)
    else:
        head_order = torch.arange(B * Hkv, device=q.device)
    head_order = head_order.to(torch.int32)                           # (B·Hkv,) of b·Hkv + h
    if has_bs:
        kv_block_idx, kv_block_cnt = block_lists(block_mask)          # (B, Hkv, nB, max), (B, Hkv, nB)
    else:
        kv_block_idx = torch.zeros(1, 1, 1, 1, dtype=torch.int32, device=q.device)  # never read
        kv_block_cnt = kv_block_idx[..., 0]
    n_q_tiles = triton.cdiv(S, BLOCK_M)
    sink, window = min(sink, S), min(window, S)    # beyond S they change nothing; keeps int32 math safe
    qk_scale = 1.4426950408889634 / math.sqrt(D)   # softmax scale 1/√D times 1/ln 2: we use exp2

    grid = (B * Hq * n_q_tiles,)
    _hybrid_attention_fwd[grid](
        q, k, v, o, lse, modes32, head_order, kv_block_idx, kv_block_cnt,
        S, n_q_tiles, Hkv, Hq // Hkv, sink, window, qk_scale,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        lse.stride(0), lse.stride(1), *modes32.stride(),
        kv_block_idx.stride(0), kv_block_idx.stride(1), kv_block_idx.stride(2),
        kv_block_cnt.stride(0), kv_block_cnt.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, HEAD_DIM=D,
        MASK_BLOCK=block_size if has_bs else BLOCK_N, HAS_BLOCK_SPARSE=has_bs, RETURN_LSE=return_lse,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # true fp32 products for fp32
        num_warps=num_warps, num_stages=num_stages,
    )
    return (o, lse) if return_lse else o
