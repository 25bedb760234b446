"""elastic_attention/model.py — a small Llama-style model, written from scratch, whose attention heads are
each FULL or sparse per input (Elastic Attention, METHOD.md §2–§5, §7).

    embedding → L × [RMSNorm → attention (GQA, rotate-half RoPE, 1/√D) → residual
                     → RMSNorm → SwiGLU MLP → residual] → RMSNorm → LM head

The math mirrors Hugging Face's LlamaForCausalLM (and Qwen3's QK-norm) so that its weights load
and give the same logits (`from_pretrained_hf`). What is new is `Attention.forward`, one step of
the method per block of code:

    1. the layer's router reads the prompt's pre-RoPE keys → log α (B, Hkv)         router.py
    2. a gate turns log α into z per (sample, KV head); z = 1 keeps the head FULL     router.py
         model.train(): hard-concrete sample, forward exactly 0/1, straight-through gradient
         model.eval():  z = 1[log α > 0], or (Config.deploy = "count") the k lowest log α SPARSE,
                        k what the training draws would have made sparse on average ("global":
                        k and the ranking over all layers at once; ranked routers only)
    3. attention, every head in its mode                                              kernels.py
         training:  O = z·O_full + (1 − z)·O_sparse   (d O / d z = O_full − O_sparse reaches the router)
         inference: one hybrid call, each (sample, KV head) in its own mode

Without routers (attach_routers() adds them) every head is FULL: the backbone. Two ways to skip the
router by hand: modes=(L, B, Hkv) kernel modes, or z=(L, B, Hkv) gate values for the training mix.

What "full" and "sparse" mean is the head configuration, {retrieval mode}-{sparse mode}: FA-SSA
(default: dense vs streaming), FA-XA (dense vs XAttention block-sparse), XA-SSA (XAttention vs
streaming), XA-XA. Which attention code runs is `Config.backend`, never the grad mode.

Shape letters: B batch, S sequence, V vocab, C model dim, L layers, Hq query heads, Hkv KV heads,
G = Hq // Hkv, D head dim.
"""
import glob
import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import decode
from . import kernels
from . import masks
from . import xattention
from .masks import BLOCK_SPARSE, FULL, STREAMING
from . import router as router_lib

# Head configurations: (mode of a retrieval head z = 1, mode of a sparse head z = 0).
HEAD_CONFIGS = {
    "FA-SSA": (FULL, STREAMING),
    "FA-XA": (FULL, BLOCK_SPARSE),
    "XA-SSA": (BLOCK_SPARSE, STREAMING),
    "XA-XA": (BLOCK_SPARSE, BLOCK_SPARSE),  # both sides XAttention: the router changes nothing; a baseline
}
GATES = ("hard-concrete", "gumbel")
DEPLOYS = ("threshold", "count", "global")   # evaluation gate: router.deterministic_gate or router.count_gate
BACKENDS = kernels.BACKENDS  # "auto", "reference", "torch", "triton": see kernels.py, section 1


@dataclass
class Config:
    vocab_size: int = 128          # the synthetic task vocabulary fits in 128 ids
    dim: int = 128                 # C, model width
    n_layers: int = 4              # L
    n_heads: int = 8               # Hq
    n_kv_heads: int = 4            # Hkv: 4 KV heads × 4 layers = 16 routing decisions per input
    head_dim: int = 0              # D; 0 → dim // n_heads (Qwen3 sets it explicitly)
    ffn_dim: int = 0               # 0 → Llama's rule: 2/3 · 4C rounded up to a multiple of 32
    rope_theta: float = 10000.0    # RoPE base (Llama 3: 500000)
    rope_scaling: dict = None      # Llama 3.1's "llama3" frequency scaling, from its config.json
    norm_eps: float = 1e-5         # RMSNorm epsilon
    max_seq_len: int = 512         # RoPE table length and the longest accepted input
    tie_embeddings: bool = False   # LM head shares the embedding matrix (Qwen3 small models do)
    qk_norm: bool = False          # Qwen3: RMSNorm over D on q and k before RoPE
    # Sparse heads (METHOD.md §3). Paper: sink 128, window 2048, block 64 at 8K–64K tokens.
    sink: int = 4                  # streaming heads always see the first `sink` tokens
    window: int = 32               # ... and the last `window` tokens up to themselves
    block_size: int = 16           # block-sparse (XAttention) granularity
    head_config: str = "FA-SSA"    # see HEAD_CONFIGS
    xa_stride: int = 4             # XAttention antidiagonal stride; must divide block_size (paper 16 @ 64)
    xa_threshold: float = 0.9      # XAttention kept softmax mass per row (paper 0.9)
    # Router (METHOD.md §4).
    router_hidden_mult: int = 4    # MLP hidden = 4·D (Table 3: ×2…×8 all within noise)
    pool_tokens: int = 16          # boundary pooling span (paper 100 at 8K+; scaled to short inputs)
    pool_skip: int = 0             # leading tokens every prompt shares (a chat system turn): not pooled
    prepass_layers: int = 0        # ranked routers' count router reads: 0 = layer 0's keys; n > 0 = the residual
                                   # stream after n layers of a pre-pass over the prompt's boundary tokens
    gate: str = "hard-concrete"    # training gate (METHOD.md §5); "gumbel" = the paper's Gumbel-softmax
    deploy: str = "threshold"      # evaluation gate: FULL iff log α > 0; "count": as many SPARSE heads as
                                   # training drew, per layer; "global": that count over all layers (ranked routers)
    # Which attention code runs, for prefill, XAttention scoring and decode alike (kernels.BACKENDS):
    # "auto" = the Triton kernels on CUDA where they support the call, PyTorch otherwise; "torch";
    # "triton" (on a CPU: TRITON_INTERPRET=1); "reference" (the naive twins).
    backend: str = "auto"

    def __post_init__(self):
        for f in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "max_seq_len", "xa_stride", "pool_tokens"):
            masks.check_int(f, getattr(self, f), 1)
        masks.check_int("pool_skip", self.pool_skip, 0)
        masks.check_int("prepass_layers", self.prepass_layers, 0)
        if self.prepass_layers > self.n_layers:
            raise ValueError(f"prepass_layers {self.prepass_layers} exceeds the model's {self.n_layers} layers")
        if not (0 < self.rope_theta < math.inf and 0 <= self.norm_eps < math.inf):
            raise ValueError(f"rope_theta must be finite and > 0, norm_eps finite and >= 0; got "
                             f"{self.rope_theta!r}, {self.norm_eps!r}")
        if self.head_dim == 0:
            self.head_dim = self.dim // self.n_heads
        if self.ffn_dim == 0:
            hidden = int(2 * 4 * self.dim / 3)
            self.ffn_dim = 32 * ((hidden + 31) // 32)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"query heads {self.n_heads} not a multiple of KV heads {self.n_kv_heads}")
        if self.head_config not in HEAD_CONFIGS:
            raise ValueError(f"head_config must be one of {list(HEAD_CONFIGS)}, got {self.head_config!r}")
        masks.check_sparse_params(self.sink, self.window, self.block_size)
        if self.block_size % self.xa_stride:
            raise ValueError(f"xa_stride {self.xa_stride} does not divide block_size {self.block_size}")
        if self.gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {self.gate!r}")
        if self.deploy not in DEPLOYS:
            raise ValueError(f"deploy must be one of {DEPLOYS}, got {self.deploy!r}")
        kernels.check_backend(self.backend)
        llama3 = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if self.rope_scaling is not None and not (
                isinstance(self.rope_scaling, dict) and self.rope_scaling.get("rope_type") == "llama3"
                and all(isinstance(self.rope_scaling.get(k), (int, float)) for k in llama3)):
            raise ValueError(f"rope_scaling must be None or Llama 3.1's (rope_type 'llama3' with numbers "
                             f"{', '.join(llama3)}), got {self.rope_scaling!r}")

    @classmethod
    def shape(cls, name, **overrides):
        """A named model shape (MODEL_SHAPES) with fields overridden."""
        if name not in MODEL_SHAPES:
            raise ValueError(f"unknown model shape {name!r}; choose from {list(MODEL_SHAPES)}")
        return cls(**{**MODEL_SHAPES[name], **overrides})

    @classmethod
    def from_hf(cls, hf):
        """From a Hugging Face Llama / Qwen3 config.json dict. A field left out takes HF's default
        for that model type. Anything this model does not compute the way HF does is refused,
        naming the field: another activation, biases, sliding-window layers, RoPE other than the
        default and Llama 3.1's, partial rotary, quantized weights. Accepted because they do not
        change an evaluation forward: attention_dropout (training only), pretraining_tp (HF only
        slices its matmuls), Qwen3's sliding_window while use_sliding_window is false."""
        model_type = hf.get("model_type")
        if model_type not in ("llama", "qwen3"):
            raise ValueError(f"only llama and qwen3 configs are supported, got model_type={model_type!r}")
        missing = [f for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                               "intermediate_size") if f not in hf]
        if missing:
            raise ValueError(f"HF config lacks required fields {missing}")
        unsupported = []
        if hf.get("hidden_act", "silu") not in ("silu", "swish"):   # HF maps both names to SiLU
            unsupported.append(f"hidden_act={hf['hidden_act']!r} (only SiLU, the SwiGLU MLP, is implemented)")
        for field in ("attention_bias", "mlp_bias"):
            if hf.get(field):
                unsupported.append(f"{field}={hf[field]!r} (the projections here have no bias)")
        if model_type == "qwen3" and hf.get("use_sliding_window"):
            unsupported.append(f"use_sliding_window={hf['use_sliding_window']!r} (sliding-window layers)")
        if model_type == "llama" and hf.get("sliding_window") is not None:
            unsupported.append(f"sliding_window={hf['sliding_window']!r} (Llama has no sliding-window layers)")
        if any(t != "full_attention" for t in hf.get("layer_types") or ()):
            unsupported.append(f"layer_types={hf['layer_types']!r} (every layer must be full_attention)")
        if hf.get("quantization_config"):
            unsupported.append("quantization_config (quantized weights)")
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            unsupported.append(f"rope scaling {rope_type!r} (default and llama3 are implemented)")
        if rope_type == "llama3":
            lacking = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                                   "original_max_position_embeddings") if k not in rope]
            if lacking:
                unsupported.append(f"llama3 rope scaling without {lacking}")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            unsupported.append(f"partial_rotary_factor={rope['partial_rotary_factor']!r} (RoPE rotates all of D)")
        qwen3 = model_type == "qwen3"
        head_dim = hf.get("head_dim") or (128 if qwen3 else hf["hidden_size"] // hf["num_attention_heads"])
        if head_dim % 2:
            unsupported.append(f"head_dim={head_dim} (rotate-half RoPE needs an even head dim)")
        if unsupported:
            raise ValueError(f"{model_type} config not implemented here: " + "; ".join(unsupported))
        n_kv_heads = hf.get("num_key_value_heads", 32 if qwen3 else None)   # HF: None means no GQA
        return cls(
            vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf["num_attention_heads"] if n_kv_heads is None else n_kv_heads,
            head_dim=head_dim, ffn_dim=hf["intermediate_size"],
            rope_theta=hf.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=dict(rope) if rope_type == "llama3" else None,
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_seq_len=hf.get("max_position_embeddings", 32768 if qwen3 else 2048),
            tie_embeddings=hf.get("tie_word_embeddings", False), qk_norm=qwen3,
            sink=128, window=2048, block_size=64, xa_stride=16, pool_tokens=100)


MODEL_SHAPES = {  # train_router.PRESETS are experiments; these are the models they use
    # CPU experiments: a few hundred tokens, sink + window a small fraction of them. RoPE base
    # 5e5, Llama 3's: the base the tiny backbone learns the recall tasks with (RESULTS.md).
    "tiny": dict(rope_theta=500000.0),
    # One-GPU experiments: the tiny model's shape with 4K-token inputs, the paper's sink 128 /
    # window 2048 (at 16K) scaled by 1/4. The shape is kept small so that its backbone trains fast.
    # Pooling 16 tokens per end, as tiny: the synthetic tasks show themselves in the first 5 and the
    # last 13 tokens at any length, and 64 would average that with ~100 tokens of filler.
    "gpu": dict(rope_theta=500000.0, max_seq_len=4096, sink=32, window=512, block_size=64, xa_stride=16,
                pool_tokens=16),
    # Llama-3.1-8B attention shapes, for benchmarks (no weights are shipped or fetched).
    "llama3-8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      ffn_dim=14336, rope_theta=500000.0, norm_eps=1e-5, max_seq_len=131072,
                      sink=128, window=2048, block_size=64, xa_stride=16, pool_tokens=100,
                      rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                        high_freq_factor=4.0, original_max_position_embeddings=8192)),
    # SmolLM2-135M's shape with the smollm2 experiment's sparse heads and pooling, for benchmarks;
    # its weights come from the GGUF file (smollm2.py), which also reads pool_skip off the tokenizer.
    "smollm2-135m": dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536,
                         rope_theta=100000.0, max_seq_len=8192, tie_embeddings=True, sink=64, window=256,
                         block_size=64, xa_stride=16, pool_tokens=32, pool_skip=24),
}

# -----------------------------------------------------------------------------
# Building blocks, each mirroring the Hugging Face Llama math.

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Normalise in float32 and cast back before the weight, exactly as HF does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(head_dim, max_seq_len, theta, scaling=None):
    """cos, sin (max_seq_len, D) in float32 for rotate-half RoPE."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is not None:  # Llama 3.1: stretch low frequencies by `factor`, blend the middle band
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        inv_freq = torch.where(medium, blended, scaled)
    freqs = torch.outer(torch.arange(max_seq_len).float(), inv_freq)  # (S, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)                            # (S, D)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    """x (B, H, S, D); cos/sin (S, D) float32, cast to x's dtype as HF does."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)  # rotate_half
    return x * cos + rotated * sin


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU

# -----------------------------------------------------------------------------
# Attention with per-(sample, KV head) modes.

def attention_row(q, k, positions):
    """Each head's dense causal attention probabilities at one query position per sample:
    q (B, Hq, S, D), k (B, Hkv, S, D) after RoPE, positions (B,) → (B, Hq, S) float32, softmax of
    q·k/√D over the keys j <= position (0 elsewhere), whatever mode the head runs."""
    B, Hq, S, D = q.shape
    qp = q[torch.arange(B, device=q.device), :, positions]                       # (B, Hq, D)
    k = k.repeat_interleave(Hq // k.shape[1], dim=1)                              # (B, Hq, S, D)
    scores = torch.einsum("bhd,bhsd->bhs", qp.float(), k.float()) / math.sqrt(D)  # (B, Hq, S)
    visible = torch.arange(S, device=q.device).view(1, 1, S) <= positions.view(B, 1, 1)
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)     # (B, Hq, S)


@dataclass
class Routing:
    """What every layer's routing needs, settled once per forward (Transformer.routing); the layers
    read it, and only the count gate's debt changes on the way down."""
    routed: bool                          # the routers decide (else modes or z given, or every head FULL)
    modes: torch.Tensor = None            # (L, B, Hkv) kernel modes given by hand
    z: torch.Tensor = None                # (L, B, Hkv) gate values given by hand, mixed as in training
    noise: torch.Tensor = None            # (L, B, Hkv) the training gates' uniform noise (None: torch's RNG)
    lengths: torch.Tensor = None          # (B,) real tokens (the rest is padding)
    prompt_lengths: torch.Tensor = None   # (B,) tokens a router may read
    rows_at: torch.Tensor = None          # (B,) record each head's dense attention row there
    shift: torch.Tensor = None            # (B,) ranked routers: the input's shift of every head's log α
    prepass_len: torch.Tensor = None      # (B,) tokens of the routing pre-pass (its work counts in Ω_ESR)
    deployed: tuple = None                # L × (B, Hkv): z chosen over all layers at once (deploy="global")
    debt: torch.Tensor = None             # (B,) the "count" gate's rounding, carried from layer to layer


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx  # which layer of a KV cache this attention writes and reads
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.router = None      # an AttentionRouter, from Transformer.attach_routers()
        self.gumbel_tau = 1.0   # temperature of the "gumbel" training gate; the training loop anneals it

    def router_keys(self, x):
        """x (B, S, C) → the pre-RoPE keys (B, Hkv, S, D) a router reads (METHOD.md §4: after the key
        norm if the model has QK-norm)."""
        B, S, _ = x.shape
        k = self.k_proj(x).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, S, D)
        return self.k_norm(k) if self.cfg.qk_norm else k

    def project(self, x, cos, sin):
        """x (B, S, C) → q (B, Hq, S, D), k (B, Hkv, S, D) after RoPE, v, and the pre-RoPE keys."""
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)     # (B, Hq, S, D)
        k = self.router_keys(x)                                                        # (B, Hkv, S, D)
        v = self.v_proj(x).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, S, D)
        if self.cfg.qk_norm:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, k

    def gate(self, log_alpha, u=None, debt=None):
        """log α (B, Hkv) → z (B, Hkv), 1 = FULL (METHOD.md §5). Training draws a hard 0/1 decision
        whose gradient is the relaxation's (u: its uniform noise, default drawn from torch's RNG);
        evaluation takes the more likely decision, or with deploy="count" the layer's share of the
        sparse heads training drew (debt: the rounding carried over the layers), no RNG."""
        if not self.training:
            if self.cfg.deploy == "count":
                return router_lib.count_gate(log_alpha, debt, check=False)
            return router_lib.deterministic_gate(log_alpha, check=False)
        if self.cfg.gate == "gumbel":
            return router_lib.gumbel_softmax_gate(log_alpha, self.gumbel_tau, u, check=False)
        return router_lib.hard_concrete_gate(log_alpha, u, check=False)

    def runs_fused(self, q, block_mask):
        """Whether attention runs every head in its own mode in one launch (the Triton kernel)."""
        return kernels.prefill_backend(self.cfg.backend, q, block_mask, self.cfg.block_size) == "triton"

    def attend(self, q, k, v, modes, block_mask):
        c = self.cfg
        return kernels.hybrid_attention(q, k, v, modes, c.sink, c.window, block_mask, c.block_size, c.backend,
                                        check=False)

    def decode(self, q, k, v, cache):
        """One new token per sample against the KV cache (decode.KVCache or decode.FullKVCache), in
        the modes the prefill decided: q (B, Hq, 1, D), k, v (B, Hkv, 1, D) → (B, Hq, D)."""
        pos = cache.n_tokens
        cache.write(self.layer_idx, pos, k, v)
        return cache.attend(self.layer_idx, q[:, :, 0], pos + 1)

    def forward(self, x, cos, sin, routing, cache=None):
        """x (B, S, C) → (out (B, S, C), record). routing: what every layer's routing needs, settled
        once per forward (Routing). cache: decode one token against it instead (record None).
        record: this layer's z, kernel modes, log α, block mask, k/v for a KV cache, and the rows.
        Transformer.forward has checked the arguments, so the calls below pass check=False (no host
        sync per layer)."""
        B, S, _ = x.shape
        q, k, v, k_pre = self.project(x, cos, sin)
        if cache is not None:
            return self.o_proj(self.decode(q, k, v, cache).reshape(B, 1, -1)), None   # (B, 1, Hq·D) → (B, 1, C)
        full_mode, sparse_mode = HEAD_CONFIGS[self.cfg.head_config]

        # 1-2. Route: the router reads the prompt's keys and a gate decides z per (sample, KV head).
        r, i = routing, self.layer_idx
        modes = None if r.modes is None else r.modes[i]   # given by hand, or None
        z = None if r.z is None else r.z[i]
        log_alpha = None
        if r.routed:
            log_alpha = self.router(k_pre, r.prompt_lengths, check=False)                  # (B, Hkv)
            if r.shift is not None:   # ranked routers: the input's shift of every head's log α
                log_alpha = log_alpha + r.shift[:, None]
            if r.deployed is not None:   # deploy="global": chosen over all layers before the first
                z = r.deployed[i]                                                          # (B, Hkv)
            else:
                z = self.gate(log_alpha, None if r.noise is None else r.noise[i], r.debt)  # (B, Hkv)
        if z is not None:
            modes = torch.where(z > 0.5, full_mode, sparse_mode).to(torch.int32)           # (B, Hkv)
        elif modes is None:
            modes = torch.full((B, self.n_kv_heads), FULL, dtype=torch.int32, device=x.device)
        mix = z is not None and (self.training or log_alpha is None)  # evaluation runs the hybrid alone

        # XAttention heads pick their key blocks from this input's q and k (no gradient).
        if z is not None:  # the modes come from this configuration: no need to look at them (a host sync)
            needs_xa = BLOCK_SPARSE in (full_mode, sparse_mode)
        else:
            needs_xa = bool((modes == BLOCK_SPARSE).any())
        block_mask = None
        if needs_xa:
            c = self.cfg
            block_mask = xattention.xattention_block_mask(q, k, c.block_size, c.xa_stride, c.xa_threshold,
                                                          c.backend, r.lengths, check=False)  # (B, Hkv, nB, nB)

        # 3. Attention. Training mix (METHOD.md §5): both outputs, O = z·O_full + (1 − z)·O_sparse.
        # With a hard z the forward is exactly the hybrid model, and d O / d z = O_full − O_sparse.
        # The gates' z is exactly 0 or 1, so where one launch runs each head in its own mode (the
        # Triton kernel) the same value and gradients cost one backward instead of two: the hybrid
        # with autograd (q, k, v get their gradient through it alone, as through the mix), and each
        # head's other mode without, for z's gradient only.
        if mix and log_alpha is not None and self.runs_fused(q, block_mask):
            out = self.attend(q, k, v, modes, block_mask)                                      # (B, Hq, S, D)
            with torch.no_grad():
                other = self.attend(q, k, v, full_mode + sparse_mode - modes, block_mask)      # the other mode
            zq = z.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)[:, :, None, None]  # (B, Hq, 1, 1)
            full_minus_sparse = (out.detach().float() - other.float()) * (2 * zq.detach() - 1)
            out = out + ((zq - zq.detach()) * full_minus_sparse).to(out.dtype)                 # + 0, d/dz = O_full − O_sparse
        elif mix:
            o_full = self.attend(q, k, v, torch.full_like(modes, full_mode), block_mask)      # (B, Hq, S, D)
            o_sparse = self.attend(q, k, v, torch.full_like(modes, sparse_mode), block_mask)  # (B, Hq, S, D)
            zq = z.to(q.dtype).repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)       # (B, Hq)
            zq = zq[:, :, None, None]                                                          # (B, Hq, 1, 1)
            out = zq * o_full + (1 - zq) * o_sparse
        else:
            out = self.attend(q, k, v, modes, block_mask)                                      # (B, Hq, S, D)
        if z is None:  # given modes: a head is sparse iff it runs this configuration's sparse mode
            z = (modes != sparse_mode).to(q.dtype)                                             # (B, Hkv)
        out = out.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim)                  # (B, S, Hq·D)
        record = dict(z=z, modes=modes, log_alpha=log_alpha, block_mask=block_mask, k=k, v=v, k_pre=k_pre,
                      rows=None if r.rows_at is None else attention_row(q, k, r.rows_at))
        return self.o_proj(out), record


class Block(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, routing, cache=None):
        a, record = self.self_attn(self.input_layernorm(x), cos, sin, routing, cache)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), record

    def dense(self, x, cos, sin):
        """The block with every head FULL and no router, recording nothing: the routing pre-pass
        (Transformer.prepass). x (B, S, C) → (B, S, C); right padding changes no real token."""
        attn = self.self_attn
        q, k, v, _ = attn.project(self.input_layernorm(x), cos, sin)
        modes = torch.full((x.shape[0], attn.n_kv_heads), FULL, dtype=torch.int32, device=x.device)
        a = attn.attend(q, k, v, modes, None).transpose(1, 2).flatten(2)    # (B, Hq, S, D) → (B, S, Hq·D)
        x = x + attn.o_proj(a)
        return x + self.mlp(self.post_attention_layernorm(x))

# -----------------------------------------------------------------------------
# The model.

class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, D)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        self.shift_router = None  # ranked routers only (attach_routers)
        self.fail_safe = None     # ranked routers, deployed: (above, floor) of router.fail_safe, or None

    def _init_weights(self, m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)  # GPT-2 / Llama initializer_range

    @property
    def routers(self):
        """The layers' routers, or None before attach_routers()."""
        routers = [layer.self_attn.router for layer in self.layers]
        return None if routers[0] is None else routers

    def attach_routers(self, static=False, init_logit=0.0, ranked=False):
        """Give every layer an AttentionRouter (METHOD.md §4), float32, on the model's device, and
        return their parameters; init_logit: their log α at the start. static=True gives a
        StaticGate instead: one learned log α per KV head, the same for every input (the
        DuoAttention / PruLong baseline, trained the same way from the same start). ranked=True
        gives StaticGates plus one AttentionRouter on layer 0's keys (shift_router) whose output,
        averaged over its heads, shifts every head's log α alike: the input decides how many heads
        go FULL, one learned ranking shared by all inputs decides which (METHOD.md §4)."""
        if static and ranked:
            raise ValueError("attach_routers: static and ranked exclude each other")
        c, device = self.cfg, self.lm_head.weight.device
        params = []
        for layer in self.layers:
            r = router_lib.StaticGate(c.n_kv_heads, init_logit) if static or ranked else \
                router_lib.AttentionRouter(c.head_dim, c.router_hidden_mult, c.pool_tokens, c.pool_skip, init_logit)
            layer.self_attn.router = r.to(device)
            params += list(r.parameters())
        self.shift_router, self.fail_safe = None, None
        if ranked:  # it reads the pre-pass's residual stream (C, one "head"), or layer 0's keys (D per KV head)
            self.shift_router = (router_lib.CountRouter(c.dim) if c.prepass_layers else
                                 router_lib.AttentionRouter(c.head_dim, c.router_hidden_mult, c.pool_tokens,
                                                            c.pool_skip, 0.0)).to(device)
            params += list(self.shift_router.parameters())
        return params

    def set_gumbel_tau(self, tau):
        for layer in self.layers:
            layer.self_attn.gumbel_tau = tau

    def check_tokens(self, idx):
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype != torch.long:
            raise ValueError(f"idx must be a (B, S) long tensor, got "
                             f"{f'{idx.dtype} {tuple(idx.shape)}' if isinstance(idx, torch.Tensor) else type(idx)}")
        if idx.shape[0] < 1 or idx.shape[1] < 1:
            raise ValueError(f"idx has no tokens: (B, S) = {tuple(idx.shape)}")
        if idx.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds max_seq_len {self.cfg.max_seq_len}")
        lo, hi = torch.stack(idx.aminmax()).tolist()   # one host sync
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.cfg.vocab_size}), got min {lo} max {hi}")

    def check_per_layer(self, name, values, B, device):
        """modes / z / gate_noise: one (B, Hkv) tensor per layer, as a list or an (L, B, Hkv)
        tensor, on the tokens' device; modes integers, z and noise real numbers in [0, 1]."""
        L, Hkv = self.cfg.n_layers, self.cfg.n_kv_heads
        want = f"(L, B, Hkv) = ({L}, {B}, {Hkv})"
        if not (isinstance(values, torch.Tensor) or
                isinstance(values, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in values)):
            raise ValueError(f"{name} must be a tensor {want} or a list of L tensors (B, Hkv), got {type(values).__name__}")
        if len(values) != L or any(tuple(v.shape) != (B, Hkv) for v in values):
            shape = tuple(values.shape) if isinstance(values, torch.Tensor) else [tuple(v.shape) for v in values]
            raise ValueError(f"{name} must have shape {want}, got {shape}")
        kind = "integer" if name == "modes" else "floating"
        for v in values:
            if v.device != device or (v.dtype.is_floating_point != (kind == "floating")) or v.dtype.is_complex \
                    or v.dtype == torch.bool:
                raise ValueError(f"{name} must be {kind} tensors on the tokens' device {device}, got {v.dtype} "
                                 f"on {v.device}")
        values = torch.stack(list(values))    # one host sync for every layer's values
        if name == "modes":
            masks.check_mode_values(values, block_mask_given=True)   # the layers make XAttention masks themselves
        elif ((values < 0) | (values > 1) | values.isnan()).any():
            raise ValueError(f"{name} must lie in [0, 1]" + (" (z = 1 FULL, 0 sparse)" if name == "z" else ""))

    def check_positions(self, name, positions, dims, B, S, device):
        """rows_at (B,), logits_at (B, K): integer positions in [0, S) on the tokens' device."""
        if (not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point
                or positions.dtype == torch.bool or positions.dim() != dims or positions.shape[0] != B
                or positions.device != device):
            want = "(B,)" if dims == 1 else "(B, K)"
            raise ValueError(f"{name} must be an integer tensor {want} with B={B} on the tokens' device "
                             f"{device}, got {positions!r}")
        if ((positions < 0) | (positions >= S)).any():
            raise ValueError(f"{name} must be positions in [0, S={S}), got {positions.tolist()}")

    def check_inputs(self, idx, modes, z, lengths, prompt_lengths, gate_noise, rows_at, logits_at, routed):
        """forward's arguments: a ValueError naming the first bad one. routed: the routers will read the
        prompt (attached, no modes or z given, not a decoding step)."""
        self.check_tokens(idx)
        (B, S), device = idx.shape, idx.device
        if modes is not None and z is not None:
            raise ValueError("give modes or z, not both")
        for name, values in (("modes", modes), ("z", z), ("gate_noise", gate_noise)):
            if values is not None:
                self.check_per_layer(name, values, B, device)
        masks.check_lengths(lengths, B, S)
        masks.check_lengths(prompt_lengths, B, S, name="prompt_lengths")
        if lengths is not None and prompt_lengths is not None and (prompt_lengths > lengths).any():
            raise ValueError(f"prompt_lengths must not exceed lengths (the router would pool padding), got "
                             f"{prompt_lengths.tolist()} and {lengths.tolist()}")
        skip = self.cfg.pool_skip
        if routed and skip:
            reads = prompt_lengths if prompt_lengths is not None else lengths
            if (S if reads is None else int(reads.min())) <= skip:
                raise ValueError(f"every prompt length must exceed the {skip} preamble tokens the routers skip, "
                                 f"got {reads.tolist() if reads is not None else [S] * B}")
        if rows_at is not None:
            self.check_positions("rows_at", rows_at, 1, B, S, device)
        if logits_at is not None:
            self.check_positions("logits_at", logits_at, 2, B, S, device)

    def forward(self, idx, modes=None, z=None, lengths=None, prompt_lengths=None, gate_noise=None,
                rows_at=None, logits_at=None, cache=None, check=True):
        """idx (B, S) → (logits (B, S, V), info). Routing follows the module docstring.

        modes (L, B, Hkv) kernel modes, or z (L, B, Hkv) in [0, 1] (1 = FULL, mixed as in training):
        skip the routers. lengths (B,): real tokens per row (right padding after them changes no real
        token's output, Ω_ESR counts real tokens only). prompt_lengths (B,): how many tokens the router
        reads — the prompt, never the answer (default: lengths). gate_noise (L, B, Hkv): the training
        gates' uniform noise (default: drawn from torch's RNG; data-parallel training passes each rank
        its rows of one draw for the whole batch, so sharding does not change the gates).
        rows_at (B,): one query position per sample; info["rows"] (L, B, Hq, S) is then each head's
        dense causal attention row there (attention_row), from every layer's input: with every head
        FULL, the backbone's (attention_rows).
        logits_at (B, K): positions; the LM head runs only there and logits is (B, K, V) (a large
        vocabulary makes the (B, S, V) grid the biggest tensor of an evaluation).
        cache: decode_step's KV cache; idx is then the token at position cache.n_tokens, every layer
        writes its K/V and attends to the cache in the modes of the prefill, and info is None.

        info: z, modes, log_alpha, block_mask (one entry per layer), records, rows, omega_msr (B,) =
        1 − mean z over layers and KV heads (carries the gate's gradient), omega_esr (B,) averaged
        over layers and omega_esr_last (B,) (METHOD.md §2).

        check: the arguments are checked here, once, values included (a handful of host syncs), and
        the layers trust them; after the layers, one more sync finds a NaN log α. check=False skips
        all of that, for a caller that has checked the same inputs: elastic_lab.runs.StepGraph records
        its training step as a CUDA graph, which cannot hold a host sync.
        """
        routed = self.routers is not None and modes is None and z is None and cache is None
        if check:
            self.check_inputs(idx, modes, z, lengths, prompt_lengths, gate_noise, rows_at, logits_at, routed)
        B, S = idx.shape
        if prompt_lengths is None:
            prompt_lengths = lengths
        start = 0 if cache is None else cache.n_tokens      # decoding: the new token's position
        cos, sin = self.rope_cos[start:start + S], self.rope_sin[start:start + S]   # (S, D)
        x = self.embed_tokens(idx)                                                    # (B, S, C)
        routing = None if cache is not None else self.routing(idx, x, modes, z, gate_noise, lengths, prompt_lengths,
                                                              rows_at, routed)
        records = []
        for layer in self.layers:
            x, record = layer(x, cos, sin, routing, cache)
            records.append(record)
        # NaN > 0 is False: a NaN log α would silently be taken as sparse
        if routed and check and torch.stack([r["log_alpha"] for r in records]).isnan().any():
            raise ValueError(f"log α has NaN entries in layers "
                             f"{[i for i, r in enumerate(records) if r['log_alpha'].isnan().any()]}: a router's output "
                             f"is not a number")
        if logits_at is not None:
            x = x[torch.arange(B, device=x.device)[:, None], logits_at]              # (B, K, C)
        logits = self.lm_head(self.norm(x))                                           # (B, S or K, V)
        if cache is not None:
            cache.n_tokens = start + S
            return logits, None
        return logits, self.summarize(records, S, lengths, routing.prepass_len)

    def routing(self, idx, x, modes, z, gate_noise, lengths, prompt_lengths, rows_at, routed):
        """The forward's Routing: what is given by hand, and for ranked routers what every layer
        shares, computed once before the first layer: the input's log α shift (from the pre-pass's
        residual stream or from layer 0's keys, METHOD.md §4) and, with deploy="global", every
        layer's z (one count and one ranking over all heads)."""
        B = idx.shape[0]
        r = Routing(routed, modes, z, gate_noise, lengths, prompt_lengths, rows_at,
                    debt=torch.zeros(B, device=idx.device) if routed else None)
        if routed and self.shift_router is not None:  # ranked routers: one log α shift per input
            r.shift, r.prepass_len = self.input_shift(idx, x, prompt_lengths)
            if not self.training and self.fail_safe is not None:
                r.shift = router_lib.fail_safe(r.shift, *self.fail_safe)
        if routed and not self.training and self.cfg.deploy == "global":
            if r.shift is None:
                raise ValueError('deploy="global" needs ranked routers (attach_routers(ranked=True)): other '
                                 "routers' log α is known only layer by layer")
            ranking = torch.stack([layer.self_attn.router.log_alpha for layer in self.layers])  # (L, Hkv)
            everyone = ranking.float()[None] + r.shift[:, None, None]                           # (B, L, Hkv)
            chosen = router_lib.count_gate(everyone.flatten(1), torch.zeros(B, device=idx.device), check=False)
            r.deployed = chosen.view_as(everyone).unbind(1)                                     # L × (B, Hkv)
        return r

    def input_shift(self, idx, x, prompt_lengths):
        """Ranked routers: each input's log α shift (B,) and its pre-pass length (B,) (None without a
        pre-pass), from the pre-pass's residual stream, or from layer 0's keys (x: the embeddings)."""
        if self.cfg.prepass_layers:
            h, prepass_len = self.prepass(idx, prompt_lengths)                               # (B, C), (B,)
            return self.shift_router.logits(h[:, None]).squeeze(1), prepass_len              # (B,)
        first = self.layers[0]
        k_pre = first.self_attn.router_keys(first.input_layernorm(x))                        # (B, Hkv, S, D)
        return self.shift_router(k_pre, prompt_lengths, check=False).mean(1), None           # (B,)

    @torch.no_grad()
    def prepass(self, idx, prompt_lengths):
        """The routing pre-pass: each prompt's shared preamble (pool_skip tokens), its first and its
        last pool_tokens tokens after that, run as one short sequence through the first
        prepass_layers layers, every head FULL. Returns the residual stream there at the last prompt
        token (B, C), the position that predicts the answer, and the pass's length per row (B,).
        With the tail as long as a streaming head's window, that position has read what a sparse
        model could answer from, and a middle layer tells whether the question needs more."""
        c = self.cfg
        B, S = idx.shape
        P, skip = c.pool_tokens, c.pool_skip
        L = torch.full((B, 1), S, device=idx.device) if prompt_lengths is None else prompt_lengths.view(B, 1)
        head = torch.arange(skip + P, device=idx.device).expand(B, -1)        # (B, skip + P) preamble + first P
        tail = L - P + torch.arange(P, device=idx.device)                      # (B, P) the last P prompt tokens
        pos = torch.cat([head, tail], 1)                                       # (B, skip + 2P)
        valid = torch.cat([head < L, tail >= skip + P], 1)                     # a short prompt: each token once
        order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)     # valid slots first, in order
        pos = torch.gather(pos, 1, order).clamp(0, S - 1)                      # (B, S')
        n = valid.sum(1)                                                       # (B,) S'_b
        x = self.embed_tokens(torch.gather(idx, 1, pos))                       # (B, S', C)
        cos, sin = self.rope_cos[:pos.shape[1]], self.rope_sin[:pos.shape[1]]  # positions 0 … S'−1
        for layer in self.layers[:c.prepass_layers]:
            x = layer.dense(x, cos, sin)
        return x[torch.arange(B, device=idx.device), n - 1], n                  # (B, C), (B,)

    @torch.no_grad()
    def attention_rows(self, idx, positions):
        """The backbone's (every head FULL) attention probabilities of one query per sample: idx (B, S),
        positions (B,) → (L, B, Hq, S) float32. A head's retrieval score is their mass on the evidence
        tokens (tasks.retrieval_scores)."""
        B = idx.shape[0]
        full = torch.full((self.cfg.n_layers, B, self.cfg.n_kv_heads), FULL, dtype=torch.int32, device=idx.device)
        # The rows need no logits: the LM head runs at one position per sample, not over (B, S, V).
        _, info = self.forward(idx, modes=full, rows_at=positions, logits_at=positions[:, None])
        return info["rows"]

    def summarize(self, records, S, lengths=None, prepass_len=None):
        c = self.cfg
        # The layers made these modes and z: reading them back would be a host sync per layer.
        esr = torch.stack([masks.omega_esr_closed_form(S, r["modes"], c.sink, c.window, r["block_mask"],
                                                       c.block_size, lengths, check=False) for r in records])  # (L, B)
        if prepass_len is not None:   # the pre-pass's pairs count as work done, in the layers it runs
            n = (torch.full_like(prepass_len, S) if lengths is None else lengths).double()     # (B,)
            m = prepass_len.double()
            esr[:c.prepass_layers] -= (m * (m + 1) / (n * (n + 1))).to(esr.device, esr.dtype)
        return dict(
            records=records, z=[r["z"] for r in records], modes=[r["modes"] for r in records],
            log_alpha=[r["log_alpha"] for r in records], block_mask=[r["block_mask"] for r in records],
            rows=None if records[0]["rows"] is None else torch.stack([r["rows"] for r in records]),  # (L, B, Hq, S)
            omega_msr=router_lib.omega_msr([r["z"] for r in records], check=False), omega_esr=esr.mean(0),
            omega_esr_last=esr[-1])


    # -------------------------------------------------------------------------
    # Generation: prefill decides every head's mode once; decoding reuses it (METHOD.md §7).

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, modes=None, cache="compact"):
        """Greedy decoding with a KV cache. Returns (tokens (B, S + new), prefill info).

        Prefill decides every head's mode (the given modes, else the routers, else all FULL) and
        decoding reuses it (METHOD.md §7). cache="compact" (default): decode.KVCache, where a
        STREAMING head keeps only its sink + window tokens and decode attention reads only those
        (Config.backend picks the Triton kernel or its naive twin). cache="full": decode.FullKVCache,
        the reference the compact cache is tested against. In both, a BLOCK_SPARSE head attends to
        its whole cache at decode: XAttention is a prefill method (the authors' decode attends the
        whole cache for every head)."""
        c = self.cfg
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if cache not in ("compact", "full"):
            raise ValueError(f"cache must be 'compact' or 'full', got {cache!r}")
        self.check_tokens(idx)
        S = idx.shape[1]
        if S + max_new_tokens > c.max_seq_len:
            raise ValueError(f"{S} + {max_new_tokens} new tokens exceed max_seq_len {c.max_seq_len}")
        logits, info = self.forward(idx, modes=modes)
        prefill = ([r["k"] for r in info["records"]], [r["v"] for r in info["records"]], info["modes"],
                   c.sink, c.window, S + max_new_tokens)      # per layer (B, Hkv, S, D) after RoPE, modes
        if cache == "compact":
            kv = decode.KVCache.from_prefill(*prefill, backend=c.backend)
        else:
            kv = decode.FullKVCache.from_prefill(*prefill)
        out = idx
        for step in range(max_new_tokens):
            nxt = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            out = torch.cat([out, nxt], dim=1)
            if step + 1 < max_new_tokens:                 # the last new token needs no forward pass
                logits = self.decode_step(nxt, out.shape[1] - 1, kv)
        return out, info

    def decode_step(self, token, pos, cache):
        """One token (B, 1) at position pos → logits (B, 1, V). cache: a decode.KVCache or
        decode.FullKVCache holding positions 0 … pos-1 (from_prefill); the step writes the token's
        K/V into it and advances it."""
        c = self.cfg
        self.check_tokens(token)
        B = token.shape[0]
        if token.shape[1] != 1:
            raise ValueError(f"decode_step takes one token per sample, (B, 1), got {tuple(token.shape)}")
        if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos < c.max_seq_len:
            raise ValueError(f"position {pos!r} outside [0, max_seq_len={c.max_seq_len})")
        cache.check_config(c.n_layers, c.n_kv_heads, c.head_dim, c.sink, c.window)
        if cache.B != B or cache.n_tokens != pos:
            raise ValueError(f"cache holds {cache.n_tokens} tokens of {cache.B} samples; got position {pos} "
                             f"for {B} samples")
        logits, _ = self.forward(token, cache=cache, check=False)   # checked above
        return logits


# -----------------------------------------------------------------------------
# Hugging Face interop: our parameter names are HF's without the "model." prefix.

def load_hf_state_dict(model, hf_state):
    """Copy a HF Llama / Qwen3 state dict (model.layers.{i}.self_attn.q_proj.weight, …,
    lm_head.weight) into `model`. Raises on missing, unexpected or mis-shaped tensors."""
    ours = {k: v for k, v in model.state_dict().items() if not router_lib.is_router_param(k)}
    mapped = {}
    for name, tensor in hf_state.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a buffer old checkpoints carry; we recompute RoPE
        key = name[len("model."):] if name.startswith("model.") else name
        mapped[key] = tensor
    if model.cfg.tie_embeddings:
        mapped.pop("lm_head.weight", None)  # tied: the embedding is the head
        ours.pop("lm_head.weight", None)
    missing, unexpected = sorted(set(ours) - set(mapped)), sorted(set(mapped) - set(ours))
    if missing or unexpected:
        raise ValueError(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for key, tensor in mapped.items():
        if tuple(tensor.shape) != tuple(ours[key].shape):
            raise ValueError(f"{key}: checkpoint shape {tuple(tensor.shape)} != model {tuple(ours[key].shape)}")
    model.load_state_dict(mapped, strict=False)
    return model


def from_pretrained_hf(directory, **config_overrides):
    """Build a Transformer from a local HF directory: config.json + *.safetensors (no downloads).
    The config is checked (Config.from_hf) before any weight is read."""
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{directory!r} has no config.json: expected a Hugging Face model directory")
    with open(config_path) as f:
        cfg = replace(Config.from_hf(json.load(f)), **config_overrides)
    try:
        from safetensors.torch import load_file
    except ImportError as e:
        raise ImportError("from_pretrained_hf reads *.safetensors: pip install safetensors") from e
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {directory}")
    state = {}
    for path in files:
        state.update(load_file(path))
    return load_hf_state_dict(Transformer(cfg), state)

# -----------------------------------------------------------------------------
# Checkpoints: the config travels with the weights, and loading into a different config fails loudly.

# Config fields a checkpoint may be loaded under with another value (load_checkpoint's cfg):
# sink and window are an experiment knob (the same weights under another streaming geometry);
# max_seq_len only sizes the RoPE table (a position's rotation does not depend on it); backend,
# gate and deploy are run-time choices (which attention code runs, which gate trains the routers,
# which rule turns log α into modes at evaluation).
FREE_FIELDS = ("sink", "window", "max_seq_len", "backend", "gate", "deploy")
# What routers learned depends on these, so they must match when the checkpoint holds routers; a
# dense backbone runs every head FULL whatever they are, so it may be loaded under any of them.
ROUTER_FIELDS = ("head_config", "block_size", "xa_stride", "xa_threshold", "pool_tokens", "pool_skip",
                 "router_hidden_mult")


# mkstemp makes its files 0600; a written file gets the mode open() would give it (0666 less the umask).
# os.umask can only be read by setting it, so read it once, here, before any thread writes.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def write_atomic(path, write, check=None):
    """Write the file at path through write(f), f a binary file object, so that a reader sees the whole
    old file or the whole new one, never a part: the bytes go to a temp file in the same folder, reach
    the disk (fsync), pass check(temp_path) if given, and only then replace path in one rename.
    The temp name is unique (mkstemp), so two processes writing one path never write into each other's
    file: the last rename wins. On any error (Ctrl-C included) the temp file is removed and the error
    raised; only a kill -9 mid-write can leave a stray <name>.<random>.tmp beside path."""
    folder, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            try:
                write(f)
                f.flush()
                os.fsync(f.fileno())  # on disk before the rename: a crash cannot leave path renamed but empty
            except (OSError, RuntimeError) as e:   # a full disk: torch.save raises RuntimeError
                raise OSError(f"cannot write {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
        os.chmod(tmp, 0o666 & ~_UMASK)
        if check is not None:
            check(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise


def save_checkpoint(path, model, **extra):
    """Atomic write (write_atomic), so an interrupted save leaves the previous file intact."""
    state = {k: v for k, v in model.state_dict().items()}
    write_atomic(path, lambda f: torch.save(dict(config=asdict(model.cfg), model=state, **extra), f))


def read_checkpoint(path, map_location="cpu", keys=("config", "model")):
    """The dict torch.load reads from path, holding at least `keys` (default: what save_checkpoint
    writes), or a ValueError saying what the file is instead: a directory, not a torch file, a
    truncated one, one holding Python objects, a plain state_dict, a router-training or a model
    checkpoint, another dict. Only tensors and plain containers are unpickled (weights_only): a
    checkpoint is data, and unpickling anything else can run code."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    expected = f"expected a dict with the keys {', '.join(map(repr, keys))}"
    if os.path.isdir(path):
        raise ValueError(f"checkpoint {path!r} is a directory; {expected} in a file")
    if os.path.getsize(path) == 0:
        raise ValueError(f"checkpoint {path!r} is empty (0 bytes); {expected}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:   # torch.load fails in many ways (zip, pickle, OS errors); all mean "unreadable"
        with open(path, "rb") as f:
            is_zip = f.read(4) == b"PK\x03\x04"   # torch.save writes a zip archive
        lines = [line for line in str(e).splitlines() if line.strip()] or [""]
        refused = lines[0].startswith("Weights only load failed")   # then one line says what it met
        why = next((x for x in lines[1:] if not x.startswith(("Please file", "Check the doc"))), lines[0]) \
            if refused else lines[0]
        if is_zip and refused:
            what = "a torch file holding Python objects besides tensors and plain containers (refused: " \
                   "unpickling them could run code)"
        else:
            what = "a torch file that is truncated or damaged" if is_zip else "not a file written by torch.save"
        raise ValueError(f"checkpoint {path!r} is {what} ({type(e).__name__}: {why}); {expected}") from None
    if not isinstance(ckpt, dict):
        raise ValueError(f"checkpoint {path!r} holds a {type(ckpt).__name__}; {expected}")
    if any(k not in ckpt for k in keys):
        if "routers" in ckpt and "lagrangian" in ckpt:
            what = "a router-training checkpoint (train_router.py's router.pt, for --resume)"
        elif "config" in ckpt and "model" in ckpt:
            what = "a model checkpoint (save_checkpoint's; load it with load_checkpoint)"
        elif ckpt and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
            what = "a plain state_dict (load it with model.load_state_dict, or load_hf_state_dict)"
        else:
            what = "a dict"
        have = sorted(str(k) for k in ckpt)
        raise ValueError(f"checkpoint {path!r} is {what} with keys {have[:6]}{' ...' if len(have) > 6 else ''}; "
                         f"{expected}")
    return ckpt


def load_checkpoint(path, cfg=None, map_location="cpu"):
    """(model, checkpoint dict) from a save_checkpoint file.

    With cfg given, the model is built with cfg, which must agree with the saved config on every
    field except FREE_FIELDS (sink, window, max_seq_len, backend, gate, deploy), and, for a checkpoint
    without routers, ROUTER_FIELDS; a ValueError names each other difference, saved vs wanted.
    """
    ckpt = read_checkpoint(path, map_location)
    if not isinstance(ckpt["config"], dict) or not isinstance(ckpt["model"], dict):
        raise ValueError(f"checkpoint {path!r}: config and model must be dicts, got "
                         f"{type(ckpt['config']).__name__} and {type(ckpt['model']).__name__}")
    unknown = sorted(set(ckpt["config"]) - {f.name for f in fields(Config)})
    if unknown:
        raise ValueError(f"checkpoint {path!r} has unknown config fields {unknown} (written by other code?)")
    saved = Config(**ckpt["config"])
    has_routers = any(router_lib.is_router_param(k) for k in ckpt["model"])
    if cfg is not None:
        free = FREE_FIELDS if has_routers else FREE_FIELDS + ROUTER_FIELDS
        diff = [f"{f.name} saved {getattr(saved, f.name)!r}, wanted {getattr(cfg, f.name)!r}"
                for f in fields(Config) if f.name not in free and getattr(saved, f.name) != getattr(cfg, f.name)]
        if diff:
            raise ValueError(f"checkpoint {path!r} was made with a different config: " + "; ".join(diff))
        saved = cfg

    def build():
        model = Transformer(saved)
        if has_routers:
            ranked = any(k.startswith("shift_router.") for k in ckpt["model"])
            model.attach_routers(static=not ranked and any(k.endswith(".router.log_alpha") for k in ckpt["model"]),
                                 ranked=ranked)
        return model

    with torch.device("meta"):   # shapes first, allocating nothing: a config its weights do not fit stops here
        want = {k: v.shape for k, v in build().state_dict().items()}
    bad = [f"{k} {tuple(v.shape)}, config {tuple(want[k])}" for k, v in ckpt["model"].items()
           if k in want and (not isinstance(v, torch.Tensor) or v.shape != want[k])]
    if bad:
        raise ValueError(f"checkpoint {path!r}: the weights do not fit the saved config: {'; '.join(bad[:3])}")
    model = build()
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:   # its weights do not fit its own config: written by other code
        raise ValueError(f"checkpoint {path!r}: the weights do not fit the saved config: {e}") from None
    model.fail_safe = router_lib.check_fail_safe(ckpt.get("fail_safe"), f"checkpoint {path!r}")
    return model, ckpt
