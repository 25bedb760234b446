"""xattention.py — XAttention block selection (Xu et al. 2025): which key blocks a BLOCK_SPARSE
head attends to, decided per input from the queries and keys themselves (METHOD.md §3, XA).

Two steps, so a benchmark can time them apart:
  1. scoring  cheap estimate of the softmax mass in every (query block, key block) tile:
              xattention_scores_reference (dense twin) and xattention_scores (Triton: no S×S matrix,
              the antidiagonal products once, a float32 scratch of S/T × S/block per query head)
  2. picking  per query-block row keep the sink and the diagonal block, then the best other blocks
              until the kept mass reaches `threshold` of the row: xattention_select (torch)
xattention_block_mask runs both; its output is the `block_mask` of masks.hybrid_mask and
kernels.hybrid_attention.

Shape letters as in masks.py, plus T the stride (tokens per antidiagonal group), g = block_size // T
groups per block, nG = nB·g groups in the sequence padded to whole blocks.
"""
import math

import torch

from .kernels import HAS_TRITON, check_backend, check_int32_reach, resolve_backend, tl, triton
from .masks import check_lengths, num_blocks

# Padding. When S is not a multiple of the block size, q and k are zero-padded to nB·block_size
# tokens (the kernel masks its loads instead, which is the same). A zero token adds exactly 0 to any
# antidiagonal sum, so a partly padded group is scored on its real tokens; causality (key group
# j <= query group i) keeps all-padding key groups out of every real query group's softmax; and
# all-padding query groups are dropped before the block sums, so padding contributes nothing.
# Right padding of a batch (lengths[b] < S) is treated the same way, per sample: every token at or
# after lengths[b] counts as a zero token, so a sample's rows are those of its real tokens alone.
# Short S. With nB <= 2 every causal block is the sink or a diagonal block, so the mask is every
# causal block, i.e. FULL; in particular S shorter than one stride (nB = 1) is FULL, not an error.
#
# GQA. The G query heads of a KV head share its K/V, hence one block mask, so their G block-score
# matrices are combined into one by an elementwise max, not a mean. A mean divides a block that only
# one query head needs by G and can drop it (one retrieval-like head among diffuse ones); under max
# that block scores as high as for the head that needs it. The price: max-combined rows are flatter,
# so a few more blocks are kept. Max is not a strict per-head promise (a head with thinly spread mass
# can end up with less than `threshold` of its own mass); the strict version, picking per query head
# and OR-ing the G masks, sorts G times as many rows.


def check_xattention_args(q, k, block_size, stride):
    """q (B, Hq, S, D), k (B, Hkv, S, D) of one float dtype and device; stride divides block_size."""
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.numel() == 0:
            raise ValueError(f"{name} must be a non-empty 4-d tensor (B, H, S, D), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64) or k.dtype != q.dtype:
        raise ValueError(f"q and k must share a float dtype (16/bf16/32/64), got {q.dtype}, {k.dtype}")
    if q.device != k.device:
        raise ValueError(f"q is on {q.device} but k is on {k.device}")
    B, Hq, S, D = q.shape
    if k.shape[0] != B or k.shape[2] != S or k.shape[3] != D:
        raise ValueError(f"k {tuple(k.shape)} must be (B, Hkv, S, D) with B={B}, S={S}, D={D} "
                         f"from q {tuple(q.shape)}")
    Hkv = k.shape[1]
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"query heads {Hq} not a multiple of KV heads {Hkv}")
    if not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size!r}")
    if not isinstance(stride, int) or stride < 1 or block_size % stride:
        raise ValueError(f"stride must be a positive int dividing block_size {block_size}, got {stride!r}")
    return B, Hq, Hkv, S, D


def check_threshold(threshold):
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be a number in (0, 1], got {threshold!r}")


def xattention_scores_reference(q, k, block_size, stride=16, lengths=None, check=True):
    """XAttention block scores, the obvious dense way. q (B, Hq, S, D), k (B, Hkv, S, D) →
    (B, Hkv, nB, nB) float32 (float64 if given float64): entry [b, h, m, n] is the estimated softmax
    mass that the query groups of block m put on key block n, max over the G query heads of KV head h.
    Zero above the diagonal; each row sums to at least its number of real query groups.

    lengths (B,) (optional, masks.check_lengths): tokens from lengths[b] on are right padding and
    count exactly as the zero tokens that pad S to whole blocks, so sample b gets the scores of its
    real tokens alone (zero in the rows and columns of all-padding blocks).

    Builds the whole (B, Hq, S, S) score matrix (S²·D multiply-adds and S² floats per query head) and
    keeps 1/T of it, the antidiagonals; the Triton kernel computes only those, S²·D/T work.
    """
    B, Hq, Hkv, S, D = check_xattention_args(q, k, block_size, stride)
    if check:
        check_lengths(lengths, B, S)
    G, T = Hq // Hkv, stride
    nB = num_blocks(S, block_size)
    g, nG = block_size // T, nB * block_size // T
    cdtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    n = torch.full((B,), S, device=q.device) if lengths is None else lengths.to(q.device)
    real = (torch.arange(S, device=q.device).view(1, 1, S, 1) < n.view(B, 1, 1, 1))   # (B, 1, S, 1)
    pad = nB * block_size - S                                       # zero tokens to a whole block
    qf = torch.nn.functional.pad(q.to(cdtype) * real, (0, 0, 0, pad))   # (B, Hq, nG·T, D), padding zeroed
    kf = torch.nn.functional.pad(k.to(cdtype) * real, (0, 0, 0, pad))   # (B, Hkv, nG·T, D)
    kf = kf.repeat_interleave(G, dim=1)                             # (B, Hq, nG·T, D): head h reads h // G
    scores = qf @ kf.transpose(-2, -1)                              # (B, Hq, nG·T, nG·T)

    # Cut into T×T tiles: tiles[..., i, r, j, c] = q[iT + r] · k[jT + c]. Flipping r turns the
    # antidiagonal r = T-1-c into the diagonal, so diagonal() reads q[iT + T-1-t] · k[jT + t].
    tiles = scores.view(B, Hq, nG, T, nG, T)
    anti = tiles.flip(3).diagonal(dim1=3, dim2=5).sum(-1)           # (B, Hq, nG, nG)

    # Causal softmax over key groups per query group, in fp32. The scale 1/(√D·T) is the usual
    # 1/√D with the T summed products averaged. Key group 0 is always visible: no empty row.
    i = torch.arange(nG, device=q.device).view(nG, 1)               # query group
    j = torch.arange(nG, device=q.device).view(1, nG)               # key group
    anti = (anti / (math.sqrt(D) * T)).masked_fill(j > i, float("-inf"))
    p = torch.softmax(anti, dim=-1)                                 # (B, Hq, nG, nG), rows sum to 1
    p = p * (i * T < n.view(B, 1, 1, 1))                            # drop all-padding query groups

    # Sum the g×g groups of each (query block, key block) tile; then one matrix per KV head (max).
    block = p.view(B, Hq, nB, g, nB, g).sum((3, 5))                 # (B, Hq, nB, nB)
    return block.view(B, Hkv, G, nB, nB).amax(2)                    # (B, Hkv, nB, nB)


if HAS_TRITON:
    @triton.jit
    def _xattn_antidiagonal_tile(q_rows, k_base, q_group, k_group, row_ok, S, D,
                                 stride_qs, stride_qd, stride_ks, stride_kd,
                                 T: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr):
        """acc[r, c] = Σ_t q[iT + T-1-t] · k[jT + t] with i = q_group[r], j = k_group[c]:
        small matmuls (ROWS × BLOCK_K) @ (BLOCK_K × BLOCK_N), one per step t along the antidiagonals
        and BLOCK_K-wide slice of D, in one loop (Triton pipelines the loads of one loop)."""
        D_STEPS: tl.constexpr = BLOCK_D // BLOCK_K
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for step in range(T * D_STEPS):
            t = step // D_STEPS
            offs_d = (step % D_STEPS) * BLOCK_K + tl.arange(0, BLOCK_K)
            d_ok = offs_d < D                                        # BLOCK_D is D rounded up to 2^k
            q_pos = q_group * T + (T - 1 - t)                        # (ROWS,)   queries walk down…
            k_pos = k_group * T + t                                  # (BLOCK_N,) …while keys walk up
            q = tl.load(q_rows[:, None] + q_pos[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                        mask=(row_ok & (q_pos < S))[:, None] & d_ok[None, :], other=0.0)  # (ROWS, BLOCK_K)
            k = tl.load(k_base + k_pos[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                        mask=(k_pos < S)[None, :] & d_ok[:, None], other=0.0)             # (BLOCK_K, BLOCK_N)
            acc += tl.dot(q, k)                                      # fp32 accumulate
        return acc

    @triton.jit
    def _xattn_scores_kernel(
        q, k, out, blk_lse,
        seq_lens, D, Hkv, nB,
        stride_qb, stride_qh, stride_qs, stride_qd,
        stride_kb, stride_kh, stride_ks, stride_kd,
        stride_ob, stride_oh, stride_om, stride_on,
        stride_xb, stride_xh, stride_xg, stride_xn,
        qk_scale,
        T: tl.constexpr, GROUPS_PER_BLOCK: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
        READ_N: tl.constexpr,
    ):
        # ---- 1. program ids → query groups, KV head -------------------------------------------
        # A program scores BLOCK_M query groups (BLOCK_M // g query blocks) of one (b, KV head) for
        # all G query heads of that KV head at once: they read the same K tiles, so they are stacked
        # as the rows of one tile. Row r is query head r // BLOCK_M, query group start_m + r % BLOCK_M.
        ROWS: tl.constexpr = G_PAD * BLOCK_M
        QB: tl.constexpr = BLOCK_M // GROUPS_PER_BLOCK                # query blocks per program
        KB: tl.constexpr = BLOCK_N // GROUPS_PER_BLOCK                # key blocks per score tile
        start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M  # longest rows first: a short tail
        b = (tl.program_id(1) // Hkv).to(tl.int64)                    # int64: b·stride_qb can pass 2³¹
        h = (tl.program_id(1) % Hkv).to(tl.int64)
        S = tl.load(seq_lens + b)          # this sample's real tokens; later ones count as zero padding
        rows = tl.arange(0, ROWS)
        head = rows // BLOCK_M                                        # (ROWS,) query head in the group
        q_group = start_m + rows % BLOCK_M                            # (ROWS,)
        row_ok = (head < G) & (q_group * T < S)   # rows for G → G_PAD or all-padding groups count nothing

        # ---- 2. pointers ---------------------------------------------------------------------
        q_rows = q + b * stride_qb + (h * G + head) * stride_qh      # (ROWS,) one query head per row
        k_base = k + b * stride_kb + h * stride_kh
        x_rows = (blk_lse + b * stride_xb + (h * G + head) * stride_xh    # (ROWS,) this program's
                  + q_group.to(tl.int64) * stride_xg)                  # scratch rows, nG·nB > 2³¹ ok
        o_base = out + b * stride_ob + h * stride_oh
        hi = tl.minimum(start_m + BLOCK_M, nB * GROUPS_PER_BLOCK)    # causal: later key groups unseen
        n_kb = hi // GROUPS_PER_BLOCK                                 # key blocks seen (hi is whole blocks)

        # ---- 3. the one matmul pass: each row's log-sum-exp per key block → scratch ----------------
        # blk_lse[row, n] = log2 Σ 2^s over the g key groups of key block n (log2 domain, like s), and
        # the row's softmax normaliser online over the blocks, as flash attention does over keys:
        # m_i a running max, l_i the sum of 2^(blk_lse - m_i). Block n's softmax mass is then
        # 2^(blk_lse[row, n] - row_lse[row]), which step 4 reads back once row_lse is known.
        m_i = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((ROWS,), dtype=tl.float32)
        for start_n in range(0, hi, BLOCK_N):
            k_group = start_n + tl.arange(0, BLOCK_N)                 # (BLOCK_N,)
            s = _xattn_antidiagonal_tile(q_rows, k_base, q_group, k_group, row_ok, S, D,
                                         stride_qs, stride_qd, stride_ks, stride_kd,
                                         T, ROWS, BLOCK_N, BLOCK_D, BLOCK_K)  # (ROWS, BLOCK_N), unscaled
            if start_n + BLOCK_N - 1 > start_m:                       # only these tiles hold future keys
                s = tl.where(k_group[None, :] <= q_group[:, None], s, float("-inf"))
            s = tl.reshape(s, (ROWS, KB, GROUPS_PER_BLOCK))           # the g key groups of each block
            # A block wholly in the row's future is all -inf. Shift it by 0, not by its max, so no
            # (-inf) - (-inf) = NaN; its sum is then 0, and its log-sum-exp -inf without a log2(0).
            blk_max = tl.max(s, 2) * qk_scale                         # (ROWS, KB), scaled (qk_scale > 0)
            seen = blk_max > float("-inf")
            blk_max = tl.where(seen, blk_max, 0.0)
            blk_sum = tl.sum(tl.exp2(s * qk_scale - blk_max[:, :, None]), 2)  # (ROWS, KB), >= 1 where seen
            lse = tl.where(seen, blk_max + tl.log2(tl.where(seen, blk_sum, 1.0)), float("-inf"))
            kb = start_n // GROUPS_PER_BLOCK + tl.arange(0, KB)       # (KB,) key blocks of this tile
            tl.store(x_rows[:, None] + kb[None, :] * stride_xn, lse,
                     mask=row_ok[:, None] & (kb < n_kb)[None, :])
            m_new = tl.maximum(m_i, tl.max(lse, 1))   # finite from the first step on: group 0 is visible
            l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(lse - m_new[:, None]), 1)
            m_i = m_new
        row_lse = m_i + tl.log2(l_i)                                  # (ROWS,) log2 Σ_j 2^s[row, j]

        # ---- 4. read the scratch back: probabilities → block sums → max over heads → store ------
        # No matmul here. In this program rather than a second kernel: row_lse stays in registers
        # (no second buffer, no second launch) and the rows it just wrote are likely still in L2.
        # It reads only entries it wrote itself, but another of its threads may have written them:
        # the barrier makes every store above visible to all of the program's threads.
        tl.debug_barrier()
        out_m = start_m // GROUPS_PER_BLOCK + tl.arange(0, QB)       # (QB,) query block rows
        for start_b in range(0, n_kb, READ_N):
            kb = start_b + tl.arange(0, READ_N)                       # (READ_N,) key blocks
            lse = tl.load(x_rows[:, None] + kb[None, :] * stride_xn,
                          mask=row_ok[:, None] & (kb < n_kb)[None, :], other=float("-inf"))
            p = tl.exp2(lse - row_lse[:, None])       # (ROWS, READ_N); rows that count nothing → 0
            # sum the g query groups of each query block, then max over the query heads
            p = tl.sum(tl.reshape(p, (G_PAD, QB, GROUPS_PER_BLOCK, READ_N)), 2)      # (G_PAD, QB, READ_N)
            blk = tl.max(p, 0)                        # (QB, READ_N); pad rows are 0, scores >= 0
            tl.store(o_base + out_m[:, None] * stride_om + kb[None, :] * stride_on, blk,
                     mask=(out_m < nB)[:, None] & (kb < n_kb)[None, :])


def xattention_scores(q, k, block_size, stride=16, backend="auto", lengths=None, *, BLOCK_M=None, BLOCK_N=None,
                      BLOCK_K=None, num_warps=8, num_stages=None, check=True):
    """Same contract as xattention_scores_reference (float32 (B, Hkv, nB, nB); lengths (B,) optional;
    float32 inputs multiply in TF32 on a GPU, tl.dot's default, enough to rank blocks), by the Triton
    kernel: no S×S and no (S/T)² matrix, the antidiagonal products computed once. In
    their place a float32 scratch of one log-sum-exp per (query group, key block):
    (B, Hq, S/T, S/block), allocated here and only half used (causal). That is 32 MiB per query head at S = 128K, T = 16, block 128, so
    1 GiB for 32 query heads; its causal half is written once and read back once right after by
    the program that wrote it (mostly from L2), against the matmul work it saves (half of it).

    backend (kernels.BACKENDS): "triton" runs the kernel (on a CPU only under TRITON_INTERPRET=1, set
    before triton is imported; fp16/fp32 there, no bf16); "reference" and "torch" the naive twin;
    "auto" the kernel on CUDA where it supports the call (not float64), else the naive twin.
    BLOCK_M (query groups per program, default: a score tile of 128 rows, G_PAD·BLOCK_M, where
    G_PAD is G rounded up to a power of two), BLOCK_N (key groups per score tile) and BLOCK_K (the
    slice of D one step multiplies), each a power of two >= 16 (BLOCK_M, BLOCK_N also >= g, BLOCK_K
    at most D rounded up to a power of two), num_warps and num_stages are exposed for timing; they
    change no result beyond summation order.
    """
    B, Hq, Hkv, S, D = check_xattention_args(q, k, block_size, stride)
    if check:
        check_lengths(lengths, B, S)
    g = block_size // stride            # a power of two: stride divides the power-of-two block_size
    BLOCK_D = max(16, 1 << (D - 1).bit_length())                    # D rounded up to a power of two
    # The scoring is a matmul with an inner dimension of T·D, whose speed on a GPU is set by the
    # bytes each program reads per product: wide score tiles (256 key groups) reuse every Q slice
    # more, and 64-wide slices of D let three pipeline stages of both tiles fit in shared memory.
    # The interpreter (and fp32, twice the bytes) keeps narrower tiles.
    wide = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    if BLOCK_N is None:
        BLOCK_N = max(256 if wide else 128, g)                      # whole blocks, >= 16 for tl.dot
    if BLOCK_K is None:
        BLOCK_K = min(64, BLOCK_D) if wide else BLOCK_D
    G_PAD = 1 << (Hq // Hkv - 1).bit_length()                       # G rounded up to a power of two
    nG = num_blocks(S, block_size) * g
    if BLOCK_M is None:
        # query groups per program: tl.dot wants >= 16 rows, and whole blocks. Taller score tiles
        # (G_PAD·BLOCK_M rows, up to 128; 256 ran slower or out of registers) load each K tile for
        # more scores, as long as the grid keeps >= 1024 programs to fill the GPU.
        BLOCK_M = max(16, g)
        while G_PAD * BLOCK_M < 128 and B * Hkv * math.ceil(nG / (2 * BLOCK_M)) >= 1024:
            BLOCK_M *= 2
    for name, value, lo, hi in (("BLOCK_M", BLOCK_M, max(16, g), None), ("BLOCK_N", BLOCK_N, max(16, g), None),
                                ("BLOCK_K", BLOCK_K, 16, BLOCK_D)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo or value & (value - 1) \
                or (hi is not None and value > hi):
            raise ValueError(f"{name} must be a power of two >= {lo}{f' and <= {hi}' if hi else ''}, got {value!r}")
    if resolve_backend(backend, q.dtype, q.is_cuda, D) != "triton":
        return xattention_scores_reference(q, k, block_size, stride, lengths, check=False)
    check_int32_reach(q=q, k=k)

    G = Hq // Hkv
    nB = num_blocks(S, block_size)
    out = torch.zeros(B, Hkv, nB, nB, device=q.device, dtype=torch.float32)  # tiles above the diagonal stay 0
    blk_lse = torch.empty(B, Hq, nG, nB, device=q.device, dtype=torch.float32)  # scratch, see above
    qk_scale = 1.44269504 / (math.sqrt(D) * stride)   # 1/(√D·T), times 1/ln 2 because we use exp2
    # fp32 tiles are twice the bytes: pipelining their loads (Triton's default, 3 stages) would ask
    # for more shared memory than an H100/H200 block has (227 KB) at G = 8. 16-bit tiles fit.
    if num_stages is None:
        num_stages = 1 if q.dtype == torch.float32 else 3
    seq_lens = (torch.full((B,), S, device=q.device, dtype=torch.int32) if lengths is None
                else lengths.to(q.device, torch.int32))            # (B,) real tokens per sample
    grid = (triton.cdiv(nG, BLOCK_M), B * Hkv)
    _xattn_scores_kernel[grid](
        q, k, out, blk_lse,
        seq_lens, D, Hkv, nB,
        *q.stride(), *k.stride(), *out.stride(), *blk_lse.stride(),
        qk_scale,
        T=stride, GROUPS_PER_BLOCK=g, G=G, G_PAD=G_PAD,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_K=BLOCK_K,
        READ_N=min(BLOCK_N, 16384 // (G_PAD * BLOCK_M)),   # key blocks read back per step: at most
        # the score tile's width, and at most 128 × 128 floats at once
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def xattention_select(block_scores, threshold=0.9, check=True):
    """Block scores (B, Hkv, nB, nB) → bool block mask (B, Hkv, nB, nB), causal at block level.
    Per query-block row: the sink block 0 and the diagonal block always; then the other causal
    blocks best first, each taken while the mass kept so far is below threshold × row total, so the
    kept mass reaches the threshold with the fewest blocks the scores allow. threshold 1.0 keeps every
    causal block (in floating point only all of them are sure to hold the whole mass).

    Costs one sort of B·Hkv·nB rows of nB floats: the part of the selection that grows as (S/block)².
    """
    check_threshold(threshold)
    if not isinstance(block_scores, torch.Tensor) or block_scores.dim() != 4 \
            or block_scores.shape[-1] != block_scores.shape[-2] or not block_scores.is_floating_point():
        raise ValueError(f"block_scores must be a float tensor (B, Hkv, nB, nB), got "
                         f"{tuple(block_scores.shape) if isinstance(block_scores, torch.Tensor) else type(block_scores)}")
    if check and not bool(((block_scores >= 0) & (block_scores < math.inf)).all()):   # a host sync
        raise ValueError("block_scores must be finite and >= 0 (softmax mass): a NaN or negative block is never picked")
    nB = block_scores.shape[-1]
    m = torch.arange(nB, device=block_scores.device).view(nB, 1)   # query block
    n = torch.arange(nB, device=block_scores.device).view(1, nB)    # key block
    is_causal = n <= m                                               # (nB, nB)
    forced = is_causal & ((n == 0) | (n == m))                       # sink + diagonal
    if threshold >= 1.0:
        return is_causal.expand(block_scores.shape).clone()

    scores = block_scores.float().masked_fill(~is_causal, 0.0)       # (B, Hkv, nB, nB)
    row_total = scores.sum(-1, keepdim=True)                         # (B, Hkv, nB, 1)
    budget = threshold * row_total - (scores * forced).sum(-1, keepdim=True)  # still wanted after sink+diag
    cand = scores.masked_fill(~(is_causal & ~forced), -1.0)          # non-candidates sort last (scores >= 0)
    vals, order = cand.sort(-1, descending=True)                     # (B, Hkv, nB, nB) best first
    mass = vals.clamp_min(0.0)
    before = mass.cumsum(-1) - mass                                  # kept by the better candidates
    take = (vals >= 0) & (before < budget)                           # (B, Hkv, nB, nB) in sorted order
    keep = torch.zeros_like(take).scatter(-1, order, take)           # back to key-block order
    return keep | forced


def xattention_block_mask(q, k, block_size, stride=16, threshold=0.9, backend="auto", lengths=None, check=True):
    """XAttention block mask for causal prefill: q (B, Hq, S, D), k (B, Hkv, S, D) → bool
    (B, Hkv, nB, nB), ready for hybrid_mask / hybrid_attention(block_mask=..., block_size=...).
    Use the keys and queries the attention itself sees (after RoPE). Not differentiable.

    lengths (B,): right padding after lengths[b] real tokens. Every block row that covers a real
    token is then the row sample b alone would get (rows made only of padding cover no real query).
    check=False: the caller has checked lengths (the model's layers: its forward did).
    """
    B, Hq, Hkv, S, D = check_xattention_args(q, k, block_size, stride)
    check_threshold(threshold)
    check_backend(backend)
    if check:
        check_lengths(lengths, B, S)
    nB = num_blocks(S, block_size)
    if nB <= 2 or threshold >= 1.0:   # nothing to choose: every causal block is forced or wanted → FULL
        idx = torch.arange(nB, device=q.device)
        return (idx.view(1, nB) <= idx.view(nB, 1)).expand(B, Hkv, nB, nB).clone()
    with torch.no_grad():
        scores = xattention_scores(q, k, block_size, stride, backend, lengths, check=False)  # (B, Hkv, nB, nB)
    return xattention_select(scores, threshold, check)   # a NaN in q or k makes NaN scores
