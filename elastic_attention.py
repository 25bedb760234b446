"""elastic_attention.py — a small Llama-style model, written from scratch, whose attention heads are
each FULL or sparse per input (Elastic Attention, METHOD.md §2, §3, §5, §7).

    embedding → L × [RMSNorm → attention (GQA, rotate-half RoPE, 1/√D) → residual
                     → RMSNorm → SwiGLU MLP → residual] → RMSNorm → LM head

The math mirrors Hugging Face's LlamaForCausalLM (and Qwen3's QK-norm) so that its weights load
and give the same logits (`from_pretrained_hf`). What is new is in `Attention.forward`: every
(sample, KV head) gets a mode — decided by the caller, by a gate z, or by the layer's router —
and `kernels.hybrid_attention` runs each head in its mode. A layer can run in three ways:

    backbone      every head FULL                                  modes=None, gates=None, route=None
    hybrid        given per-sample per-head kernel modes          modes=(L, B, Hkv) int
    training mix  O = z·O_full + (1 − z)·O_sparse, z ∈ [0, 1]      gates=(L, B, Hkv) or route=gate_fn

z = 1 means FULL (a retrieval head), z = 0 means SPARSE (METHOD.md §5). What "full" and "sparse"
mean is the head configuration, written {retrieval mode}-{sparse mode}: FA-SSA (default: dense vs
streaming), FA-XA (dense vs XAttention block-sparse), XA-SSA (XAttention vs streaming), XA-XA.

Shape letters: B batch, S sequence, V vocab, C model dim, L layers, Hq query heads, Hkv KV heads,
G = Hq // Hkv, D head dim, T cached tokens.
"""
import glob
import json
import math
import os
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
import masks
import xattention
from masks import BLOCK_SPARSE, FULL, STREAMING
import router as router_lib

# Head configurations: (mode of a retrieval head z = 1, mode of a sparse head z = 0).
HEAD_CONFIGS = {
    "FA-SSA": (FULL, STREAMING),
    "FA-XA": (FULL, BLOCK_SPARSE),
    "XA-SSA": (BLOCK_SPARSE, STREAMING),
    "XA-XA": (BLOCK_SPARSE, BLOCK_SPARSE),  # both sides XAttention: the router changes nothing; a baseline
}


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

    def __post_init__(self):
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

    @classmethod
    def preset(cls, name, **overrides):
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {list(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_hf(cls, hf):
        """From a Hugging Face Llama / Qwen3 config.json dict."""
        if hf.get("model_type") not in ("llama", "qwen3"):
            raise ValueError(f"only llama and qwen3 configs are supported, got model_type={hf.get('model_type')!r}")
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"unsupported rope scaling {rope_type!r} (default and llama3 are implemented)")
        return cls(
            vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            ffn_dim=hf["intermediate_size"],
            rope_theta=hf.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=dict(rope) if rope_type == "llama3" else None,
            norm_eps=hf.get("rms_norm_eps", 1e-6), max_seq_len=hf.get("max_position_embeddings", 4096),
            tie_embeddings=hf.get("tie_word_embeddings", False), qk_norm=hf["model_type"] == "qwen3",
            sink=128, window=2048, block_size=64, xa_stride=16, pool_tokens=100)


PRESETS = {
    # CPU experiments: a few hundred tokens, sink + window a small fraction of them. RoPE base
    # 5e5 (Llama 3's): with 1e4 the batch-32 backbone runs stalled on the recall tasks.
    "tiny": dict(rope_theta=500000.0),
    # One-GPU experiments: the tiny model's shape with 4K-token inputs, the paper's sink 128 /
    # window 2048 (at 16K) scaled by 1/4. The shape is kept small so its backbone trains in minutes.
    "long": dict(rope_theta=500000.0, max_seq_len=4096, sink=32, window=512, block_size=64, xa_stride=16,
                 pool_tokens=64),
    # Llama-3.1-8B attention shapes, for benchmarks (no weights are shipped or fetched).
    "llama3-8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      ffn_dim=14336, rope_theta=500000.0, norm_eps=1e-5, max_seq_len=131072,
                      sink=128, window=2048, block_size=64, xa_stride=16, pool_tokens=100,
                      rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                        high_freq_factor=4.0, original_max_position_embeddings=8192)),
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

class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def project(self, x, cos, sin):
        """x (B, S, C) → q (B, Hq, S, D), k (B, Hkv, S, D) after RoPE, v, and the pre-RoPE keys
        the router reads (METHOD.md §4: after the key norm if the model has QK-norm)."""
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)     # (B, Hq, S, D)
        k = self.k_proj(x).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, S, D)
        v = self.v_proj(x).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, S, D)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, k

    def run(self, q, k, v, modes, block_mask):
        c = self.cfg
        return kernels.hybrid_attention(q, k, v, modes, c.sink, c.window, block_mask, c.block_size)

    def forward(self, x, cos, sin, modes=None, gate=None, route=None, router=None, block_mask=None,
                lengths=None):
        """Returns (out (B, S, C), record). record holds this layer's z (B, Hkv), kernel modes
        (B, Hkv) int, log α (router only), block mask (XA only) and k/v for a KV cache."""
        B, S, _ = x.shape
        q, k, v, k_pre = self.project(x, cos, sin)
        full_mode, sparse_mode = HEAD_CONFIGS[self.cfg.head_config]
        log_alpha = None
        if route is not None:  # the router looks at this input and decides per KV head
            log_alpha = router(k_pre, lengths)                       # (B, Hkv)
            gate = router_lib.deterministic_gate(log_alpha) if route == "eval" else route(log_alpha)
            mix = route != "eval"
        else:
            mix = gate is not None
        if gate is not None:
            if modes is not None:
                raise ValueError("give either modes or a gate/route, not both")
            if tuple(gate.shape) != (B, self.n_kv_heads):
                raise ValueError(f"gate has shape {tuple(gate.shape)}, expected (B, Hkv) = ({B}, {self.n_kv_heads})")
            modes = torch.where(gate > 0.5, full_mode, sparse_mode).to(torch.int32)  # (B, Hkv)
        elif modes is None:
            modes = torch.full((B, self.n_kv_heads), FULL, dtype=torch.int32, device=x.device)
        if gate is not None:  # modes come from this configuration: no need to look at them (a host sync)
            needs_xa = BLOCK_SPARSE in (full_mode, sparse_mode)
        else:
            needs_xa = bool((modes == BLOCK_SPARSE).any())
        if block_mask is None and needs_xa:
            block_mask = xattention.xattention_block_mask(q, k, self.cfg.block_size, self.cfg.xa_stride,
                                                       self.cfg.xa_threshold)  # (B, Hkv, nB, nB)

        if mix:
            # Training mix (METHOD.md §5): both outputs, O = z·O_full + (1 − z)·O_sparse. With a hard
            # z the forward is exactly the hybrid model; d O / d z = O_full − O_sparse.
            o_full = self.run(q, k, v, torch.full_like(modes, full_mode), block_mask)      # (B, Hq, S, D)
            o_sparse = self.run(q, k, v, torch.full_like(modes, sparse_mode), block_mask)  # (B, Hq, S, D)
            zq = gate.to(q.dtype).repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)  # (B, Hq)
            zq = zq[:, :, None, None]                                                      # (B, Hq, 1, 1)
            out = zq * o_full + (1 - zq) * o_sparse
        else:
            out = self.run(q, k, v, modes, block_mask)                                     # (B, Hq, S, D)
        # Given modes, a head is sparse (z = 0) iff it runs this configuration's sparse mode: a dense
        # FULL head in XA-SSA is not sparse.
        z = gate if gate is not None else (modes != sparse_mode).to(q.dtype)              # (B, Hkv)
        out = out.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim)             # (B, S, Hq·D)
        record = dict(z=z, modes=modes, log_alpha=log_alpha, block_mask=block_mask, k=k, v=v)
        return self.o_proj(out), record


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, **attn_kwargs):
        a, record = self.self_attn(self.input_layernorm(x), cos, sin, **attn_kwargs)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), record

# -----------------------------------------------------------------------------
# The model.

class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, D)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.routers = None  # attach_routers() adds one AttentionRouter per layer
        self.apply(self._init_weights)

    def _init_weights(self, m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)  # GPT-2 / Llama initializer_range

    def attach_routers(self):
        """One AttentionRouter per layer (METHOD.md §4); returns them."""
        c = self.cfg
        self.routers = nn.ModuleList(
            router_lib.AttentionRouter(c.head_dim, c.router_hidden_mult, c.pool_tokens) for _ in range(c.n_layers))
        self.routers.to(self.lm_head.weight.device)
        return self.routers

    def check_tokens(self, idx):
        if idx.dim() != 2 or idx.dtype != torch.long:
            raise ValueError(f"idx must be a (B, S) long tensor, got {idx.dtype} {tuple(idx.shape)}")
        if idx.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds max_seq_len {self.cfg.max_seq_len}")
        if idx.numel() and (idx.min() < 0 or idx.max() >= self.cfg.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.cfg.vocab_size}), got min {idx.min().item()} "
                             f"max {idx.max().item()}")

    def forward(self, idx, modes=None, gates=None, route=None, block_masks=None, lengths=None):
        """idx (B, S) → (logits (B, S, V), info). See the module docstring for modes / gates / route.

        info: z, modes, log_alpha, block_mask, records (one entry per layer), omega_msr (B,)
        = 1 − mean z over layers and KV heads (carries the gate's gradient), omega_esr (B,)
        mean over layers and omega_esr_last (B,) for the last layer (METHOD.md §2).
        """
        self.check_tokens(idx)
        B, S = idx.shape
        L = self.cfg.n_layers
        if route is not None and self.routers is None:
            raise ValueError("route given but the model has no routers: call attach_routers() first")
        if route is not None and not (route == "eval" or callable(route)):
            raise ValueError(f"route must be None, 'eval' or a gate function, got {route!r}")
        for name, per_layer in (("modes", modes), ("gates", gates), ("block_masks", block_masks)):
            if per_layer is not None and len(per_layer) != L:
                raise ValueError(f"{name} must have one entry per layer ({L}), got {len(per_layer)}")
        cos, sin = self.rope_cos[:S], self.rope_sin[:S]
        x = self.embed_tokens(idx)  # (B, S, C)
        records = []
        for i, layer in enumerate(self.layers):
            x, record = layer(x, cos, sin,
                              modes=None if modes is None else modes[i],
                              gate=None if gates is None else gates[i],
                              route=route, router=None if self.routers is None else self.routers[i],
                              block_mask=None if block_masks is None else block_masks[i], lengths=lengths)
            records.append(record)
        logits = self.lm_head(self.norm(x))  # (B, S, V)
        return logits, self.summarize(records, S)

    def summarize(self, records, S):
        c = self.cfg
        z = torch.stack([r["z"] for r in records])  # (L, B, Hkv)
        esr = torch.stack([masks.omega_esr_closed_form(S, r["modes"], c.sink, c.window, r["block_mask"],
                                                         c.block_size) for r in records])  # (L, B)
        return dict(
            records=records, z=[r["z"] for r in records], modes=[r["modes"] for r in records],
            log_alpha=[r["log_alpha"] for r in records], block_mask=[r["block_mask"] for r in records],
            omega_msr=1.0 - z.float().mean((0, 2)), omega_esr=esr.mean(0), omega_esr_last=esr[-1])

    @torch.no_grad()
    def attention_rows(self, idx, positions):
        """Backbone (all heads FULL) attention probabilities of one query per sample:
        positions (B,) → (L, B, Hq, S). The retrieval score of a head (METHOD.md §8, App. C) is
        their mass on the needle tokens."""
        self.check_tokens(idx)
        B, S = idx.shape
        cos, sin = self.rope_cos[:S], self.rope_sin[:S]
        x = self.embed_tokens(idx)
        rows = []
        for layer in self.layers:
            attn = layer.self_attn
            q, k, _, _ = attn.project(layer.input_layernorm(x), cos, sin)    # (B, Hq, S, D), (B, Hkv, S, D)
            qp = q[torch.arange(B, device=idx.device), :, positions]         # (B, Hq, D)
            k = k.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=1)   # (B, Hq, S, D)
            scores = torch.einsum("bhd,bhsd->bhs", qp.float(), k.float()) / math.sqrt(attn.head_dim)
            visible = torch.arange(S, device=idx.device).view(1, 1, S) <= positions.view(B, 1, 1)
            rows.append(torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1))  # (B, Hq, S)
            x, _ = layer(x, cos, sin)
        return torch.stack(rows)                                               # (L, B, Hq, S)

    # -------------------------------------------------------------------------
    # Generation: prefill decides every head's mode once; decoding reuses it (METHOD.md §7).

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, modes=None, route=None, block_masks=None):
        """Greedy decoding with a KV cache. Returns (tokens (B, S + new), prefill info).

        Streaming heads see only sinks + window at decode too. Block-sparse heads keep their
        prefill mask for rows it covers and attend to every cached key after it: XAttention is a
        prefill method (the authors' decode attends the whole cache for every head)."""
        if idx.shape[1] + max_new_tokens > self.cfg.max_seq_len:
            raise ValueError(f"{idx.shape[1]} + {max_new_tokens} new tokens exceed max_seq_len {self.cfg.max_seq_len}")
        logits, info = self.forward(idx, modes=modes, route=route, block_masks=block_masks)
        cache = [(r["k"], r["v"]) for r in info["records"]]  # per layer (B, Hkv, T, D) after RoPE
        out = idx
        for _ in range(max_new_tokens):
            nxt = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            out = torch.cat([out, nxt], dim=1)
            if out.shape[1] == idx.shape[1] + max_new_tokens:
                break
            logits, cache = self.decode_step(nxt, out.shape[1] - 1, cache, info)
        return out, info

    def decode_step(self, token, pos, cache, info):
        """One token at position pos against the cache: logits (B, 1, V) and the grown cache."""
        c = self.cfg
        x = self.embed_tokens(token)                                  # (B, 1, C)
        cos, sin = self.rope_cos[pos:pos + 1], self.rope_sin[pos:pos + 1]
        new_cache = []
        for layer, (k_cache, v_cache), modes, bm in zip(self.layers, cache, info["modes"], info["block_mask"]):
            attn = layer.self_attn
            q, k, v, _ = attn.project(layer.input_layernorm(x), cos, sin)  # (B, H, 1, D)
            k_cache, v_cache = torch.cat([k_cache, k], 2), torch.cat([v_cache, v], 2)  # (B, Hkv, T, D)
            T = k_cache.shape[2]
            mask = masks.hybrid_mask(T, modes, c.sink, c.window, _grow(bm, T, c.block_size), c.block_size,
                                       q_idx=torch.tensor([pos]))   # (B, Hkv, 1, T)
            a = masks.masked_attention(q, k_cache, v_cache, mask)  # (B, Hq, 1, D)
            a = a.transpose(1, 2).reshape(x.shape[0], 1, -1)        # (B, 1, Hq·D)
            x = x + attn.o_proj(a)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            new_cache.append((k_cache, v_cache))
        return self.lm_head(self.norm(x)), new_cache


def _grow(block_mask, T, block_size):
    """Pad a prefill block mask (B, Hkv, n, n) to cover T tokens, or None. New query blocks get
    every key block on: past the prefill, block-sparse heads attend like full ones."""
    if block_mask is None:
        return None
    n = masks.num_blocks(T, block_size)
    return F.pad(block_mask, (0, n - block_mask.shape[-1], 0, n - block_mask.shape[-2]), value=True)

# -----------------------------------------------------------------------------
# Hugging Face interop: our parameter names are HF's without the "model." prefix.

def load_hf_state_dict(model, hf_state):
    """Copy a HF Llama / Qwen3 state dict (model.layers.{i}.self_attn.q_proj.weight, …,
    lm_head.weight) into `model`. Raises on missing, unexpected or mis-shaped tensors."""
    ours = {k: v for k, v in model.state_dict().items() if not k.startswith("routers.")}
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
    """Build a Transformer from a local HF directory: config.json + *.safetensors (no downloads)."""
    try:
        from safetensors.torch import load_file
    except ImportError as e:
        raise ImportError("from_pretrained_hf reads *.safetensors: pip install safetensors") from e
    with open(os.path.join(directory, "config.json")) as f:
        cfg = replace(Config.from_hf(json.load(f)), **config_overrides)
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {directory}")
    state = {}
    for path in files:
        state.update(load_file(path))
    return load_hf_state_dict(Transformer(cfg), state)

# -----------------------------------------------------------------------------
# Checkpoints: the config travels with the weights, and loading into a different config fails loudly.

def save_checkpoint(path, model, **extra):
    """Atomic write (temp file + rename), so an interrupted save leaves the previous file intact."""
    state = {k: v for k, v in model.state_dict().items()}
    tmp = f"{path}.tmp"
    torch.save(dict(config=asdict(model.cfg), model=state, **extra), tmp)
    os.replace(tmp, path)


def load_checkpoint(path, cfg=None, map_location="cpu"):
    """(model, checkpoint dict). With cfg given, every field that shapes the weights must match."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    ckpt = torch.load(path, map_location=map_location, weights_only=False)
    saved = Config(**ckpt["config"])
    if cfg is not None:
        shape_fields = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
                        "tie_embeddings", "qk_norm", "router_hidden_mult")
        diff = {f: (getattr(saved, f), getattr(cfg, f)) for f in shape_fields if getattr(saved, f) != getattr(cfg, f)}
        if diff:
            raise ValueError(f"checkpoint {path!r} was made with a different config (saved, wanted): {diff}")
        saved = cfg
    model = Transformer(saved)
    if any(k.startswith("routers.") for k in ckpt["model"]):
        model.attach_routers()
    model.load_state_dict(ckpt["model"])
    return model, ckpt
