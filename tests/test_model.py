"""The Llama-style model: hybrid heads, the training mix, KV-cache decoding, HF interop, bad input."""
import json

import pytest
import torch
from hypothesis import given, settings, strategies as st

import elastic_attention
from elastic_attention import kernels, masks
from elastic_attention.masks import FULL, STREAMING
from elastic_attention.model import Routing

SETTINGS = settings(max_examples=10, deadline=None)


def tiny(**overrides):
    base = dict(vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=256,
                sink=2, window=5, block_size=4, xa_stride=2, pool_tokens=4)
    base.update(overrides)
    return elastic_attention.Config(**base)


def model_and_tokens(cfg, B, S, seed=0):
    torch.manual_seed(seed)
    model = elastic_attention.Transformer(cfg).double().eval()
    idx = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(seed + 1))
    return model, idx


def random_modes(cfg, B, seed, values=(FULL, STREAMING)):
    g = torch.Generator().manual_seed(seed)
    choice = torch.tensor(values)
    return choice[torch.randint(0, len(values), (cfg.n_layers, B, cfg.n_kv_heads), generator=g)]


def test_model_shapes_and_derived_fields():
    for name in elastic_attention.MODEL_SHAPES:
        cfg = elastic_attention.Config.shape(name)
        assert cfg.head_dim * cfg.n_heads == cfg.dim or name == "llama3-8b"
    big = elastic_attention.Config.shape("llama3-8b")
    assert (big.n_heads, big.n_kv_heads, big.head_dim, big.ffn_dim) == (32, 8, 128, 14336)
    assert elastic_attention.Config(dim=128).ffn_dim == 352  # 2/3 · 512 = 341.3 → next multiple of 32
    with pytest.raises(ValueError, match="unknown model shape 'huge'"):
        elastic_attention.Config.shape("huge")
    for bad, message in ((dict(n_kv_heads=0), "n_kv_heads must be an int >= 1, got 0"),
                         (dict(n_layers=0), "n_layers must be an int >= 1, got 0"),
                         (dict(xa_stride=0), "xa_stride must be an int >= 1, got 0"),
                         (dict(pool_tokens=0), "pool_tokens must be an int >= 1, got 0"),
                         (dict(pool_skip=-2), "pool_skip must be an int >= 0, got -2"),
                         (dict(rope_theta=-1.0), r"rope_theta .* got -1.0, 1e-05"),
                         (dict(norm_eps=-1e-6), r"norm_eps .* got 10000.0, -1e-06")):
        with pytest.raises(ValueError, match=message):   # not a ZeroDivisionError or non-finite logits later
            elastic_attention.Config(**bad)


@SETTINGS
@given(S=st.sampled_from([1, 7, 23, 40]), seed=st.integers(0, 1000))
def test_batch_with_per_sample_modes_equals_one_at_a_time(S, seed):
    cfg = tiny()
    model, idx = model_and_tokens(cfg, 3, S, seed)
    modes = random_modes(cfg, 3, seed)
    logits, info = model(idx, modes=modes)
    for b in range(3):
        one, _ = model(idx[b:b + 1], modes=modes[:, b:b + 1])
        torch.testing.assert_close(logits[b:b + 1], one, rtol=1e-12, atol=1e-12)
    assert torch.equal(torch.stack(info["modes"]), modes.to(torch.int32))


def test_all_full_modes_equal_backbone_and_window_ge_S_streaming_too():
    cfg = tiny()
    model, idx = model_and_tokens(cfg, 2, 30)
    backbone, info = model(idx)
    assert torch.equal(info["omega_msr"], torch.zeros(2)) and torch.equal(info["omega_esr"], torch.zeros(2).double())
    full, _ = model(idx, modes=torch.zeros(cfg.n_layers, 2, cfg.n_kv_heads, dtype=torch.long))
    torch.testing.assert_close(full, backbone, rtol=0, atol=0)
    wide = elastic_attention.Transformer(tiny(window=64)).double().eval()
    wide.load_state_dict(model.state_dict())
    stream, _ = wide(idx, modes=torch.ones(cfg.n_layers, 2, cfg.n_kv_heads, dtype=torch.long))
    torch.testing.assert_close(stream, backbone, rtol=1e-12, atol=1e-12)
    sparse, _ = model(idx, modes=torch.ones(cfg.n_layers, 2, cfg.n_kv_heads, dtype=torch.long))
    assert (sparse - backbone).abs().max() > 1e-6, "window 5 < S 30 must change the output"


def test_training_mix_endpoints_and_gradient_wrt_z():
    cfg = tiny()
    model, idx = model_and_tokens(cfg, 2, 25)
    B, H = 2, cfg.n_kv_heads
    modes = random_modes(cfg, B, 3)
    z_hard = (modes == FULL).double()
    hybrid, _ = model(idx, modes=modes)
    mixed, info = model(idx, z=z_hard)
    torch.testing.assert_close(mixed, hybrid, rtol=1e-12, atol=1e-12)
    assert torch.allclose(info["omega_msr"], 1 - z_hard.mean((0, 2)).float())

    # d(out)/dz at one layer: the attention output is linear in z, so the gradient equals
    # the output difference O(z_h = 1) − O(z_h = 0) projected on any direction R.
    layer = model.layers[0].self_attn
    x = torch.randn(B, 25, cfg.dim, dtype=torch.float64)
    cos, sin = model.rope_cos[:25], model.rope_sin[:25]
    z = torch.rand(B, H, dtype=torch.float64, requires_grad=True)
    at = lambda z: Routing(routed=False, z=z[None])   # z for layer 0, given by hand   # noqa: E731
    out, _ = layer(x, cos, sin, at(z))
    R = torch.randn_like(out)
    (grad,) = torch.autograd.grad((out * R).sum(), z)
    for b in range(B):
        for h in range(H):
            hi, lo = z.detach().clone(), z.detach().clone()
            hi[b, h], lo[b, h] = 1.0, 0.0
            diff = ((layer(x, cos, sin, at(hi))[0] - layer(x, cos, sin, at(lo))[0]) * R).sum()
            torch.testing.assert_close(grad[b, h], diff, rtol=1e-9, atol=1e-9)


def test_mix_with_z_one_is_full_and_zero_is_sparse_per_layer():
    cfg = tiny()
    model, idx = model_and_tokens(cfg, 2, 19)
    ones = torch.ones(cfg.n_layers, 2, cfg.n_kv_heads, dtype=torch.float64)
    torch.testing.assert_close(model(idx, z=ones)[0], model(idx)[0], rtol=1e-12, atol=1e-12)
    stream_modes = torch.ones(cfg.n_layers, 2, cfg.n_kv_heads, dtype=torch.long)
    torch.testing.assert_close(model(idx, z=ones * 0)[0], model(idx, modes=stream_modes)[0],
                               rtol=1e-12, atol=1e-12)


@SETTINGS
@given(prompt=st.sampled_from([1, 6, 13]), new=st.sampled_from([1, 9]), seed=st.integers(0, 1000))
def test_kv_cache_greedy_generation_equals_recomputation(prompt, new, seed):
    cfg = tiny()
    model, idx = model_and_tokens(cfg, 2, prompt, seed)
    modes = random_modes(cfg, 2, seed)
    out, _ = model.generate(idx, new, modes=modes)
    assert out.shape == (2, prompt + new)
    seq = idx
    for _ in range(new):  # the slow way: re-run the whole forward on the growing sequence
        logits, _ = model(seq, modes=modes)
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


@pytest.mark.parametrize("G, dtype", [(2, torch.float64), (1, torch.float32)])
def test_attention_rows_equal_walking_the_layers_by_hand(G, dtype):
    """Transformer.attention_rows (the model's one loop with rows_at) against walking the backbone's
    layers by hand: bitwise equal to the same formula (q·k/√D in float32, softmax over keys <= the
    position), and within float32 round-off of the dense float64 attention matrix's row. Routers
    attached do not change the rows: they are the backbone's, every head FULL."""
    cfg = tiny(n_heads=2 * G, n_kv_heads=2)
    model, idx = model_and_tokens(cfg, 3, 23, seed=4)
    model.attach_routers()
    model.to(dtype)
    positions = torch.tensor([22, 0, 9])
    rows = model.attention_rows(idx, positions)                              # (L, B, Hq, S)
    assert rows.shape == (cfg.n_layers, 3, cfg.n_heads, 23) and rows.dtype == torch.float32

    S, D = idx.shape[1], cfg.head_dim
    cos, sin = model.rope_cos[:S], model.rope_sin[:S]
    causal = masks.causal(None, None, torch.arange(S).view(S, 1), torch.arange(S).view(1, S))  # (S, S)
    x = model.embed_tokens(idx)
    with torch.no_grad():
        for layer, got in zip(model.layers, rows):
            q, k, _, _ = layer.self_attn.project(layer.input_layernorm(x), cos, sin)
            k = k.repeat_interleave(G, dim=1)                                # (B, Hq, S, D)
            qp = q[torch.arange(3), :, positions]                            # (B, Hq, D)
            scores = torch.einsum("bhd,bhsd->bhs", qp.float(), k.float()) / D ** 0.5
            visible = torch.arange(S).view(1, 1, S) <= positions.view(3, 1, 1)
            assert torch.equal(got, torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1))
            dense = (q.double() @ k.double().transpose(-2, -1) / D ** 0.5).masked_fill(~causal, float("-inf"))
            want = torch.softmax(dense, dim=-1)[torch.arange(3), :, positions]   # (B, Hq, S)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
            x = layer.dense(x, cos, sin)


def test_logits_at_positions_equal_the_full_grid():
    cfg = tiny()
    model, idx = model_and_tokens(cfg, 2, 19, seed=2)
    modes = random_modes(cfg, 2, 2)
    pos = torch.tensor([[3, 18, 0], [7, 7, 12]])
    grid, _ = model(idx, modes=modes)
    some, _ = model(idx, modes=modes, logits_at=pos)                         # (B, K, V)
    torch.testing.assert_close(some, grid[torch.arange(2)[:, None], pos], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"logits_at must be positions in \[0, S=19\)"):
        model(idx, logits_at=torch.tensor([[19], [0]]))
    with pytest.raises(ValueError, match=r"rows_at must be an integer tensor \(B,\) with B=2"):
        model(idx, rows_at=torch.tensor([[1, 2]]))


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_config_backend_reaches_xattention_scoring_and_decode(backend, monkeypatch):
    """Config.backend is the one choice for prefill, XAttention scoring and the decode cache."""
    from elastic_attention import decode
    from elastic_attention import xattention
    seen = []
    score = xattention.xattention_scores
    monkeypatch.setattr(xattention, "xattention_scores",
                        lambda q, k, bs, stride, backend, lengths, **kw: seen.append(("xa", backend))
                        or score(q, k, bs, stride, backend, lengths, **kw))
    attend = decode.KVCache.attend
    monkeypatch.setattr(decode.KVCache, "attend",
                        lambda self, *args: seen.append(("decode", self.backend)) or attend(self, *args))
    cfg = tiny(head_config="FA-XA", xa_threshold=0.5, backend=backend)
    model, idx = model_and_tokens(cfg, 2, 40)
    model.generate(idx, 2, modes=torch.full((cfg.n_layers, 2, cfg.n_kv_heads), masks.BLOCK_SPARSE))
    assert set(seen) == {("xa", backend), ("decode", backend)}


def test_omega_msr_and_esr_hand_computed():
    cfg = tiny(n_layers=2, n_kv_heads=2, n_heads=2, sink=1, window=1)
    model, idx = model_and_tokens(cfg, 1, 4)
    modes = torch.tensor([[[FULL, STREAMING]], [[STREAMING, STREAMING]]])  # (L, B, Hkv)
    _, info = model(idx, modes=modes)
    assert info["omega_msr"].item() == pytest.approx(3 / 4)
    # Streaming S=4, sink 1, window 1 prunes 3 of 10 pairs (see test_reference): layer 0 mean 0.15, layer 1 0.3.
    assert info["omega_esr_last"].item() == pytest.approx(0.3)
    assert info["omega_esr"].item() == pytest.approx(0.225)


def test_routers_train_mix_and_eval_modes():
    """model.train(): hard 0/1 gates, a differentiable Ω_MSR, and the mix equals the hybrid of the
    drawn modes. model.eval(): modes = 1[log α > 0], and the output is that hybrid."""
    cfg = tiny()
    model, idx = model_and_tokens(cfg, 3, 21)
    model.attach_routers()
    model.double().train()
    logits, info = model(idx)
    assert all(set(z.detach().unique().tolist()) <= {0.0, 1.0} for z in info["z"])
    assert info["omega_msr"].requires_grad
    hybrid, _ = model(idx, modes=torch.stack(info["modes"]))
    torch.testing.assert_close(logits, hybrid, rtol=1e-12, atol=1e-12)
    logits, info = model.eval()(idx)
    for la, m in zip(info["log_alpha"], info["modes"]):
        assert torch.equal(m, torch.where(la > 0, FULL, STREAMING).to(torch.int32))
    again, _ = model(idx, modes=torch.stack(info["modes"]))
    torch.testing.assert_close(logits, again, rtol=0, atol=0)


def test_count_deployment_gives_each_input_its_expected_sparsity():
    """Config.deploy = "count": an input's Ω_MSR at evaluation is its training gates' expected Ω,
    1 − mean σ(log α), to within half a head, and the hybrid run is the one of those modes."""
    cfg = tiny(deploy="count")
    model, idx = model_and_tokens(cfg, 4, 21)
    model.attach_routers(init_logit=-0.7)       # about a third of the heads FULL in training draws
    model.double().eval()
    logits, info = model(idx)
    expected = 1 - torch.sigmoid(torch.stack(info["log_alpha"])).mean((0, 2))     # (B,)
    heads = cfg.n_layers * cfg.n_kv_heads
    assert ((info["omega_msr"] - expected).abs() <= 0.5 / heads + 1e-6).all()
    assert (info["omega_msr"] < 1).all(), "init −0.7 must leave some heads FULL"
    again, _ = model(idx, modes=torch.stack(info["modes"]))
    torch.testing.assert_close(logits, again, rtol=0, atol=0)
    with pytest.raises(ValueError, match="deploy"):
        tiny(deploy="top-k")


def test_global_deployment_ranks_every_layers_heads_at_once():
    """Config.deploy = "global" (ranked routers): the count is the training gates' expected one over
    all layers, to within half a head, and the FULL heads are the highest log α anywhere."""
    cfg = tiny(deploy="global", n_layers=3)
    model, idx = model_and_tokens(cfg, 4, 21)
    model.attach_routers(init_logit=-0.7, ranked=True)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.router.log_alpha.normal_(-0.5, 1.0)   # layers unequal: not a per-layer count
    model.double().eval()
    logits, info = model(idx)
    la, full = torch.stack(info["log_alpha"]).transpose(0, 1), torch.stack(info["modes"]).transpose(0, 1) == FULL
    expected = 1 - torch.sigmoid(la).mean((1, 2))                                  # (B,)
    assert ((info["omega_msr"] - expected).abs() <= 0.5 / la[0].numel() + 1e-6).all()
    for a, f in zip(la, full):                                                      # each input
        assert f.any() and (~f).any() and a[f].min() >= a[~f].max(), (a, f)
    again, _ = model(idx, modes=torch.stack(info["modes"]))
    torch.testing.assert_close(logits, again, rtol=0, atol=0)
    with torch.no_grad():
        model.layers[1].self_attn.router.log_alpha[0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):                                    # not silently sparse
        model(idx)
    model.attach_routers()                                                          # per-head routers
    with pytest.raises(ValueError, match='deploy="global" needs ranked routers'):
        model(idx)


# -----------------------------------------------------------------------------
# Hugging Face interop (the parity test against transformers itself is tests/test_hf_parity.py).

def hf_names(model):
    sd = {}
    for k, v in model.state_dict().items():
        sd[k if k == "lm_head.weight" else "model." + k] = v.clone()
    return sd


@pytest.mark.parametrize("qk_norm, tied", [(False, False), (True, True)])
def test_hf_state_dict_round_trip(qk_norm, tied):
    cfg = tiny(qk_norm=qk_norm, tie_embeddings=tied)
    src, idx = model_and_tokens(cfg, 2, 11, seed=5)
    hf = hf_names(src)
    if tied:
        hf.pop("lm_head.weight")
    hf["model.rotary_emb.inv_freq"] = torch.zeros(4)  # old checkpoints carry it; ignored
    dst = elastic_attention.load_hf_state_dict(elastic_attention.Transformer(cfg).double(), hf)
    torch.testing.assert_close(dst(idx)[0], src(idx)[0], rtol=0, atol=0)
    bad = dict(hf)
    bad["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="q_proj.weight: checkpoint shape"):
        elastic_attention.load_hf_state_dict(elastic_attention.Transformer(cfg).double(), bad)
    bad = dict(hf)
    bad.pop("model.norm.weight")
    with pytest.raises(ValueError, match="missing.*norm.weight"):
        elastic_attention.load_hf_state_dict(elastic_attention.Transformer(cfg).double(), bad)


def hf_config(model_type="llama", **extra):
    d = dict(model_type=model_type, vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=64, rope_theta=10000.0, rms_norm_eps=1e-6,
             max_position_embeddings=128, tie_word_embeddings=False)
    d.update(extra)
    return d


def test_config_from_hf():
    cfg = elastic_attention.Config.from_hf(hf_config())
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.qk_norm) == \
        (32, 2, 4, 2, 8, 64, False)
    q3 = elastic_attention.Config.from_hf(hf_config("qwen3", head_dim=16, tie_word_embeddings=True))
    assert q3.qk_norm and q3.head_dim == 16 and q3.tie_embeddings
    rs = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)
    assert elastic_attention.Config.from_hf(hf_config(rope_scaling=rs)).rope_scaling["factor"] == 8.0
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        elastic_attention.Config.from_hf(hf_config("gpt2"))
    with pytest.raises(ValueError, match="yarn"):
        elastic_attention.Config.from_hf(hf_config(rope_scaling=dict(rope_type="yarn", factor=4.0)))


def test_from_pretrained_hf_reads_safetensors(tmp_path):
    st_torch = pytest.importorskip("safetensors.torch")
    d = hf_config()
    src = elastic_attention.Transformer(elastic_attention.Config.from_hf(d))
    (tmp_path / "config.json").write_text(json.dumps(d))
    sd = hf_names(src)
    keys = sorted(sd)
    st_torch.save_file({k: sd[k].contiguous() for k in keys[:5]}, str(tmp_path / "model-00001.safetensors"))
    st_torch.save_file({k: sd[k].contiguous() for k in keys[5:]}, str(tmp_path / "model-00002.safetensors"))
    dst = elastic_attention.from_pretrained_hf(str(tmp_path))
    idx = torch.randint(0, 40, (1, 9))
    torch.testing.assert_close(dst(idx)[0], src(idx)[0], rtol=0, atol=0)


def test_llama3_rope_scaling_changes_only_low_frequencies():
    rs = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    cos0, _ = elastic_attention.rope_tables(16, 256, 10000.0)
    cos1, _ = elastic_attention.rope_tables(16, 256, 10000.0, rs)
    assert torch.equal(cos0[:, 0], cos1[:, 0])  # the highest frequency is untouched
    assert not torch.equal(cos0[:, 7], cos1[:, 7])  # the lowest one is stretched


# -----------------------------------------------------------------------------
# Bad input.

def test_model_bad_input_raises():
    cfg = tiny()
    model, idx = model_and_tokens(cfg, 1, 8)
    with pytest.raises(ValueError, match="exceeds max_seq_len 256"):
        model(torch.zeros(1, 300, dtype=torch.long))
    with pytest.raises(ValueError, match="max 40"):
        model(torch.full((1, 4), 40))
    with pytest.raises(ValueError, match="min -1"):
        model(torch.full((1, 4), -1))
    with pytest.raises(ValueError, match="long tensor"):
        model(idx.float())
    with pytest.raises(ValueError, match=r"modes must have shape \(L, B, Hkv\) = \(2, 1, 2\)"):
        model(idx, modes=torch.zeros(1, 1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(L, B, Hkv\)"):        # (L, Hkv): the batch axis is missing
        model(idx, modes=torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="list of L tensors"):    # nested python lists
        model(idx, modes=[[[0, 0]], [[0, 1]]])
    with pytest.raises(ValueError, match=r"z must lie in \[0, 1\]"):
        model(idx, z=torch.full((2, 1, 2), 2.0))
    with pytest.raises(ValueError, match="no tokens"):
        model(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="modes must be in"):
        model(idx, modes=torch.full((2, 1, 2), 5))
    with pytest.raises(ValueError, match="query heads 6 not a multiple of KV heads 4"):
        tiny(n_heads=6, n_kv_heads=4)
    with pytest.raises(ValueError, match="window"):
        tiny(window=0)
    with pytest.raises(ValueError, match="head_config"):
        tiny(head_config="FA-XYZ")
    with pytest.raises(ValueError, match="exceed max_seq_len"):
        model.generate(idx, 300)


def test_model_refuses_what_would_fail_deeper_or_silently():
    """B = 0, modes that are complex or elsewhere, gate noise of the wrong shape or range, and a
    prompt longer than the real tokens (the router would pool padding): named at the entry."""
    cfg = tiny()
    model, idx = model_and_tokens(cfg, 2, 8)
    model.attach_routers()
    model.train()
    with pytest.raises(ValueError, match=r"idx has no tokens: \(B, S\) = \(0, 8\)"):
        model(idx[:0])
    with pytest.raises(ValueError, match="modes must be integer tensors on the tokens' device cpu, got torch.complex64"):
        model(idx, modes=torch.zeros(2, 2, 2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="modes must be integer tensors on the tokens' device cpu, got .* on meta"):
        model(idx, modes=torch.zeros(2, 2, 2, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match=r"gate_noise must have shape \(L, B, Hkv\) = \(2, 2, 2\), got \(2, 2\)"):
        model(idx, gate_noise=torch.rand(2, 2))          # (L, B) would broadcast over the heads
    with pytest.raises(ValueError, match=r"gate_noise must lie in \[0, 1\]"):
        model(idx, gate_noise=torch.full((2, 2, 2), 1.5))  # would pin every gate FULL
    with pytest.raises(ValueError, match="gate_noise must be floating"):
        model(idx, gate_noise=torch.ones(2, 2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"prompt_lengths must not exceed lengths .* got \[8, 6\] and \[8, 4\]"):
        model(idx, lengths=torch.tensor([8, 4]), prompt_lengths=torch.tensor([8, 6]))
    model(idx, lengths=torch.tensor([8, 4]), prompt_lengths=torch.tensor([8, 4]), gate_noise=torch.rand(2, 2, 2))


def test_model_checks_its_layers_inputs_once_and_routers_outputs_after_them():
    """The layers check no values (each would be a host sync per layer), so the entry names what
    they would have: a prompt inside the skipped preamble, and after the layers a router whose log α
    is NaN (its gates would have called the heads sparse)."""
    cfg = tiny(pool_skip=3)
    model, idx = model_and_tokens(cfg, 2, 8)
    model.attach_routers()
    with pytest.raises(ValueError, match=r"exceed the 3 preamble tokens the routers skip, got \[8, 3\]"):
        model(idx, prompt_lengths=torch.tensor([8, 3]))
    model(idx, prompt_lengths=torch.tensor([8, 4]))
    model(idx, prompt_lengths=torch.tensor([8, 3]), modes=torch.zeros(2, 2, 2, dtype=torch.int32))  # no router reads
    out, _ = model.eval().generate(idx, 3)             # decoding steps (one token each) reuse the prefill's modes
    assert out.shape == (2, 11)
    with torch.no_grad():
        model.layers[1].self_attn.router.router_mlp[-1].bias.fill_(float("nan"))
    for mode in (model.train, model.eval):
        mode()
        with pytest.raises(ValueError, match=r"log α has NaN entries in layers \[1\]"):
            model(idx)


def test_a_forward_reads_given_modes_once_and_its_own_never(monkeypatch):
    """Given modes are read once for all layers. The modes a routed forward makes are valid by
    construction; reading them back would be a host sync per layer on a GPU (30 per SmolLM2 step run
    op by op): neither the layers nor the Ω_ESR summary after them do."""
    cfg = tiny()
    model, idx = model_and_tokens(cfg, 2, 8)
    reads, check = [], masks.check_mode_values
    monkeypatch.setattr(masks, "check_mode_values", lambda *args, **kw: reads.append(args) or check(*args, **kw))
    model(idx, modes=torch.zeros(cfg.n_layers, 2, cfg.n_kv_heads, dtype=torch.int32))
    assert len(reads) == 1
    model.attach_routers()
    _, info = model(idx, lengths=torch.tensor([8, 5]))
    assert len(reads) == 1 and info["omega_esr"].shape == (2,)
    masks.check_modes(torch.zeros(1, 2, dtype=torch.int32), 1, 2, block_mask_given=False)
    assert len(reads) == 2                             # called directly, the check runs


def test_a_forward_reads_values_at_its_entry_not_in_every_layer(monkeypatch):
    """A value read on the host is a GPU sync, and a CUDA graph cannot record one. The forward checks
    its inputs once and its layers trust them: a model twice as deep reads no more values, and
    check=False (what elastic_lab.runs.StepGraph records) reads none. The "reference" backend: "torch"
    asks in every layer whether the heads share a mode (a sync that picks the kernel, not a check)."""
    reads = []
    for name in ("__bool__", "__int__", "__float__", "item", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _real=real: reads.append(1) or _real(t, *a))
    counts = []
    for n_layers in (2, 4):
        model, idx = model_and_tokens(tiny(n_layers=n_layers, backend="reference"), 2, 16)
        model.attach_routers()
        lengths, noise = torch.tensor([16, 12]), torch.rand(n_layers, 2, 2)
        for train in (True, False):
            model.train(train)
            reads.clear()
            model(idx, lengths=lengths, gate_noise=noise)
            counts.append(len(reads))
        model.train()
        reads.clear()
        model(idx, lengths=lengths, gate_noise=noise, check=False)
        assert reads == []
    assert counts[:2] == counts[2:] and min(counts) > 0, counts


def test_the_checks_name_bad_values_wherever_they_are_called():
    """check_modes and check_lengths read the values every time; the functions the model's layers
    call check them too unless told the caller has (check=False)."""
    bad_modes = torch.full((1, 2), 7, dtype=torch.int32)
    with pytest.raises(ValueError, match="modes must be in"):
        masks.check_modes(bad_modes, 1, 2, block_mask_given=True)
    with pytest.raises(ValueError, match="shape"):
        masks.check_modes(bad_modes, 1, 3, block_mask_given=True)
    with pytest.raises(ValueError, match=r"lengths must be in \[1, S=4\]"):
        masks.check_lengths(torch.tensor([0]), 1, 4)
    q = torch.randn(1, 2, 4, 8)
    k = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="modes must be in"):
        kernels.hybrid_attention(q, k, k, bad_modes, 2, 5, backend="reference")
    with pytest.raises(ValueError, match="modes must be in"):
        masks.hybrid_mask(4, bad_modes, 2, 5)
    with pytest.raises(ValueError, match=r"lengths must be in \[1, S=4\]"):
        masks.kept_pairs(4, torch.zeros(1, 2, dtype=torch.int32), 2, 5, lengths=torch.tensor([5]))


@pytest.mark.parametrize("head_config", ["FA-XA", "XA-SSA", "XA-XA"])
def test_xattention_head_configs_run_and_threshold_one_is_dense(head_config):
    """With τ = 1 XAttention keeps every causal block, so its heads are exactly FULL heads."""
    cfg = tiny(head_config=head_config, xa_threshold=1.0)
    model, idx = model_and_tokens(cfg, 2, 37)
    backbone, _ = model(idx)             # no routers yet: every head FULL
    model.attach_routers()
    model.double()
    z = torch.ones(cfg.n_layers, 2, cfg.n_kv_heads, dtype=torch.float64)
    xa_side = z if head_config.startswith("XA") else z * 0  # the gate value that selects XAttention
    out, info = model(idx, z=xa_side)
    torch.testing.assert_close(out, backbone, rtol=1e-12, atol=1e-12)
    assert all(bm is not None and bm.shape == (2, cfg.n_kv_heads, 10, 10) for bm in info["block_mask"])
    # Routed, training mix (hard gates) and evaluation: the output is the hybrid of the modes the
    # gates chose; where both sides are XAttention or FULL (τ = 1: the same), it is the backbone.
    for train in (True, False):
        out, info = model.train(train)(idx)
        hybrid, _ = model(idx, modes=torch.stack(info["modes"]))
        torch.testing.assert_close(out, hybrid, rtol=1e-12, atol=1e-12)
        if head_config != "XA-SSA":
            torch.testing.assert_close(out, backbone, rtol=1e-12, atol=1e-12)
            assert torch.equal(info["omega_esr"], torch.zeros(2, dtype=torch.float64))


def test_fa_xa_omega_esr_counts_the_blocks_xattention_dropped():
    """At τ = 0.5 XAttention drops blocks; the model's Ω_ESR equals the fraction of causal pairs the
    dense ground-truth mask of the chosen blocks prunes, layer by layer."""
    cfg = tiny(head_config="FA-XA", xa_threshold=0.5, block_size=4, xa_stride=2)
    model, idx = model_and_tokens(cfg, 2, 64)
    modes = torch.full((cfg.n_layers, 2, cfg.n_kv_heads), masks.BLOCK_SPARSE)
    _, info = model(idx, modes=modes)
    per_layer = [masks.omega_esr(masks.hybrid_mask(64, m, cfg.sink, cfg.window, bm, cfg.block_size))
                 for m, bm in zip(info["modes"], info["block_mask"])]
    torch.testing.assert_close(info["omega_esr"], torch.stack(per_layer).mean(0), rtol=1e-12, atol=1e-12)
    assert (info["omega_esr"] > 0).all(), "τ = 0.5 kept every block: the test checks nothing"


def test_omega_msr_of_given_modes_counts_only_the_configs_sparse_mode():
    """A head is sparse iff it runs the configuration's sparse mode: in XA-SSA a dense FULL head is
    not sparse (Ω_MSR 0), nor is an XA head (its "full" side), only STREAMING (1); in FA-SSA FULL
    counts 0 and STREAMING 1."""
    for head_config in ("XA-SSA", "FA-SSA"):
        cfg = tiny(head_config=head_config)
        model, idx = model_and_tokens(cfg, 2, 37)
        expected = {masks.FULL: 0.0, masks.STREAMING: 1.0}
        if head_config == "XA-SSA":
            expected[masks.BLOCK_SPARSE] = 0.0
        for mode, omega in expected.items():
            modes = torch.full((cfg.n_layers, 2, cfg.n_kv_heads), mode)
            _, info = model(idx, modes=modes)
            assert torch.equal(info["omega_msr"], torch.full((2,), omega)), (head_config, mode)
