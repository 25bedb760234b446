"""kernels.py — what each attention head may see, the naive reference, and the fused Triton kernel.

Elastic Attention gives every (sample, KV head) its own *mode* (PAPER.md §3, §7):

    FULL          causal attention over every earlier token          (retrieval head, z = 1)
    STREAMING     the first `sink` tokens + the last `window` tokens  (StreamingLLM, z = 0)
    BLOCK_SPARSE  the key blocks a boolean block mask switches on     (XAttention, issue 6)

Everything here is built on one idea from attention-gym: a mask is first a tiny predicate
`(b, h, q_idx, kv_idx) -> bool`. `hybrid_mask` evaluates the predicates into a dense boolean
(B, Hkv, S, S) tensor, and that tensor is the single ground truth for the naive reference, for the
Triton kernel's tests and for the effective sparsity Ω_ESR.

Shape letters: B batch, S sequence length, Hq query heads, Hkv KV heads, G = Hq // Hkv query heads
per KV head (GQA groups are contiguous: query head h reads KV head h // G), D head dim,
nB = ceil(S / block_size) blocks per sequence, BLOCK_M / BLOCK_N kernel tile sizes.
"""
import math

import torch

# Head modes, stored as small ints so they can be passed to a kernel as a (B, Hkv) int32 tensor.
FULL = 0
STREAMING = 1
BLOCK_SPARSE = 2
MODE_NAMES = {FULL: "full", STREAMING: "streaming", BLOCK_SPARSE: "block_sparse"}

# -----------------------------------------------------------------------------
# Mask predicates (b, h, q_idx, kv_idx) -> bool. They take broadcastable index tensors, so one
# call builds a whole (B, H, S, S) mask; with python ints they answer a single question.

def causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def and_masks(*predicates):
    """A pair is visible iff every predicate allows it."""
    def predicate(b, h, q_idx, kv_idx):
        out = True
        for p in predicates:
            out = out & p(b, h, q_idx, kv_idx)
        return out
    return predicate


def or_masks(*predicates):
    """A pair is visible iff any predicate allows it."""
    def predicate(b, h, q_idx, kv_idx):
        out = False
        for p in predicates:
            out = out | p(b, h, q_idx, kv_idx)
        return out
    return predicate


def streaming(sink, window):
    """Token-exact StreamingLLM: key j is visible to query i iff j <= i and (j < sink or i - j < window)."""
    def in_sink(b, h, q_idx, kv_idx):
        return kv_idx < sink

    def in_window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < window
    return and_masks(causal, or_masks(in_sink, in_window))


def block_sparse(block_mask, block_size):
    """Causal inside the key blocks that block_mask[b, h, q_block, kv_block] switches on."""
    def block_on(b, h, q_idx, kv_idx):
        return block_mask[b, h, q_idx // block_size, kv_idx // block_size]
    return and_masks(causal, block_on)


# -----------------------------------------------------------------------------
# Checks shared by every public entry point: bad input gets an error naming the bad value.

def check_sparse_params(sink, window, block_size=None):
    if not isinstance(sink, int) or sink < 0:
        raise ValueError(f"sink must be an int >= 0, got {sink!r}")
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1 (a token always sees itself), got {window!r}")
    if block_size is not None and (not isinstance(block_size, int) or block_size < 1
                                   or block_size & (block_size - 1)):
        raise ValueError(f"block_size must be a power of two, got {block_size!r}")


def check_modes(modes, B, Hkv, device=None):
    if not isinstance(modes, torch.Tensor) or modes.dtype.is_floating_point or modes.dtype == torch.bool:
        raise ValueError(f"modes must be an integer tensor of shape ({B}, {Hkv}), got {modes!r}")
    if tuple(modes.shape) != (B, Hkv):
        raise ValueError(f"modes has shape {tuple(modes.shape)}, expected (B, Hkv) = ({B}, {Hkv})")
    bad = modes[(modes < FULL) | (modes > BLOCK_SPARSE)]
    if bad.numel():
        raise ValueError(f"modes must be in {{0 FULL, 1 STREAMING, 2 BLOCK_SPARSE}}, got {bad.unique().tolist()}")
    if device is not None and modes.device != device:
        raise ValueError(f"modes is on {modes.device} but q is on {device}")


def num_blocks(seq_len, block_size):
    return (seq_len + block_size - 1) // block_size


def check_block_mask(block_mask, modes, seq_len, block_size):
    """block_mask is required (B, Hkv, nB, nB) bool as soon as any head is BLOCK_SPARSE."""
    B, Hkv = modes.shape
    if block_mask is None:
        if (modes == BLOCK_SPARSE).any():
            raise ValueError("some heads are BLOCK_SPARSE (mode 2) but block_mask is None")
        return
    nB = num_blocks(seq_len, block_size)
    if block_mask.dtype != torch.bool or tuple(block_mask.shape) != (B, Hkv, nB, nB):
        raise ValueError(f"block_mask must be bool of shape (B, Hkv, nB, nB) = ({B}, {Hkv}, {nB}, {nB}) "
                         f"for S={seq_len}, block_size={block_size}; got {block_mask.dtype} "
                         f"{tuple(block_mask.shape)}")
    if block_mask.device != modes.device:
        raise ValueError(f"block_mask is on {block_mask.device} but modes is on {modes.device}")


def check_qkv(q, k, v):
    """q (B, Hq, S, D), k and v (B, Hkv, S, D): same dtype and device, Hq a multiple of Hkv."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-d tensor (B, H, S, D), got shape "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    B, Hq, S, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2] != S or k.shape[3] != D:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be (B, Hkv, S, D) with "
                         f"B={B}, S={S}, D={D} from q {tuple(q.shape)}")
    Hkv = k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} not a multiple of KV heads {Hkv}")
    return B, Hq, Hkv, S, D

# -----------------------------------------------------------------------------
# The ground truth: a dense per-KV-head boolean mask built from the predicates.

def hybrid_mask(seq_len, modes, sink, window, block_mask=None, block_size=64, q_idx=None):
    """Bool (B, Hkv, S, S): may query i of (sample b, KV head h) see key j, given that head's mode.

    q_idx (Sq,) picks the query positions (default all S): decoding with a KV cache asks for
    one row, (B, Hkv, 1, S). Costs B·Hkv·Sq·S bytes: fine for tests and small models, never
    built by the Triton path.
    """
    check_sparse_params(sink, window, block_size)
    B, Hkv = modes.shape
    check_modes(modes, B, Hkv)
    check_block_mask(block_mask, modes, seq_len, block_size)
    device = modes.device
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(Hkv, device=device).view(1, Hkv, 1, 1)
    q_idx = torch.arange(seq_len, device=device) if q_idx is None else q_idx.to(device)
    q_idx = q_idx.view(1, 1, -1, 1)
    kv_idx = torch.arange(seq_len, device=device).view(1, 1, 1, seq_len)

    m = modes.view(B, Hkv, 1, 1)
    mask = (m == FULL) & causal(b, h, q_idx, kv_idx)
    mask = mask | ((m == STREAMING) & streaming(sink, window)(b, h, q_idx, kv_idx))
    if block_mask is not None:
        mask = mask | ((m == BLOCK_SPARSE) & block_sparse(block_mask, block_size)(b, h, q_idx, kv_idx))
    return mask  # (B, Hkv, S, S)


def omega_esr(mask):
    """Effective sparsity Ω_ESR (PAPER.md §2): per sample, the fraction of causal (query, key) pairs
    a head prunes, averaged over heads. mask (B, Hkv, S, S) → (B,); a list of per-layer masks →
    the mean over layers (B,)."""
    if isinstance(mask, (list, tuple)):
        return torch.stack([omega_esr(m) for m in mask]).mean(0)
    S = mask.shape[-1]
    idx = torch.arange(S, device=mask.device)
    is_causal = causal(None, None, idx.view(S, 1), idx.view(1, S))  # (S, S)
    kept = (mask & is_causal).sum((-2, -1))                           # (B, Hkv)
    causal_pairs = S * (S + 1) / 2
    return 1.0 - (kept.double() / causal_pairs).mean(-1)              # (B,)


def kept_pairs(seq_len, modes, sink, window, block_mask=None, block_size=64):
    """(B, Hkv) causal (query, key) pairs each head keeps, counted in O(S) without an S×S mask.
    Must equal hybrid_mask(...).sum((-2, -1)) (tests hold it to that); the model uses it for
    Ω_ESR at long S, where the mask itself would not fit."""
    B, Hkv = modes.shape
    i = torch.arange(seq_len, device=modes.device, dtype=torch.float64)  # query positions
    full = (i + 1).sum()
    # Streaming row i keeps its window [max(0, i-window+1), i] plus the sink keys left of it.
    stream = (torch.clamp(i + 1, max=window) + torch.clamp(i - window + 1, min=0).clamp(max=sink)).sum()
    kept = torch.where(modes == FULL, full, stream).to(torch.float64)  # (B, Hkv)
    if block_mask is not None:
        nB = num_blocks(seq_len, block_size)
        rows = torch.bincount((i // block_size).long(), minlength=nB).double()  # queries per block
        diag = torch.zeros(nB, dtype=torch.float64, device=modes.device)
        diag.index_add_(0, (i // block_size).long(), i - (i // block_size) * block_size + 1)
        qb = torch.arange(nB, device=modes.device)
        below = qb.view(nB, 1) > qb.view(1, nB)                   # key block strictly left of the diagonal
        off = (block_mask & below).sum(-1).double() * rows * block_size  # (B, Hkv, nB): whole blocks
        on_diag = block_mask.diagonal(dim1=-2, dim2=-1).double() * diag  # (B, Hkv, nB): causal triangle
        kept = torch.where(modes == BLOCK_SPARSE, (off + on_diag).sum(-1), kept)
    return kept


def omega_esr_closed_form(seq_len, modes, sink, window, block_mask=None, block_size=64):
    """Ω_ESR (B,) like omega_esr(hybrid_mask(...)), from kept_pairs instead of the mask."""
    kept = kept_pairs(seq_len, modes, sink, window, block_mask, block_size)
    return 1.0 - (kept / (seq_len * (seq_len + 1) / 2)).mean(-1)

# -----------------------------------------------------------------------------
# The naive reference: plain O(S²) attention under a boolean mask.

def naive_attention(q, k, v, mask, scale=None):
    """Masked softmax attention, obviously right. q (B, Hq, S, D); k, v (B, Hkv, S, D);
    mask bool (B, Hkv, S, S) (or broadcastable to it). Returns (B, Hq, S, D) in q's dtype.

    Computes in float64 if given float64, else in float32. Costs the full score matrix: B·Hq·S²
    floats written, read by the softmax, written again as probabilities, read by the second matmul.
    A row with no visible key returns zeros (its probabilities are multiplied by the mask), never NaN.
    """
    check_qkv(q, k, v)
    return masked_attention(q, k, v, mask, scale)


def masked_attention(q, k, v, mask, scale=None):
    """naive_attention without the checks, for Sq query rows against Sk keys: q (B, Hq, Sq, D),
    k/v (B, Hkv, Sk, D), mask (B, Hkv, Sq, Sk). Decoding with a KV cache uses it with Sq = 1."""
    B, Hq, Sq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    cdtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qg = q.to(cdtype).view(B, Hkv, G, Sq, D)                  # (B, Hkv, G, Sq, D)
    kf, vf = k.to(cdtype).unsqueeze(2), v.to(cdtype).unsqueeze(2)  # (B, Hkv, 1, Sk, D)
    mask = mask.unsqueeze(2)                                  # (B, Hkv, 1, Sq, Sk): shared by the group
    scores = (qg @ kf.transpose(-2, -1)) * scale              # (B, Hkv, G, Sq, Sk)
    any_key = mask.any(-1, keepdim=True)                      # (B, Hkv, 1, Sq, 1)
    # Fill masked scores with -inf, but a fully masked row with 0 so softmax stays finite.
    scores = scores.masked_fill(~mask, float("-inf")).masked_fill(~any_key, 0.0)
    p = torch.softmax(scores, dim=-1) * mask                  # (B, Hkv, G, Sq, Sk)
    out = p @ vf                                              # (B, Hkv, G, Sq, D)
    return out.view(B, Hq, Sq, D).to(q.dtype)

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


# ============================================================================================
# Triton: fused hybrid attention (issue 5). Section owned by the kernel work.
# ============================================================================================
import os  # TRITON_INTERPRET=1 switches the kernel to Triton's CPU interpreter

try:
    import triton
    import triton.language as tl
    _HAS_TRITON = True
except ImportError:  # the reference path above needs only torch
    _HAS_TRITON = False


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

# ============================================================================================
# XAttention block selection (issue 6). Section owned by the XAttention work.
# ============================================================================================
#
# XAttention (Xu et al. 2025; PAPER.md §3 XA) decides, per input, which key blocks a BLOCK_SPARSE
# head attends to. Two steps, so a benchmark can time them apart:
#   1. scoring  cheap estimate of the softmax mass in every (query block, key block) tile:
#               xattention_scores_naive (dense twin) and xattention_scores (Triton: no S×S matrix,
#               the antidiagonal products once, a float32 scratch of S/T × S/block per query head)
#   2. picking  per query-block row keep the sink and the diagonal block, then the best other blocks
#               until the kept mass reaches `threshold` of the row: xattention_select (torch)
# xattention_block_mask runs both; its output is the `block_mask` of hybrid_mask/hybrid_attention.
#
# Extra shape letters: T the stride (tokens per antidiagonal group), g = block_size // T groups per
# block, nG = nB·g groups in the sequence padded to whole blocks.
#
# Padding. When S is not a multiple of the block size, q and k are zero-padded to nB·block_size
# tokens (the kernel masks its loads instead, which is the same). A zero token adds exactly 0 to any
# antidiagonal sum, so a partly padded group is scored on its real tokens; causality (key group
# j <= query group i) keeps all-padding key groups out of every real query group's softmax; and
# all-padding query groups are dropped before the block sums, so padding contributes nothing.
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
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} not a multiple of KV heads {Hkv}")
    if not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size!r}")
    if not isinstance(stride, int) or stride < 1 or block_size % stride:
        raise ValueError(f"stride must be a positive int dividing block_size {block_size}, got {stride!r}")
    return B, Hq, Hkv, S, D


def check_threshold(threshold):
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be a number in (0, 1], got {threshold!r}")


def check_xattention_backend(backend):
    if backend not in ("auto", "reference", "triton"):
        raise ValueError(f"backend must be 'auto', 'reference' or 'triton', got {backend!r}")


def xattention_scores_naive(q, k, block_size, stride=16):
    """XAttention block scores, the obvious dense way. q (B, Hq, S, D), k (B, Hkv, S, D) →
    (B, Hkv, nB, nB) float32 (float64 if given float64): entry [b, h, m, n] is the estimated softmax
    mass that the query groups of block m put on key block n, max over the G query heads of KV head h.
    Zero above the diagonal; each row sums to at least its number of real query groups.

    Builds the whole (B, Hq, S, S) score matrix (S²·D multiply-adds and S² floats per query head) and
    keeps 1/T of it, the antidiagonals; the Triton kernel computes only those, S²·D/T work.
    """
    B, Hq, Hkv, S, D = check_xattention_args(q, k, block_size, stride)
    G, T = Hq // Hkv, stride
    nB = num_blocks(S, block_size)
    g, nG = block_size // T, nB * block_size // T
    cdtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    pad = nB * block_size - S                                       # zero tokens to a whole block
    qf = torch.nn.functional.pad(q.to(cdtype), (0, 0, 0, pad))      # (B, Hq, nG·T, D)
    kf = torch.nn.functional.pad(k.to(cdtype), (0, 0, 0, pad))      # (B, Hkv, nG·T, D)
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
    p = p * (i * T < S)                                             # drop all-padding query groups

    # Sum the g×g groups of each (query block, key block) tile; then one matrix per KV head (max).
    block = p.view(B, Hq, nB, g, nB, g).sum((3, 5))                 # (B, Hq, nB, nB)
    return block.view(B, Hkv, G, nB, nB).amax(2)                    # (B, Hkv, nB, nB)


if _HAS_TRITON:
    @triton.jit
    def _xattn_antidiagonal_tile(q_rows, k_base, q_group, k_group, row_ok, S, D,
                                 stride_qs, stride_qd, stride_ks, stride_kd,
                                 T: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_D: tl.constexpr):
        """acc[r, c] = Σ_t q[iT + T-1-t] · k[jT + t] with i = q_group[r], j = k_group[c]:
        T small matmuls (ROWS × D) @ (D × BLOCK_N), one per step t along the antidiagonals."""
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D                                            # BLOCK_D is D rounded up to 2^k
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for t in range(T):
            q_pos = q_group * T + (T - 1 - t)                        # (ROWS,)   queries walk down…
            k_pos = k_group * T + t                                  # (BLOCK_N,) …while keys walk up
            q = tl.load(q_rows[:, None] + q_pos[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                        mask=(row_ok & (q_pos < S))[:, None] & d_ok[None, :], other=0.0)  # (ROWS, BLOCK_D)
            k = tl.load(k_base + k_pos[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                        mask=(k_pos < S)[None, :] & d_ok[:, None], other=0.0)             # (BLOCK_D, BLOCK_N)
            acc += tl.dot(q, k)                                      # fp32 accumulate
        return acc

    @triton.jit
    def _xattn_scores_kernel(
        q, k, out, blk_lse,
        S, D, Hkv, nB,
        stride_qb, stride_qh, stride_qs, stride_qd,
        stride_kb, stride_kh, stride_ks, stride_kd,
        stride_ob, stride_oh, stride_om, stride_on,
        stride_xb, stride_xh, stride_xg, stride_xn,
        qk_scale,
        T: tl.constexpr, GROUPS_PER_BLOCK: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, READ_N: tl.constexpr,
    ):
        # ---- 1. program ids → query groups, KV head -------------------------------------------
        # A program scores BLOCK_M query groups (BLOCK_M // g query blocks) of one (b, KV head) for
        # all G query heads of that KV head at once: they read the same K tiles, so they are stacked
        # as the rows of one tile. Row r is query head r // BLOCK_M, query group start_m + r % BLOCK_M.
        ROWS: tl.constexpr = G_PAD * BLOCK_M
        QB: tl.constexpr = BLOCK_M // GROUPS_PER_BLOCK                # query blocks per program
        KB: tl.constexpr = BLOCK_N // GROUPS_PER_BLOCK                # key blocks per score tile
        start_m = tl.program_id(0) * BLOCK_M
        b = (tl.program_id(1) // Hkv).to(tl.int64)                    # int64: b·stride_qb can pass 2³¹
        h = (tl.program_id(1) % Hkv).to(tl.int64)
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
                                         T, ROWS, BLOCK_N, BLOCK_D) * qk_scale
            s = tl.where(k_group[None, :] <= q_group[:, None], s, float("-inf"))  # (ROWS, BLOCK_N)
            s = tl.reshape(s, (ROWS, KB, GROUPS_PER_BLOCK))           # the g key groups of each block
            # A block wholly in the row's future is all -inf. Shift it by 0, not by its max, so no
            # (-inf) - (-inf) = NaN; its sum is then 0, and its log-sum-exp -inf without a log2(0).
            blk_max = tl.max(s, 2)                                    # (ROWS, KB)
            seen = blk_max > float("-inf")
            blk_max = tl.where(seen, blk_max, 0.0)
            blk_sum = tl.sum(tl.exp2(s - blk_max[:, :, None]), 2)     # (ROWS, KB), >= 1 where seen
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


def xattention_scores(q, k, block_size, stride=16, backend="auto", *, BLOCK_N=None, num_warps=8):
    """Same contract as xattention_scores_naive (float32 (B, Hkv, nB, nB)), by the Triton kernel:
    no S×S and no (S/T)² matrix, the antidiagonal products computed once. In their place a float32
    scratch of one log-sum-exp per (query group, key block): (B, Hq, S/T, S/block), allocated here
    and only half used (causal). That is 32 MiB per query head at S = 128K, T = 16, block 128, so
    1 GiB for 32 query heads; its causal half is written once and read back once right after by
    the program that wrote it (mostly from L2), against the matmul work it saves (half of it).

    backend: "auto" = Triton on CUDA (not float64), else the naive twin; "reference"; "triton" (on
    CPU only under TRITON_INTERPRET=1, set before triton is imported; fp16/fp32 there, no bf16).
    BLOCK_N (key groups per score tile, default max(128, g); a power of two, >= 16 and >= g) and
    num_warps are exposed for timing; they change no result beyond summation order.
    """
    B, Hq, Hkv, S, D = check_xattention_args(q, k, block_size, stride)
    check_xattention_backend(backend)
    g = block_size // stride            # a power of two: stride divides the power-of-two block_size
    if BLOCK_N is None:
        # key groups per score tile: >= 16 for tl.dot, and whole blocks. Measured on an H200 at 128K
        # (Hq 32, D 128, block 128, stride 16, bf16): BLOCK_N 64 / 4 warps 21.6 ms, 128 / 4 warps
        # 18.3 ms, 128 / 8 warps 15.3 ms (the default): wider tiles reuse each Q load more.
        BLOCK_N = max(128, g)
    if isinstance(BLOCK_N, bool) or not isinstance(BLOCK_N, int) or BLOCK_N < max(16, g) \
            or BLOCK_N & (BLOCK_N - 1):
        raise ValueError(f"BLOCK_N must be a power of two >= max(16, g={g}), got {BLOCK_N!r}")
    if backend == "auto":
        backend = "triton" if q.is_cuda and _HAS_TRITON and q.dtype != torch.float64 else "reference"
    if backend == "reference":
        return xattention_scores_naive(q, k, block_size, stride)
    if not _HAS_TRITON:
        raise ValueError("backend='triton' but triton is not installed")
    if q.dtype == torch.float64:
        raise ValueError("the Triton scoring kernel takes float16/bfloat16/float32, got float64")
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError("backend='triton' on CPU needs TRITON_INTERPRET=1 set before triton is imported")

    G = Hq // Hkv
    nB = num_blocks(S, block_size)
    nG = nB * g
    BLOCK_M = max(16, g)   # query groups per program: tl.dot wants >= 16 rows, and whole blocks
    out = torch.zeros(B, Hkv, nB, nB, device=q.device, dtype=torch.float32)  # tiles above the diagonal stay 0
    blk_lse = torch.empty(B, Hq, nG, nB, device=q.device, dtype=torch.float32)  # scratch, see above
    qk_scale = 1.44269504 / (math.sqrt(D) * stride)   # 1/(√D·T), times 1/ln 2 because we use exp2
    # fp32 tiles are twice the bytes: pipelining their loads (Triton's default, 3 stages) would ask
    # for more shared memory than an H100/H200 block has (227 KB) at G = 8. 16-bit tiles fit.
    num_stages = 1 if q.dtype == torch.float32 else 3
    grid = (triton.cdiv(nG, BLOCK_M), B * Hkv)
    _xattn_scores_kernel[grid](
        q, k, out, blk_lse,
        S, D, Hkv, nB,
        *q.stride(), *k.stride(), *out.stride(), *blk_lse.stride(),
        qk_scale,
        T=stride, GROUPS_PER_BLOCK=g, G=G, G_PAD=triton.next_power_of_2(G),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(D)),
        READ_N=BLOCK_N,   # key blocks per read-back step: a tile as large as the score tile
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def xattention_select(block_scores, threshold=0.9):
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


def xattention_block_mask(q, k, block_size, stride=16, threshold=0.9, backend="auto"):
    """XAttention block mask for causal prefill: q (B, Hq, S, D), k (B, Hkv, S, D) → bool
    (B, Hkv, nB, nB), ready for hybrid_mask / hybrid_attention(block_mask=..., block_size=...).
    Use the keys and queries the attention itself sees (after RoPE). Not differentiable.
    """
    B, Hq, Hkv, S, D = check_xattention_args(q, k, block_size, stride)
    check_threshold(threshold)
    check_xattention_backend(backend)
    nB = num_blocks(S, block_size)
    if nB <= 2 or threshold >= 1.0:   # nothing to choose: every causal block is forced or wanted → FULL
        idx = torch.arange(nB, device=q.device)
        return (idx.view(1, nB) <= idx.view(nB, 1)).expand(B, Hkv, nB, nB).clone()
    with torch.no_grad():
        scores = xattention_scores(q, k, block_size, stride, backend)  # (B, Hkv, nB, nB)
    return xattention_select(scores, threshold)
