"""bench.py — the fused hybrid-attention kernel against PyTorch's attention, on one GPU.

Five tables, one per claim; ratios above 1 mean ours is faster.

    forward     causal prefill at Llama-3.1-8B attention shapes (preset "llama3-8b": B 1, Hq 32,
                Hkv 8, D 128, sink 128, window 2048; bf16; S 32K and 128K), a fraction f of the KV
                heads STREAMING and the rest FULL, plus one setting "bsparse" where every head is
                BLOCK_SPARSE (128-token blocks, ~90 % of them off). Side by side, in one process:
        ours    kernels.fused_hybrid_attention: one launch, each head walks only its own tiles
        flex    compiled FlexAttention, one BlockMask holding every head's mode
        split   SDPA on the FULL heads + Flex on the STREAMING heads, merged into one output (the
                paper's §7 baseline; the gathers and the scatter are part of its cost)
        sdpa    dense causal SDPA: what runs without Elastic Attention
                TF/s counts useful FLOPs (masks.attention_flops); "ideal" is the speedup over our
                own all-FULL time those FLOPs allow, "of_ideal" the share of it we reach.
    backward    the same peers, forward + backward (dq, dk, dv from one upstream gradient), at
                S 32K, f 0 and 0.75, and bsparse.
    xattention  XAttention's block selection (xattention.py: scoring, then picking) as a share of
                dense SDPA, and the attention that uses it: FA-XA, against FA-SSA and XA-SSA;
                the forward's S, each f > 0.
    decode      one new token per sample against a cache of S tokens: decode.py's compact cache
                (sink + window rows for a STREAMING head) against SDPA, Flex and the model's masked
                reference, which read the whole cache for every head; the experiment's gpu model
                at 4K and Llama's heads at 8K, 32K, 128K, batch 1 and 16. Decode is memory-bound,
                so the ideal speedup over SDPA is full bytes / compact bytes.
    train       one router-training step (train_router.train_step: gates drawn, forward through the
                frozen model, answer loss + Lagrangian, backward, AdamW) at the gpu and smollm2
                presets' settings, random weights and tokens, run op by op (eager) and replayed as
                a CUDA graph (what training does on one GPU): ms per step, the share of it the GPU
                spends in kernels (torch.profiler), host-device synchronisations per step, and the
                ops that take the most GPU time. What is not kernel time is launch and host work.

Every peer's Flex mask is built from masks.py's predicates, the rule our kernel is tested against.
Times are triton.testing.do_bench medians; in the forward and backward tables every peer is
timed in --rounds interleaved rounds, and each ratio is the median of the rounds' ratios, with
their range beside it (a ratio near 1 decides "faster" only when its range does). Writes
bench.json (and bench_speedup.png) to --out.
Shape letters: B batch, S sequence (or cache) length, Hq query heads, Hkv KV heads, G = Hq / Hkv,
D head dim, f the share of STREAMING KV heads.

    python -m elastic_lab.bench                                     # every table
    python -m elastic_lab.bench --tables decode --cudagraph         # one table; decode timed as graph replays

Without CUDA it is a smoke test on the CPU (preset "tiny", S = 128, Triton's interpreter, eager
Flex): every path runs once and is compared with ours; it prints no times, since an interpreter's
say nothing about speed.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings

# OpenMP threads that sleep between parallel regions instead of spinning: a CPU shared with other
# jobs is not slowed several-fold (the GPU timings do not change). Read when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

CUDA = torch.cuda.is_available()
if __name__ == "__main__" and not CUDA:  # the smoke test runs the kernels in Triton's interpreter,
    os.environ.setdefault("TRITON_INTERPRET", "1")  # which must be chosen before triton is imported

import torch.nn.functional as F  # noqa: E402
import triton.testing  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from elastic_attention import decode  # noqa: E402
from elastic_attention import kernels  # noqa: E402
from elastic_attention import masks  # noqa: E402
from elastic_attention import router as router_lib  # noqa: E402
from elastic_attention import tasks  # noqa: E402
from elastic_attention import xattention  # noqa: E402
from elastic_attention import Config, Transformer, write_atomic  # noqa: E402
from elastic_attention.masks import BLOCK_SPARSE, FULL, STREAMING  # noqa: E402
from elastic_lab import runs  # noqa: E402
import train_router  # noqa: E402   the router step it times

DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float16    # Triton's interpreter has no bf16
TABLES = ("forward", "backward", "xattention", "decode", "train")
# Block 128: FlexAttention's sparse block too, so the block-sparse setting favours neither side.
SHAPES = Config.shape("llama3-8b", block_size=128) if CUDA else Config.shape("tiny")
# Decode grid (preset, context lengths S, batch sizes): the experiment's gpu model and Llama's heads.
DECODE_GRID = [("gpu", [4096], [1, 16]), ("llama3-8b", [8192, 32768, 131072], [1, 16])] if CUDA \
    else [("tiny", [128], [1, 2])]
# Router-training steps (experiment preset, model shape, dtype of the frozen model, batch, S).
TRAIN_GRID = [("gpu", "gpu", torch.float32, 16, 4096), ("smollm2", "smollm2-135m", torch.bfloat16, 8, 4096)] \
    if CUDA else [("gpu", "tiny", torch.float32, 4, 128)]   # the GPU presets' step terms on a small shape
CPU_MAX_SEQ_LEN = 4096   # the smoke test's eager Flex and masked peers hold Hq·S² values
# Compiled on a GPU: Flex's fused kernels, and a BlockMask made without an S×S mask in memory.
flex = torch.compile(flex_attention, dynamic=False) if CUDA else flex_attention
FLEX_BLOCK = 128  # FlexAttention's default block size
# Only SDPA's fused backends: a peer that fell back to the math backend would flatter us.
FAST_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]

# ----------------------------------------------------------------------------------------------
# Timing and the one table helper


def sync():
    if CUDA:
        torch.cuda.synchronize()


def time_ms(fn, args, graph=False):
    """Median ms of fn: do_bench (warm-up, then repetitions, each after an L2 flush), or with
    graph=True replays of a captured CUDA graph (no launch cost, no flush). None on the CPU."""
    if not CUDA:
        return None
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=args.rep, return_mode="median")
    return triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")


def max_diff(a, b):
    """Max |a - b|; over every pair when given tuples (of gradients)."""
    if isinstance(a, (tuple, list)):
        return max(max_diff(x, y) for x, y in zip(a, b))
    return (a.float() - b.float()).abs().max().item()


def ratio(a, b):
    return a / b if a and b else None


def measure(rec, name, fn, ref, args, graph=False, timed=True):
    """Run fn once (that first call, compilation included, timed apart), then record its max
    |difference| from ref and (timed=True) its median time as rec[name + "_diff"], rec[name + "_ms"].
    A peer that fails is recorded and printed, not fatal: the other columns still mean something."""
    try:
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        rec[f"{name}_first_call_ms"] = 1e3 * (time.perf_counter() - t0)
        rec[f"{name}_diff"] = None if ref is None else max_diff(out, ref)
        if timed:
            rec[f"{name}_ms"] = time_ms(fn, args, graph)
        return out
    except Exception as e:  # noqa: BLE001
        rec[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"  {name} failed: {rec[f'{name}_error']}", flush=True)


def time_rounds(rec, calls, sfx, args):
    """Time the peers that ran (calls: name → fn, ours first) in args.rounds interleaved rounds, so
    that a slow spell of the GPU hits every peer alike. rec[name + sfx + "_ms"]: each one's median
    over the rounds; rec["vs_" + peer]: the median of the rounds' ratios peer / ours, and
    rec["vs_" + peer + "_range"] their lowest and highest. A ratio near 1 is a verdict only when
    its range stays on one side of 1."""
    if not CUDA:
        return
    calls = {name: fn for name, fn in calls.items() if f"{name}{sfx}_error" not in rec}
    times = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, fn in calls.items():
            times[name].append(time_ms(fn, args))
    for name, ts in times.items():
        rec[f"{name}{sfx}_rounds_ms"] = ts                      # bench.json keeps every round
        rec[f"{name}{sfx}_ms"] = statistics.median(ts)
        if name != "ours" and "ours" in times:
            ratios = [t / ours for t, ours in zip(ts, times["ours"])]
            rec[f"vs_{name}"] = statistics.median(ratios)
            rec[f"vs_{name}_range"] = f"{min(ratios):.2f}-{max(ratios):.2f}"


def table(title, keys, times, checks):
    """Print a title and a header; return a function that prints one record as a row under it.
    Each column is a (record key, format spec) pair, headed by its key (bench.json's name for it);
    a missing value prints as "-". The times and the ratios made of them show on a GPU only."""
    columns = keys + (times if CUDA else []) + checks
    widths = [max(len(key), 8) for key, _ in columns]
    print(f"\n{title}\n" + "  ".join(key.rjust(w) for (key, _), w in zip(columns, widths)), flush=True)

    def row(rec):
        cells = ["-" if rec.get(key) is None else format(rec[key], spec) for key, spec in columns]
        print("  ".join(c.rjust(w) for c, w in zip(cells, widths)), flush=True)
    return row

# ----------------------------------------------------------------------------------------------
# The settings and the peers


def modes_with(frac, perm, B=1):
    """(B, Hkv) int32 modes: round(frac·Hkv) STREAMING heads, the first of a fixed random
    permutation (so the STREAMING set grows with f), the rest FULL; the same in every sample."""
    modes = torch.full((B, len(perm)), FULL, dtype=torch.int32)
    modes[:, perm[:round(frac * len(perm))]] = STREAMING
    return modes.to(DEVICE)


def random_block_mask(S, block_size, sparsity, Hkv, gen):
    """(1, Hkv, nB, nB) bool, XAttention-like: the sink column and the diagonal always on, other
    causal blocks on at random so that about (1 - sparsity) of the causal blocks are on."""
    nb = masks.num_blocks(S, block_size)
    causal_blocks, forced = nb * (nb + 1) / 2, 2 * nb - 1
    p = max(0.0, ((1 - sparsity) * causal_blocks - forced) / max(1.0, causal_blocks - forced))
    bm = torch.rand(1, Hkv, nb, nb, generator=gen) < p
    bm[..., :, 0] = True
    bm |= torch.eye(nb, dtype=torch.bool)
    return (bm & torch.ones(nb, nb, dtype=torch.bool).tril()).to(DEVICE)


def settings(S, fracs, perm, args, gen):
    """The prefill settings at one S: (name, f, modes, block_mask) for each f, then every head
    BLOCK_SPARSE."""
    for frac in fracs:
        yield f"f={frac:.2f}", frac, modes_with(frac, perm), None
    bm = random_block_mask(S, SHAPES.block_size, args.block_sparsity, SHAPES.n_kv_heads, gen)
    yield "bsparse", None, torch.full((1, len(perm)), BLOCK_SPARSE, dtype=torch.int32, device=DEVICE), bm


def mode_predicate(modes, sink, window, block_mask=None, block_size=None):
    """masks.hybrid_mask's rule as one predicate over (sample, KV head, query, key): each head's
    mode picks masks.causal, masks.streaming or masks.block_sparse."""
    def runs(mode):
        return lambda b, h, q_idx, kv_idx: modes[b, h] == mode
    parts = [masks.and_masks(runs(FULL), masks.causal),
             masks.and_masks(runs(STREAMING), masks.streaming(sink, window))]
    if block_mask is not None:
        parts.append(masks.and_masks(runs(BLOCK_SPARSE), masks.block_sparse(block_mask, block_size)))
    return masks.or_masks(*parts)


def flex_block_mask(predicate, H, G, kv_len, q_len=None, rows=512):
    """FlexAttention's BlockMask for a predicate over (sample, KV head, query, key). Flex numbers
    query heads, hence h // G (H None: the same mask for every head); its q_len queries are the
    last positions (decode: one query at kv_len − 1). Every sample shares sample 0's modes.
    Built exactly, `rows` query rows at a time: the predicate is evaluated per KV head on a chunk
    and reduced to 'some pair visible' / 'every pair visible' per FLEX_BLOCK² block, so no
    (Hq, S, S) mask is ever held (create_block_mask would hold one uncompiled, and its compiled
    form can fall back to one when shapes change)."""
    q_len = q_len or kv_len
    shift = kv_len - q_len

    def mask_mod(b, h, q_idx, kv_idx):
        return predicate(b, h // G, q_idx + shift, kv_idx)
    heads = 1 if H is None else H // G                                            # KV heads (or one)
    nq, nk = -(-q_len // FLEX_BLOCK), -(-kv_len // FLEX_BLOCK)
    some = torch.zeros(1, heads, nq, nk, dtype=torch.bool, device=DEVICE)
    every = torch.zeros_like(some)
    b = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=DEVICE)                  # sample 0 stands for all
    h = torch.arange(heads, device=DEVICE).view(1, -1, 1, 1)
    kv = torch.arange(nk * FLEX_BLOCK, device=DEVICE).view(1, 1, 1, -1)
    for r0 in range(0, nq * FLEX_BLOCK, rows):
        q = torch.arange(r0, min(r0 + rows, nq * FLEX_BLOCK), device=DEVICE).view(1, 1, -1, 1)
        inside = (q < q_len) & (kv < kv_len)                                      # padding to whole blocks
        m = predicate(b, h, (q + shift).clamp(max=kv_len - 1), kv.clamp(max=kv_len - 1))  # padding: any index
        m = (m & inside).expand(1, heads, -1, -1)                                   # (1, heads, rows, nk·FB)
        m = m.view(1, heads, -1, FLEX_BLOCK, nk, FLEX_BLOCK)
        some[:, :, r0 // FLEX_BLOCK:r0 // FLEX_BLOCK + m.shape[2]] = m.any(5).any(3)
        every[:, :, r0 // FLEX_BLOCK:r0 // FLEX_BLOCK + m.shape[2]] = m.all(5).all(3)

    def indices(blocks):  # (1, heads, nq, nk) bool → per-row counts and ascending indices, per query head
        blocks = blocks.repeat_interleave(1 if H is None else G, 1)
        order = torch.sort((~blocks).to(torch.int8), dim=-1, stable=True).indices
        return blocks.sum(-1, dtype=torch.int32), order.to(torch.int32)
    return BlockMask.from_kv_blocks(*indices(some & ~every), *indices(every), BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(q_len, kv_len))


def sdpa(q, k, v, is_causal=True):
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    with sdpa_kernel(FAST_SDPA):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)


def split_attention(modes, S):
    """The split baseline as attention(q, k, v): SDPA on the FULL heads' query and KV heads, Flex
    on the STREAMING ones, scattered into one output."""
    G = SHAPES.n_heads // SHAPES.n_kv_heads
    kv_full = (modes[0] == FULL).nonzero().flatten()                              # FULL KV heads
    kv_stream = (modes[0] == STREAMING).nonzero().flatten()
    q_full = (kv_full[:, None] * G + torch.arange(G, device=DEVICE)).flatten()    # their query heads
    q_stream = (kv_stream[:, None] * G + torch.arange(G, device=DEVICE)).flatten()
    if len(kv_stream):
        stream_mask = flex_block_mask(masks.streaming(SHAPES.sink, SHAPES.window), None, 1, S)

    def split(q, k, v):
        o = torch.empty_like(q)                                                   # (B, Hq, S, D)
        if len(kv_full):
            o[:, q_full] = sdpa(q[:, q_full], k[:, kv_full], v[:, kv_full])
        if len(kv_stream):
            o[:, q_stream] = flex(q[:, q_stream], k[:, kv_stream], v[:, kv_stream], block_mask=stream_mask,
                                  enable_gqa=True)
        return o
    return split


def prefill_peers(S, modes, block_mask, backward):
    """name → attention(q, k, v) for one setting: ours first, then Flex, then split where the heads
    are FULL and STREAMING only. (FlexAttention has no backward on the CPU.)"""
    cfg, G = SHAPES, SHAPES.n_heads // SHAPES.n_kv_heads
    peers = {"ours": lambda q, k, v: kernels.fused_hybrid_attention(q, k, v, modes, cfg.sink, cfg.window,
                                                                    block_mask, cfg.block_size)}
    if backward and not CUDA:
        return peers
    hybrid = flex_block_mask(mode_predicate(modes, cfg.sink, cfg.window, block_mask, cfg.block_size),
                             cfg.n_heads, G, S)
    peers["flex"] = lambda q, k, v: flex(q, k, v, block_mask=hybrid, enable_gqa=True)
    if block_mask is None:
        peers["split"] = split_attention(modes, S)
    return peers

# ----------------------------------------------------------------------------------------------
# Prefill: forward, and forward + backward


FORWARD = dict(keys=[("S", "d"), ("setting", "s")],
               times=[("ours_ms", ".2f"), ("tflops", ".0f"), ("flex_ms", ".2f"), ("split_ms", ".2f"),
                      ("sdpa_ms", ".2f"), ("vs_flex", ".2f"), ("vs_flex_range", "s"), ("vs_split", ".2f"),
                      ("vs_split_range", "s"), ("vs_sdpa", ".2f"), ("vs_sdpa_range", "s"), ("ideal", ".2f"),
                      ("of_ideal", ".0%")],
               checks=[("flex_diff", ".1e"), ("split_diff", ".1e"), ("sdpa_diff", ".1e")])
BACKWARD = dict(keys=[("S", "d"), ("setting", "s")],
                times=[("ours_ms", ".2f"), ("ours_fb_ms", ".2f"), ("flex_fb_ms", ".2f"), ("split_fb_ms", ".2f"),
                       ("sdpa_fb_ms", ".2f"), ("vs_flex", ".2f"), ("vs_flex_range", "s"), ("vs_split", ".2f"),
                       ("vs_split_range", "s"), ("vs_sdpa", ".2f"), ("vs_sdpa_range", "s")],
                checks=[("flex_fb_diff", ".1e"), ("split_fb_diff", ".1e"), ("sdpa_fb_diff", ".1e")])


def prefill(args, backward=False):
    """One row per (S, setting): the forward table, or with backward=True the forward + backward
    one (its ours_ms is our forward alone, for scale). Diffs are max |difference| from ours."""
    cfg = SHAPES
    Hq, Hkv, D, G = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
    seq_lens, fracs = (args.bwd_seq_lens, args.bwd_fracs) if backward else (args.seq_lens, args.fracs)
    sfx = "_fb" if backward else ""
    row = table(f"{'forward + backward' if backward else 'forward'}: B 1, Hq {Hq}, Hkv {Hkv}, D {D}, sink {cfg.sink}, "
                f"window {cfg.window}, {DTYPE}; ms", **(BACKWARD if backward else FORWARD))
    gen = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(Hkv, generator=gen)
    rows = []
    for S in seq_lens:
        q = torch.randn(1, Hq, S, D, generator=gen).to(DEVICE, DTYPE)          # (B, Hq, S, D)
        k = torch.randn(1, Hkv, S, D, generator=gen).to(DEVICE, DTYPE)         # (B, Hkv, S, D)
        v = torch.randn(1, Hkv, S, D, generator=gen).to(DEVICE, DTYPE)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        do = torch.randn_like(q) if backward else None                        # upstream gradient

        def call(attention):  # what is timed: the forward, or forward + backward
            if backward:
                return lambda: torch.autograd.grad(attention(*leaves), leaves, do)
            return lambda: attention(q, k, v)
        flops_full = masks.attention_flops(S, modes_with(0, perm), cfg.sink, cfg.window, head_dim=D, group=G)
        ours_full_ms = None
        for name, frac, modes, block_mask in settings(S, fracs, perm, args, gen):
            flops = masks.attention_flops(S, modes, cfg.sink, cfg.window, block_mask, cfg.block_size,
                                          head_dim=D, group=G)
            rec = dict(S=S, setting=name, frac=frac, flops=flops, ideal=flops_full / flops)
            peers = prefill_peers(S, modes, block_mask, backward)
            if backward:
                rec["ours_ms"] = time_ms(lambda: peers["ours"](q, k, v), args)
            calls = {peer: call(attention) for peer, attention in peers.items()} | {"sdpa": call(sdpa)}
            ref = measure(rec, "ours" + sfx, calls["ours"], None, args, timed=False)
            for peer in list(calls)[1:]:  # SDPA is dense causal: it computes what we compute at f = 0 only
                measure(rec, peer + sfx, calls[peer], ref if peer != "sdpa" or frac == 0 else None, args, timed=False)
            time_rounds(rec, calls, sfx, args)
            if frac == 0:
                ours_full_ms = rec.get(f"ours{sfx}_ms")
            if not backward:
                rec["tflops"] = ratio(flops / 1e9, rec.get("ours_ms"))
                rec["of_ideal"] = ratio(ratio(ours_full_ms, rec.get("ours_ms")), rec["ideal"])
            row(rec)
            rows.append(rec)
    return rows

# ----------------------------------------------------------------------------------------------
# XAttention: selection, then the hybrid kernel with XAttention heads


def structured_qkv(S, gen):
    """q, k, v whose attention is local with a few distant hot spots, as in real long-context heads.
    Random q and k give flat attention, where XAttention keeps ~95 % of the blocks. So q and k carry
    a local component (a RoPE-like wave: q_i·k_j peaks at i = j) plus one "retrieval" direction that
    four key blocks match, over noise."""
    Hq, Hkv, D, bs = SHAPES.n_heads, SHAPES.n_kv_heads, SHAPES.head_dim, SHAPES.block_size
    pos = torch.arange(S).view(S, 1).float()
    freqs = 1.0 / (64.0 * 4.0 ** torch.arange(D // 8).float())               # slow waves: ~64+ tokens
    wave = torch.cat([(pos * freqs).cos(), (pos * freqs).sin()], 1)          # (S, D/4)
    q = 0.5 * torch.randn(1, Hq, S, D, generator=gen)                        # (B, Hq, S, D)
    k = 0.5 * torch.randn(1, Hkv, S, D, generator=gen)                       # (B, Hkv, S, D)
    q[..., :D // 4] += 3.0 * wave
    k[..., :D // 4] += 3.0 * wave
    for blk in torch.randperm(S // bs, generator=gen)[:4].tolist():         # the "needle" key blocks
        k[:, :, blk * bs:(blk + 1) * bs, D // 4] += 6.0
    q[..., D // 4] += 1.0
    v = torch.randn(1, Hkv, S, D, generator=gen)
    return (t.to(DEVICE, DTYPE) for t in (q, k, v))


XATTENTION = dict(keys=[("S", "d"), ("frac", ".2f")],
                  times=[("score_ms", ".2f"), ("pick_ms", ".2f"), ("select_of_sdpa", ".1%"), ("fa_xa_ms", ".2f"),
                         ("fa_ssa_ms", ".2f"), ("xa_ssa_ms", ".2f"), ("full_ms", ".2f"), ("sdpa_ms", ".2f"),
                         ("of_ideal", ".0%")],
                  checks=[("density", ".3f")])


def xattention_table(args):
    """Per (S, f > 0): scoring and picking time, their share of dense SDPA, and the attention with
    a fraction f of the KV heads XAttention (FA-XA) or STREAMING (FA-SSA), or STREAMING with the
    other heads XAttention (XA-SSA). density: the share of causal blocks XAttention keeps."""
    cfg = SHAPES
    bs, stride, thr = cfg.block_size, cfg.xa_stride, cfg.xa_threshold
    row = table(f"XAttention selection (block {bs}, stride {stride}, τ {thr}) and attention; ms", **XATTENTION)
    gen = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(cfg.n_kv_heads, generator=gen)

    def ours(modes, block_mask=None):
        return lambda: kernels.fused_hybrid_attention(q, k, v, modes, cfg.sink, cfg.window, block_mask, bs)
    rows = []
    for S in args.seq_lens:
        q, k, v = structured_qkv(S, gen)
        common = dict(S=S)
        measure(common, "sdpa", lambda: sdpa(q, k, v), None, args)
        scores = measure(common, "score", lambda: xattention.xattention_scores(q, k, bs, stride), None, args)
        block_mask = measure(common, "pick", lambda: xattention.xattention_select(scores, thr), None, args)
        measure(common, "full", ours(modes_with(0, perm)), None, args)
        common["select_of_sdpa"] = ratio((common.get("score_ms") or 0) + (common.get("pick_ms") or 0),
                                         common.get("sdpa_ms"))
        flops_full = masks.attention_flops(S, modes_with(0, perm), cfg.sink, cfg.window,
                                           head_dim=cfg.head_dim, group=cfg.n_heads // cfg.n_kv_heads)
        for frac in [f for f in args.fracs if f > 0]:
            fa_ssa = modes_with(frac, perm)
            fa_xa = torch.where(fa_ssa == STREAMING, BLOCK_SPARSE, fa_ssa).to(torch.int32)
            xa_ssa = torch.where(fa_ssa == FULL, BLOCK_SPARSE, fa_ssa).to(torch.int32)
            rec = dict(common, frac=frac)
            measure(rec, "fa_ssa", ours(fa_ssa), None, args)
            measure(rec, "fa_xa", ours(fa_xa, block_mask), None, args)
            measure(rec, "xa_ssa", ours(xa_ssa, block_mask), None, args)
            xa_heads = fa_xa[0] == BLOCK_SPARSE
            nb = block_mask.shape[-1]
            rec["density"] = float(block_mask[0, xa_heads].sum()) / (int(xa_heads.sum()) * nb * (nb + 1) / 2)
            ideal = flops_full / masks.attention_flops(S, fa_xa, cfg.sink, cfg.window, block_mask, bs,
                                                       head_dim=cfg.head_dim, group=cfg.n_heads // cfg.n_kv_heads)
            rec["of_ideal"] = ratio(ratio(rec.get("full_ms"), rec.get("fa_xa_ms")), ideal)
            row(rec)
            rows.append(rec)
    return rows

# ----------------------------------------------------------------------------------------------
# Decode: one new token per sample against a KV cache of S tokens


DECODE = dict(keys=[("model", "s"), ("S", "d"), ("B", "d"), ("frac", ".2f"), ("compact_MB", ".2f"),
                    ("full_MB", ".2f"), ("saved", ".4f"), ("ideal_saved", ".4f")],
              times=[("ours_us", ".1f"), ("ours_GBps", ".0f"), ("masked_us", ".1f"), ("sdpa_us", ".1f"),
                     ("sdpa_GBps", ".0f"), ("flex_us", ".1f"), ("vs_sdpa", ".2f"), ("ideal", ".2f"),
                     ("of_ideal", ".0%"), ("vs_masked", ".1f")],
              checks=[("ours_diff", ".1e"), ("sdpa_diff", ".1e"), ("flex_diff", ".1e")])


def masked_decode(q, k, v, modes, sink, window):
    """The model's reference decode over a full cache: one masks.hybrid_mask row, masked attention in fp32."""
    S = k.shape[2]
    mask = masks.hybrid_mask(S, modes, sink, window, q_idx=torch.tensor([S - 1]))   # (B, Hkv, 1, S)
    return masks.masked_attention(q[:, :, None], k, v, mask)[:, :, 0]             # (B, Hq, D)


def decode_table(args):
    """Per (model, S, B, f): the bytes each side reads per sample and layer (MB), the saved share
    against its ideal f·(1 − (sink + window)/S), times in µs, GB/s, and the speedup over SDPA
    against the ideal full / compact bytes. Flex (a compile per shape): at each model's longest S,
    f = 0.75. Diffs are max |difference| from the masked reference."""
    env = {}
    if CUDA:  # the copy bandwidth, a yardstick for the GB/s columns (bytes read + written)
        src = torch.empty(2 ** 30, dtype=torch.float32, device=DEVICE)
        dst = torch.empty_like(src)
        env["copy_GBps"] = 2 * src.numel() * 4 / time_ms(lambda: dst.copy_(src), args) / 1e6
        del src, dst
    timer = "CUDA-graph replays" if args.cudagraph else "do_bench"
    copy = f"; copy bandwidth {env['copy_GBps']:.0f} GB/s" if CUDA else ""
    row = table(f"decode, one token ({DTYPE}, {timer}{copy}); µs, MB per sample and layer", **DECODE)
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for preset, lengths, batches in DECODE_GRID:
        cfg = Config.shape(preset)
        Hq, Hkv, D, sink, window = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.sink, cfg.window
        perm = torch.randperm(Hkv, generator=gen)
        for S in lengths:
            for B in batches:
                # Drawn on the device: 16 × 128K × 8 heads × 128 is 2·10⁹ numbers.
                k = torch.randn(B, Hkv, S, D, device=DEVICE, dtype=DTYPE)                  # (B, Hkv, S, D)
                v = torch.randn(B, Hkv, S, D, device=DEVICE, dtype=DTYPE)
                q = torch.randn(B, Hq, D, device=DEVICE, dtype=DTYPE)                      # (B, Hq, D)
                full_bytes = 2 * k.numel() * k.element_size()
                dense = {}    # SDPA does the same work at every f
                o_sdpa = measure(dense, "sdpa", lambda: sdpa(q[:, :, None], k, v, is_causal=False)[:, :, 0],
                                 None, args, args.cudagraph)
                for frac in (0.0, 0.5, 0.75, 1.0):
                    modes = modes_with(frac, perm, B)
                    cache = decode.KVCache.from_prefill([k], [v], [modes], sink, window, S)
                    compact = cache.nbytes()
                    rec = dict(model=preset, S=S, B=B, frac=frac, compact_MB=compact / B / 1e6,
                               full_MB=full_bytes / B / 1e6, saved=1 - compact / full_bytes,
                               ideal_saved=round(frac * Hkv) / Hkv * (1 - min(sink + window, S) / S),
                               ideal=full_bytes / compact, **dense)
                    ref = measure(rec, "masked", lambda: masked_decode(q, k, v, modes, sink, window), None, args)
                    def ours():   # the cache's extents are exact: no host sync to check them, as in the model
                        return decode.decode_attention(q, cache.k[0], cache.v[0], cache.start[0], cache.cap[0],
                                                       S, **cache.extents(0, S), check=False)
                    measure(rec, "ours", ours, ref, args, args.cudagraph)
                    if frac == 0 and o_sdpa is not None and ref is not None:
                        rec["sdpa_diff"] = max_diff(o_sdpa, ref)
                    if frac == 0.75 and S == lengths[-1]:
                        bm = flex_block_mask(mode_predicate(modes, sink, window), Hq, Hq // Hkv, S, q_len=1)
                        measure(rec, "flex", lambda: flex(q[:, :, None], k, v, block_mask=bm, enable_gqa=True)[:, :, 0],
                                ref, args, args.cudagraph)
                    for peer in ("ours", "masked", "sdpa", "flex"):
                        ms = rec.get(f"{peer}_ms")
                        rec[f"{peer}_us"] = None if ms is None else 1e3 * ms
                    rec["ours_GBps"] = ratio(compact / 1e6, rec.get("ours_ms"))
                    rec["sdpa_GBps"] = ratio(full_bytes / 1e6, rec.get("sdpa_ms"))
                    rec["vs_sdpa"] = ratio(rec.get("sdpa_ms"), rec.get("ours_ms"))
                    rec["of_ideal"] = ratio(rec["vs_sdpa"], rec["ideal"])
                    rec["vs_masked"] = ratio(rec.get("masked_ms"), rec.get("ours_ms"))
                    row(rec)
                    rows.append(rec)
    return env, rows

# ----------------------------------------------------------------------------------------------
# Training: one step of the router experiment


TRAIN = dict(keys=[("preset", "s"), ("B", "d"), ("S", "d")],
             times=[("eager_ms", ".1f"), ("graph_ms", ".1f"), ("speedup", ".2f"), ("eager_busy", ".0%"),
                    ("graph_busy", ".0%"), ("syncs", "d"), ("graph_syncs", "d")],
             checks=[("loss", ".3f"), ("graph_loss", ".3f")])


def train_batch(cfg, B, S, gen):
    """Random tokens with the experiment's layout: a prompt, then an answer of 8 tokens (64 for
    every fourth sample, the continuation task) that alone is scored; four tasks, two sensitive."""
    tokens = torch.randint(cfg.vocab_size, (B, S), generator=gen)
    answer = torch.tensor([64 if i % 4 == 3 else 8 for i in range(B)])
    prompt_lengths = S - answer
    pos = torch.arange(S)
    targets = torch.where(pos >= prompt_lengths[:, None] - 1, tokens.roll(-1, 1), -100)
    targets[:, -1] = -100
    task_ids = torch.arange(B) % 4
    answer_pos, answers = tasks.scored_positions(targets)
    return dict(tokens=tokens, prompt_lengths=prompt_lengths, answer_pos=answer_pos, answers=answers,
                task_ids=task_ids, task_counts=torch.bincount(task_ids, minlength=4), n_answer=(answers != -100).sum())


def train_row(preset, shape, dtype, B, S, args, gen):
    """One preset: train_router.train_step run op by op (eager) and replayed as a CUDA graph
    (runs.StepGraph), each from the same weights and batch, timed over 10 steps after 3 of
    warm-up; busy: GPU kernel time over the wall time of 3 profiled steps; syncs: host-device
    synchronisations in one step (torch's sync debug mode); loss: the first step's."""
    flags = train_router.build_parser().parse_args(
        ["--preset", preset, "--batch-size", str(B), "--seq-len", str(S), "--device", DEVICE, "--seed", str(args.seed)])
    P, _ = train_router.settings_from(flags)
    torch.manual_seed(args.seed)   # the random weights and the routers' init
    model = Transformer(Config.shape(shape, backend=P["backend"])).to(DEVICE, dtype)
    params = model.attach_routers()
    router_lib.freeze_backbone(model)
    model.train()
    run = train_router.Run(P, flags, torch.device(DEVICE), None, None)   # the step needs no task suite
    lagrangian = router_lib.SparsityLagrangian(4, [0.7, 0.7, 0.95, 0.95]).to(DEVICE)
    sens = torch.tensor([True, True, False, False], device=DEVICE)
    b = {k: v.to(DEVICE) for k, v in train_batch(model.cfg, B, S, gen).items()}
    start = [{k: v.clone() for k, v in m.state_dict().items()} for m in (model, lagrangian)]
    rec = dict(preset=preset, B=B, S=S)
    graphed = [("graph_", runs.StepGraph(params + list(lagrangian.parameters())))] if CUDA else []
    for name, graph in [("", None)] + graphed:
        for m, state in zip((model, lagrangian), start):   # both from the same routers and λ, AdamW afresh
            m.load_state_dict(state)
        optimizer, scheduler = router_lib.build_optimizer(params, lagrangian, 10 ** 6, P["router_lr"], P["lambda_lr"])

        def step():
            return train_router.train_step(run, model, lagrangian, optimizer, scheduler, params, sens, b,
                                           False, 0, graph)
        rec[name + "loss"] = step()["loss"]
        if not CUDA:
            continue
        for _ in range(3):
            step()
        sync()
        t0 = time.perf_counter()
        for _ in range(10):
            step()
        sync()
        rec[(name or "eager_") + "ms"] = 1e3 * (time.perf_counter() - t0) / 10
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            step()
            torch.cuda.set_sync_debug_mode(0)
        rec[name + "syncs"] = sum("synchroniz" in str(w.message) for w in caught)
    if not CUDA:
        return rec
    for m, state in zip((model, lagrangian), start):
        m.load_state_dict(state)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:   # eager: kernels by op
        sync()
        t0 = time.perf_counter()
        for _ in range(3):
            train_router.train_step(run, model, lagrangian, optimizer, scheduler, params, sens, b, False, 0)
        sync()
        wall_us = 1e6 * (time.perf_counter() - t0)
    events = prof.key_averages()   # torch ops (CPU) and the kernels they launched (CUDA), each once
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 3
    rec["eager_busy"] = 3 * kernel_us / wall_us
    rec["graph_busy"] = kernel_us / (1e3 * rec["graph_ms"])   # a replay runs the same kernels
    rec["speedup"] = rec["eager_ms"] / rec["graph_ms"]
    ops = sorted((e for e in events if e.device_type == DeviceType.CPU), key=lambda e: -e.self_device_time_total)
    rec["top_ops"] = [(e.key[:60], e.self_device_time_total / 3e3, e.count // 3) for e in ops[:8]]
    return rec


def train_table(args):
    """One row per preset of TRAIN_GRID (train_row), then its top ops by GPU time."""
    row = table("router training step (random weights and tokens, the preset's settings); ms", **TRAIN)
    gen = torch.Generator().manual_seed(args.seed)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True   # as train_router.main sets it on a GPU
    rows = []
    try:
        for grid_row in TRAIN_GRID:
            rows.append(train_row(*grid_row, args, gen))
            row(rows[-1])
            for name, ms, n in rows[-1].get("top_ops", []):
                print(f"    {ms:8.2f} ms  {n:5d}×  {name}")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return rows

# ----------------------------------------------------------------------------------------------
# The plot and main


def plot(rows, path):
    """Speedup over dense SDPA against f, one panel per S, log scale: ours, Flex, split, ideal."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in rows if r["frac"] is not None]
    Ss = sorted({r["S"] for r in rows})
    fig, axes = plt.subplots(1, len(Ss), figsize=(3.2 * len(Ss), 3.0), squeeze=False, sharey=True)
    for ax, S in zip(axes[0], Ss):
        rs = [r for r in rows if r["S"] == S]
        fs = [r["frac"] for r in rs]
        for peer, label, style in (("ours", "ours (fused)", "o-"), ("flex", "Flex hybrid", "s-"),
                                   ("split", "split SDPA+Flex", "^-")):
            ax.plot(fs, [ratio(r["sdpa_ms"], r.get(f"{peer}_ms")) or math.nan for r in rs], style, label=label, ms=4)
        ax.plot(fs, [r["ideal"] for r in rs], "k--", label="ideal (FLOPs at SDPA's rate)", lw=1)
        ax.set_yscale("log")
        ax.set_title(f"S = {S // 1024}K" if S >= 1024 else f"S = {S}")
        ax.set_xlabel("fraction of STREAMING heads")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("speedup over SDPA dense")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110))


def main(args):
    if CUDA:  # many (shape, mask) combinations: let dynamo keep every compiled Flex variant
        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 256)
    else:
        print("No CUDA device: a smoke test on the CPU (Triton's interpreter, eager Flex). Every path runs "
              "once and is compared with ours; no times. Flex has no backward on a CPU: forward + backward "
              "is compared with SDPA's, every head FULL.")
        warnings.filterwarnings("ignore", message=".*flex_attention.*")  # eager Flex: "unfused", every call
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"error: cannot make the output folder {args.out!r}: {e.strerror}")
    results = dict(env=dict(torch=torch.__version__, triton=triton.__version__,
                            device=torch.cuda.get_device_name() if CUDA else "cpu (smoke test)"),
                   args=vars(args))
    print(results["env"], flush=True)
    for name in args.tables:
        if name in ("forward", "backward"):
            results[name] = prefill(args, backward=name == "backward")
        elif name == "xattention":
            results[name] = xattention_table(args)
        elif name == "train":
            results[name] = train_table(args)
        else:
            env, results[name] = decode_table(args)
            results["env"].update(env)
        # after each table, atomically: partial runs survive, and a kill mid-write keeps the last table's
        write_atomic(os.path.join(args.out, "bench.json"), lambda f: f.write(json.dumps(results, indent=1).encode()))
    if CUDA and "forward" in results:
        plot(results["forward"], os.path.join(args.out, "bench_speedup.png"))
    print(f"\nall numbers in {os.path.join(args.out, 'bench.json')}")


if __name__ == "__main__":
    for stream in (sys.stdout, sys.stderr):   # a non-UTF-8 locale prints Ω as \u03a9, not a traceback
        stream.reconfigure(errors="backslashreplace")
    def numbers(kind):  # "8192,32768" → [8192, 32768]; argparse names the type in its error
        def parse(text):
            return [kind(x) for x in text.split(",")]
        parse.__name__ = f"comma-separated {kind.__name__}"
        return parse
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--tables", nargs="+", choices=TABLES, default=list(TABLES), help="which tables to print")
    parser.add_argument("--seq-lens", type=numbers(int), default=[32768, 131072] if CUDA else [128],
                        help="comma-separated sequence lengths S of the forward and XAttention tables")
    parser.add_argument("--fracs", type=numbers(float), default=[0.0, 0.5, 0.75, 1.0],
                        help="fractions f of STREAMING KV heads (XAttention: the nonzero ones)")
    parser.add_argument("--bwd-seq-lens", type=numbers(int), default=[32768] if CUDA else [128],
                        help="sequence lengths of the forward + backward table")
    parser.add_argument("--bwd-fracs", type=numbers(float), default=[0.0, 0.75],
                        help="fractions f of the forward + backward table")
    parser.add_argument("--block-sparsity", type=float, default=0.9,
                        help="share of causal blocks off in the bsparse setting")
    parser.add_argument("--cudagraph", action="store_true",
                        help="decode: time ours, SDPA and Flex as CUDA-graph replays, as a serving loop runs "
                             "them (no launch cost; caches under the L2 size may be read from it)")
    parser.add_argument("--warmup", type=int, default=100, help="do_bench warm-up, ms")
    parser.add_argument("--rep", type=int, default=500, help="do_bench repetition time, ms")
    parser.add_argument("--rounds", type=int, default=3,
                        help="forward and backward tables: interleaved timing rounds per setting (median, range)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the inputs, the modes and the block masks")
    parser.add_argument("--out", type=str, default="runs/bench", help="folder for bench.json and bench_speedup.png")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: need at least one timing round")
    too_long = [S for S in args.seq_lens + args.bwd_seq_lens if S > CPU_MAX_SEQ_LEN]
    if not CUDA and too_long:  # refused before anything is allocated
        parser.error(f"no CUDA device: this is a CPU smoke test, and S = {too_long} would not fit "
                     f"(its peers hold Hq·S² values); use S <= {CPU_MAX_SEQ_LEN}")
    main(args)
