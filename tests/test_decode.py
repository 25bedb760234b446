"""Decoding with the compact KV cache (decode.py): the model's greedy tokens and logits against the
masked full-cache decode and a full re-forward, the ring buffer over many wrap-arounds, the
memory it saves, the decode kernel against its naive twin, and bad input.

Without CUDA the kernel runs in Triton's CPU interpreter (conftest.py) in float32/float16, on few
drawn cases (about a second per call); on a GPU everything runs there and the drawn kernel cases are
bf16/fp16. Tolerance for the kernel (flash-attention's rule, as in test_kernels_triton.py): its max
error against float64 at most 2× the error of torch's own attention in the same dtype, plus a
round-off-sized floor.
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from elastic_attention import decode
import elastic_attention
from elastic_attention import kernels
from elastic_attention import masks
from elastic_attention.masks import BLOCK_SPARSE, FULL, STREAMING

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
MODEL_SETTINGS = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KERNEL_SETTINGS = settings(max_examples=25 if CUDA else 8, deadline=None,
                           suppress_health_check=[HealthCheck.too_slow])
FLOOR = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-4}
KERNEL_DTYPES = [torch.float16, torch.bfloat16] if CUDA else [torch.float32, torch.float16]
needs_triton = pytest.mark.skipif(not kernels.HAS_TRITON, reason="triton is not installed")


def tiny(**overrides):
    base = dict(vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=256,
                sink=2, window=5, block_size=4, xa_stride=2, pool_tokens=4)
    return elastic_attention.Config(**{**base, **overrides})


def model_and_tokens(cfg, B, S, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    model = elastic_attention.Transformer(cfg).to(DEVICE, dtype).eval()
    idx = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(seed + 1))
    return model, idx.to(DEVICE)


def random_modes(cfg, B, seed, values=(FULL, STREAMING)):
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, len(values), (cfg.n_layers, B, cfg.n_kv_heads), generator=g)
    return torch.tensor(values)[pick].to(DEVICE)            # (L, B, Hkv)


@torch.no_grad()
def decode_run(model, idx, new, modes, cache="compact", backend="reference"):
    """generate's loop by hand, keeping each step's logits: tokens (B, S + new), [logits (B, V)] × new."""
    c = model.cfg
    logits, info = model(idx, modes=modes)
    recs = info["records"]
    prefill = ([r["k"] for r in recs], [r["v"] for r in recs], info["modes"], c.sink, c.window, idx.shape[1] + new)
    if cache == "compact":
        kv = decode.KVCache.from_prefill(*prefill, backend=backend)
    else:
        kv = decode.FullKVCache.from_prefill(*prefill)
    out, steps = idx, []
    for _ in range(new):
        steps.append(logits[:, -1])
        out = torch.cat([out, steps[-1].argmax(-1, keepdim=True)], dim=1)
        logits = model.decode_step(out[:, -1:], out.shape[1] - 1, kv)
    return out, steps

# ----------------------------------------------------------------------------------------------
# The model: compact cache == masked full cache == re-running the whole sequence.

@MODEL_SETTINGS
@given(S=st.sampled_from([1, 5, 13]), sink=st.sampled_from([0, 2]), window=st.sampled_from([1, 3, 5, 64]),
       seed=st.integers(0, 10_000))
def test_compact_decode_equals_full_cache_and_reforward(S, sink, window, seed):
    """Modes drawn per layer, sample and head; past sink + window several times (window 64: the
    window covers the whole context, nothing is ever dropped)."""
    cfg = tiny(sink=sink, window=window)
    new = 3 * (sink + window) + 1 if window < 64 else 20
    model, idx = model_and_tokens(cfg, 3, S, seed)
    modes = random_modes(cfg, 3, seed)
    out, logits = decode_run(model, idx, new, modes, "compact")
    out_full, logits_full = decode_run(model, idx, new, modes, "full")
    assert torch.equal(out, out_full)
    reforward, _ = model(out[:, :-1], modes=modes)             # (B, S + new - 1, V), one causal pass
    for t, (a, b) in enumerate(zip(logits, logits_full)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(a, reforward[:, S - 1 + t], rtol=1e-10, atol=1e-10)
    gen, _ = model.generate(idx, new, modes=modes)             # the default path: compact
    assert torch.equal(gen, out[:, :S + new])


def test_sample_full_and_sample_streaming_in_one_batch_with_block_sparse_heads():
    """Sample 0 all FULL, sample 1 all STREAMING, sample 2 one head of each mode; BLOCK_SPARSE heads
    attend to their whole cache at decode in both caches (no re-forward: XAttention would re-pick
    its blocks on the longer sequence)."""
    cfg = tiny(n_kv_heads=4, n_heads=8, sink=1, window=3)
    model, idx = model_and_tokens(cfg, 3, 11, seed=3)
    per_sample = torch.tensor([[FULL] * 4, [STREAMING] * 4, [FULL, STREAMING, BLOCK_SPARSE, STREAMING]])
    modes = per_sample.expand(cfg.n_layers, 3, 4).to(DEVICE)
    out, logits = decode_run(model, idx, 25, modes, "compact")
    out_full, logits_full = decode_run(model, idx, 25, modes, "full")
    assert torch.equal(out, out_full)
    for a, b in zip(logits, logits_full):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    for b in range(3):  # each sample alone gives the same tokens as in the batch
        alone, _ = model.generate(idx[b:b + 1], 25, modes=modes[:, b:b + 1])
        assert torch.equal(alone, out[b:b + 1])


def test_zero_and_one_new_tokens():
    cfg = tiny()
    model, idx = model_and_tokens(cfg, 2, 6)
    modes = random_modes(cfg, 2, 0)
    assert torch.equal(model.generate(idx, 0, modes=modes)[0], idx)
    one, _ = model.generate(idx, 1, modes=modes)
    assert one.shape == (2, 7) and torch.equal(one, model.generate(idx, 1, modes=modes, cache="full")[0])


@needs_triton
def test_compact_decode_through_the_kernel_float32():
    """The Triton kernel inside the model (interpreter on a CPU), float32: the same tokens as the
    masked full-cache decode, logits within float32 round-off."""
    cfg = tiny(n_layers=1, sink=2, window=3)
    model, idx = model_and_tokens(cfg, 2, 9, seed=5, dtype=torch.float32)
    modes = torch.tensor([[[FULL, STREAMING], [STREAMING, BLOCK_SPARSE]]]).to(DEVICE)
    out, logits = decode_run(model, idx, 8, modes, "compact", backend="triton")
    out_full, logits_full = decode_run(model, idx, 8, modes, "full")
    assert torch.equal(out, out_full)
    for a, b in zip(logits, logits_full):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

# ----------------------------------------------------------------------------------------------
# The cache alone: every step against masked attention over the whole sequence.

@pytest.mark.parametrize("sink,window", [(2, 3), (0, 4), (1, 1), (70, 5), (3, 100)])
def test_ring_buffer_every_step_equals_masked_attention(sink, window):
    """36 decode steps: with window 3 the ring wraps 12 times, with window 1 every step; sink 70 /
    window 100 exceed the sequence (nothing is dropped)."""
    g = torch.Generator().manual_seed(sink * 100 + window)
    B, Hkv, G, T, D, S0 = 2, 3, 2, 40, 8, 4
    k = torch.randn(B, Hkv, T, D, generator=g, dtype=torch.float64).to(DEVICE)
    v = torch.randn(B, Hkv, T, D, generator=g, dtype=torch.float64).to(DEVICE)
    q = torch.randn(B, Hkv * G, T, D, generator=g, dtype=torch.float64).to(DEVICE)
    modes = torch.tensor([[FULL, STREAMING, BLOCK_SPARSE], [STREAMING, STREAMING, FULL]]).to(DEVICE)
    cache = decode.KVCache.from_prefill([k[:, :, :S0]], [v[:, :, :S0]], [modes], sink, window, T)
    dec_modes = torch.where(modes == BLOCK_SPARSE, FULL, modes)      # decode: BLOCK_SPARSE sees all
    for pos in range(S0, T):
        cache.write(0, pos, k[:, :, pos:pos + 1], v[:, :, pos:pos + 1])
        cache.n_tokens = pos + 1
        out = cache.attend(0, q[:, :, pos], pos + 1)                               # (B, Hq, D)
        mask = masks.hybrid_mask(pos + 1, dec_modes, sink, window, q_idx=torch.tensor([pos]))  # (B, Hkv, 1, T)
        ref = masks.masked_attention(q[:, :, pos:pos + 1], k[:, :, :pos + 1], v[:, :, :pos + 1], mask)
        torch.testing.assert_close(out, ref[:, :, 0], rtol=1e-12, atol=1e-12)
    ring = min(sink + window, T)
    assert cache.k[0].shape[0] == 3 * T + 3 * ring                   # 3 keep-all heads, 3 streaming


@pytest.mark.parametrize("frac", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_bytes_saved_are_the_ideal(frac):
    """Saved fraction of a full cache: exactly f·(1 − (sink + window)/T_max)."""
    Hkv, T, sink, window = 8, 1000, 16, 100
    modes = torch.full((2, Hkv), FULL)
    modes[:, :round(frac * Hkv)] = STREAMING
    cache = decode.KVCache([modes, modes], sink, window, T, 32, torch.float16, "cpu")
    full = decode.full_cache_bytes(2, 2, Hkv, T, 32, torch.float16)
    assert 1 - cache.nbytes() / full == pytest.approx(frac * (1 - (sink + window) / T), abs=1e-12)
    # The grid hints, from python ints, are the rows the heads hold at every length.
    for n in (1, 50, sink + window, 500, T):
        assert cache.extents(1, n) == dict(max_cap=T if frac < 1 else sink + window,
                                           live_rows=int(cache.cap[1].clamp(max=n).sum()))

# ----------------------------------------------------------------------------------------------
# The decode kernel against its naive twin, on drawn cases.

@st.composite
def decode_cases(draw):
    B = draw(st.sampled_from([1, 2]))
    Hkv = draw(st.sampled_from([1, 2, 3]))
    G = draw(st.sampled_from([1, 2, 4, 8]))
    D = draw(st.sampled_from([8, 128] if CUDA else [8, 40]))   # 8, 40: padded to 16, 64
    n_tokens = draw(st.integers(1, 5000 if CUDA else 120))
    long = draw(st.sampled_from([n_tokens, n_tokens + 7]))                # keep-all capacity
    caps = [long if draw(st.booleans()) else draw(st.integers(1, 70)) for _ in range(B * Hkv)]
    keys_per_split = draw(st.one_of(st.none(), st.sampled_from([16, 17, 48, 1000])))
    dtype = draw(st.sampled_from(KERNEL_DTYPES))
    seed = draw(st.integers(0, 2 ** 16))
    return B, Hkv, G, D, n_tokens, caps, keys_per_split, dtype, seed


def torch_error(q, k, v, start, cap, n_tokens, ref):
    """Max error of torch's SDPA in q's dtype on the same live rows: the yardstick."""
    n_live = cap.long().clamp(max=n_tokens)
    L = int(n_live.max())
    offs = torch.arange(L, device=q.device)
    live = offs < n_live[..., None]                                        # (B, Hkv, L)
    rows = torch.where(live, start[..., None] + offs, 0)
    G = q.shape[1] // cap.shape[1]
    kg, vg = k[rows].repeat_interleave(G, 1), v[rows].repeat_interleave(G, 1)  # (B, Hq, L, D)
    mask = live.repeat_interleave(G, 1)[:, :, None]                        # (B, Hq, 1, L)
    out = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], kg, vg, attn_mask=mask)
    return (out[:, :, 0].double() - ref).abs().max().item()


@needs_triton
@KERNEL_SETTINGS
@given(case=decode_cases())
def test_decode_kernel_equals_reference(case):
    B, Hkv, G, D, n_tokens, caps, keys_per_split, dtype, seed = case
    g = torch.Generator().manual_seed(seed)
    cap = torch.tensor(caps, dtype=torch.int32).view(B, Hkv)
    # Extents in a shuffled order: the kernel must follow start, not assume (b, h) order.
    order = torch.randperm(B * Hkv, generator=g)
    sizes = cap.flatten()[order].long()
    start = torch.empty(B * Hkv, dtype=torch.long)
    start[order] = sizes.cumsum(0) - sizes
    R = int(cap.sum())
    k = torch.randn(R, D, generator=g).to(DEVICE, dtype)
    v = torch.randn(R, D, generator=g).to(DEVICE, dtype)
    q = torch.randn(B, Hkv * G, D, generator=g).to(DEVICE, dtype)
    start, cap = start.view(B, Hkv).to(DEVICE), cap.to(DEVICE)
    out = decode.decode_attention(q, k, v, start, cap, n_tokens, keys_per_split=keys_per_split)
    # the grid sized from exact hints, unchecked, as KVCache gives them: the same launch
    hinted = decode.decode_attention(q, k, v, start, cap, n_tokens, keys_per_split=keys_per_split,
                                     max_cap=max(caps), live_rows=sum(min(c, n_tokens) for c in caps), check=False)
    assert torch.equal(out, hinted)
    ref = decode.decode_attention_reference(q.double(), k.double(), v.double(), start, cap, n_tokens)
    err = (out.double() - ref).abs()
    bound = 2 * torch_error(q, k, v, start, cap, n_tokens, ref) + FLOOR[dtype]
    assert out.dtype == dtype and not out.isnan().any()
    assert err.max().item() <= bound, (
        f"max diff {err.max().item():.3e} (mean {err.mean().item():.3e}) > bound {bound:.3e}; "
        f"B={B} Hkv={Hkv} G={G} D={D} n_tokens={n_tokens} caps={caps} keys_per_split={keys_per_split} {dtype}")

# ----------------------------------------------------------------------------------------------
# Bad input.

def test_bad_input():
    cfg = tiny()
    model, idx = model_and_tokens(cfg, 2, 6)
    modes = random_modes(cfg, 2, 1)
    for bad in (-3, 2.5, "4"):
        with pytest.raises(ValueError, match=f"max_new_tokens must be an int >= 0, got {bad!r}"):
            model.generate(idx, bad)
    with pytest.raises(ValueError, match="cache must be 'compact' or 'full', got 'paged'"):
        model.generate(idx, 2, cache="paged")
    with pytest.raises(ValueError, match="6 \\+ 251 new tokens exceed max_seq_len 256"):
        model.generate(idx, 251)

    _, info = model(idx, modes=modes)
    recs = info["records"]
    def cache_for(c, max_len=10):
        return decode.KVCache.from_prefill([r["k"] for r in recs], [r["v"] for r in recs],
                                           [r["modes"] for r in recs], c.sink, c.window, max_len)
    tok = idx[:, :1]
    with pytest.raises(ValueError, match="position 256 outside \\[0, max_seq_len=256\\)"):
        model.decode_step(tok, 256, cache_for(cfg))
    with pytest.raises(ValueError, match="cache holds 6 tokens of 2 samples; got position 8"):
        model.decode_step(tok, 8, cache_for(cfg))
    full = cache_for(cfg, max_len=6)  # room for the prompt only: position 6 does not fit
    with pytest.raises(ValueError, match="position 6: the cache holds 6 tokens of at most 6"):
        model.decode_step(tok, 6, full)
    other = tiny(window=7)            # a cache built for another config is refused
    with pytest.raises(ValueError, match="another config .*'window': \\(5, 7\\)"):
        model_and_tokens(other, 2, 6)[0].decode_step(tok, 6, cache_for(cfg))
    with pytest.raises(ValueError, match="does not fit a cache of max_len 4"):
        cache_for(cfg, max_len=4)

    q = torch.randn(2, 4, 16, device=DEVICE)
    k = torch.randn(50, 16, device=DEVICE)
    start = torch.tensor([[0, 20], [30, 40]], device=DEVICE)
    cap = torch.tensor([[20, 10], [10, 10]], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="n_tokens must be an int >= 1 .*, got 0"):
        decode.decode_attention_reference(q, k, k, start, cap, 0)
    with pytest.raises(ValueError, match="q must be \\(B, Hq, D\\), got \\(2, 4, 1, 16\\)"):
        decode.decode_attention_reference(q[:, :, None], k, k, start, cap, 5)
    with pytest.raises(ValueError, match="must both be \\(R, D\\) with D=16"):
        decode.decode_attention_reference(q, k[:, :8], k[:, :8], start, cap, 5)
    with pytest.raises(ValueError, match="must be \\(B, Hkv\\) with B=2 and Hkv dividing Hq=4"):
        decode.decode_attention_reference(q, k, k, start[:, :1].repeat(1, 3), cap.repeat(1, 3)[:, :3], 5)
    if kernels.HAS_TRITON:
        with pytest.raises(ValueError, match="keys_per_split must be an int >= 1, got 0"):
            decode.decode_attention(q, k, k, start, cap, 5, keys_per_split=0)
        with pytest.raises(ValueError, match="live_rows must be an int >= 1, got 12.5"):
            decode.decode_attention(q, k, k, start, cap, 5, live_rows=12.5)
        live = int(cap.clamp(max=5).sum())   # hints that would leave rows unread are refused
        top = int(cap.max())
        with pytest.raises(ValueError, match=f"max_cap 1 and live_rows None must be the caps' maximum {top}"):
            decode.decode_attention(q, k, k, start, cap, 5, max_cap=1)
        with pytest.raises(ValueError, match=f"live_rows {live - 1} must be .* their live rows {live}"):
            decode.decode_attention(q, k, k, start, cap, 5, live_rows=live - 1)
        with pytest.raises(ValueError, match="supports float16, bfloat16 and float32, got torch.float64"):
            decode.decode_attention(q.double(), k.double(), k.double(), start, cap, 5)
    # start and cap that would read outside k, or no row at all (NaN), or overflow start·D
    for s_, c_, message in ((start, cap * 0, "cap down to 0"), (start + 5, cap, "start \\+ cap up to 55"),
                            (start - 1, cap, "start down to -1"), (start.int(), cap, "start must be int64")):
        with pytest.raises(ValueError, match=message):
            decode.decode_attention_reference(q, k, k, s_, c_, 5)
    with pytest.raises(ValueError, match="modes must be in .* got \\[3\\]"):
        decode.KVCache([torch.tensor([[3, FULL]])], 4, 8, 32, 16, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="modes must be in .* got \\[3\\]"):   # at construction, as KVCache
        decode.FullKVCache([torch.tensor([[3, FULL]])], 4, 8, 32, 16, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="backend must be one of .*, got 'cuda'"):
        decode.KVCache([modes[0]], 2, 5, 10, 16, torch.float32, "cpu", backend="cuda")
