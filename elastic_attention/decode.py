"""decode.py — one token at a time: a KV cache that keeps, per (sample, KV head), only the keys that
head can still see, and the decode attention that reads exactly those (METHOD.md §3, §7).

Routing happens once, at prefill, and decoding reuses the decision (METHOD.md §7). From then on a
STREAMING head only ever looks at the first `sink` tokens and the last `window` ones, so it keeps
only those; a FULL head keeps everything. BLOCK_SPARSE heads keep everything too: XAttention is a
prefill method (it scores blocks of queries against blocks of keys, and decode has one query), so
at decode a BLOCK_SPARSE head attends to its whole cache, as the authors' decode does.

Layout. Per layer one K buffer and one V buffer, (R, D) rows. Each (sample, KV head) owns a
contiguous extent of rows, start[b, h] … start[b, h] + cap[b, h] - 1, sized by its prefill mode:

    keep-all heads (FULL, BLOCK_SPARSE)   cap = T_max (prompt + new tokens); row p holds position p
    STREAMING heads                       cap = sink + window; rows 0 … sink-1 hold the sinks,
                                          rows sink … sink+window-1 are a ring buffer: position
                                          p >= sink lives in row sink + (p - sink) % window

Example: B = 2, Hkv = 2, sink = 2, window = 3, T_max = 10, after 10 tokens (positions 0 … 9):

    modes        h = 0        h = 1
      b = 0      FULL         STREAMING          start = [[0, 10], [15, 20]]
      b = 1      STREAMING    BLOCK_SPARSE       cap   = [[10, 5], [5, 10]]      R = 30 rows

    row        0 … 9    | 10 11 | 12 13 14 | 15 16 | 17 18 19 | 20 … 29
    position   0 … 9    |  0  1 |  8  9  7 |  0  1 |  8  9  7 | 0 … 9
               (b0, h0) | (b0, h1)         | (b1, h0)         | (b1, h1)
                        |sinks  ring       |sinks  ring       |

    The query at position 9 of a STREAMING head may see key j iff j <= 9 and (j < 2 or 9 - j < 3),
    i.e. {0, 1, 7, 8, 9}: exactly the five rows its extent holds. Writing position 10 next
    overwrites row 14 (position 7), the one key query 10 no longer sees.

So after n tokens every head has min(n, cap) live rows, and they are exactly the keys the
token-exact predicate (masks.streaming; causal for keep-all heads) lets query n - 1 see. Softmax does
not care about order, so decode attention reads rows start … start + min(n, cap) - 1 of each head
and needs no mask at all. The mode lives only in (start, cap), fixed at prefill; the kernel is the
same walk for every head, and a STREAMING head's walk is short. Memory per sample: Σ_heads cap·D
rows of K and of V; against a full cache of T_max rows per head, a fraction f of STREAMING heads
saves exactly f·(1 - (sink + window) / T_max) (nbytes against full_cache_bytes).

FullKVCache, with the same interface, keeps every token of every head and masks at attention time:
the reference the compact cache is tested against.

Decode attention (flash-decoding, split-K): one query token per sample. Each program takes the G
query heads that share KV head h of sample b (GQA: they share every K/V tile it loads) against one
contiguous slice, a split, of that head's live rows, and writes a partial (o, lse); a STREAMING head
has few splits, a FULL one many, and the grid holds exactly the splits there are. A second small
kernel merges the splits of each query head. Splitting the key axis is what fills the GPU when
B·Hkv is small and the context long.

Shape letters: B batch, Hq query heads, Hkv KV heads, G = Hq // Hkv, D head dim, R rows of a
layer's buffer, T tokens so far, BLOCK_N keys per tile, BLOCK_G query rows per tile (G padded).
"""
import math

import torch

from .kernels import HAS_TRITON, check_backend, interpreting, resolve_backend, tl, triton, triton_unsupported
from . import masks
from .masks import BLOCK_SPARSE, FULL, STREAMING, check_sparse_params, masked_attention

# -----------------------------------------------------------------------------
# The cache.


def ring_row(pos, sink, window):
    """Row of position pos inside a STREAMING head's extent: sinks in place, the rest in a ring.
    pos is an int or a tensor of positions."""
    if isinstance(pos, torch.Tensor):
        return torch.where(pos < sink, pos, sink + (pos - sink) % window)
    return pos if pos < sink else sink + (pos - sink) % window


class KVCache:
    """Per-layer compact K/V buffers (see the module docstring for the layout).

    k[l], v[l]   (R_l, D) rows              start[l]  (B, Hkv) int64, first row of each head
    cap[l]       (B, Hkv) int32 capacity    stream[l] (B, Hkv) bool, STREAMING heads
    n_tokens     positions written so far (the same for every sample: prompts have equal length)
    """

    def __init__(self, modes, sink, window, max_len, head_dim, dtype, device, backend="auto"):
        """An empty cache: modes is a list of per-layer (B, Hkv) int tensors decided at prefill;
        max_len the most tokens it will hold (prompt + new tokens)."""
        check_sparse_params(sink, window)
        for m in modes:   # BLOCK_SPARSE heads keep every row, as FULL ones
            masks.check_modes(m, *modes[0].shape, block_mask_given=True)
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len must be an int >= 1, got {max_len!r}")
        check_backend(backend)
        self.sink, self.window, self.max_len, self.head_dim = sink, window, max_len, head_dim
        self.B, self.n_kv_heads = modes[0].shape
        self.backend, self.n_tokens = backend, 0
        self.k, self.v, self.start, self.cap, self.stream = [], [], [], [], []
        self.n_stream = []   # per layer, a python int: with ring and max_len, the grid's sizes at any length
        self.ring = ring = min(sink + window, max_len)   # a window reaching past max_len never wraps
        for m in modes:
            stream = (m == STREAMING).to(device)                                   # (B, Hkv)
            cap = torch.where(stream, ring, max_len).to(torch.int32)              # (B, Hkv)
            start = (cap.flatten().long().cumsum(0) - cap.flatten()).view_as(cap)  # exclusive prefix sum
            rows = int(cap.sum())                                                  # one host sync, at prefill
            self.k.append(torch.empty(rows, head_dim, dtype=dtype, device=device))  # (R, D)
            self.v.append(torch.empty(rows, head_dim, dtype=dtype, device=device))
            self.start.append(start)
            self.cap.append(cap)
            self.stream.append(stream)
            self.n_stream.append(int(stream.sum()))                                # one host sync, at prefill

    @classmethod
    def from_prefill(cls, ks, vs, modes, sink, window, max_len, backend="auto"):
        """A cache holding a prompt: ks, vs per layer (B, Hkv, S, D) after RoPE; modes per layer
        (B, Hkv). STREAMING heads keep positions p < sink and p >= S - window (those the next
        query, S, can still see), each at ring_row(p)."""
        B, Hkv, S, D = ks[0].shape
        if S > max_len:
            raise ValueError(f"prompt of {S} tokens does not fit a cache of max_len {max_len}")
        cache = cls(modes, sink, window, max_len, D, ks[0].dtype, ks[0].device, backend)
        pos = torch.arange(S, device=ks[0].device)                                 # (S,)
        stream_keep = (pos < sink) | (pos >= S - window)                          # (S,)
        for l, (k, v) in enumerate(zip(ks, vs)):
            stream = cache.stream[l][..., None]                                    # (B, Hkv, 1)
            rows = cache.start[l][..., None] + torch.where(stream, ring_row(pos, sink, window), pos)  # (B, Hkv, S)
            keep = ~stream | stream_keep                                           # (B, Hkv, S)
            cache.k[l][rows[keep]] = k[keep]                                       # (kept, D)
            cache.v[l][rows[keep]] = v[keep]
        cache.n_tokens = S
        return cache

    def check_config(self, n_layers, n_kv_heads, head_dim, sink, window):
        """Refuse a cache built for another model configuration (a ValueError naming the fields)."""
        ours = dict(n_layers=len(self.k), n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
                    sink=self.sink, window=self.window)
        theirs = dict(n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim, sink=sink, window=window)
        diff = {f: (ours[f], theirs[f]) for f in ours if ours[f] != theirs[f]}
        if diff:
            raise ValueError(f"KV cache was built for another config (cache, model): {diff}")

    def check_position(self, pos):
        """The next position to write is the one after the tokens held, and it must fit."""
        if pos != self.n_tokens or pos >= self.max_len:
            raise ValueError(f"position {pos}: the cache holds {self.n_tokens} tokens of at most {self.max_len}")

    def write(self, layer, pos, k, v):
        """Store the K/V of position pos: k, v (B, Hkv, 1, D)."""
        self.check_position(pos)
        slot = torch.where(self.stream[layer], ring_row(pos, self.sink, self.window), pos)  # (B, Hkv)
        rows = (self.start[layer] + slot).flatten()                                         # (B·Hkv,)
        self.k[layer].index_copy_(0, rows, k.reshape(-1, self.head_dim))                     # (B·Hkv, D)
        self.v[layer].index_copy_(0, rows, v.reshape(-1, self.head_dim))

    def attend(self, layer, q, n_tokens):
        """Decode attention of q (B, Hq, D) over the first n_tokens positions → (B, Hq, D). The cache
        made start, cap and the extents itself: no host sync checks them."""
        args = (q, self.k[layer], self.v[layer], self.start[layer], self.cap[layer], n_tokens)
        if resolve_backend(self.backend, q.dtype, q.is_cuda, self.head_dim) == "triton":
            return decode_attention(*args, **self.extents(layer, n_tokens), check=False)
        return decode_attention_reference(*args, check=False)   # "torch" too: decode has no better torch path

    def extents(self, layer, n_tokens):
        """decode_attention's grid sizes for this layer at n_tokens, from python ints (no host sync):
        the longest head's rows and the rows all heads hold."""
        n_stream, n_long = self.n_stream[layer], self.B * self.n_kv_heads - self.n_stream[layer]
        live_rows = n_stream * min(self.ring, n_tokens) + n_long * min(self.max_len, n_tokens)
        return dict(max_cap=self.max_len if n_long else self.ring, live_rows=live_rows)

    def nbytes(self):
        """Bytes of K and V held, all layers and samples."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class FullKVCache:
    """The reference KVCache is tested against, with the same interface (from_prefill, write, attend,
    check_config, n_tokens): every head keeps every token, (B, Hkv, max_len, D) per layer, and a
    one-row mask from masks.hybrid_mask hides what a head may not see. Attention is always the naive
    masked_attention, whatever the model's backend."""

    def __init__(self, modes, sink, window, max_len, head_dim, dtype, device):
        check_sparse_params(sink, window)
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len must be an int >= 1, got {max_len!r}")
        self.sink, self.window, self.max_len, self.head_dim = sink, window, max_len, head_dim
        for m in modes:
            masks.check_modes(m, *modes[0].shape, block_mask_given=True)
        self.B, self.n_kv_heads = modes[0].shape
        # At decode a BLOCK_SPARSE head sees its whole cache, like a FULL one (module docstring).
        self.modes = [torch.where(m == BLOCK_SPARSE, FULL, m).to(device) for m in modes]   # (B, Hkv) each
        shape = (self.B, self.n_kv_heads, max_len, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in modes]          # (B, Hkv, T, D)
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in modes]
        self.n_tokens = 0

    @classmethod
    def from_prefill(cls, ks, vs, modes, sink, window, max_len):
        """A cache holding a prompt: ks, vs per layer (B, Hkv, S, D) after RoPE; modes per layer (B, Hkv)."""
        B, Hkv, S, D = ks[0].shape
        if S > max_len:
            raise ValueError(f"prompt of {S} tokens does not fit a cache of max_len {max_len}")
        cache = cls(modes, sink, window, max_len, D, ks[0].dtype, ks[0].device)
        for l, (k, v) in enumerate(zip(ks, vs)):
            cache.k[l][:, :, :S] = k
            cache.v[l][:, :, :S] = v
        cache.n_tokens = S
        return cache

    # The same checks as the compact cache: they read only the fields both classes have.
    check_config = KVCache.check_config
    check_position = KVCache.check_position

    def write(self, layer, pos, k, v):
        """Store the K/V of position pos: k, v (B, Hkv, 1, D)."""
        self.check_position(pos)
        self.k[layer][:, :, pos:pos + 1] = k
        self.v[layer][:, :, pos:pos + 1] = v

    def attend(self, layer, q, n_tokens):
        """Attention of q (B, Hq, D), the query at position n_tokens - 1, over the first n_tokens → (B, Hq, D)."""
        mask = masks.hybrid_mask(n_tokens, self.modes[layer], self.sink, self.window,
                                 q_idx=torch.tensor([n_tokens - 1]), check=False)     # (B, Hkv, 1, n_tokens)
        k, v = self.k[layer][:, :, :n_tokens], self.v[layer][:, :, :n_tokens]          # (B, Hkv, n_tokens, D)
        return masked_attention(q[:, :, None], k, v, mask)[:, :, 0]                   # (B, Hq, D)

    def nbytes(self):
        """Bytes of K and V held, all layers and samples: full_cache_bytes."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def full_cache_bytes(n_layers, B, n_kv_heads, max_len, head_dim, dtype):
    """What a cache keeping every token for every head holds."""
    return 2 * n_layers * B * n_kv_heads * max_len * head_dim * torch.empty(0, dtype=dtype).element_size()

# -----------------------------------------------------------------------------
# Decode attention: the naive twin, then the Triton kernels.


def check_decode_inputs(q, k, v, start, cap, n_tokens, check=True):
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be (B, Hq, D), got {tuple(q.shape) if isinstance(q, torch.Tensor) else type(q)}")
    B, Hq, D = q.shape
    if k.dim() != 2 or k.shape != v.shape or k.shape[1] != D:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be (R, D) with D={D}")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} "
                         f"on {q.device}/{k.device}/{v.device}")
    if (start.dim() != 2 or start.shape != cap.shape or start.shape[0] != B or start.shape[1] < 1
            or Hq % start.shape[1]):
        raise ValueError(f"start {tuple(start.shape)} and cap {tuple(cap.shape)} must be (B, Hkv) with B={B} "
                         f"and Hkv dividing Hq={Hq}")
    if start.dtype != torch.int64 or cap.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"start must be int64 (start·D passes 2^31 in a long cache) and cap int32 or int64, "
                         f"got {start.dtype} and {cap.dtype}")
    if not isinstance(n_tokens, int) or n_tokens < 1:
        raise ValueError(f"n_tokens must be an int >= 1 (the query sees itself), got {n_tokens!r}")
    if check and start.numel():   # one host sync; a cache's own start and cap skip it
        low_cap, low_start, end = torch.stack([cap.min().long(), start.min(), (start + cap).max()]).tolist()
        if low_cap < 1 or low_start < 0 or end > k.shape[0]:
            raise ValueError(f"each head needs cap >= 1 and rows start … start + cap - 1 inside k's {k.shape[0]} "
                             f"rows, got cap down to {low_cap}, start down to {low_start}, start + cap up to {end}")
    return B, Hq, start.shape[1], D


def decode_attention_reference(q, k, v, start, cap, n_tokens, check=True):
    """The naive twin of decode_attention (same signature): gather each head's live rows
    start … start + min(cap, n_tokens) - 1 into a padded (B, Hkv, L, D) copy and run masked softmax
    attention on it. Costs a copy of every live row plus the padding (B·Hkv·L·D elements, L the
    longest head), in float32 (float64 for float64 input); the kernel reads each live row once."""
    check_decode_inputs(q, k, v, start, cap, n_tokens, check)
    n_live = cap.long().clamp(max=n_tokens)                        # (B, Hkv)
    L = int(n_live.max())
    offs = torch.arange(L, device=q.device)
    live = offs < n_live[..., None]                                # (B, Hkv, L)
    rows = torch.where(live, start[..., None] + offs, 0)           # (B, Hkv, L); padding reads row 0
    out = masked_attention(q[:, :, None], k[rows], v[rows], live[:, :, None])  # (B, Hq, 1, D)
    return out[:, :, 0]                                            # (B, Hq, D)


if HAS_TRITON:
    @triton.jit(do_not_specialize=["n_tokens", "keys_per_split", "n_heads", "H_KV", "G"])
    def _decode_split_kernel(
        Q, K, V, Start, Cap, Opart, Lse,                                   # pointers
        n_tokens, keys_per_split, n_heads, H_KV, G, qk_scale,              # sizes and scalars
        stride_qb, stride_qh, stride_qd, stride_kr, stride_kd, stride_vr, stride_vd,  # strides
        stride_sb, stride_sh, stride_cb, stride_ch,
        stride_ob, stride_oh, stride_os, stride_od, stride_lb, stride_lh, stride_ls,
        BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_BH: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        """One program = the G query heads of one (sample, KV head) against one slice of its live rows."""
        # -- 1. program id -> (sample, KV head, split) and this split's rows lo … hi-1 ----------------
        # The programs are the heads' splits one after another, head by head: a short (STREAMING) head
        # has few, so no program is spent on a split past its rows. Each program finds its head from
        # the running count of splits over all B·Hkv heads (n_heads <= BLOCK_BH of them).
        pid = tl.program_id(0)
        offs_h = tl.arange(0, BLOCK_BH)
        caps = tl.load(Cap + (offs_h // H_KV) * stride_cb + (offs_h % H_KV) * stride_ch, mask=offs_h < n_heads,
                       other=0)
        used = (tl.minimum(caps, n_tokens) + keys_per_split - 1) // keys_per_split   # splits per head
        ends = tl.cumsum(used, 0)                                                    # (BLOCK_BH,) inclusive
        valid = pid < tl.max(ends, 0)                   # the grid may overshoot the total by < n_heads
        bh = tl.minimum(tl.sum((ends <= pid).to(tl.int32), 0), n_heads - 1)
        split = pid - tl.sum(tl.where(offs_h == bh, ends - used, 0), 0)
        b = bh // H_KV
        h = bh % H_KV
        n_live = tl.where(valid, tl.minimum(tl.load(Cap + b * stride_cb + h * stride_ch), n_tokens), 0)
        lo = split * keys_per_split
        hi = tl.minimum(lo + keys_per_split, n_live)    # hi <= lo only past the last split: no rows

        # -- 2. pointers: the G query rows (padded to BLOCK_G >= 16 for tl.dot) and the head's rows ---
        offs_g = tl.arange(0, BLOCK_G)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM                        # a non-power-of-two D is padded
        h_q = h * G + offs_g                            # query heads of this KV head
        q = tl.load(Q + b.to(tl.int64) * stride_qb + h_q[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                    mask=(offs_g[:, None] < G) & d_ok[None, :], other=0.0)      # (BLOCK_G, BLOCK_D)
        row0 = tl.load(Start + b * stride_sb + h * stride_sh)                   # int64: R·D can pass 2³¹
        k_ptrs = K + (row0 + offs_n)[:, None] * stride_kr + offs_d[None, :] * stride_kd  # rows 0 … BLOCK_N-1
        v_ptrs = V + (row0 + offs_n)[:, None] * stride_vr + offs_d[None, :] * stride_vd

        # -- 3. online softmax over the slice, in fp32 and the log2 domain (qk_scale holds 1/ln 2) -----
        m_i = tl.zeros([BLOCK_G], dtype=tl.float32) - float("inf")   # running max
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)                  # running Σ exp2(s - m_i)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)         # running Σ p v
        for n0 in range(lo, hi, BLOCK_N):
            in_slice = (n0 + offs_n) < hi                                         # (BLOCK_N,)
            k = tl.load(k_ptrs + n0 * stride_kr, mask=in_slice[:, None] & d_ok[None, :], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)           # (BLOCK_G, BLOCK_N)
            qk = tl.where(in_slice[None, :], qk * qk_scale, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))      # finite: every tile has a key in the slice
            p = tl.math.exp2(qk - m_ij[:, None])                                 # (BLOCK_G, BLOCK_N)
            alpha = tl.math.exp2(m_i - m_ij)           # rescales what was summed under the old max
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptrs + n0 * stride_vr, mask=in_slice[:, None] & d_ok[None, :], other=0.0)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
            m_i = m_ij

        # -- 4. store this split's normalised output and its log-sum-exp (log2 units) -----------------
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)         # 0 only past the last split, which stores nothing
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        g_ok = offs_g < tl.where(valid, G, 0)          # a program past the last split stores nothing
        o_ptrs = Opart + b.to(tl.int64) * stride_ob + h_q[:, None] * stride_oh + split * stride_os \
            + offs_d[None, :] * stride_od
        tl.store(o_ptrs, acc / l_safe[:, None], mask=g_ok[:, None] & d_ok[None, :])
        tl.store(Lse + b * stride_lb + h_q * stride_lh + split * stride_ls, lse, mask=g_ok)

    @triton.jit(do_not_specialize=["n_tokens", "keys_per_split", "H_Q", "G"])
    def _decode_combine_kernel(
        Opart, Lse, Cap, Out,
        n_tokens, keys_per_split, H_Q, G,
        stride_pb, stride_ph, stride_ps, stride_pd, stride_lb, stride_lh, stride_ls,
        stride_cb, stride_ch, stride_ob, stride_oh, stride_od,
        BLOCK_S: tl.constexpr, BLOCK_DC: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):
        """One program = BLOCK_DC features of one (sample, query head): merge its used splits,
        BLOCK_S at a time, o = Σ_s 2^(lse_s - m) o_s / Σ_s 2^(lse_s - m)."""
        pid = tl.program_id(0)
        b = pid // H_Q
        h_q = pid % H_Q
        n_live = tl.minimum(tl.load(Cap + b * stride_cb + (h_q // G) * stride_ch), n_tokens)
        n_used = (n_live + keys_per_split - 1) // keys_per_split   # later splits hold no row of this head
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.program_id(1) * BLOCK_DC + tl.arange(0, BLOCK_DC)
        d_ok = offs_d < HEAD_DIM
        o_base = Opart + b.to(tl.int64) * stride_pb + h_q * stride_ph
        l_base = Lse + b.to(tl.int64) * stride_lb + h_q * stride_lh
        # Scalar running max and sum, made as reductions so that they are fp32 tensors from the start.
        m_i = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
        l_i = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
        acc = tl.zeros([BLOCK_DC], dtype=tl.float32)
        for s0 in range(0, n_used, BLOCK_S):
            s_ok = (s0 + offs_s) < n_used
            lse = tl.load(l_base + (s0 + offs_s) * stride_ls, mask=s_ok, other=float("-inf"))   # (BLOCK_S,)
            o = tl.load(o_base + (s0 + offs_s)[:, None] * stride_ps + offs_d[None, :] * stride_pd,
                        mask=s_ok[:, None] & d_ok[None, :], other=0.0)                      # (BLOCK_S, BLOCK_DC)
            m_new = tl.maximum(m_i, tl.max(lse, 0))     # finite: every used split holds a row
            alpha = tl.math.exp2(m_i - m_new)
            w = tl.math.exp2(lse - m_new)                                                   # (BLOCK_S,)
            l_i = l_i * alpha + tl.sum(w, 0)
            acc = acc * alpha + tl.sum(w[:, None] * o, 0)
            m_i = m_new
        tl.store(Out + b.to(tl.int64) * stride_ob + h_q * stride_oh + offs_d * stride_od,
                 acc / l_i, mask=d_ok)


def _decode_config(interpret):
    """(BLOCK_N, num_warps, num_stages, min and max keys per split). GPU: 64-key tiles (16 KB of K and
    of V at D = 128, bf16) with 3 stages of prefetch, 96 KB of shared memory: two programs fit an SM.
    A split is at least 256 keys, so its partial output (G·D fp32, written and read again) is a few
    percent of the K/V it reads, and at most 4096, so that a large batch still gives each SM several
    programs. Interpreter: small tiles and splits, so that short test caches cross several of each."""
    if interpret:
        return 16, 4, 1, 32, 64
    return 64, 4, 3, 256, 4096


def decode_attention(q, k, v, start, cap, n_tokens, *, max_cap=None, live_rows=None, keys_per_split=None,
                     config=None, check=True):
    """One query token per sample against the compact cache: q (B, Hq, D); k, v (R, D) rows; head
    (b, h) reads rows start[b, h] … start[b, h] + min(cap[b, h], n_tokens) - 1. Returns (B, Hq, D) in
    q's dtype; the same numbers as decode_attention_reference.

    Grid: one program per keys_per_split rows of a head (a head with fewer live rows gets fewer
    programs), then B·Hq programs to merge each head's splits. max_cap (an int, the largest cap) and
    live_rows (an int, Σ min(cap, n_tokens) over the heads: the rows read) size the grid without a
    host sync. keys_per_split defaults to about two programs per SM over the rows the heads really
    hold, within the config's bounds; config = (BLOCK_N, num_warps, num_stages, min and max keys per
    split) overrides _decode_config. check=False: the caller vouches for start, cap and the hints
    (KVCache.attend: the cache made them), so that no host sync reads them.
    """
    B, Hq, Hkv, D = check_decode_inputs(q, k, v, start, cap, n_tokens, check)
    reason = triton_unsupported(q.dtype, q.is_cuda, D)
    if reason is not None:
        raise ValueError(f"decode_attention: {reason}")
    interpret = interpreting()
    G = Hq // Hkv
    BLOCK_N, num_warps, num_stages, min_split, max_split = config or _decode_config(interpret)
    if live_rows is not None and (not isinstance(live_rows, int) or live_rows < 1):
        raise ValueError(f"live_rows must be an int >= 1, got {live_rows!r}")
    if check or max_cap is None or live_rows is None:   # host syncs
        true_max, true_rows = int(cap.max()), int(cap.clamp(max=n_tokens).sum())
        if max_cap not in (None, true_max) or live_rows not in (None, true_rows):  # a wrong grid misses rows
            raise ValueError(f"max_cap {max_cap} and live_rows {live_rows} must be the caps' maximum "
                             f"{true_max} and their live rows {true_rows}")
        max_cap, live_rows = true_max, true_rows
    live_max = min(max_cap, n_tokens)
    if keys_per_split is None:
        # Sized by the rows read, not B·Hkv·live_max: at batch 1 with most heads STREAMING, a few FULL
        # heads hold nearly all rows, and splits sized as if every head were that long are too short
        # to fill the pipeline of the programs that do the work.
        n_sm = 1 if interpret else torch.cuda.get_device_properties(q.device).multi_processor_count
        keys_per_split = min(max(min_split, triton.cdiv(live_rows, 2 * n_sm)), max_split)
        keys_per_split = triton.cdiv(keys_per_split, BLOCK_N) * BLOCK_N  # whole tiles
    elif not isinstance(keys_per_split, int) or keys_per_split < 1:
        raise ValueError(f"keys_per_split must be an int >= 1, got {keys_per_split!r}")
    n_splits = triton.cdiv(live_max, keys_per_split)
    # Σ over heads of ceil(rows / keys_per_split) < ceil(live_rows / keys_per_split) + B·Hkv: a bound
    # from python ints, so no host sync; the few programs past the true total store nothing.
    n_programs = min(triton.cdiv(live_rows, keys_per_split) + B * Hkv, n_splits * B * Hkv)

    opart = torch.empty(B, Hq, n_splits, D, dtype=torch.float32, device=q.device)  # (B, Hq, splits, D)
    lse = torch.empty(B, Hq, n_splits, dtype=torch.float32, device=q.device)       # (B, Hq, splits)
    out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)                     # (B, Hq, D)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    qk_scale = 1.4426950408889634 / math.sqrt(D)   # softmax scale 1/√D times 1/ln 2: we use exp2
    _decode_split_kernel[(n_programs,)](
        q, k, v, start, cap, opart, lse,
        n_tokens, keys_per_split, B * Hkv, Hkv, G, qk_scale,
        *q.stride(), *k.stride(), *v.stride(), *start.stride(), *cap.stride(),
        *opart.stride(), *lse.stride(),
        BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, HEAD_DIM=D,
        BLOCK_BH=triton.next_power_of_2(B * Hkv),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # true fp32 products for fp32
        num_warps=num_warps, num_stages=num_stages)
    # Merge: most heads' splits fit one BLOCK_S chunk (a loop of dependent loads is latency-bound),
    # and D is cut into 32-wide slices so that a (BLOCK_S, BLOCK_DC) fp32 tile stays in registers.
    BLOCK_S = 16 if interpret else min(128, max(16, triton.next_power_of_2(n_splits)))
    BLOCK_DC = BLOCK_D if interpret else min(BLOCK_D, 32)
    _decode_combine_kernel[(B * Hq, triton.cdiv(D, BLOCK_DC))](
        opart, lse, cap, out,
        n_tokens, keys_per_split, Hq, G,
        *opart.stride(), *lse.stride(), *cap.stride(), *out.stride(),
        BLOCK_S=BLOCK_S, BLOCK_DC=BLOCK_DC, HEAD_DIM=D, num_warps=4)
    return out
