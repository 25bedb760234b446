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


def streaming(sink, window):
    """Token-exact StreamingLLM: key j is visible to query i iff j <= i and (j < sink or i - j < window)."""
    def predicate(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((kv_idx < sink) | (q_idx - kv_idx < window))
    return predicate


def block_sparse(block_mask, block_size):
    """Causal inside the key blocks that block_mask[b, h, q_block, kv_block] switches on."""
    def predicate(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & block_mask[b, h, q_idx // block_size, kv_idx // block_size]
    return predicate


def and_masks(*predicates):
    def predicate(b, h, q_idx, kv_idx):
        out = True
        for p in predicates:
            out = out & p(b, h, q_idx, kv_idx)
        return out
    return predicate


def or_masks(*predicates):
    def predicate(b, h, q_idx, kv_idx):
        out = False
        for p in predicates:
            out = out | p(b, h, q_idx, kv_idx)
        return out
    return predicate

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

def hybrid_mask(seq_len, modes, sink, window, block_mask=None, block_size=64):
    """Bool (B, Hkv, S, S): may query i of (sample b, KV head h) see key j, given that head's mode.

    Costs B·Hkv·S² bytes: fine for tests and small models, never built by the Triton path.
    """
    check_sparse_params(sink, window, block_size)
    B, Hkv = modes.shape
    check_modes(modes, B, Hkv)
    check_block_mask(block_mask, modes, seq_len, block_size)
    device = modes.device
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(Hkv, device=device).view(1, Hkv, 1, 1)
    q_idx = torch.arange(seq_len, device=device).view(1, 1, seq_len, 1)
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

# -----------------------------------------------------------------------------
# The naive reference: plain O(S²) attention under a boolean mask.

def naive_attention(q, k, v, mask, scale=None):
    """Masked softmax attention, obviously right. q (B, Hq, S, D); k, v (B, Hkv, S, D);
    mask bool (B, Hkv, S, S) (or broadcastable to it). Returns (B, Hq, S, D) in q's dtype.

    Computes in float64 if given float64, else in float32. Costs the full score matrix: B·Hq·S²
    floats written, read by the softmax, written again as probabilities, read by the second matmul.
    A row with no visible key returns zeros (its probabilities are multiplied by the mask), never NaN.
    """
    B, Hq, Hkv, S, D = check_qkv(q, k, v)
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    cdtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qg = q.to(cdtype).view(B, Hkv, G, S, D)                   # (B, Hkv, G, S, D)
    kf, vf = k.to(cdtype).unsqueeze(2), v.to(cdtype).unsqueeze(2)  # (B, Hkv, 1, S, D)
    mask = mask.unsqueeze(2) if mask.dim() == 4 else mask      # (B, Hkv, 1, S, S): shared by the group
    scores = (qg @ kf.transpose(-2, -1)) * scale              # (B, Hkv, G, S, S)
    any_key = mask.any(-1, keepdim=True)                      # (B, Hkv, 1, S, 1)
    # Fill masked scores with -inf, but a fully masked row with 0 so softmax stays finite.
    scores = scores.masked_fill(~mask, float("-inf")).masked_fill(~any_key, 0.0)
    p = torch.softmax(scores, dim=-1) * mask                  # (B, Hkv, G, S, S)
    out = p @ vf                                              # (B, Hkv, G, S, D)
    return out.view(B, Hq, S, D).to(q.dtype)

# -----------------------------------------------------------------------------
# The one entry point the model calls.

def hybrid_attention(q, k, v, modes, sink, window, block_mask=None, block_size=64, backend="auto"):
    """Causal attention where each (sample, KV head) runs its own mode. q (B, Hq, S, D),
    k/v (B, Hkv, S, D), modes int (B, Hkv). Returns (B, Hq, S, D) in q's dtype.

    backend: "reference" (naive_attention on hybrid_mask, differentiable), "triton" (the fused
    kernel below; forward only), "auto" = triton on CUDA when no gradient is needed, else reference.
    """
    B, Hq, Hkv, S, D = check_qkv(q, k, v)
    check_sparse_params(sink, window, block_size)
    check_modes(modes, B, Hkv, device=q.device)
    check_block_mask(block_mask, modes, S, block_size)
    if backend not in ("auto", "reference", "triton"):
        raise ValueError(f"backend must be 'auto', 'reference' or 'triton', got {backend!r}")
    if backend == "auto":
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        backend = "triton" if (q.is_cuda and not needs_grad and _HAS_TRITON) else "reference"
    if backend == "triton":
        return fused_hybrid_attention(q, k, v, modes, sink, window, block_mask, block_size)
    mask = hybrid_mask(S, modes, sink, window, block_mask, block_size)  # (B, Hkv, S, S), per KV head
    return naive_attention(q, k, v, mask)


# ============================================================================================
# Triton: fused hybrid attention (issue 5). Section owned by the kernel work.
# ============================================================================================
try:
    import triton
    import triton.language as tl
    _HAS_TRITON = True
except ImportError:  # the reference path above needs only torch
    _HAS_TRITON = False


def fused_hybrid_attention(q, k, v, modes, sink, window, block_mask=None, block_size=64):
    raise NotImplementedError("the fused Triton kernel lands with issue 5")

# ============================================================================================
# XAttention block selection (issue 6). Section owned by the XAttention work.
# ============================================================================================
