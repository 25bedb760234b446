"""masks.py — what each attention head may see: modes, mask predicates, the dense ground-truth
mask, the effective sparsity Ω_ESR, and plain O(S²) attention under a mask.

Elastic Attention gives every (sample, KV head) its own *mode* (METHOD.md §3):

    FULL          causal attention over every earlier token          (retrieval head, z = 1)
    STREAMING     the first `sink` tokens + the last `window` tokens  (StreamingLLM, z = 0)
    BLOCK_SPARSE  the key blocks a boolean block mask switches on     (XAttention, xattention.py)

Everything here is built on one idea from attention-gym: a mask is first a tiny predicate
`(b, h, q_idx, kv_idx) -> bool`. `hybrid_mask` evaluates the predicates into a dense boolean
(B, Hkv, S, S) tensor, and that tensor is the single ground truth for the naive reference, for the
Triton kernels' tests and for Ω_ESR.

Shape letters: B batch, S sequence length, Hq query heads, Hkv KV heads, G = Hq // Hkv query heads
per KV head (GQA groups are contiguous: query head h reads KV head h // G), D head dim,
nB = ceil(S / block_size) blocks per sequence.
"""

import math

import torch

# Head modes, stored as small ints so they can be passed to a kernel as a (B, Hkv) int32 tensor.
FULL = 0
STREAMING = 1
BLOCK_SPARSE = 2

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
# Checks shared by every public entry point: bad input gets an error naming the bad value. A check
# that reads tensor values (modes, lengths) is a host sync: the GPU idles until the host launches
# again, and a CUDA graph cannot record one. So a public function checks, and a caller that has
# checked (the model, once per forward, not in every layer) passes check=False.

def check_int(name, value, low=None, why=""):
    """An int (a bool is not one) of at least `low`, or a ValueError naming the value."""
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        raise ValueError(f"{name} must be an int{'' if low is None else f' >= {low}'}{why}, got {value!r}")


def check_sparse_params(sink, window, block_size=None):
    check_int("sink", sink, 0)
    check_int("window", window, 1, " (a token always sees itself)")
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1
                                   or block_size & (block_size - 1)):
        raise ValueError(f"block_size must be a power of two, got {block_size!r}")


def check_mode_values(modes, block_mask_given):
    """Every entry one of the three modes, and no BLOCK_SPARSE head without a block mask. Reads the
    smallest and largest mode: one host sync, which stalls the GPU until the host launches again."""
    if modes.numel() == 0:
        return
    lo, hi = torch.stack(modes.aminmax()).tolist()
    if lo < FULL or hi > BLOCK_SPARSE:
        bad = modes[(modes < FULL) | (modes > BLOCK_SPARSE)].unique().tolist()
        raise ValueError(f"modes must be in {{0 FULL, 1 STREAMING, 2 BLOCK_SPARSE}}, got {bad}")
    if hi == BLOCK_SPARSE and not block_mask_given:
        raise ValueError("some heads are BLOCK_SPARSE (mode 2) but block_mask is None")


def check_modes(modes, B, Hkv, device=None, *, block_mask_given):
    """modes (B, Hkv) integer, on q's device; block_mask_given: whether the caller holds a block mask,
    which BLOCK_SPARSE heads need (asked, not defaulted, so that no caller skips that check)."""
    if not isinstance(modes, torch.Tensor) or modes.dtype.is_floating_point or modes.dtype == torch.bool:
        raise ValueError(f"modes must be an integer tensor of shape ({B}, {Hkv}), got {modes!r}")
    if tuple(modes.shape) != (B, Hkv):
        raise ValueError(f"modes has shape {tuple(modes.shape)}, expected (B, Hkv) = ({B}, {Hkv})")
    check_mode_values(modes, block_mask_given)
    if device is not None and modes.device != device:
        raise ValueError(f"modes is on {modes.device} but q is on {device}")


def check_lengths(lengths, B, S, name="lengths"):
    """lengths (B,) integer tensor: sample b's real tokens are positions 0 .. lengths[b] − 1, the
    rest is right padding. Each length in [1, S]. None (all S real) passes through. name: what the
    error calls them (prompt_lengths: the tokens a router reads)."""
    if lengths is None:
        return None
    if (not isinstance(lengths, torch.Tensor) or lengths.dtype.is_floating_point
            or lengths.dtype == torch.bool or tuple(lengths.shape) != (B,)):
        raise ValueError(f"{name} must be an integer tensor of shape (B,) = ({B},), got {lengths!r}")
    bad = (lengths < 1) | (lengths > S)
    if bad.any():
        raise ValueError(f"{name} must be in [1, S={S}], got {lengths[bad].tolist()}")
    return lengths


def num_blocks(seq_len, block_size):
    return (seq_len + block_size - 1) // block_size


def check_block_mask(block_mask, modes, seq_len, block_size):
    """block_mask (B, Hkv, nB, nB) bool. It is required as soon as any head is BLOCK_SPARSE: pass
    block_mask_given=block_mask is not None to check_modes, which reads the modes anyway."""
    B, Hkv = modes.shape
    if block_mask is None:
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
    if not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must be floating point, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    B, Hq, S, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2] != S or k.shape[3] != D:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be (B, Hkv, S, D) with "
                         f"B={B}, S={S}, D={D} from q {tuple(q.shape)}")
    Hkv = k.shape[1]
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"query heads {Hq} not a multiple of KV heads {Hkv}")
    return B, Hq, Hkv, S, D

# -----------------------------------------------------------------------------
# The ground truth: a dense per-KV-head boolean mask built from the predicates.

def hybrid_mask(seq_len, modes, sink, window, block_mask=None, block_size=64, q_idx=None, check=True):
    """Bool (B, Hkv, S, S): may query i of (sample b, KV head h) see key j, given that head's mode.

    q_idx (Sq,) picks the query positions (default all S): decoding with a KV cache asks for
    one row, (B, Hkv, 1, S). Costs B·Hkv·Sq·S bytes: fine for tests and small models, never
    built by the Triton path.
    """
    B, Hkv = modes.shape
    if check:
        check_sparse_params(sink, window, block_size)
        check_modes(modes, B, Hkv, block_mask_given=block_mask is not None)
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
    """Effective sparsity Ω_ESR (METHOD.md §2): per sample, the fraction of causal (query, key) pairs
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


def kept_pairs(seq_len, modes, sink, window, block_mask=None, block_size=64, lengths=None, check=True):
    """(B, Hkv) causal (query, key) pairs each head keeps, counted in O(B·S) without an S×S mask.
    Must equal hybrid_mask(...).sum((-2, -1)) (tests hold it to that); the model uses it for
    Ω_ESR at long S, where the mask itself would not fit.

    lengths (B,) (optional, see check_lengths): count only sample b's real tokens, queries and
    keys < lengths[b]: hybrid_mask(...)[b, :, :L, :L].sum(). Causality makes a real query see
    only real keys, so it is enough to drop the padded query rows."""
    if check:
        check_sparse_params(sink, window, block_size)
        if not isinstance(modes, torch.Tensor) or modes.dim() != 2:
            raise ValueError(f"modes must be an integer tensor (B, Hkv), got {modes!r}")
        check_modes(modes, *modes.shape, block_mask_given=block_mask is not None)
        check_block_mask(block_mask, modes, seq_len, block_size)
        check_lengths(lengths, modes.shape[0], seq_len)
    B, Hkv = modes.shape
    device = modes.device
    i = torch.arange(seq_len, device=device, dtype=torch.float64)           # query positions
    n = torch.full((B,), seq_len, device=device) if lengths is None else lengths.to(device)
    real = (i.view(1, -1) < n.view(B, 1)).double()                           # (B, S) 1 = real query
    full = real @ (i + 1)                                                    # (B,)
    # Streaming row i keeps its window [max(0, i-window+1), i] plus the sink keys left of it.
    stream = real @ (torch.clamp(i + 1, max=window) + torch.clamp(i - window + 1, min=0).clamp(max=sink))  # (B,)
    kept = torch.where(modes == FULL, full.view(B, 1), stream.view(B, 1))   # (B, Hkv) float64
    if block_mask is not None:
        nB = num_blocks(seq_len, block_size)
        blk = (i // block_size).long()                                       # (S,) query block of row i
        rows = torch.zeros(B, nB, dtype=torch.float64, device=device).index_add_(1, blk, real)  # real queries per block
        diag = torch.zeros(B, nB, dtype=torch.float64, device=device).index_add_(
            1, blk, real * (i - blk * block_size + 1))                       # (B, nB) causal triangle, real rows
        qb = torch.arange(nB, device=device)
        below = qb.view(nB, 1) > qb.view(1, nB)                   # key block strictly left of the diagonal
        off = (block_mask & below).sum(-1).double() * rows.view(B, 1, nB) * block_size  # (B, Hkv, nB)
        on_diag = block_mask.diagonal(dim1=-2, dim2=-1).double() * diag.view(B, 1, nB)  # (B, Hkv, nB)
        kept = torch.where(modes == BLOCK_SPARSE, (off + on_diag).sum(-1), kept)
    return kept


def omega_esr_closed_form(seq_len, modes, sink, window, block_mask=None, block_size=64, lengths=None, check=True):
    """Ω_ESR (B,) like omega_esr(hybrid_mask(...)), from kept_pairs instead of the mask. With
    lengths (B,), sample b's Ω_ESR over its lengths[b] real tokens only: padding neither adds
    pruned pairs nor kept ones."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"Ω_ESR needs seq_len >= 1 (a fraction of no pairs is undefined), got {seq_len!r}")
    kept = kept_pairs(seq_len, modes, sink, window, block_mask, block_size, lengths, check)   # (B, Hkv)
    n = torch.full((modes.shape[0],), float(seq_len), dtype=torch.float64, device=modes.device) \
        if lengths is None else lengths.to(modes.device, torch.float64)             # (B,) real tokens
    return 1.0 - (kept / (n * (n + 1) / 2).view(-1, 1)).mean(-1)

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
