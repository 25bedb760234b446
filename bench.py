"""bench.py — the fused hybrid-attention kernel against torch's attention, on one GPU.

Causal prefill at Llama-3.1-8B attention shapes (bf16, B = 1, Hq = 32, Hkv = 8, D = 128), with a
fraction f of the KV heads STREAMING (sink 128 + window 2048) and the rest FULL, plus one setting
where every head is BLOCK_SPARSE at ~90 % block sparsity. Side by side, in one process:

    ours    kernels.fused_hybrid_attention: one launch, each head walks only its own tiles
    flex    torch.compile'd FlexAttention with one BlockMask holding every head's mode
            (its mask_mod reads a per-head mode tensor; the BlockMask is built once, timed apart)
    sdpa    torch SDPA, dense causal (what you run without Elastic Attention)
    split   SDPA on the FULL heads + FlexAttention on the STREAMING heads, merged into one output
            (the gather/scatter copies are part of its cost, as in the paper's §7 baseline)

Reported per (S, f): median ms (triton.testing.do_bench), effective TFLOP/s (useful FLOPs from
masks.attention_flops over time), speedup over SDPA dense, the ideal speedup from FLOP counts,
and each peer's max |difference| from our output. Writes bench.json (on a GPU also bench_speedup.png)
to --out, default runs/bench, and prints compact tables last.

    python bench.py                      # the forward grid (several minutes on an H200)
    python bench.py --quick              # S = 8K, 32K; f = 0, 0.5, 1
    python bench.py --backward           # also forward+backward against Flex, split and SDPA
    python bench.py --train              # router-training step: backend "torch" vs "triton"
    python bench.py --old kernels_old    # also time another kernels module's forward (before/after)
    python bench.py --bwd-tune           # backward tile configs (with --old: that module's backward too)
    python bench.py --decode             # decode: compact per-head KV cache vs full-cache peers
Without CUDA it runs a tiny smoke test on the CPU (Triton interpreter, eager Flex): it checks that
every code path runs and that the peers agree with ours, and prints no times (an interpreter's say
nothing about speed; bench.json keeps them) and no PNG.
"""
import argparse
import importlib
import json
import math
import os
import statistics
import time
import warnings

# OpenMP threads that sleep between parallel regions instead of spinning: a CPU shared with other
# jobs is not slowed several-fold (the GPU timings do not change). Read when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if not torch.cuda.is_available():  # smoke-test mode: must be set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: E402

import kernels  # noqa: E402
import masks  # noqa: E402
import xattention  # noqa: E402
from masks import BLOCK_SPARSE, FULL, STREAMING  # noqa: E402

CUDA = torch.cuda.is_available()
CPU_MAX_SEQ_LEN = 4096  # the CPU smoke test's eager Flex and naive peers hold Hq·S² floats

# ----------------------------------------------------------------------------------------------
# Arguments

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
parser.add_argument("--seq-lens", type=str, default="8192,32768,65536,131072" if CUDA else "256",
                    help="comma-separated sequence lengths S of the forward grid")
parser.add_argument("--fracs", type=str, default="0,0.25,0.5,0.75,1", help="fractions of STREAMING KV heads")
parser.add_argument("--quick", action="store_true", help="S = 8K, 32K and f = 0, 0.5, 1 only")
parser.add_argument("--heads", type=int, default=32 if CUDA else 4, help="query heads Hq (Llama-3.1-8B: 32)")
parser.add_argument("--kv-heads", type=int, default=8 if CUDA else 2, help="KV heads Hkv (Llama-3.1-8B: 8)")
parser.add_argument("--head-dim", type=int, default=128 if CUDA else 32, help="head dim D (Llama-3.1-8B: 128)")
parser.add_argument("--sink", type=int, default=128 if CUDA else 16, help="STREAMING sink tokens (paper: 128)")
parser.add_argument("--window", type=int, default=2048 if CUDA else 64, help="STREAMING window (paper: 2048)")
parser.add_argument("--block-size", type=int, default=128 if CUDA else 32,
                    help="block-sparse setting's mask block (128 = FlexAttention's block too)")
parser.add_argument("--block-sparsity", type=float, default=0.9, help="fraction of causal blocks off")
parser.add_argument("--no-block-sparse", action="store_true", help="skip the all-BLOCK_SPARSE setting")
parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (and the split baseline's Flex part)")
parser.add_argument("--no-split", action="store_true", help="skip the split baseline")
parser.add_argument("--old", type=str, default=None,
                    help="module name of another kernels.py (e.g. an earlier version saved as kernels_old.py): "
                         "its forward is timed beside ours in the same run")
parser.add_argument("--backward", action="store_true",
                    help="also time forward+backward (ours, Flex, split, SDPA) at --bwd-seq-lens")
parser.add_argument("--bwd-seq-lens", type=str, default="32768" if CUDA else "256",
                    help="sequence lengths of the forward+backward timings (a subset of --seq-lens)")
parser.add_argument("--bwd-fracs", type=str, default=None,
                    help="fractions f of the forward+backward timings (default: all of --fracs)")
parser.add_argument("--train", action="store_true",
                    help="time one router-training step (training mix, forward+backward) through backend "
                         "'torch' and 'triton' at --train-seq-lens")
parser.add_argument("--train-only", action="store_true", help="only the --train section")
parser.add_argument("--train-seq-lens", type=str, default="4096,8192,16384,32768" if CUDA else "128",
                    help="sequence lengths of the training-step section")
parser.add_argument("--train-batch", type=int, default=1, help="samples per training step")
parser.add_argument("--tune", action="store_true", help="time a few tile configs of our kernel at --tune-seq-len")
parser.add_argument("--tune-seq-len", type=int, default=32768 if CUDA else 256, help="S of the --tune sweep")
parser.add_argument("--bwd-tune", action="store_true",
                    help="time a few backward tile configs (dk/dv, dq) at --tune-seq-len, backward alone; "
                         "--backward then runs the fastest all-FULL one")
parser.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
parser.add_argument("--seed", type=int, default=0, help="random seed of inputs, modes and block masks")
parser.add_argument("--out", type=str, default="runs/bench", help="folder for bench.json and bench_speedup.png")
parser.add_argument("--replot", type=str, default=None, help="redraw PNG and table from a bench.json, run nothing")
parser.add_argument("--xa", action="store_true", help="also time FA-XA: XAttention selection + attention")
parser.add_argument("--xa-only", action="store_true", help="only the FA-XA section")
parser.add_argument("--xa-stride", type=int, default=16 if CUDA else 4, help="XAttention stride (paper 16)")
parser.add_argument("--xa-threshold", type=float, default=0.9, help="XAttention kept mass (paper 0.9)")
parser.add_argument("--decode", action="store_true", help="only the decode section (compact KV cache)")
parser.add_argument("--decode-tune", action="store_true", help="decode: time a few kernel configs at 128K")
parser.add_argument("--decode-cudagraph", action="store_true",
                    help="decode: time ours/sdpa/flex as CUDA-graph replays (no launch overhead)")
parser.add_argument("--decode-flex-budget-s", type=float, default=120.0,
                    help="decode: skip FlexAttention (a compile per shape) once the section ran this long")
args = parser.parse_args()
if args.quick:
    args.seq_lens, args.fracs = ("8192,32768" if CUDA else "256"), "0,0.5,1"
seq_lens = [int(s) for s in args.seq_lens.split(",")]
bwd_seq_lens = [int(s) for s in args.bwd_seq_lens.split(",")]
train_seq_lens = [int(s) for s in args.train_seq_lens.split(",")]
fracs = [float(f) for f in args.fracs.split(",")]
bwd_fracs = [float(f) for f in args.bwd_fracs.split(",")] if args.bwd_fracs else fracs
B, Hq, Hkv, D = 1, args.heads, args.kv_heads, args.head_dim
G = Hq // Hkv
dtype = torch.bfloat16 if CUDA else torch.float16   # the interpreter has no bf16
device = "cuda" if CUDA else "cpu"
FLEX_BLOCK = 128 if CUDA else 32                    # FlexAttention's (default) sparse block
if not CUDA:
    too_long = [S for S in seq_lens + bwd_seq_lens + train_seq_lens + [args.tune_seq_len] if S > CPU_MAX_SEQ_LEN]
    if too_long:  # refused before anything is allocated
        parser.error(f"no CUDA device: this is a CPU smoke test, and S = {too_long} would not fit "
                     f"(the CPU peers hold Hq·S² floats); use S <= {CPU_MAX_SEQ_LEN}, e.g. the defaults")
    print("No CUDA device: CPU smoke test (Triton interpreter, eager FlexAttention). It checks the code "
          "paths only (each runs, the peers agree with ours): no times, no PNG.")
    # Eager Flex on a CPU warns on every call that it is unfused: known, and the point of a smoke test.
    warnings.filterwarnings("ignore", message=".*flex_attention.*")
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.nn.attention.flex_attention")
os.makedirs(args.out, exist_ok=True)
old_kernels = importlib.import_module(args.old) if args.old else None

# ----------------------------------------------------------------------------------------------
# Timing, peers and their masks

if CUDA:
    import triton.testing

    def bench_ms(fn):
        return triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")

    # Many (shape, mask) combinations: let dynamo keep every compiled Flex variant.
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    flex = torch.compile(flex_attention, dynamic=False)
else:
    def bench_ms(fn, n=1):  # smoke test only: wall clock, median of n
        fn()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    flex = flex_attention  # eager (unfused) on the CPU


def sync():
    if CUDA:
        torch.cuda.synchronize()


def sdpa_gqa(q, k, v):
    """Causal SDPA with Hkv < Hq. Uses enable_gqa on the fast backends when this torch allows it,
    else repeats the KV heads (inside the call: that copy is part of the cost)."""
    if SDPA_GQA:
        with torch.nn.attention.sdpa_kernel(FAST_SDPA):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                          is_causal=True)


SDPBackend = torch.nn.attention.SDPBackend
FAST_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
try:  # probe once on a small case
    _q = torch.randn(1, 4, 256, D, device=device, dtype=dtype)
    _k = torch.randn(1, 2, 256, D, device=device, dtype=dtype)
    with torch.nn.attention.sdpa_kernel(FAST_SDPA):
        F.scaled_dot_product_attention(_q, _k, _k, is_causal=True, enable_gqa=True)
    SDPA_GQA = True
except Exception:  # noqa: BLE001 (old torch, or no fast backend takes GQA)
    SDPA_GQA = False


def hybrid_mask_mod(modes_q, block_mask_q, sink, window, block_size):
    """FlexAttention mask_mod over query heads: the same predicate as masks.hybrid_mask, with
    the mode read per (sample, query head) from a tensor. Flex evaluates it only on partial blocks."""
    def mask_mod(b, h, q_idx, kv_idx):
        mode = modes_q[b, h]
        causal = kv_idx <= q_idx
        stream = (kv_idx < sink) | (q_idx - kv_idx < window)
        blocks = block_mask_q[b, h, q_idx // block_size, kv_idx // block_size]
        return causal & ((mode == FULL) | ((mode == STREAMING) & stream) | ((mode == BLOCK_SPARSE) & blocks))
    return mask_mod


def flex_block_mask(S, modes, sink, window, block_mask=None, block_size=128, rows_per_chunk=2048, backward=False):
    """One FlexAttention BlockMask for per-head modes, built exactly and without an S×S mask per
    query head: masks.hybrid_mask is evaluated per KV head on chunks of query rows and reduced
    to 'some pair visible' / 'every pair visible' per FLEX_BLOCK² block (the same result as
    create_block_mask, whose uncompiled form would materialise B·Hq·S² bools at S = 128K)."""
    Bm, Hk = modes.shape
    nb = S // FLEX_BLOCK
    partial = torch.zeros(Bm, Hk, nb, nb, dtype=torch.bool, device=device)
    full = torch.zeros_like(partial)
    for r0 in range(0, S, rows_per_chunk):
        rows = torch.arange(r0, min(S, r0 + rows_per_chunk), device=device)
        m = masks.hybrid_mask(S, modes, sink, window, block_mask, block_size, q_idx=rows)   # (B, Hkv, rows, S)
        m = m.view(Bm, Hk, len(rows) // FLEX_BLOCK, FLEX_BLOCK, nb, FLEX_BLOCK)
        anyv, allv = m.any(5).any(3), m.all(5).all(3)                                 # (B, Hkv, rows/blk, nb)
        partial[:, :, r0 // FLEX_BLOCK: r0 // FLEX_BLOCK + anyv.shape[2]] = anyv & ~allv
        full[:, :, r0 // FLEX_BLOCK: r0 // FLEX_BLOCK + anyv.shape[2]] = allv

    def to_indices(bm):  # (B, Hkv, nb, nb) bool → counts and ascending indices, expanded to Hq
        bm = bm.repeat_interleave(G, 1)                                               # (B, Hq, nb, nb)
        cnt = bm.sum(-1, dtype=torch.int32)
        idx = torch.sort((~bm).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
        return cnt, idx

    if block_mask is None:  # all-off stand-in of the real shape, so one mask_mod serves every setting
        n = masks.num_blocks(S, block_size)
        block_mask = torch.zeros(Bm, Hk, n, n, dtype=torch.bool, device=device)
    bm_q = block_mask.repeat_interleave(G, 1).contiguous()                            # (B, Hq, nB, nB)
    modes_q = modes.repeat_interleave(G, 1).to(torch.int32).contiguous()              # (B, Hq)
    mask_mod = hybrid_mask_mod(modes_q, bm_q, sink, window, block_size)
    # Forward only: skip the transposed (per key block) index that only the backward pass reads.
    has_flag = "compute_q_blocks" in BlockMask.from_kv_blocks.__code__.co_varnames
    extra = {"compute_q_blocks": False} if has_flag and not backward else {}
    return BlockMask.from_kv_blocks(*to_indices(partial), *to_indices(full), BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=mask_mod, **extra)


def modes_for(frac, perm):
    """(1, Hkv) modes with round(frac·Hkv) STREAMING heads, picked by a fixed random permutation
    (nested as f grows), the rest FULL."""
    modes = torch.full((B, Hkv), FULL, dtype=torch.int32)
    modes[0, perm[:round(frac * Hkv)]] = STREAMING
    return modes.to(device)


def random_block_mask(S, block_size, sparsity, gen):
    """(1, Hkv, nB, nB) bool, XAttention-like: the sink column and the diagonal always on, other
    causal blocks on at random so that about (1 - sparsity) of the causal blocks are on."""
    nb = masks.num_blocks(S, block_size)
    causal_blocks = nb * (nb + 1) / 2
    forced = 2 * nb - 1
    p = max(0.0, ((1 - sparsity) * causal_blocks - forced) / max(1.0, causal_blocks - forced))
    bm = torch.rand(B, Hkv, nb, nb, generator=gen) < p
    idx = torch.arange(nb)
    bm[..., idx, idx] = True
    bm[..., :, 0] = True
    return (bm & torch.ones(nb, nb, dtype=torch.bool).tril()).to(device)


def max_diff(a, b):
    """Max |a - b|; over every pair when given tuples (of gradients)."""
    if isinstance(a, (tuple, list)):
        return max(max_diff(x, y) for x, y in zip(a, b))
    return (a.float() - b.float()).abs().max().item()


def setting_name(r):
    """A result row's setting as the tables print it: the streaming fraction, or block-sparse."""
    return f"f={r['frac']:.2f}" if r["kind"] == "hybrid" else "bsparse"


def fmt(x, spec, suffix=""):
    return "-" if x is None else format(x, spec) + suffix


def timed_build(fn):
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, (time.perf_counter() - t0) * 1e3


def run_peer(name, fn, ref, record):
    """Time one peer, check it against our output; a failing peer is recorded, not fatal."""
    try:
        _, first_ms = timed_build(fn)                 # first call: includes any compilation
        out = fn()
        record[f"{name}_first_call_ms"] = first_ms
        record[f"{name}_diff"] = max_diff(out, ref) if ref is not None else None
        del out
        record[f"{name}_ms"] = bench_ms(fn)
    except Exception as e:  # noqa: BLE001
        record[f"{name}_ms"] = None
        record[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"  {name} failed: {record[f'{name}_error']}")

def make_split(S, modes, backward=False):
    """The split baseline as a function (q, k, v) -> o: SDPA on the FULL heads' query and KV heads,
    Flex on the STREAMING ones, scattered into one output. None when it needs Flex and Flex is off."""
    kv_f = (modes[0] == FULL).nonzero().flatten()                        # FULL KV heads
    kv_s = (modes[0] == STREAMING).nonzero().flatten()
    q_f = (kv_f[:, None] * G + torch.arange(G, device=device)).flatten()  # their query heads
    q_s = (kv_s[:, None] * G + torch.arange(G, device=device)).flatten()
    stream_mask = None
    if len(kv_s):
        if args.no_flex:
            return None
        stream_modes = torch.full((B, len(kv_s)), STREAMING, dtype=torch.int32, device=device)
        stream_mask = flex_block_mask(S, stream_modes, args.sink, args.window, backward=backward)

    def split(q, k, v):
        out = torch.empty_like(q)                                        # (B, Hq, S, D)
        if len(kv_f):
            out[:, q_f] = sdpa_gqa(q[:, q_f], k[:, kv_f], v[:, kv_f])
        if len(kv_s):
            out[:, q_s] = flex(q[:, q_s], k[:, kv_s], v[:, kv_s], block_mask=stream_mask, enable_gqa=True)
        return out
    return split


def backward_timings(q, k, v, modes, bm, bs, kind, rec, bwd_cfg=None):
    """Forward+backward ms (one upstream gradient do, dq/dk/dv returned) of ours, Flex, the split
    baseline and SDPA dense; each peer's gradients' max |difference| from ours."""
    S = q.shape[2]
    do = torch.randn_like(q)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def fwd_bwd(attention):
        return lambda: torch.autograd.grad(attention(*leaves), leaves, do)
    ours = fwd_bwd(lambda q, k, v: kernels.fused_hybrid_attention(q, k, v, modes, args.sink, args.window, bm, bs,
                                                                  bwd_config=bwd_cfg))
    try:
        g_ours = ours()
        rec["ours_fb_ms"] = bench_ms(ours)
    except Exception as e:  # noqa: BLE001 (reported, the grid goes on)
        rec["ours_fb_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"  ours forward+backward failed: {rec['ours_fb_error']}")
        return
    if old_kernels is not None:  # the other kernels module (its own default configs), right after ours
        run_peer("old_fb", fwd_bwd(lambda q, k, v: old_kernels.fused_hybrid_attention(
            q, k, v, modes, args.sink, args.window, bm, bs)), g_ours, rec)
    if kind == "hybrid" and not modes.any():
        run_peer("sdpa_fb", fwd_bwd(sdpa_gqa), g_ours, rec)
    else:
        rec["sdpa_fb_ms"] = bench_ms(fwd_bwd(sdpa_gqa))
    if not CUDA and not args.no_flex:
        print("  (FlexAttention has no backward on a CPU: Flex and split skipped in forward+backward)")
    if CUDA and not args.no_flex:
        block_mask = flex_block_mask(S, modes, args.sink, args.window, bm, bs, backward=True)
        run_peer("flex_fb", fwd_bwd(lambda q, k, v: flex(q, k, v, block_mask=block_mask, enable_gqa=True)),
                 g_ours, rec)
        del block_mask
    if CUDA and kind == "hybrid" and not args.no_split:
        split = make_split(S, modes, backward=True)
        if split is not None:
            run_peer("split_fb", fwd_bwd(split), g_ours, rec)
        del split
    for peer in ("flex", "split", "sdpa", "old"):
        ms = rec.get(f"{peer}_fb_ms")
        rec[f"ours_fb_vs_{peer}"] = ms / rec["ours_fb_ms"] if ms else None
    if CUDA:
        print(f"  forward+backward S={S} {kind} f={rec['frac']}: ours {rec['ours_fb_ms']:.3f} ms, "
              f"flex {fmt(rec.get('flex_fb_ms'), '.3f')}, split {fmt(rec.get('split_fb_ms'), '.3f')}, "
              f"sdpa {fmt(rec.get('sdpa_fb_ms'), '.3f')}, old {fmt(rec.get('old_fb_ms'), '.3f')}", flush=True)
    else:
        print(f"  forward+backward S={S} {kind} f={rec['frac']}: ran " + ", ".join(
            p for p in ("ours", "flex", "split", "sdpa", "old") if rec.get(f"{p}_fb_ms")), flush=True)

# ----------------------------------------------------------------------------------------------
# Router training: one step of the training mix, backend "torch" (today's path) vs "triton"

# The experiment's model (elastic_attention.Config.preset("gpu")): width 128, 4 layers, 8 query
# heads, 4 KV heads, head dim 16, sink 32, window 512. Sink and window stay fixed at every S.
TRAIN_SHAPE = dict(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=16, sink=32, window=512)


def train_section(gen):
    """One router-training step as a kernel-level mock of the model: per layer, q/k/v projections,
    the training mix O = z·O_full + (1 − z)·O_sparse (METHOD.md §5) with O_full (all heads FULL)
    and O_sparse (all heads STREAMING) from two hybrid_attention calls, an output projection and a
    residual; then backward, with the projections and the gate logits requiring grad (so q, k, v
    do). float32 with TF32 matmuls, as train_router.py runs the model. Reports the median step
    time, the peak GPU memory of a step and the max relative difference of the gradients."""
    C, L, Hq_t, Hkv_t, D_t, sink, window = (TRAIN_SHAPE[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads",
                                                                      "head_dim", "sink", "window"))
    Bt, Gt = args.train_batch, Hq_t // Hkv_t
    if CUDA:
        torch.backends.cuda.matmul.allow_tf32 = True
    rows = []
    for S in train_seq_lens:
        g = torch.Generator().manual_seed(args.seed)
        x = torch.randn(Bt, S, C, generator=g).to(device)
        w_qkv = [(torch.randn(C, (Hq_t + 2 * Hkv_t) * D_t, generator=g) / C ** 0.5).to(device).requires_grad_()
                 for _ in range(L)]
        w_o = [(torch.randn(Hq_t * D_t, C, generator=g) / (Hq_t * D_t) ** 0.5).to(device).requires_grad_()
               for _ in range(L)]
        gate_logits = torch.zeros(L, Hkv_t, device=device, requires_grad=True)
        params = w_qkv + w_o + [gate_logits]
        full = torch.full((Bt, Hkv_t), FULL, dtype=torch.int32, device=device)
        stream = torch.full((Bt, Hkv_t), STREAMING, dtype=torch.int32, device=device)

        def step(backend):
            for p in params:
                p.grad = None
            h = x
            for layer in range(L):
                q, k, v = (h @ w_qkv[layer]).split([Hq_t * D_t, Hkv_t * D_t, Hkv_t * D_t], -1)
                q = q.view(Bt, S, Hq_t, D_t).transpose(1, 2)                      # (B, Hq, S, D)
                k = k.view(Bt, S, Hkv_t, D_t).transpose(1, 2)                     # (B, Hkv, S, D)
                v = v.view(Bt, S, Hkv_t, D_t).transpose(1, 2)
                o_full = kernels.hybrid_attention(q, k, v, full, sink, window, backend=backend)
                o_sparse = kernels.hybrid_attention(q, k, v, stream, sink, window, backend=backend)
                z = torch.sigmoid(gate_logits[layer]).repeat_interleave(Gt).view(1, Hq_t, 1, 1)
                o = z * o_full + (1 - z) * o_sparse                               # (B, Hq, S, D)
                h = h + o.transpose(1, 2).reshape(Bt, S, Hq_t * D_t) @ w_o[layer]
            h.square().mean().backward()
            return [p.grad.clone() for p in (w_qkv[0], gate_logits)]

        grads = {}
        for backend in ("torch", "triton"):
            rec = dict(S=S, backend=backend, batch=Bt)
            try:
                grads[backend] = step(backend)                                    # warm-up (compiles)
                if CUDA:  # on a CPU the one step above is the smoke test
                    sync()
                    torch.cuda.reset_peak_memory_stats()
                    times = []
                    for _ in range(3):
                        t0 = time.perf_counter()
                        step(backend)
                        sync()
                        times.append((time.perf_counter() - t0) * 1e3)
                    rec["step_ms"] = statistics.median(times)
                    rec["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
            except Exception as e:  # noqa: BLE001 (out of memory is a result here)
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                grads.pop(backend, None)
                if CUDA:
                    torch.cuda.empty_cache()
            if backend == "triton" and len(grads) == 2:
                rec["grad_rel_diff"] = max((a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
                                           for a, b in zip(grads["triton"], grads["torch"]))
            rows.append(rec)
            print(f"  train S={S} {backend}: " + (rec["error"] if "error" in rec else
                                                 f"{rec['step_ms']:.1f} ms, peak {rec['peak_gb']:.2f} GB" if CUDA
                                                 else "ran"), flush=True)
        del x, w_qkv, w_o, gate_logits, params, grads
        if CUDA:
            torch.cuda.empty_cache()
    return rows

# ----------------------------------------------------------------------------------------------
# Tile-config sweep of our kernel (--tune): one S, all-FULL and f = 0.75


def tune(S, perm):
    gen = torch.Generator().manual_seed(args.seed)
    q = torch.randn(B, Hq, S, D, generator=gen).to(device, dtype)
    k = torch.randn(B, Hkv, S, D, generator=gen).to(device, dtype)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(device, dtype)
    configs = [None, (128, 64, 8, 4), (128, 128, 8, 2), (64, 64, 4, 3)] \
        if CUDA else [None, (32, 32, 4, 1)]
    rows = []
    for frac in (0.0, 0.75):
        modes = modes_for(frac, perm)
        flops = masks.attention_flops(S, modes, args.sink, args.window, head_dim=D, group=G)
        ref = kernels.fused_hybrid_attention(q, k, v, modes, args.sink, args.window)
        for cfg in configs:
            rec = dict(S=S, frac=frac, config=cfg)
            try:
                fn = lambda: kernels.fused_hybrid_attention(q, k, v, modes, args.sink, args.window, config=cfg)  # noqa: E731
                rec["diff"] = max_diff(fn(), ref)
                rec["ms"] = bench_ms(fn)
                rec["tflops"] = flops / rec["ms"] / 1e9
            except Exception as e:  # noqa: BLE001 (a config that does not fit is reported)
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(rec)
            print(f"  tune S={S} f={frac} config={cfg}: "
                  + (f"{rec['ms']:.3f} ms {rec['tflops']:.0f} TF/s diff {rec['diff']:.1e}" if "ms" in rec
                     else rec["error"]))
    return rows


def bwd_tune(S, perm):
    """Backward alone (dq, dk, dv from a saved forward) for several (dk/dv, dq) tile configs, each
    (BLOCK_M, BLOCK_N, num_warps, num_stages), around kernels._bwd_tile_config's (RESULTS.md has the
    wider sweep that chose it): first the dk/dv config varied with the dq config held, then the dq
    config, then the best of each together. With --old, that module's backward too."""
    gen = torch.Generator().manual_seed(args.seed)
    q = torch.randn(B, Hq, S, D, generator=gen).to(device, dtype)
    k = torch.randn(B, Hkv, S, D, generator=gen).to(device, dtype)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(device, dtype)
    do = torch.randn(B, Hq, S, D, generator=gen).to(device, dtype)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    dkdv0, dq0 = kernels._bwd_tile_config(D, dtype, args.block_size, False, not CUDA)   # the default
    if CUDA:
        dkdvs = [(32, 128, 4, 3), (32, 128, 8, 3), (32, 64, 4, 3), (64, 128, 8, 4)]
        dqs = [(128, 32, 4, 3), (128, 64, 8, 2), (128, 64, 8, 4), (64, 64, 4, 3)]
    else:
        dkdvs, dqs = [(16, 16, 4, 1)], [(16, 16, 4, 1)]
    dkdvs, dqs = [c for c in dkdvs if c != dkdv0], [c for c in dqs if c != dq0]
    rows, refs = [], {}

    def run(frac, dkdv, dq_cfg, module=kernels, label=None):
        modes = modes_for(frac, perm)
        cfg = (dkdv, dq_cfg) if module is kernels else None
        o = module.fused_hybrid_attention(*leaves, modes, args.sink, args.window,
                                          **(dict(bwd_config=cfg) if cfg else {}))
        rec = dict(S=S, frac=frac, dkdv=dkdv, dq=dq_cfg, module=label or "ours")
        try:
            grads = torch.autograd.grad(o, leaves, do, retain_graph=True)
            if frac not in refs:
                refs[frac] = grads
            rec["diff"] = max(max_diff(a, b) for a, b in zip(grads, refs[frac]))
            rec["ms"] = bench_ms(lambda: torch.autograd.grad(o, leaves, do, retain_graph=True))
        except Exception as e:  # noqa: BLE001 (a config that does not fit is reported)
            rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(rec)
        print(f"  bwd-tune S={S} f={frac} {rec['module']} dkdv={dkdv} dq={dq_cfg}: "
              + (f"{rec['ms']:.3f} ms diff {rec['diff']:.1e}" if "ms" in rec else rec["error"]), flush=True)
        return rec.get("ms", math.inf)

    for frac in (0.0, 0.75):
        base = run(frac, dkdv0, dq0)
        if old_kernels is not None:
            run(frac, None, None, old_kernels, label=args.old)
        t_dkdv = {c: run(frac, c, dq0) for c in dkdvs}
        t_dq = {c: run(frac, dkdv0, c) for c in dqs}
        t_dkdv[dkdv0] = t_dq[dq0] = base
        pick = (min(t_dkdv, key=t_dkdv.get), min(t_dq, key=t_dq.get))
        if pick != (dkdv0, dq0):
            run(frac, *pick)
    full = [r for r in rows if "ms" in r and r["frac"] == 0.0 and r["module"] == "ours"]
    return rows, min(full, key=lambda r: r["ms"]) if full else None

# ----------------------------------------------------------------------------------------------
# The grid


def main():
    gen = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(Hkv, generator=gen)
    env = dict(torch=torch.__version__, triton=__import__("triton").__version__,
               device=torch.cuda.get_device_name() if CUDA else "cpu (interpreter smoke test)",
               sdpa_enable_gqa=SDPA_GQA)
    print(env)
    results = dict(env=env, args=vars(args), runs=[], tune=[], ours_config=None, train=[], bwd_tune=[],
                   ours_bwd_config=None)
    if args.tune:  # the grid below then runs the fastest all-FULL config
        results["tune"] = tune(args.tune_seq_len, perm)
        full = [r for r in results["tune"] if "ms" in r and r["frac"] == 0.0]
        if full:
            results["ours_config"] = min(full, key=lambda r: r["ms"])["config"]
        print(f"grid runs config={results['ours_config']}")
    cfg = results["ours_config"]
    if args.bwd_tune:  # --backward then runs the fastest all-FULL backward config
        results["bwd_tune"], best = bwd_tune(args.tune_seq_len, perm)
        if best:
            results["ours_bwd_config"] = (best["dkdv"], best["dq"])
        print(f"backward runs bwd_config={results['ours_bwd_config']}")
    bwd_cfg = results["ours_bwd_config"]

    def save():  # after every section and every S: partial runs survive
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump(results, f, indent=1)

    if args.train or args.train_only:
        results["train"] = train_section(gen)
        save()
        if args.train_only:
            print_train_table(results["train"])
            return
    if args.xa_only:
        results["xa"] = xa_section(perm, gen, {})
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump(results, f, indent=1)
        print_xa_table(results["xa"])
        return
    for S in seq_lens:
        q = torch.randn(B, Hq, S, D, generator=gen).to(device, dtype)    # (B, Hq, S, D)
        k = torch.randn(B, Hkv, S, D, generator=gen).to(device, dtype)   # (B, Hkv, S, D)
        v = torch.randn(B, Hkv, S, D, generator=gen).to(device, dtype)
        all_full = torch.full((B, Hkv), FULL, dtype=torch.int32, device=device)
        flops_full = masks.attention_flops(S, all_full, args.sink, args.window, head_dim=D, group=G)
        o_sdpa = sdpa_gqa(q, k, v)
        sdpa_ms = bench_ms(lambda: sdpa_gqa(q, k, v))
        ours_full_ms = None

        settings = [("hybrid", f) for f in fracs]
        if not args.no_block_sparse:
            settings.append(("block_sparse", None))
        for kind, frac in settings:
            if kind == "hybrid":
                modes, bm, bs = modes_for(frac, perm), None, args.block_size
            else:
                modes = torch.full((B, Hkv), BLOCK_SPARSE, dtype=torch.int32, device=device)
                bs = args.block_size
                bm = random_block_mask(S, bs, args.block_sparsity, gen)
            flops = masks.attention_flops(S, modes, args.sink, args.window, bm, bs, head_dim=D, group=G)
            rec = dict(S=S, kind=kind, frac=frac, flops=flops, ideal_speedup=flops_full / flops,
                       omega_esr=float(masks.omega_esr_closed_form(S, modes, args.sink, args.window, bm, bs)[0]),
                       sdpa_ms=sdpa_ms)

            ours = lambda: kernels.fused_hybrid_attention(q, k, v, modes, args.sink, args.window, bm, bs,  # noqa: E731
                                                          config=cfg)
            o_ours = ours()
            rec["ours_ms"] = bench_ms(ours)
            if old_kernels is not None:  # the other kernels module, timed right after ours
                run_peer("old", lambda: old_kernels.fused_hybrid_attention(q, k, v, modes, args.sink, args.window,
                                                                           bm, bs), o_ours, rec)
                rec["ours_vs_old"] = rec["old_ms"] / rec["ours_ms"] if rec.get("old_ms") else None
            if kind == "hybrid" and frac == 0:
                ours_full_ms = rec["ours_ms"]
                rec["sdpa_diff"] = max_diff(o_sdpa, o_ours)

            if not args.no_flex:
                try:
                    block_mask, rec["flex_build_ms"] = timed_build(
                        lambda: flex_block_mask(S, modes, args.sink, args.window, bm, bs))
                    run_peer("flex", lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True), o_ours, rec)
                    del block_mask
                except Exception as e:  # noqa: BLE001
                    rec["flex_ms"], rec["flex_error"] = None, f"{type(e).__name__}: {str(e)[:300]}"
                    print(f"  flex failed: {rec['flex_error']}")

            if kind == "hybrid" and not args.no_split:
                split, rec["split_build_ms"] = timed_build(lambda: make_split(S, modes))
                if split is not None:
                    run_peer("split", lambda: split(q, k, v), o_ours, rec)
                del split

            if args.backward and S in bwd_seq_lens and (kind != "hybrid" or frac in bwd_fracs):
                backward_timings(q, k, v, modes, bm, bs, kind, rec, bwd_cfg)

            for peer in ("ours", "flex", "split"):
                ms = rec.get(f"{peer}_ms")
                if ms:
                    rec[f"{peer}_tflops"] = flops / ms / 1e9
                    rec[f"{peer}_speedup_vs_sdpa"] = sdpa_ms / ms
            rec["ours_vs_flex"] = rec["flex_ms"] / rec["ours_ms"] if rec.get("flex_ms") else None
            rec["ours_vs_split"] = rec["split_ms"] / rec["ours_ms"] if rec.get("split_ms") else None
            if ours_full_ms:
                rec["ours_speedup_vs_own_full"] = ours_full_ms / rec["ours_ms"]
                rec["fraction_of_ideal"] = rec["ours_speedup_vs_own_full"] / rec["ideal_speedup"]
            results["runs"].append(rec)
            if CUDA:
                print(f"S={S} {kind} f={frac}: ours {rec['ours_ms']:.3f} ms, old {fmt(rec.get('old_ms'), '.3f')}, "
                      f"flex {fmt(rec.get('flex_ms'), '.3f')}, split {fmt(rec.get('split_ms'), '.3f')}, "
                      f"sdpa {sdpa_ms:.3f}", flush=True)
            else:  # an interpreter's times say nothing about speed: which paths ran
                print(f"S={S} {kind} f={frac}: ran " + ", ".join(
                    p for p in ("ours", "old", "flex", "split") if rec.get(f"{p}_ms")) + ", sdpa", flush=True)
            del o_ours
        del q, k, v, o_sdpa
        if CUDA:
            torch.cuda.empty_cache()
        save()

    if args.xa:
        sdpa_by_S = {r["S"]: r["sdpa_ms"] for r in results["runs"]}
        results["xa"] = xa_section(perm, gen, sdpa_by_S)
        save()
    if CUDA:
        plot(results["runs"])
    print_table(results["runs"])
    if args.backward:
        print_backward_table(results["runs"])
    if results["bwd_tune"]:
        print_bwd_tune_table(results["bwd_tune"], results["ours_bwd_config"])
    if results["train"]:
        print_train_table(results["train"])
    if args.xa:
        print_xa_table(results["xa"])

# ----------------------------------------------------------------------------------------------
# FA-XA: XAttention picks each sparse head's key blocks from the input, then the fused
# kernel runs FULL heads dense and XA heads block-sparse. Random q/k give flat attention, where
# XAttention keeps ~95 % of blocks; real long-context heads are peaked. So q/k here carry a local
# component (a RoPE-like wave: q_i·k_j peaks at i = j) plus one "retrieval" direction that a few
# key blocks match, over noise: attention is local with a few distant hot spots, as in practice.

def structured_qkv(S, gen):
    pos = torch.arange(S).view(S, 1).float()
    freqs = 1.0 / (64.0 * 4.0 ** torch.arange(D // 8).float())               # slow waves: ~64+ tokens
    wave = torch.cat([(pos * freqs).cos(), (pos * freqs).sin()], 1)          # (S, D/4)
    q = 0.5 * torch.randn(B, Hq, S, D, generator=gen)
    k = 0.5 * torch.randn(B, Hkv, S, D, generator=gen)
    q[..., :D // 4] += 3.0 * wave
    k[..., :D // 4] += 3.0 * wave
    hot = torch.randperm(S // args.block_size, generator=gen)[:4]             # 4 "needle" key blocks
    for blk in hot.tolist():
        k[:, :, blk * args.block_size:(blk + 1) * args.block_size, D // 4] += 6.0
    q[..., D // 4] += 1.0
    v = torch.randn(B, Hkv, S, D, generator=gen)
    return (t.to(device, dtype) for t in (q, k, v))


def xa_section(perm, gen, sdpa_by_S):
    rows = []
    bs, stride, thr = args.block_size, args.xa_stride, args.xa_threshold
    for S in seq_lens:
        q, k, v = structured_qkv(S, gen)
        sdpa_ms = sdpa_by_S.get(S) or bench_ms(lambda: sdpa_gqa(q, k, v))
        scores = xattention.xattention_scores(q, k, bs, stride)                          # (B, Hkv, nB, nB)
        score_ms = bench_ms(lambda: xattention.xattention_scores(q, k, bs, stride))
        pick_ms = bench_ms(lambda: xattention.xattention_select(scores, thr))
        bm = xattention.xattention_select(scores, thr)                                    # (B, Hkv, nB, nB)
        nB = bm.shape[-1]
        causal_blocks = nB * (nB + 1) / 2
        all_full = torch.full((B, Hkv), FULL, dtype=torch.int32, device=device)
        full_ms = bench_ms(lambda: kernels.fused_hybrid_attention(q, k, v, all_full, args.sink, args.window))
        flops_full = masks.attention_flops(S, all_full, args.sink, args.window, head_dim=D, group=G)
        for frac in fracs:
            if frac == 0:
                continue
            ssa_modes = modes_for(frac, perm)                                     # FA-SSA, same heads
            ssa_ms = bench_ms(lambda: kernels.fused_hybrid_attention(q, k, v, ssa_modes, args.sink, args.window))
            modes = torch.where(ssa_modes == STREAMING, BLOCK_SPARSE, ssa_modes).to(torch.int32)  # FA-XA
            xassa = torch.where(ssa_modes == FULL, BLOCK_SPARSE, ssa_modes).to(torch.int32)  # XA-SSA
            xassa_ms = bench_ms(lambda: kernels.fused_hybrid_attention(q, k, v, xassa, args.sink, args.window, bm, bs))
            attn_ms = bench_ms(lambda: kernels.fused_hybrid_attention(q, k, v, modes, args.sink, args.window, bm, bs))
            flops = masks.attention_flops(S, modes, args.sink, args.window, bm, bs, head_dim=D, group=G)
            xa_heads = modes[0] == BLOCK_SPARSE
            density = float(bm[0, xa_heads].sum()) / (int(xa_heads.sum()) * causal_blocks)
            ideal = flops_full / flops
            rec = dict(S=S, frac=frac, score_ms=score_ms, pick_ms=pick_ms, attn_ms=attn_ms, full_ms=full_ms,
                       ssa_ms=ssa_ms, xassa_ms=xassa_ms,
                       sdpa_ms=sdpa_ms, xa_block_density=density, ideal_speedup=ideal,
                       fraction_of_ideal=(full_ms / attn_ms) / ideal,
                       selection_over_sdpa=(score_ms + pick_ms) / sdpa_ms,
                       end_to_end_speedup_vs_sdpa=sdpa_ms / (score_ms + pick_ms + attn_ms))
            rows.append(rec)
            if CUDA:
                print(f"FA-XA S={S} f={frac}: score {score_ms:.3f} + pick {pick_ms:.3f} ms "
                      f"({100 * rec['selection_over_sdpa']:.1f} % of SDPA {sdpa_ms:.3f}), attention {attn_ms:.3f} ms "
                      f"(FA-SSA {ssa_ms:.3f}, XA-SSA {xassa_ms:.3f}, all-FULL {full_ms:.3f}), "
                      f"density {density:.3f}, {100 * rec['fraction_of_ideal']:.0f} % of ideal {ideal:.2f}x",
                      flush=True)
            else:
                print(f"FA-XA S={S} f={frac}: ran scoring, picking, FA-XA, FA-SSA, XA-SSA, all FULL, SDPA; "
                      f"block density {density:.3f}", flush=True)
        del q, k, v, scores, bm
    return rows

# ----------------------------------------------------------------------------------------------
# Output: PNG and the compact table


def plot(runs):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    hybrid = [r for r in runs if r["kind"] == "hybrid"]
    Ss = sorted({r["S"] for r in hybrid})
    fig, axes = plt.subplots(1, len(Ss), figsize=(3.2 * len(Ss), 3.0), squeeze=False, sharey=True)
    for ax, S in zip(axes[0], Ss):
        rs = sorted((r for r in hybrid if r["S"] == S), key=lambda r: r["frac"])
        fs = [r["frac"] for r in rs]
        for key, label, style in (("ours", "ours (fused)", "o-"), ("flex", "Flex hybrid", "s-"),
                                  ("split", "split SDPA+Flex", "^-")):
            ys = [r.get(f"{key}_speedup_vs_sdpa") for r in rs]
            if any(y is not None for y in ys):
                ax.plot(fs, [y if y is not None else math.nan for y in ys], style, label=label, ms=4)
        ax.plot(fs, [r["ideal_speedup"] for r in rs], "k--", label="ideal (FLOPs at SDPA's rate)", lw=1)
        ax.set_yscale("log")
        ax.set_title(f"S = {S // 1024}K" if S >= 1024 else f"S = {S}")
        ax.set_xlabel("fraction of STREAMING heads")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("speedup over SDPA dense")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "bench_speedup.png"), dpi=110)


def print_backward_table(runs):
    rows = [r for r in runs if r.get("ours_fb_ms")]
    if not CUDA:
        print("\nforward+backward, CPU smoke test: max |gradient difference| from ours")
        for r in rows:
            setting = setting_name(r)
            print(f"{r['S']:>7}  {setting:>7}  flex {fmt(r.get('flex_fb_diff'), '.1e')}  "
                  f"split {fmt(r.get('split_fb_diff'), '.1e')}  sdpa {fmt(r.get('sdpa_fb_diff'), '.1e')}")
        return
    print("\nforward+backward (ms; ratios > 1: ours faster)")
    print("      S  setting  ours fwd  ours f+b  flex f+b  split f+b  sdpa f+b  vs flex  vs split  vs sdpa  "
          "grad diff flex/split" + ("  old f+b  vs old" if args.old else ""))
    for r in rows:
        setting = setting_name(r)
        print(f"{r['S']:>7}  {setting:>7}  {r['ours_ms']:8.2f}  {r['ours_fb_ms']:8.2f}  "
              f"{fmt(r.get('flex_fb_ms'), '8.2f'):>8}  {fmt(r.get('split_fb_ms'), '9.2f'):>9}  "
              f"{fmt(r.get('sdpa_fb_ms'), '8.2f'):>8}  {fmt(r.get('ours_fb_vs_flex'), '6.2f', 'x'):>7}  "
              f"{fmt(r.get('ours_fb_vs_split'), '7.2f', 'x'):>8}  {fmt(r.get('ours_fb_vs_sdpa'), '6.2f', 'x'):>7}  "
              f"{fmt(r.get('flex_fb_diff'), '.1e')}/{fmt(r.get('split_fb_diff'), '.1e')}"
              + (f"  {fmt(r.get('old_fb_ms'), '7.2f'):>7}  {fmt(r.get('ours_fb_vs_old'), '5.2f', 'x'):>6}" if args.old else ""))


def print_bwd_tune_table(rows, best):
    print(f"\nbackward alone, tile configs (BLOCK_M, BLOCK_N, warps, stages); --backward ran {best}")
    print("      S     f  module        dk/dv config       dq config            ms  max grad diff")
    for r in rows:
        print(f"{r['S']:>7}  {r['frac']:4.2f}  {r['module']:<12}  {str(r['dkdv']):<17}  {str(r['dq']):<17}  "
              f"{fmt(r.get('ms'), '8.2f'):>8}  {fmt(r.get('diff'), '.1e'):>13}" + (f"  {r['error']}" if "error" in r else ""))


def print_train_table(rows):
    s = TRAIN_SHAPE
    print(f"\nrouter-training step (training mix fwd+bwd; {s['n_layers']} layers, Hq {s['n_heads']}, "
          f"Hkv {s['n_kv_heads']}, D {s['head_dim']}, sink {s['sink']}, window {s['window']}, "
          f"batch {args.train_batch}, fp32/TF32)")
    if not CUDA:
        print("CPU smoke test: both backends ran; times and memory are not measured here")
    print("      S  backend   step ms  peak GB  grad rel diff")
    for r in rows:
        print(f"{r['S']:>7}  {r['backend']:>7}  {fmt(r.get('step_ms'), '8.1f'):>8}  {fmt(r.get('peak_gb'), '7.2f'):>7}  "
              f"{fmt(r.get('grad_rel_diff'), '.1e'):>13}" + (f"  {r['error']}" if "error" in r else ""))


def print_xa_table(rows):
    if not CUDA:  # smoke test: no times; the block density is a property of the inputs, not of speed
        print("\nFA-XA, CPU smoke test: every path ran; XAttention block density " +
              ", ".join(f"S={r['S']} f={r['frac']}: {r['xa_block_density']:.3f}" for r in rows))
        return
    print("\n      S     f  score ms  pick ms  select/SDPA  FA-XA ms  FA-SSA ms  XA-SSA ms  all-FULL ms  SDPA ms  "
          "density  of ideal")
    for r in rows:
        print(f"{r['S']:>7}  {r['frac']:4.2f}  {r['score_ms']:8.2f}  {r['pick_ms']:7.2f}  {r['selection_over_sdpa']:11.1%}  "
              f"{r['attn_ms']:8.2f}  {r['ssa_ms']:9.2f}  {r['xassa_ms']:9.2f}  {r['full_ms']:11.2f}  {r['sdpa_ms']:7.2f}  "
              f"{r['xa_block_density']:7.3f}  {r['fraction_of_ideal']:8.0%}")


def print_table(runs):
    if not CUDA:  # smoke test: times of an interpreter say nothing about speed, ratios even less
        print("\nCPU smoke test (not a speed measurement): every path ran; max |difference| from ours")
        print("      S  setting  flex diff  split diff  old diff")
        for r in runs:
            setting = setting_name(r)
            print(f"{r['S']:>7}  {setting:>7}  {fmt(r.get('flex_diff'), '9.1e'):>9}  "
                  f"{fmt(r.get('split_diff'), '10.1e'):>10}  {fmt(r.get('old_diff'), '8.1e'):>8}")
        return
    if any(r.get("old_ms") for r in runs):
        print("\n      S  setting  ours ms  old ms  old/ours")
        for r in runs:
            setting = setting_name(r)
            print(f"{r['S']:>7}  {setting:>7}  {r['ours_ms']:7.2f}  {fmt(r.get('old_ms'), '6.2f'):>6}  "
                  f"{fmt(r.get('ours_vs_old'), '7.3f', 'x'):>8}")
    print("\n      S  setting  ours ms  TF/s  flex ms  split ms  sdpa ms  vs flex  vs split  vs sdpa  "
          "ideal  of ideal  diff flex/split")
    for r in runs:
        setting = setting_name(r)
        print(f"{r['S']:>7}  {setting:>7}  {r['ours_ms']:>7.2f}  {fmt(r.get('ours_tflops'), '4.0f')}  "
              f"{fmt(r.get('flex_ms'), '7.2f')}  {fmt(r.get('split_ms'), '8.2f')}  {r['sdpa_ms']:>7.2f}  "
              f"{fmt(r.get('ours_vs_flex'), '6.2f', 'x'):>7}  {fmt(r.get('ours_vs_split'), '7.2f', 'x'):>8}  "
              f"{fmt(r.get('ours_speedup_vs_sdpa'), '6.2f', 'x'):>7}  {r['ideal_speedup']:4.2f}x  "
              f"{fmt(r.get('fraction_of_ideal'), '7.0%'):>8}  "
              f"{fmt(r.get('flex_diff'), '.1e')}/{fmt(r.get('split_diff'), '.1e')}")


# ----------------------------------------------------------------------------------------------
# Decode (--decode): one new token per sample against a KV cache of S tokens, per (S, batch, f).
# The compact cache (decode.py) holds sink + window rows for a STREAMING head and S for the others;
# every peer holds S rows for every head:
#     ours     decode.decode_attention over the compact cache (split-K Triton kernel)
#     masked   the model's reference decode: a masks.hybrid_mask row + masks.masked_attention (fp32)
#     sdpa     torch SDPA, the one query over the whole cache (decoding without sparse heads)
#     flex     compiled FlexAttention over the whole cache with a per-head streaming mask (it skips
#              masked-out blocks; one compile per shape, so only at the longest S, f = 0.75)
# Memory-bound: each reads its K/V once, so GB/s = bytes read / time, against the measured copy
# bandwidth, and the bandwidth-ideal speedup over sdpa is full bytes / compact bytes.


def decode_bench():
    import decode
    import elastic_attention
    small = elastic_attention.Config.preset("gpu" if "gpu" in elastic_attention.PRESETS else "long")
    shapes = [  # (name, Hq, Hkv, D, sink, window, context lengths, batches); the quick one first
        ("small", small.n_heads, small.n_kv_heads, small.head_dim, small.sink, small.window,
         [small.max_seq_len] if CUDA else [256], [1, 16] if CUDA else [1]),
        ("llama3-8b", args.heads, args.kv_heads, args.head_dim, args.sink, args.window,
         [8192, 32768, 131072] if CUDA else [256], [1, 16] if CUDA else [1]),
    ]
    t_start = time.perf_counter()
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    src = torch.empty(2 ** 30 if CUDA else 2 ** 20, dtype=torch.float32, device=device)  # 4 GB on a GPU
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() * 4 / bench_ms(lambda: dst.copy_(src)) / 1e6   # read + write
    del src, dst
    env = dict(torch=torch.__version__, triton=__import__("triton").__version__,
               device=torch.cuda.get_device_name() if CUDA else "cpu (interpreter smoke test)",
               copy_GBps=copy_gbs)
    results = dict(env=env, args=vars(args), decode=[], tune=[], config=None)
    # ours / sdpa / flex timer. do_bench: each call launched from Python after an L2 flush, so the
    # host's launch cost is in it once it exceeds the flush. --decode-cudagraph: replays of a captured
    # graph (how a serving loop runs decode), no launch cost and no flush (caches under the 60 MB L2
    # may be read from it). The masked reference always runs eagerly (it copies host tensors).
    timer = bench_ms
    env["timer"] = "do_bench"
    if args.decode_cudagraph and CUDA:
        def timer(fn):
            return triton.testing.do_bench_cudagraph(fn, rep=args.rep, return_mode="median")
        env["timer"] = "do_bench_cudagraph"

    def sdpa_decode(q, k, v, fast=True):  # q (B, Hq, D) → (B, Hq, D): no mask, the last token sees all
        if fast:
            with torch.nn.attention.sdpa_kernel(FAST_SDPA):
                return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]
        return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]

    def masked_decode(q, k, v, modes, sink, window):  # what Transformer.decode_step does with a full cache
        S = k.shape[2]
        mask = masks.hybrid_mask(S, modes, sink, window, q_idx=torch.tensor([S - 1]))  # (B, Hkv, 1, S)
        return masks.masked_attention(q[:, :, None], k, v, mask)[:, :, 0]

    def flex_decode_fn(q, k, v, modes, sink, window):
        from torch.nn.attention.flex_attention import create_block_mask
        S, g = k.shape[2], q.shape[1] // k.shape[1]
        stream_q = (modes[0] == STREAMING).repeat_interleave(g).contiguous()  # (Hq,), same for every sample

        def mask_mod(b, h, q_idx, kv_idx):  # the one query sits at position S - 1
            return ~stream_q[h] | (kv_idx < sink) | (S - 1 - kv_idx < window)
        bm = create_block_mask(mask_mod, None, q.shape[1], 1, S, device=device)
        return lambda: flex(q[:, :, None], k, v, block_mask=bm, enable_gqa=True)[:, :, 0]

    def setting(bsz, hq, hkv, d, S, frac, perm, sink, window):
        """Random full-cache q/k/v (drawn on the device: 16 × 128K × 8 heads is 2·10⁹ numbers), the
        modes with round(frac·Hkv) STREAMING heads, and the compact cache built from them."""
        k = torch.randn(bsz, hkv, S, d, device=device, dtype=dtype)        # (B, Hkv, S, D)
        v = torch.randn(bsz, hkv, S, d, device=device, dtype=dtype)
        q = torch.randn(bsz, hq, d, device=device, dtype=dtype)            # (B, Hq, D)
        modes = torch.full((bsz, hkv), FULL, dtype=torch.int32)
        modes[:, perm[:round(frac * hkv)]] = STREAMING
        modes = modes.to(device)
        return q, k, v, modes, decode.KVCache.from_prefill([k], [v], [modes], sink, window, S)

    def ours_fn(q, cache, S, cfg):
        return lambda: decode.decode_attention(q, cache.k[0], cache.v[0], cache.start[0], cache.cap[0], S,
                                               max_cap=cache.max_cap[0], config=cfg)

    # Which SDPA backends take a decode-shaped GQA call here.
    _q, _k = torch.randn(1, 4, 16, device=device, dtype=dtype), torch.randn(1, 2, 256, 16, device=device, dtype=dtype)
    try:
        sdpa_decode(_q, _k, _k)
        sdpa_fast = True
    except Exception:  # noqa: BLE001 (no fast backend for this shape: torch picks one)
        sdpa_fast = False
    env["sdpa_fast_backends"] = sdpa_fast
    print(env, flush=True)

    # Kernel configs at the target point (Llama shapes, longest S, B = 1, f = 0.75); the grid runs
    # the fastest. (BLOCK_N, num_warps, num_stages, min keys per split); the first is the default.
    cfg_best = None
    if args.decode_tune and CUDA:
        _, hq, hkv, d, sink, window, lengths, _ = shapes[1]
        perm = torch.randperm(hkv, generator=torch.Generator().manual_seed(args.seed))
        q, k, v, modes, cache = setting(1, hq, hkv, d, lengths[-1], 0.75, perm, sink, window)
        best = None
        for cfg in ((64, 4, 3, 256), (128, 4, 3, 256), (64, 8, 3, 256), (32, 4, 4, 256), (64, 4, 3, 1024),
                    (64, 4, 2, 128)):
            try:
                ms = timer(ours_fn(q, cache, lengths[-1], cfg))
                best = (ms, cfg) if best is None or ms < best[0] else best
            except Exception as e:  # noqa: BLE001 (a config that does not compile is reported)
                ms = f"{type(e).__name__}: {str(e)[:200]}"
            results["tune"].append(dict(config=cfg, ms=ms))
            print(f"  decode tune {cfg}: {ms}", flush=True)
        cfg_best = best[1] if best else None
        results["config"] = cfg_best
        del q, k, v, cache

    for name, hq, hkv, d, sink, window, lengths, batches in shapes:
        perm = torch.randperm(hkv, generator=gen)
        for S in lengths:
            for bsz in batches:
                sdpa_ms = masked_ms = None
                for frac in (0.0, 0.5, 0.75, 1.0):
                    q, k, v, modes, cache = setting(bsz, hq, hkv, d, S, frac, perm, sink, window)
                    full_bytes = 2 * k.numel() * k.element_size()
                    if sdpa_ms is None:  # the peers do the same work at every f: time them once
                        sdpa_ms = timer(lambda: sdpa_decode(q, k, v, sdpa_fast))
                        masked_ms = bench_ms(lambda: masked_decode(q, k, v, modes, sink, window))
                    ref = masked_decode(q, k, v, modes, sink, window)
                    ours = ours_fn(q, cache, S, cfg_best)
                    out = ours()
                    ours_ms = timer(ours)
                    compact = cache.nbytes()
                    rec = dict(model=name, S=S, B=bsz, frac=frac, Hq=hq, Hkv=hkv, D=d, sink=sink, window=window,
                               full_bytes_per_sample=full_bytes / bsz, compact_bytes_per_sample=compact / bsz,
                               saved=1 - compact / full_bytes,
                               ideal_saved=round(frac * hkv) / hkv * (1 - min(sink + window, S) / S),
                               ours_ms=ours_ms, masked_ms=masked_ms, sdpa_ms=sdpa_ms,
                               ours_GBps=compact / ours_ms / 1e6, sdpa_GBps=full_bytes / sdpa_ms / 1e6,
                               ideal_speedup=full_bytes / compact, diff_vs_masked=max_diff(out, ref),
                               sdpa_diff=max_diff(sdpa_decode(q, k, v, sdpa_fast), ref) if frac == 0 else None)
                    rec["speedup_vs_sdpa"] = sdpa_ms / ours_ms
                    rec["of_ideal"] = rec["speedup_vs_sdpa"] / rec["ideal_speedup"]
                    rec["speedup_vs_masked"] = masked_ms / ours_ms
                    rec["ours_of_copy_bw"] = rec["ours_GBps"] / copy_gbs
                    results["decode"].append(rec)
                    print(f"{name} S={S} B={bsz} f={frac}: ours {1e3 * ours_ms:.1f} us "
                          f"({rec['ours_GBps']:.0f} GB/s), sdpa {1e3 * sdpa_ms:.1f} us, masked "
                          f"{1e3 * masked_ms:.1f} us, saved {rec['saved']:.4f} (ideal {rec['ideal_saved']:.4f}), "
                          f"diff {rec['diff_vs_masked']:.1e}", flush=True)
                    del q, k, v, modes, cache, out, ref
                if CUDA:
                    torch.cuda.empty_cache()
                with open(os.path.join(args.out, "decode.json"), "w") as f:  # partial runs survive
                    json.dump(results, f, indent=1)

    # FlexAttention last (a compile per shape): Llama shapes, longest S, f = 0.75, while time is left.
    name, hq, hkv, d, sink, window, lengths, batches = shapes[1]
    perm = torch.randperm(hkv, generator=torch.Generator().manual_seed(args.seed))
    for bsz in batches:
        if time.perf_counter() - t_start > args.decode_flex_budget_s:
            print(f"  flex skipped at B={bsz}: the section ran past {args.decode_flex_budget_s} s", flush=True)
            break
        rec = next(r for r in results["decode"] if r["model"] == name and r["S"] == lengths[-1]
                   and r["B"] == bsz and r["frac"] == 0.75)
        q, k, v, modes, cache = setting(bsz, hq, hkv, d, lengths[-1], 0.75, perm, sink, window)
        try:
            fn = flex_decode_fn(q, k, v, modes, sink, window)
            out, rec["flex_first_call_ms"] = timed_build(fn)                     # includes the compile
            rec["flex_diff"] = max_diff(out, ours_fn(q, cache, lengths[-1], cfg_best)())
            rec["flex_ms"] = timer(fn)
        except Exception as e:  # noqa: BLE001 (a failing peer is recorded, not fatal)
            rec["flex_ms"], rec["flex_error"] = None, f"{type(e).__name__}: {str(e)[:300]}"
        print(f"{name} S={lengths[-1]} B={bsz} f=0.75: flex {rec.get('flex_ms')} ms, first call "
              f"{rec.get('flex_first_call_ms')} ms, diff {rec.get('flex_diff')} {rec.get('flex_error', '')}", flush=True)
        del q, k, v, modes, cache
        with open(os.path.join(args.out, "decode.json"), "w") as f:
            json.dump(results, f, indent=1)
    print(f"decode section {time.perf_counter() - t_start:.0f} s; kernel config {cfg_best or 'default'}")
    print_decode_table(results["decode"], copy_gbs, env["timer"])


def print_decode_table(rows, copy_gbs, timer_name):
    def fmt(x, spec):
        return "-" if x is None else format(x, spec)
    print(f"\ndecode, one token: times in us ({timer_name}); GB/s of the bytes each reads "
          f"(copy bandwidth {copy_gbs:.0f} GB/s)")
    print("model        S   B     f  KV MB/sample  saved (ideal)    ours  GB/s    masked     sdpa  GB/s     flex"
          "  vs sdpa (ideal, of ideal)  vs masked")
    for r in rows:
        print(f"{r['model']:<9} {r['S']:>6} {r['B']:>3}  {r['frac']:4.2f}  {r['compact_bytes_per_sample'] / 1e6:6.1f}/"
              f"{r['full_bytes_per_sample'] / 1e6:<6.1f} {r['saved']:6.4f} ({r['ideal_saved']:6.4f})  "
              f"{1e3 * r['ours_ms']:6.1f}  {r['ours_GBps']:4.0f}  {1e3 * r['masked_ms']:8.1f}  "
              f"{1e3 * r['sdpa_ms']:7.1f}  {r['sdpa_GBps']:4.0f}  {fmt(r.get('flex_ms') and 1e3 * r['flex_ms'], '7.1f'):>7}  "
              f"{r['speedup_vs_sdpa']:5.2f}x ({r['ideal_speedup']:5.2f}x, {r['of_ideal']:4.0%})  "
              f"{r['speedup_vs_masked']:7.1f}x")


if __name__ == "__main__":
    if args.decode:
        decode_bench()
        print(f"\nall numbers in {os.path.join(args.out, 'decode.json')}")
    elif args.replot:
        with open(args.replot) as f:
            runs = json.load(f)["runs"]
        plot(runs)
        print_table(runs)
    else:
        main()
        print(f"\nall numbers in {os.path.join(args.out, 'bench.json')}"
              + (f", the plot in {os.path.join(args.out, 'bench_speedup.png')}" if CUDA and os.path.exists(
                  os.path.join(args.out, "bench_speedup.png")) else ""))
