"""The ground truth itself: mask predicates, hybrid_mask, the naive reference, Ω_ESR, bad input.

Everything else in the project is tested against these, so they are tested against the most
literal code we can write: Python loops over (i, j) straight from the definitions in METHOD.md §3.
"""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from elastic_attention import kernels
from elastic_attention import masks
from elastic_attention.masks import BLOCK_SPARSE, FULL, STREAMING

SETTINGS = settings(max_examples=30, deadline=None)


def loop_mask(S, mode, sink, window, block_mask=None, block_size=64):
    """One head's (S, S) mask, one pair at a time, from the definitions."""
    m = torch.zeros(S, S, dtype=torch.bool)
    for i in range(S):
        for j in range(i + 1):
            if mode == FULL:
                m[i, j] = True
            elif mode == STREAMING:
                m[i, j] = j < sink or i - j < window
            else:
                m[i, j] = bool(block_mask[i // block_size, j // block_size])
    return m


def loop_attention(q, k, v, mask):
    """One head, float64, softmax written out: q/k/v (S, D), mask (S, S)."""
    S, D = q.shape
    out = torch.zeros(S, D, dtype=torch.float64)
    for i in range(S):
        keys = mask[i].nonzero().flatten()
        if len(keys) == 0:
            continue
        s = torch.stack([q[i] @ k[j] for j in keys]) / math.sqrt(D)
        p = torch.exp(s - s.max())
        out[i] = (p[:, None] * v[keys]).sum(0) / p.sum()
    return out


def random_case(B, Hkv, G, S, D, block_size, seed, p_block=0.5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, S, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64)
    modes = torch.randint(0, 3, (B, Hkv), generator=g)
    nB = masks.num_blocks(S, block_size)
    block_mask = torch.rand(B, Hkv, nB, nB, generator=g) < p_block
    return q, k, v, modes, block_mask


lengths = st.sampled_from([1, 2, 7, 16, 17, 31, 64, 97, 130])


@SETTINGS
@given(S=lengths, sink=st.integers(0, 20), window=st.integers(1, 40), block_size=st.sampled_from([4, 16, 64]),
       seed=st.integers(0, 2**16))
def test_hybrid_mask_matches_definition(S, sink, window, block_size, seed):
    _, _, _, modes, bm = random_case(2, 3, 1, S, 4, block_size, seed)
    mask = masks.hybrid_mask(S, modes, sink, window, bm, block_size)
    for b in range(2):
        for h in range(3):
            want = loop_mask(S, int(modes[b, h]), sink, window, bm[b, h], block_size)
            assert torch.equal(mask[b, h], want), f"b={b} h={h} mode={int(modes[b, h])}"


@SETTINGS
@given(S=st.sampled_from([1, 5, 17, 40]), G=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**16))
def test_naive_attention_matches_loops_and_gqa_shares_modes(S, G, seed):
    """Each query head uses the mask of its KV head h // G (contiguous groups)."""
    q, k, v, modes, bm = random_case(2, 2, G, S, 8, 4, seed)
    out = kernels.hybrid_attention(q, k, v, modes, 2, 3, bm, 4, backend="reference")
    for b in range(2):
        for hq in range(2 * G):
            hk = hq // G
            mask = loop_mask(S, int(modes[b, hk]), 2, 3, bm[b, hk], 4)
            want = loop_attention(q[b, hq], k[b, hk], v[b, hk], mask)
            torch.testing.assert_close(out[b, hq], want, rtol=1e-10, atol=1e-10)


@SETTINGS
@given(S=lengths, sink=st.integers(0, 8), seed=st.integers(0, 2**16))
def test_streaming_with_window_at_least_S_is_full(S, sink, seed):
    q, k, v, _, _ = random_case(1, 2, 2, S, 8, 16, seed)
    full = torch.full((1, 2), FULL)
    stream = torch.full((1, 2), STREAMING)
    for window in (S, S + 5):
        assert torch.equal(masks.hybrid_mask(S, stream, sink, window), masks.hybrid_mask(S, full, sink, window))
        torch.testing.assert_close(kernels.hybrid_attention(q, k, v, stream, sink, window),
                                   kernels.hybrid_attention(q, k, v, full, sink, window), rtol=0, atol=0)


@SETTINGS
@given(S=lengths, window=st.integers(1, 10), seed=st.integers(0, 2**16))
def test_streaming_with_sink_at_least_S_is_full(S, window, seed):
    modes = torch.full((1, 1), STREAMING)
    assert torch.equal(masks.hybrid_mask(S, modes, S, window), masks.hybrid_mask(S, modes * 0, 0, window))


@SETTINGS
@given(S=lengths, block_size=st.sampled_from([4, 16, 64]), seed=st.integers(0, 2**16))
def test_block_sparse_with_every_block_on_is_full(S, block_size, seed):
    q, k, v, _, _ = random_case(1, 2, 1, S, 8, block_size, seed)
    nB = masks.num_blocks(S, block_size)
    bm = torch.ones(1, 2, nB, nB, dtype=torch.bool)
    out = kernels.hybrid_attention(q, k, v, torch.full((1, 2), BLOCK_SPARSE), 0, 1, bm, block_size)
    torch.testing.assert_close(out, kernels.hybrid_attention(q, k, v, torch.zeros(1, 2, dtype=torch.long), 0, 1),
                               rtol=0, atol=0)


def test_rows_with_no_visible_key_are_zero_not_nan():
    S, bs = 20, 4
    q, k, v, _, _ = random_case(1, 1, 2, S, 8, bs, 0)
    nB = masks.num_blocks(S, bs)
    bm = torch.ones(1, 1, nB, nB, dtype=torch.bool)
    bm[0, 0, 2, :] = False  # query block 2 (rows 8..11) sees nothing
    q.requires_grad_(True)
    out = kernels.hybrid_attention(q, k, v, torch.full((1, 1), BLOCK_SPARSE), 0, 1, bm, bs)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, :, 8:12], torch.zeros_like(out[0, :, 8:12]))
    assert out[0, :, 12:].abs().sum() > 0
    out.sum().backward()
    assert torch.isfinite(q.grad).all(), "gradient through an empty row must stay finite"


@SETTINGS
@given(S=lengths, seed=st.integers(0, 2**16))
def test_batch_with_different_modes_equals_one_sample_at_a_time(S, seed):
    q, k, v, modes, bm = random_case(3, 2, 2, S, 8, 16, seed)
    out = kernels.hybrid_attention(q, k, v, modes, 3, 5, bm, 16, backend="reference")
    for b in range(3):  # (backend "torch" would take SDPA for a sample whose heads share one mode)
        one = kernels.hybrid_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], modes[b:b + 1], 3, 5, bm[b:b + 1], 16,
                                       backend="reference")
        torch.testing.assert_close(out[b:b + 1], one, rtol=0, atol=0)


def test_omega_esr_hand_computed():
    # S = 4, sink 1, window 1: row i keeps {0, i} → 1 + 2 + 2 + 2 = 7 of 10 causal pairs.
    modes = torch.tensor([[FULL, STREAMING]])
    mask = masks.hybrid_mask(4, modes, 1, 1)
    assert mask[0, 1].sum() == 7
    assert masks.omega_esr(mask).item() == pytest.approx((0.0 + 0.3) / 2)
    # Two layers: the mean over layers.
    mask_full = masks.hybrid_mask(4, torch.tensor([[FULL, FULL]]), 1, 1)
    assert masks.omega_esr([mask, mask_full]).item() == pytest.approx(0.075)
    # Block-sparse S = 8, block 4, only the diagonal blocks: 2 × (1+2+3+4) = 20 of 36 pairs kept.
    bm = torch.eye(2, dtype=torch.bool).view(1, 1, 2, 2)
    m = masks.hybrid_mask(8, torch.tensor([[BLOCK_SPARSE]]), 0, 1, bm, 4)
    assert masks.omega_esr(m).item() == pytest.approx(1 - 20 / 36)


@SETTINGS
@given(S=lengths, sink=st.integers(0, 20), window=st.integers(1, 40), block_size=st.sampled_from([4, 16]),
       seed=st.integers(0, 2**16))
def test_closed_form_esr_equals_mask_esr(S, sink, window, block_size, seed):
    _, _, _, modes, bm = random_case(2, 3, 1, S, 4, block_size, seed)
    mask = masks.hybrid_mask(S, modes, sink, window, bm, block_size)
    assert torch.equal(masks.kept_pairs(S, modes, sink, window, bm, block_size), mask.sum((-2, -1)).double())
    torch.testing.assert_close(masks.omega_esr_closed_form(S, modes, sink, window, bm, block_size), masks.omega_esr(mask))


@SETTINGS
@given(S=lengths, sink=st.integers(0, 20), window=st.integers(1, 40), block_size=st.sampled_from([4, 16]),
       seed=st.integers(0, 2**16), data=st.data())
def test_closed_form_esr_counts_only_real_tokens(S, sink, window, block_size, seed, data):
    """With right padding (sample b real up to lengths[b]) the count is hybrid_mask restricted to
    the real (query, key) pairs, and Ω_ESR is that sample's own, as if it had never been padded."""
    _, _, _, modes, bm = random_case(3, 2, 1, S, 4, block_size, seed)
    lens = torch.tensor(data.draw(st.lists(st.integers(1, S), min_size=3, max_size=3)))
    mask = masks.hybrid_mask(S, modes, sink, window, bm, block_size)                 # (B, Hkv, S, S)
    kept = masks.kept_pairs(S, modes, sink, window, bm, block_size, lengths=lens)    # (B, Hkv)
    esr = masks.omega_esr_closed_form(S, modes, sink, window, bm, block_size, lengths=lens)
    for b, L in enumerate(lens.tolist()):
        real = mask[b:b + 1, :, :L, :L]                                              # (1, Hkv, L, L)
        assert torch.equal(kept[b], real.sum((-2, -1)).double()[0]), f"sample {b}, length {L} of {S}"
        torch.testing.assert_close(esr[b:b + 1], masks.omega_esr(real))
    full_lens = torch.full((3,), S)
    assert torch.equal(masks.kept_pairs(S, modes, sink, window, bm, block_size, lengths=full_lens),
                       masks.kept_pairs(S, modes, sink, window, bm, block_size))
    with pytest.raises(ValueError, match=r"lengths must be in \[1, S"):
        masks.omega_esr_closed_form(S, modes, sink, window, bm, block_size, lengths=full_lens + 1)


def test_reference_is_differentiable_in_float32():
    q, k, v, modes, bm = random_case(1, 2, 2, 33, 8, 16, 1)
    q, k, v = (t.float().requires_grad_(True) for t in (q, k, v))
    kernels.hybrid_attention(q, k, v, modes, 2, 4, bm, 16).square().sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0


# -----------------------------------------------------------------------------
# Bad input: a clear ValueError naming the bad value.

def _qkv(Hq=4, Hkv=2, S=8, D=8, dtype=torch.float32):
    return torch.randn(1, Hq, S, D, dtype=dtype), torch.randn(1, Hkv, S, D, dtype=dtype), \
        torch.randn(1, Hkv, S, D, dtype=dtype)


@pytest.mark.parametrize("kwargs, match", [
    (dict(window=0), "window"),
    (dict(sink=-1), "sink"),
    (dict(block_size=12), "power of two"),
    (dict(modes=torch.tensor([[0, 3]])), "modes"),
    (dict(modes=torch.tensor([[0, -1]])), "modes"),
    (dict(modes=torch.tensor([[0, 1, 1]])), "shape"),
    (dict(modes=torch.tensor([[0.0, 1.0]])), "integer"),
    (dict(modes=torch.tensor([[0, 2]])), "block_mask is None"),
    (dict(modes=torch.tensor([[0, 2]]), block_mask=torch.ones(1, 2, 3, 3, dtype=torch.bool)), "block_mask"),
    (dict(modes=torch.tensor([[0, 2]]), block_mask=torch.ones(1, 2, 2, 2)), "bool"),
    (dict(backend="cuda-magic"), "backend"),
])
def test_bad_arguments_raise(kwargs, match):
    q, k, v = _qkv()
    args = dict(modes=torch.tensor([[0, 1]]), sink=1, window=2, block_mask=None, block_size=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        kernels.hybrid_attention(q, k, v, **args)


def test_bad_tensors_raise():
    modes = torch.tensor([[0, 1]])
    q, k, v = _qkv(Hq=3, Hkv=2)
    with pytest.raises(ValueError, match="query heads 3 not a multiple of KV heads 2"):
        kernels.hybrid_attention(q, k, v, torch.tensor([[0, 1]]), 1, 2)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="dtypes differ"):
        kernels.hybrid_attention(q.double(), k, v, modes, 1, 2)
    with pytest.raises(ValueError, match="must be floating point, got torch.int64"):
        kernels.hybrid_attention(q.long(), k.long(), v.long(), modes, 1, 2)
    with pytest.raises(ValueError, match="must both be"):
        kernels.hybrid_attention(q, k[:, :, :5], v[:, :, :5], modes, 1, 2)
    with pytest.raises(ValueError, match="4-d"):
        kernels.hybrid_attention(q[0], k, v, modes, 1, 2)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="devices differ"):
            kernels.hybrid_attention(q.cuda(), k, v, modes, 1, 2)


@SETTINGS
@given(S=lengths, G=st.sampled_from([1, 2, 4]), mode=st.sampled_from([FULL, STREAMING]),
       sink=st.integers(0, 9), window=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_torch_backend_equals_reference_for_uniform_modes(S, G, mode, sink, window, seed):
    q, k, v, _, _ = random_case(2, 2, G, S, 16, 16, seed)
    q, k, v = q.float(), k.float(), v.float()
    modes = torch.full((2, 2), mode)
    fast = kernels.hybrid_attention(q, k, v, modes, sink, window, backend="torch")
    ref = kernels.hybrid_attention(q.double(), k.double(), v.double(), modes, sink, window, backend="reference")
    err = (fast.double() - ref).abs()
    assert err.max() < 1e-5, f"max {err.max():.2e} mean {err.mean():.2e}"


@SETTINGS
@given(S=lengths, G=st.sampled_from([1, 2, 4]), bs=st.sampled_from([1, 4, 16]), p=st.floats(0.0, 1.0),
       seed=st.integers(0, 2**16))
def test_torch_backend_equals_reference_for_block_sparse(S, G, bs, p, seed):
    """All heads BLOCK_SPARSE with a random block mask whose diagonal is on (as XAttention's is)."""
    q, k, v, _, _ = random_case(2, 2, G, S, 16, 16, seed)
    q, k, v = q.float(), k.float(), v.float()
    nB = masks.num_blocks(S, bs)
    gen = torch.Generator().manual_seed(seed)
    block_mask = (torch.rand(2, 2, nB, nB, generator=gen) < p) | torch.eye(nB, dtype=torch.bool)
    modes = torch.full((2, 2), BLOCK_SPARSE)
    fast = kernels.hybrid_attention(q, k, v, modes, 1, 2, block_mask, bs, backend="torch")
    ref = kernels.hybrid_attention(q.double(), k.double(), v.double(), modes, 1, 2, block_mask, bs, backend="reference")
    err = (fast.double() - ref).abs()
    assert err.max() < 1e-5, f"max {err.max():.2e} mean {err.mean():.2e}"


@SETTINGS
@given(S=lengths, G=st.sampled_from([1, 2, 3]), bs=st.sampled_from([1, 4, 16]), diagonal=st.booleans(),
       seed=st.integers(0, 2**16))
def test_torch_backend_equals_reference_for_mixed_modes(S, G, bs, diagonal, seed):
    """Every (sample, KV head) in its own mode: SDPA per mode and sample, forward and gradients.
    With a diagonal block off, some BLOCK_SPARSE rows see nothing: 0, as in the reference (never NaN)."""
    q, k, v, modes, block_mask = random_case(3, 3, G, S, 8, bs, seed)
    if diagonal:
        block_mask |= torch.eye(block_mask.shape[-1], dtype=torch.bool)
    grads = []
    for backend, dtype in (("torch", torch.float32), ("reference", torch.float64)):
        x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = kernels.hybrid_attention(*x, modes, 2, 5, block_mask, bs, backend=backend)
        out.backward(torch.cos(torch.arange(out.numel(), dtype=dtype)).view_as(out))
        grads.append([out, *(t.grad for t in x)])
    for name, fast, ref in zip(("out", "dq", "dk", "dv"), *grads):
        err = (fast.double() - ref).abs().max()
        assert err < 1e-5 * max(1.0, ref.abs().max().item()), f"{name}: max error {err:.2e}"
        assert not fast.isnan().any(), name


def test_torch_backend_gives_an_empty_block_row_zero_not_nan():
    """SDPA returns NaN for a row that sees no key; the torch backend runs such heads through the
    reference, where the row is 0."""
    q, k, v = _qkv()
    nB = masks.num_blocks(q.shape[2], 4)
    block_mask = torch.ones(1, k.shape[1], nB, nB, dtype=torch.bool)
    block_mask[0, 0, 1] = False  # rows 4-7 of KV head 0 see nothing
    modes = torch.full((1, k.shape[1]), BLOCK_SPARSE)
    out = kernels.hybrid_attention(q, k, v, modes, 1, 2, block_mask, 4, backend="torch")
    assert not out.isnan().any() and (out[0, :2, 4:8] == 0).all()
    torch.testing.assert_close(out, kernels.hybrid_attention(q, k, v, modes, 1, 2, block_mask, 4, backend="reference"),
                               rtol=0, atol=0)


def test_predicates_compose_with_and_or():
    """The combinators at scalar level: streaming = causal ∧ (sink ∨ window)."""
    pred = masks.streaming(sink=2, window=3)
    assert pred(0, 0, 10, 1) and pred(0, 0, 10, 8) and pred(0, 0, 10, 10)   # sink, window, self
    assert not pred(0, 0, 10, 5) and not pred(0, 0, 10, 11)                  # middle, future
    never = masks.and_masks(masks.causal, lambda b, h, q, kv: False)
    always = masks.or_masks(masks.causal, lambda b, h, q, kv: True)
    assert not never(0, 0, 5, 0) and always(0, 0, 0, 5)


def test_pair_counts_and_kernel_entries_refuse_bad_input():
    """kept_pairs (and so Ω_ESR and the FLOP count) checks what hybrid_mask checks: no silent count
    for an unknown mode, a BLOCK_SPARSE head without its mask, or a negative window or sink; the
    Triton entry refuses strides its int32 offsets cannot reach (meta tensors: nothing allocated)."""
    for modes, sink, window, message in ((torch.tensor([[BLOCK_SPARSE, FULL]]), 4, 8, "block_mask is None"),
                                         (torch.tensor([[7, FULL]]), 4, 8, "got \\[7\\]"),
                                         (torch.tensor([[FULL, STREAMING]]), 4, -5, "window must be an int >= 1"),
                                         (torch.tensor([[FULL, STREAMING]]), True, 5, "sink must be an int >= 0, got True")):
        with pytest.raises(ValueError, match=message):
            masks.omega_esr_closed_form(16, modes, sink, window)
    with pytest.raises(ValueError, match="query heads 2 not a multiple of KV heads 0"):   # not a ZeroDivisionError
        masks.check_qkv(*(torch.zeros(1, h, 4, 16) for h in (2, 0, 0)))
    q = torch.empty_strided((1, 1, 40, 16), (0, 0, 2 ** 26, 1), device="meta", dtype=torch.float16)
    k = torch.empty(1, 1, 40, 16, device="meta", dtype=torch.float16)
    with pytest.raises(ValueError, match="q \\(1, 1, 40, 16\\) with strides .* reaches 2617245711 elements"):
        kernels.fused_hybrid_attention(q, k, k, torch.zeros(1, 1, dtype=torch.int32, device="meta"), 4, 8)
