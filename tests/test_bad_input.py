"""Bad input at the model's file boundaries: checkpoints (save_checkpoint / load_checkpoint) and
Hugging Face configs (Config.from_hf / from_pretrained_hf). Each gets a ValueError that names the
file or field, what it holds and what was expected — never a silent load of something else.

HF configs are plain config.json dicts here: transformers is not needed.
"""
import json
import os

import pytest
import torch

import elastic_attention
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny(**overrides):
    base = dict(vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                sink=2, window=5, block_size=4, xa_stride=2, pool_tokens=4)
    base.update(overrides)
    return elastic_attention.Config(**base)


def saved(tmp_path, cfg, routers=False, name="m.pt"):
    torch.manual_seed(0)
    model = elastic_attention.Transformer(cfg)
    if routers:
        model.attach_routers()
    path = str(tmp_path / name)
    elastic_attention.save_checkpoint(path, model, step=3)
    return path, model

# -----------------------------------------------------------------------------
# load_checkpoint(path, cfg): which differences from the saved config are allowed.


@pytest.mark.parametrize("field, wanted", [
    ("rope_theta", 500000.0), ("norm_eps", 1e-6), ("qk_norm", True), ("dim", 64), ("n_kv_heads", 4),
    ("rope_scaling", dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=32)),
])
def test_fields_that_change_the_weights_meaning_must_match(tmp_path, field, wanted):
    path, _ = saved(tmp_path, tiny())
    with pytest.raises(ValueError, match="different config") as err:
        elastic_attention.load_checkpoint(path, tiny(**{field: wanted}))
    assert f"{field} saved {getattr(tiny(), field)!r}, wanted {wanted!r}" in str(err.value)


@pytest.mark.parametrize("field, wanted", [
    ("head_config", "FA-XA"), ("pool_tokens", 8), ("block_size", 8), ("xa_stride", 1), ("xa_threshold", 0.5),
    ("router_hidden_mult", 2),
])
def test_router_fields_must_match_when_the_checkpoint_has_routers(tmp_path, field, wanted):
    """What the routers learned depends on these; a dense backbone (no routers) does not, so it may
    be loaded under any of them (train_router loads the one backbone for every head config)."""
    path, _ = saved(tmp_path, tiny(), routers=True)
    with pytest.raises(ValueError, match=f"{field} saved"):
        elastic_attention.load_checkpoint(path, tiny(**{field: wanted}))
    backbone, model = saved(tmp_path, tiny(), name="backbone.pt")
    loaded, _ = elastic_attention.load_checkpoint(backbone, tiny(**{field: wanted}))
    assert getattr(loaded.cfg, field) == wanted
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


@pytest.mark.parametrize("routers", [False, True])
def test_sink_window_and_run_time_fields_may_differ(tmp_path, routers):
    """sink / window are an experiment knob (the same weights under another streaming geometry),
    max_seq_len only sizes the RoPE table; the loaded model runs with the wanted values."""
    path, model = saved(tmp_path, tiny(), routers=routers)
    wanted = tiny(sink=4, window=9, max_seq_len=128)
    loaded, ckpt = elastic_attention.load_checkpoint(path, wanted)
    assert (loaded.cfg.sink, loaded.cfg.window, loaded.cfg.max_seq_len, ckpt["step"]) == (4, 9, 128, 3)
    ref = elastic_attention.Transformer(wanted)
    if routers:
        ref.attach_routers()
    ref.load_state_dict(model.state_dict())
    idx = torch.randint(0, 40, (1, 20))
    assert torch.equal(loaded.eval()(idx)[0], ref.eval()(idx)[0])

# -----------------------------------------------------------------------------
# load_checkpoint on files that are not model checkpoints.


def test_truncated_checkpoint(tmp_path):
    path, _ = saved(tmp_path, tiny())
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])
    with pytest.raises(ValueError, match="truncated or damaged"):
        elastic_attention.load_checkpoint(path)


def test_plain_state_dict(tmp_path):
    path = str(tmp_path / "sd.pt")
    torch.save(elastic_attention.Transformer(tiny()).state_dict(), path)
    with pytest.raises(ValueError, match="plain state_dict.*expected a dict with the keys 'config', 'model'"):
        elastic_attention.load_checkpoint(path)


def test_router_training_checkpoint(tmp_path):
    """train_router.py's router.pt (for --resume) is not a model checkpoint."""
    path = str(tmp_path / "router.pt")
    torch.save(dict(config={}, routers={}, lagrangian={}, optimizer={}, scheduler={}, step=0, log=[]), path)
    with pytest.raises(ValueError, match="router-training checkpoint.*expected a dict with the keys 'config', 'model'"):
        elastic_attention.load_checkpoint(path)


def test_read_checkpoint_with_other_keys(tmp_path):
    """What train_router's --resume needs: a router.pt; a model checkpoint is named as such."""
    path, _ = saved(tmp_path, tiny())
    with pytest.raises(ValueError, match="is a model checkpoint.*expected a dict with the keys 'config', 'routers'"):
        elastic_attention.read_checkpoint(path, keys=("config", "routers"))
    assert elastic_attention.read_checkpoint(path)["step"] == 3


@pytest.mark.parametrize("what", ["readme", "tensor", "directory", "empty"])
def test_files_that_are_not_checkpoints(tmp_path, what):
    if what == "empty":
        path, match = str(tmp_path / "e.pt"), r"is empty \(0 bytes\)"
        open(path, "wb").close()
    elif what == "readme":
        path, match = os.path.join(ROOT, "README.md"), "not a file written by torch.save"
    elif what == "tensor":
        path, match = str(tmp_path / "t.pt"), "holds a Tensor"
        torch.save(torch.zeros(3), path)
    else:
        path, match = str(tmp_path), "is a directory"
    with pytest.raises(ValueError, match=match):
        elastic_attention.load_checkpoint(path)


def test_config_fields_this_code_does_not_know(tmp_path):
    path, model = saved(tmp_path, tiny())
    ckpt = torch.load(path, weights_only=True)
    ckpt["config"]["flash_mode"] = 3
    torch.save(ckpt, path)
    with pytest.raises(ValueError, match=r"unknown config fields \['flash_mode'\]"):
        elastic_attention.load_checkpoint(path)

@pytest.mark.parametrize("change, match", [
    (lambda c: dict(c, config=[]), "config and model must be dicts, got list"),
    (lambda c: dict(c, config=dict(c["config"], vocab_size=2**40)), r"do not fit the saved config: .*1099511627776"),
    (lambda c: dict(c, config=dict(c["config"], rope_scaling={"rope_type": "evil"})), "rope_scaling must be None"),
    (lambda c: dict(c, config=dict(c["config"], deploy="bogus")), "deploy must be one of"),
])
def test_crafted_config_fields_are_refused_before_any_allocation(tmp_path, change, match):
    """A checkpoint's config is read, not trusted: a vocab of 2**40 (a 562 TB embedding) is caught
    on the meta device, where shapes cost nothing."""
    path, model = saved(tmp_path, tiny())
    torch.save(change(torch.load(path, weights_only=True)), path)
    with pytest.raises(ValueError, match=match):
        elastic_attention.load_checkpoint(path)


# -----------------------------------------------------------------------------
# Hugging Face configs: refuse what the model does not implement, naming the field.


def hf_config(model_type="llama", **extra):
    d = dict(model_type=model_type, vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=64, rope_theta=10000.0, rms_norm_eps=1e-6,
             max_position_embeddings=128, tie_word_embeddings=False, hidden_act="silu")
    d.update(extra)
    return d


@pytest.mark.parametrize("model_type, extra, field", [
    ("llama", dict(hidden_act="gelu"), "hidden_act"),
    ("qwen3", dict(hidden_act="relu"), "hidden_act"),
    ("llama", dict(attention_bias=True), "attention_bias"),
    ("qwen3", dict(attention_bias=True), "attention_bias"),
    ("llama", dict(mlp_bias=True), "mlp_bias"),
    ("qwen3", dict(use_sliding_window=True, sliding_window=64), "use_sliding_window"),
    ("qwen3", dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    ("llama", dict(sliding_window=64), "sliding_window"),
    ("llama", dict(rope_scaling=dict(rope_type="linear", factor=2.0)), "rope"),
    ("llama", dict(rope_scaling=dict(rope_type="llama3", factor=8.0)), "low_freq_factor"),
    ("llama", dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)),
     "partial_rotary_factor"),
    ("llama", dict(head_dim=7), "head_dim"),
    ("llama", dict(quantization_config=dict(quant_method="gptq")), "quantization_config"),
    ("llama", dict(intermediate_size=None), "intermediate_size"),
])
def test_hf_configs_we_do_not_implement_are_refused(model_type, extra, field):
    d = {k: v for k, v in hf_config(model_type, **extra).items() if v is not None}
    with pytest.raises(ValueError, match=field):
        elastic_attention.Config.from_hf(d)


def test_hf_configs_that_do_not_change_the_math_are_accepted():
    """Dropout acts only in training (the backbone is frozen here); pretraining_tp > 1 only slices
    HF's matmuls; Qwen3's sliding_window is ignored while use_sliding_window is false."""
    elastic_attention.Config.from_hf(hf_config(attention_dropout=0.1, pretraining_tp=2, hidden_act="silu", mlp_bias=False))
    elastic_attention.Config.from_hf(hf_config("qwen3", use_sliding_window=False, sliding_window=4096, max_window_layers=28,
                               layer_types=["full_attention"] * 2))
    elastic_attention.Config.from_hf(hf_config(head_dim=16))   # Llama honours an explicit head_dim (4 × 16 != 32)


def test_hf_defaults_follow_the_model_type():
    """A field left out gets HF's default for that model: Qwen3's head_dim is 128, not hidden / heads."""
    d = hf_config("qwen3")
    assert elastic_attention.Config.from_hf(d).head_dim == 128
    assert elastic_attention.Config.from_hf(hf_config()).head_dim == 8


def test_from_pretrained_hf_refuses_before_reading_weights(tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        json.dump(hf_config(hidden_act="gelu"), f)
    with pytest.raises(ValueError, match="hidden_act"):
        elastic_attention.from_pretrained_hf(str(tmp_path))

# -----------------------------------------------------------------------------
# A checkpoint is data: no reader unpickles objects that could run code.


def test_payload_is_live(pickle_payload, tmp_path):
    """The control: an unrestricted torch.load runs the payload (so the tests below mean something)."""
    write, marker = pickle_payload
    path = write(tmp_path / "x.pt", ["config"])
    torch.load(path, weights_only=False)
    assert os.path.isdir(marker)


@pytest.mark.parametrize("reader", ["read_checkpoint", "load_checkpoint", "read_routers"])
def test_no_reader_runs_code_in_a_checkpoint(pickle_payload, tmp_path, reader):
    write, marker = pickle_payload
    keys = ["config", "model", "settings", "static", "routers", "lagrangian", "optimizer", "scheduler", "step", "log"]
    path = write(tmp_path / "evil.pt", keys)
    if reader == "read_routers":
        from elastic_lab import smollm2
        read = smollm2.read_routers
    else:
        read = getattr(elastic_attention, reader)
    with pytest.raises(ValueError, match="holding Python objects besides tensors.*could run code.*GLOBAL posix.mkdir"):
        read(path)
    assert not os.path.exists(marker)


def test_what_the_project_saves_loads_as_weights_only(tmp_path):
    """save_checkpoint with the extras train_router passes (settings, tuples, a backbone curriculum)."""
    path, _ = saved(tmp_path, tiny(), routers=True)
    elastic_attention.save_checkpoint(path, elastic_attention.Transformer(tiny()), settings=dict(
        config=dict(rope_scaling=None), targets=[0.7, 1.0], tasks=["a"]), stages=[(256, 10, 4, 3e-3)])
    assert torch.load(path, weights_only=True)["stages"] == [(256, 10, 4, 3e-3)]
    assert torch.load(os.path.join(ROOT, "tiny_backbone.pt"), weights_only=True)["config"]["n_layers"] == 4
