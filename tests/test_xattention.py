"""XAttention block selection (METHOD.md §3 XA): scoring and picking.

The naive scoring twin is tested against Python loops written straight from the definition; the
Triton kernel against the naive twin (CPU: the interpreter, fp32/fp16; CUDA: also bf16); the
picking step against the properties it promises (causal, sink + diagonal, kept mass >= threshold,
fewest blocks); and the whole mask against hybrid_mask / naive_attention.
"""
import math
import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

from elastic_attention import kernels
from elastic_attention import masks
from elastic_attention import xattention
from elastic_attention.masks import BLOCK_SPARSE, FULL, STREAMING

SETTINGS = settings(max_examples=25, deadline=None)
SLOW = settings(max_examples=8, deadline=None)   # each example runs the Triton interpreter

# Triton runs on CUDA, or on CPU under the interpreter (conftest.py switches it on without a GPU).
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HAS_TRITON_RUN = kernels.HAS_TRITON and (torch.cuda.is_available() or kernels.interpreting())
needs_triton = pytest.mark.skipif(not HAS_TRITON_RUN, reason="needs triton on CUDA or TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bf16 and real shapes)")


def loop_scores(q, k, block_size, stride):
    """Block scores one number at a time, float64, from METHOD.md §3: antidiagonal sums, causal
    softmax over key groups, sums over each tile's groups; all-padding query groups skipped; then
    the max over the query heads of each KV head."""
    B, Hq, S, D = q.shape
    Hkv, T = k.shape[1], stride
    G, nB = Hq // Hkv, masks.num_blocks(S, block_size)
    nG, g = nB * block_size // T, block_size // T
    out = torch.zeros(B, Hq, nB, nB, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            for i in range(nG):
                if i * T >= S:  # a query group made only of padding
                    continue
                s = torch.zeros(i + 1, dtype=torch.float64)
                for j in range(i + 1):
                    for t in range(T):
                        qi, kj = i * T + T - 1 - t, j * T + t
                        if qi < S and kj < S:  # padded tokens add nothing
                            s[j] += q[b, h, qi].double() @ k[b, h // G, kj].double()
                p = torch.softmax(s / (math.sqrt(D) * T), 0)
                for j in range(i + 1):
                    out[b, h, i // g, j // g] += p[j]
    return out.view(B, Hkv, G, nB, nB).amax(2)


def random_qk(B, Hkv, G, S, D, seed, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, S, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, Hkv, S, D, generator=gen, dtype=torch.float64)
    return q.to(device, dtype), k.to(device, dtype)


def assert_close(got, want, atol, rtol, what=""):
    got, want = got.double().cpu(), want.double().cpu()
    diff = (got - want).abs()
    assert got.shape == want.shape, f"{what}: shapes {tuple(got.shape)} vs {tuple(want.shape)}"
    assert torch.allclose(got, want, atol=atol, rtol=rtol), \
        f"{what}: max diff {diff.max().item():.3g}, mean diff {diff.mean().item():.3g}"


def causal_blocks(nB):
    idx = torch.arange(nB)
    return idx.view(1, nB) <= idx.view(nB, 1)  # (nB, nB)


def forced_blocks(nB):
    idx = torch.arange(nB)
    m, n = idx.view(nB, 1), idx.view(1, nB)
    return (n <= m) & ((n == 0) | (n == m))  # sink + diagonal

# -----------------------------------------------------------------------------
# Scoring: naive twin == the definition; Triton == naive twin.


@pytest.mark.parametrize("B,Hkv,G,S,D,block_size,stride", [
    (1, 1, 1, 32, 8, 8, 4),     # whole blocks
    (1, 1, 2, 37, 8, 16, 4),    # S not a multiple of the stride nor the block, GQA 2
    (2, 2, 3, 21, 4, 8, 8),     # G = 3, stride = block
    (1, 1, 1, 3, 4, 8, 4),      # S shorter than one stride
    (1, 1, 1, 12, 4, 4, 1),     # stride 1: plain q·k
])
def test_reference_scores_match_definition(B, Hkv, G, S, D, block_size, stride):
    q, k = random_qk(B, Hkv, G, S, D, seed=S, dtype=torch.float64)
    want = loop_scores(q, k, block_size, stride)
    assert_close(xattention.xattention_scores_reference(q, k, block_size, stride), want, 1e-10, 1e-10, "reference vs loops")


def test_gqa_combines_query_heads_by_max():
    """A KV head's scores are the elementwise max of its query heads' own scores."""
    q, k = random_qk(1, 2, 4, 40, 8, seed=0, dtype=torch.float64)
    combined = xattention.xattention_scores_reference(q, k, 8, 4)                             # (1, 2, 5, 5)
    per_head = xattention.xattention_scores_reference(q, k.repeat_interleave(4, dim=1), 8, 4)  # (1, 8, 5, 5)
    assert_close(combined, per_head.view(1, 2, 4, 5, 5).amax(2), 0, 0, "GQA max")


def triton_tol(dtype, device):
    # Both sides see the same rounded inputs and accumulate in fp32, so they differ by summation
    # order only, except fp32 on a GPU, where tl.dot rounds its inputs to TF32 (10-bit mantissa).
    if device == "cuda" and dtype == torch.float32:
        return dict(atol=2e-3, rtol=1e-2)
    return dict(atol=2e-5, rtol=1e-4)


TRITON_CASES = [
    # B, Hkv, G, S, D, block_size, stride
    (1, 1, 1, 64, 16, 16, 4),
    (2, 2, 2, 97, 16, 32, 8),    # odd S, two heads per KV head
    (1, 1, 3, 50, 24, 16, 16),   # G = 3 (padded to 4 rows), D not a power of two, stride = block
    (1, 2, 1, 5, 8, 16, 8),      # S shorter than one stride, D < 16 (padded for tl.dot)
    (1, 1, 4, 130, 16, 64, 16),  # the default stride, g = 4 groups per block
    (1, 1, 1, 40, 16, 64, 2),    # g = 32 groups per block: one block wider than the 16-row tile
]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_scores_match_reference(case, dtype):
    B, Hkv, G, S, D, block_size, stride = case
    q, k = random_qk(B, Hkv, G, S, D, seed=S + D, dtype=dtype, device=TRITON_DEVICE)
    got = xattention.xattention_scores(q, k, block_size, stride, backend="triton")
    want = xattention.xattention_scores_reference(q, k, block_size, stride)
    assert got.dtype == torch.float32
    assert_close(got, want, what=f"{case} {dtype}", **triton_tol(dtype, TRITON_DEVICE))


@needs_triton
@SLOW
@given(B=st.integers(1, 2), Hkv=st.integers(1, 2), G=st.sampled_from([1, 2, 4]),
       S=st.integers(1, 150), D=st.sampled_from([8, 16, 32]),
       block_stride=st.sampled_from([(8, 4), (16, 4), (16, 16), (32, 8)]), seed=st.integers(0, 99))
def test_triton_scores_match_reference_drawn(B, Hkv, G, S, D, block_stride, seed):
    block_size, stride = block_stride
    q, k = random_qk(B, Hkv, G, S, D, seed, dtype=torch.float32, device=TRITON_DEVICE)
    got = xattention.xattention_scores(q, k, block_size, stride, backend="triton")
    want = xattention.xattention_scores_reference(q, k, block_size, stride)
    assert_close(got, want, what="drawn", **triton_tol(torch.float32, TRITON_DEVICE))


@needs_triton
@pytest.mark.parametrize("BLOCK_N", [16, 32])
def test_triton_scores_narrow_tiles(BLOCK_N):
    """Narrow tiles: each program walks several score tiles (BLOCK_N key groups) and reads its
    scratch back in several steps (BLOCK_N key blocks each; 38 blocks here), G = 3."""
    q, k = random_qk(1, 1, 3, 300, 16, seed=7, device=TRITON_DEVICE)
    got = xattention.xattention_scores(q, k, 8, 4, backend="triton", BLOCK_N=BLOCK_N)
    want = xattention.xattention_scores_reference(q, k, 8, 4)
    assert_close(got, want, what=f"BLOCK_N={BLOCK_N}", **triton_tol(torch.float32, TRITON_DEVICE))


@needs_triton
@pytest.mark.parametrize("D, BLOCK_K", [(48, 16), (64, 32)])
def test_triton_scores_sliced_head_dim(D, BLOCK_K):
    """D multiplied BLOCK_K at a time (as on a GPU, where 64 of D = 128 fit three pipeline stages),
    the last slice past D = 48 masked; the steps walk t and the slices of D in one loop."""
    q, k = random_qk(1, 2, 2, 200, D, seed=D, device=TRITON_DEVICE)
    got = xattention.xattention_scores(q, k, 16, 4, backend="triton", BLOCK_K=BLOCK_K)
    want = xattention.xattention_scores_reference(q, k, 16, 4)
    assert_close(got, want, what=f"D={D} BLOCK_K={BLOCK_K}", **triton_tol(torch.float32, TRITON_DEVICE))


@needs_triton
@pytest.mark.parametrize("BLOCK_M, lens", [(32, None), (64, [300, 131])])
def test_triton_scores_tall_tiles(BLOCK_M, lens):
    """Several query blocks per program (BLOCK_M query groups, 4 or 8 blocks of g = 8 here): the
    read-back sums each block's groups apart; a program's last rows past S count nothing, G = 3."""
    q, k = random_qk(2 if lens else 1, 1, 3, 300, 16, seed=9, device=TRITON_DEVICE)
    lengths = torch.tensor(lens) if lens else None
    got = xattention.xattention_scores(q, k, 32, 4, backend="triton", BLOCK_M=BLOCK_M, BLOCK_N=16,
                                       lengths=None if lens is None else lengths.to(TRITON_DEVICE))
    want = xattention.xattention_scores_reference(q, k, 32, 4, lengths=lengths)
    assert_close(got, want, what=f"BLOCK_M={BLOCK_M}", **triton_tol(torch.float32, TRITON_DEVICE))


@needs_triton
def test_triton_scores_sharp_logits():
    """Logits in the hundreds (log2 units): blocks far below the row's best, whole key blocks in a
    row's future (all -inf) next to seen ones, a running max that jumps. No overflow, no NaN."""
    q, k = random_qk(1, 2, 2, 200, 16, seed=8, device=TRITON_DEVICE)
    # fp16 inputs: exact products on a GPU and in the interpreter alike. fp32 inputs would go through
    # TF32 on a GPU, whose 10-bit mantissa (not the kernel) is the error at logits in the hundreds.
    q, k = (q * 300).half(), k.half()
    got = xattention.xattention_scores(q, k, 16, 4, backend="triton", BLOCK_N=16)
    want = xattention.xattention_scores_reference(q, k, 16, 4)
    assert torch.isfinite(got).all()
    assert_close(got, want, what="sharp", atol=1e-4, rtol=1e-4)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("B,Hkv,G,S,D,block_size,stride", [
    (1, 2, 4, 1000, 128, 64, 16),
    (2, 1, 8, 2053, 64, 128, 8),
    (1, 8, 1, 4096, 128, 64, 16),
])
def test_triton_scores_match_reference_gpu(B, Hkv, G, S, D, block_size, stride, dtype):
    q, k = random_qk(B, Hkv, G, S, D, seed=S, dtype=dtype, device="cuda")
    got = xattention.xattention_scores(q, k, block_size, stride)  # auto: Triton on CUDA
    want = xattention.xattention_scores_reference(q, k, block_size, stride)
    assert_close(got, want, what=f"gpu {dtype}", **triton_tol(dtype, "cuda"))


@needs_cuda
def test_block_mask_triton_matches_reference_gpu():
    """Same scores up to rounding → the same blocks, except for near-ties at the threshold."""
    q, k = random_qk(1, 4, 2, 4096, 128, seed=1, dtype=torch.bfloat16, device="cuda")
    q = q + 2 * q[:, :, :1]  # some structure: every query leans one way
    got = xattention.xattention_block_mask(q, k, 64, 16, 0.9, backend="triton")
    want = xattention.xattention_block_mask(q, k, 64, 16, 0.9, backend="reference")
    assert (got == want).float().mean().item() > 0.999

# -----------------------------------------------------------------------------
# Right padding: with lengths (B,), sample b is scored as if it were only its lengths[b] tokens.


def padded_qk(B, Hkv, G, S, D, lens, seed, dtype=torch.float32, device="cpu"):
    """Random q, k whose tokens from lengths[b] on are junk of a much larger scale: if padding
    reached a real row's softmax at all, it would dominate it."""
    q, k = random_qk(B, Hkv, G, S, D, seed, dtype, device)
    junk_q, junk_k = random_qk(B, Hkv, G, S, D, seed + 1, dtype, device)
    pad = (torch.arange(S, device=device).view(1, 1, S, 1) >= lens.to(device).view(B, 1, 1, 1))
    return torch.where(pad, 30 * junk_q, q), torch.where(pad, 30 * junk_k, k)


def truncated_scores(q, k, lens, block_size, stride):
    """Each sample scored alone on its real tokens, zero-padded to the padded batch's (nB, nB)."""
    B, Hkv, nB = q.shape[0], k.shape[1], masks.num_blocks(q.shape[2], block_size)
    out = torch.zeros(B, Hkv, nB, nB, dtype=torch.float64)
    for b, L in enumerate(lens.tolist()):
        n = masks.num_blocks(L, block_size)
        out[b, :, :n, :n] = xattention.xattention_scores_reference(q[b:b + 1, :, :L], k[b:b + 1, :, :L],
                                                               block_size, stride)[0].double()
    return out


@SETTINGS
@given(S=st.integers(1, 120), G=st.sampled_from([1, 2]), block_stride=st.sampled_from([(8, 4), (16, 4), (16, 16)]),
       seed=st.integers(0, 999), data=st.data())
def test_reference_scores_ignore_right_padding(S, G, block_stride, seed, data):
    block_size, stride = block_stride
    lens = torch.tensor(data.draw(st.lists(st.integers(1, S), min_size=2, max_size=2)))
    q, k = padded_qk(2, 2, G, S, 8, lens, seed, dtype=torch.float64)
    got = xattention.xattention_scores_reference(q, k, block_size, stride, lengths=lens)
    assert_close(got, truncated_scores(q, k, lens, block_size, stride), 1e-12, 1e-12, f"lengths {lens.tolist()}")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("S,lens,block_size,stride,G", [
    (97, [97, 40], 16, 4, 2),     # one sample unpadded, one padded mid-block and mid-group
    (130, [1, 65], 64, 16, 4),    # a single real token; g = 4 groups per block
    (300, [300, 131], 8, 4, 3),   # several score tiles per program (BLOCK_N 16), G = 3 padded to 4
])
def test_triton_scores_with_lengths_match_reference(S, lens, block_size, stride, G, dtype):
    lens = torch.tensor(lens)
    q, k = padded_qk(2, 2, G, S, 16, lens, seed=S, dtype=dtype, device=TRITON_DEVICE)
    got = xattention.xattention_scores(q, k, block_size, stride, backend="triton", lengths=lens.to(TRITON_DEVICE),
                                       BLOCK_N=16)
    want = xattention.xattention_scores_reference(q, k, block_size, stride, lengths=lens)
    assert_close(got, want, what=f"lengths {lens.tolist()} {dtype}", **triton_tol(dtype, TRITON_DEVICE))
    assert_close(want, truncated_scores(q, k, lens, block_size, stride), 1e-5, 1e-5, "reference vs truncated")


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
def test_block_mask_rows_of_real_tokens_ignore_padding(backend):
    """Junk appended after lengths[b] changes no block-mask row that covers a real token: those rows
    are the mask of the sample alone (threshold 0.5, where a changed score does change blocks)."""
    B, S, bs, stride = 3, 160, 16, 4
    lens = torch.tensor([160, 75, 17])
    q, k = padded_qk(B, 2, 2, S, 16, lens, seed=11, device=TRITON_DEVICE)
    q = q + 2 * q[:, :, :1]                       # some structure: every query leans one way
    mask = xattention.xattention_block_mask(q, k, bs, stride, 0.5, backend, lengths=lens.to(TRITON_DEVICE)).cpu()
    for b, L in enumerate(lens.tolist()):
        n = masks.num_blocks(L, bs)
        alone = xattention.xattention_block_mask(q[b:b + 1, :, :L], k[b:b + 1, :, :L], bs, stride, 0.5, backend).cpu()
        assert torch.equal(mask[b, :, :n, :n], alone[0]), f"sample {b} (length {L}): rows of real tokens differ"
        assert not mask[b, :, :n, n:].any()       # causal: real rows see no later block
    if backend == "reference":                    # without lengths the junk does move real rows
        blind = xattention.xattention_block_mask(q, k, bs, stride, 0.5, backend).cpu()
        assert not torch.equal(blind[1, :, :5, :5], mask[1, :, :5, :5])


def test_lengths_are_checked():
    q, k = random_qk(2, 1, 1, 40, 8, seed=0)
    for bad, match in ((torch.tensor([0, 40]), r"lengths must be in \[1, S=40\]"),
                       (torch.tensor([41, 40]), r"lengths must be in \[1, S=40\]"),
                       (torch.tensor([40.0, 40.0]), "integer tensor"), (torch.tensor([40]), r"\(B,\) = \(2,\)")):
        with pytest.raises(ValueError, match=match):
            xattention.xattention_block_mask(q, k, 16, 4, 0.9, lengths=bad)
        with pytest.raises(ValueError, match=match):
            xattention.xattention_scores_reference(q, k, 16, 4, lengths=bad)

# -----------------------------------------------------------------------------
# Picking: the properties xattention_select promises, on drawn scores.


def check_selection(scores, mask, threshold):
    B, Hkv, nB, _ = scores.shape
    is_causal, forced = causal_blocks(nB), forced_blocks(nB)
    assert mask.dtype == torch.bool and mask.shape == scores.shape
    assert not (mask & ~is_causal).any(), "a block above the diagonal is on"
    assert mask[..., forced].all(), "a sink or diagonal block is off"
    s = scores.double() * is_causal
    total = s.sum(-1)                                                  # (B, Hkv, nB)
    kept = (s * mask).sum(-1)
    slack = 1e-5 * total + 1e-9                                        # fp32 cumsum rounding
    assert (kept >= threshold * total - slack).all(), \
        f"kept mass below threshold: worst {(kept / total).min().item():.4f} < {threshold}"
    # Fewest blocks: the kept optional blocks are the best ones, and without the weakest of them
    # the row would fall short of the threshold.
    optional = mask & is_causal & ~forced
    dropped = ~mask & is_causal
    weakest_kept = torch.where(optional, s, math.inf).amin(-1)         # (B, Hkv, nB)
    best_dropped = torch.where(dropped, s, -math.inf).amax(-1)
    assert (weakest_kept >= best_dropped).all(), "a dropped block beats a kept one"
    has_optional = optional.any(-1)
    without = kept - torch.where(has_optional, weakest_kept, 0.0)
    assert (without[has_optional] < threshold * total[has_optional] + slack[has_optional]).all(), \
        "a kept block was not needed to reach the threshold"


@SETTINGS
@given(nB=st.integers(1, 24), threshold=st.floats(0.01, 1.0), seed=st.integers(0, 10_000),
       spiky=st.booleans())
def test_select_properties(nB, threshold, seed, spiky):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(2, 3, nB, nB, generator=gen)
    if spiky:  # a few heavy blocks among light ones, like real attention
        scores = scores ** 8
    scores = scores * causal_blocks(nB)
    mask = xattention.xattention_select(scores, threshold)
    check_selection(scores, mask, threshold)


@SETTINGS
@given(S=st.integers(1, 200), G=st.sampled_from([1, 2, 3]), threshold=st.floats(0.05, 1.0),
       block_stride=st.sampled_from([(8, 4), (16, 8), (16, 16)]), seed=st.integers(0, 999))
def test_block_mask_properties(S, G, threshold, block_stride, seed):
    block_size, stride = block_stride
    q, k = random_qk(1, 2, G, S, 8, seed)
    q = q * 3  # sharper attention than unit-variance noise gives
    mask = xattention.xattention_block_mask(q, k, block_size, stride, threshold, backend="reference")
    nB = masks.num_blocks(S, block_size)
    assert mask.shape == (1, 2, nB, nB)
    check_selection(xattention.xattention_scores_reference(q, k, block_size, stride), mask, threshold)


def test_threshold_one_keeps_every_causal_block():
    q, k = random_qk(2, 2, 2, 150, 16, seed=3)
    for scores_mask in (xattention.xattention_block_mask(q, k, 16, 4, 1.0),
                        xattention.xattention_select(xattention.xattention_scores_reference(q, k, 16, 4), 1.0)):
        assert torch.equal(scores_mask, causal_blocks(10).expand(2, 2, 10, 10))


def test_tiny_threshold_keeps_only_sink_and_diagonal():
    q, k = random_qk(2, 2, 2, 150, 16, seed=4)
    mask = xattention.xattention_block_mask(q, k, 16, 4, 1e-6)
    assert torch.equal(mask, forced_blocks(10).expand(2, 2, 10, 10))


def test_a_planted_block_is_found():
    """Content decides: keys of block 5 point the way every query points, so from block 6 on every
    row keeps block 5 and, at threshold 0.5, nothing else beyond the sink and the diagonal."""
    q, k = random_qk(1, 1, 1, 256, 16, seed=5)
    u = torch.zeros(16)
    u[0] = 1.0
    q = 0.3 * q + 2.0 * u                       # every query leans towards u
    k = 0.3 * k
    k[:, :, 5 * 16:6 * 16] += 8.0 * u           # block 5's keys are u, strongly
    mask = xattention.xattention_block_mask(q, k, 16, 4, 0.5)[0, 0]   # (16, 16)
    optional = mask & ~forced_blocks(16)
    assert optional[6:, 5].all()
    assert optional[6:].sum() == 10             # block 5 in rows 6..15, nothing else


@pytest.mark.parametrize("S", [1, 3, 15, 16, 17, 31, 32])
def test_short_sequences_are_full(S):
    """nB <= 2 leaves nothing to choose (sink and diagonal are all the causal blocks): FULL. That
    covers S shorter than one stride (one partial block)."""
    q, k = random_qk(1, 2, 1, S, 8, seed=S)
    mask = xattention.xattention_block_mask(q, k, 16, 16, 0.5)
    nB = masks.num_blocks(S, 16)
    assert torch.equal(mask, causal_blocks(nB).expand(1, 2, nB, nB))
    modes = torch.full((1, 2), BLOCK_SPARSE)
    full = masks.hybrid_mask(S, torch.full((1, 2), FULL), 0, 1)
    assert torch.equal(masks.hybrid_mask(S, modes, 0, 1, block_mask=mask, block_size=16), full)

# -----------------------------------------------------------------------------
# The mask in use.


def test_block_mask_drives_hybrid_attention():
    B, Hkv, G, S, D, bs = 2, 3, 2, 100, 16, 16
    q, k = random_qk(B, Hkv, G, S, D, seed=6)
    v = torch.randn(B, Hkv, S, D, generator=torch.Generator().manual_seed(7))
    block_mask = xattention.xattention_block_mask(q, k, bs, 4, 0.8)          # (B, Hkv, nB, nB)
    modes = torch.tensor([[BLOCK_SPARSE, FULL, STREAMING], [BLOCK_SPARSE] * 3])
    mask = masks.hybrid_mask(S, modes, 4, 16, block_mask=block_mask, block_size=bs)
    out = masks.naive_attention(q, k, v, mask)
    assert out.shape == (B, Hkv * G, S, D) and torch.isfinite(out).all()
    assert masks.omega_esr(mask)[1] > 0   # the all-XA sample prunes something
    # threshold 1.0 keeps every causal block: block-sparse attention is then exactly FULL
    all_on = xattention.xattention_block_mask(q, k, bs, 4, 1.0)
    sparse = kernels.hybrid_attention(q, k, v, torch.full((B, Hkv), BLOCK_SPARSE), 4, 16,
                                block_mask=all_on, block_size=bs, backend="reference")
    dense = kernels.hybrid_attention(q, k, v, torch.full((B, Hkv), FULL), 4, 16, backend="reference")
    assert_close(sparse, dense, 0, 0, "threshold 1 vs FULL")

# -----------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize("change,match", [
    (dict(stride=12), "stride"),                  # does not divide 16
    (dict(stride=0), "stride"),
    (dict(stride=32), "stride"),                  # larger than the block
    (dict(block_size=24), "block_size"),
    (dict(threshold=0.0), "threshold"),
    (dict(threshold=1.5), "threshold"),
    (dict(threshold=-0.1), "threshold"),
    (dict(threshold=float("nan")), "threshold"),
    (dict(threshold=True), "threshold"),
    (dict(backend="cuda"), "backend"),
    (dict(q=torch.randn(2, 40, 8)), "4-d"),
    (dict(q=torch.randn(1, 2, 0, 8), k=torch.randn(1, 1, 0, 8)), "non-empty"),
    (dict(q=torch.randn(1, 3, 40, 8), k=torch.randn(1, 2, 40, 8)), "multiple of KV heads"),
    (dict(k=torch.randn(1, 1, 41, 8)), r"\(B, Hkv, S, D\)"),
    (dict(k=torch.randn(1, 1, 40, 4)), r"\(B, Hkv, S, D\)"),
    (dict(k=torch.randn(1, 1, 40, 8).double()), "dtype"),
    (dict(q=torch.ones(1, 2, 40, 8, dtype=torch.long), k=torch.ones(1, 1, 40, 8, dtype=torch.long)), "dtype"),
])
def test_bad_input(change, match):
    args = dict(q=torch.randn(1, 2, 40, 8), k=torch.randn(1, 1, 40, 8), block_size=16, stride=4,
                threshold=0.9, backend="auto")
    args.update(change)
    with pytest.raises(ValueError, match=match):
        xattention.xattention_block_mask(**args)


def test_bad_input_scores_and_select():
    q, k = random_qk(1, 1, 1, 40, 8, seed=0)
    with pytest.raises(ValueError, match="stride"):
        xattention.xattention_scores(q, k, 16, 3)
    with pytest.raises(ValueError, match="stride"):
        xattention.xattention_scores_reference(q, k, 16, 5)
    with pytest.raises(ValueError, match="float64"):
        xattention.xattention_scores(q.double(), k.double(), 16, 4, backend="triton")
    for bad in (8, 48, 16.0):   # tl.dot needs >= 16; a power of two; an int
        with pytest.raises(ValueError, match="BLOCK_N"):
            xattention.xattention_scores(q, k, 16, 4, backend="triton", BLOCK_N=bad)
        with pytest.raises(ValueError, match="BLOCK_M"):
            xattention.xattention_scores(q, k, 16, 4, backend="triton", BLOCK_M=bad)
    for bad in (8, 24, 32):   # >= 16; a power of two; at most D = 8 rounded up to 16
        with pytest.raises(ValueError, match="BLOCK_K"):
            xattention.xattention_scores(q, k, 16, 4, backend="triton", BLOCK_K=bad)
    with pytest.raises(ValueError, match="block_scores"):
        xattention.xattention_select(torch.rand(1, 1, 3, 4), 0.9)
    for bad in (float("nan"), -1.0):   # such a block would silently never be picked
        with pytest.raises(ValueError, match="block_scores must be finite and >= 0"):
            xattention.xattention_select(torch.rand(1, 1, 3, 3).index_fill_(-1, torch.tensor([1]), bad), 0.9)
    with pytest.raises(ValueError, match="threshold"):
        xattention.xattention_select(torch.rand(1, 1, 3, 3), 2.0)
