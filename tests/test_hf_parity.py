"""Same weights → same logits as Hugging Face's LlamaForCausalLM / Qwen3ForCausalLM (float32 round-off).

`transformers` comes with the test extra (`pip install -e ".[test]"`); without it these tests skip.
"""
import os
import subprocess
import sys

import pytest
import torch

import elastic_attention
transformers = pytest.importorskip("transformers")


def build_hf(kind, **extra):
    common = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=96, max_position_embeddings=128,
                  rms_norm_eps=1e-6, rope_theta=10000.0, attn_implementation="eager")
    common.update(extra)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(head_dim=32, **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    torch.manual_seed(0)
    with torch.no_grad():  # HF's init leaves norms at 1: randomise every tensor so nothing hides
        for p in model.parameters():
            p.normal_(0, 0.05 if p.dim() > 1 else 1.0)
    return cfg, model.float().eval()


@pytest.mark.parametrize("kind, extra", [
    ("llama", {}),
    ("llama", dict(tie_word_embeddings=True)),
    ("llama", dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0, original_max_position_embeddings=32))),
    ("qwen3", dict(tie_word_embeddings=True)),
])
def test_logits_match_hugging_face(kind, extra):
    hf_cfg, hf_model = build_hf(kind, **extra)
    ours = elastic_attention.load_hf_state_dict(elastic_attention.Transformer(elastic_attention.Config.from_hf(hf_cfg.to_dict())), hf_model.state_dict()).eval()
    idx = torch.randint(0, 97, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf_model(idx).logits
        got, _ = ours(idx)
    err = (got - want).abs().max().item()
    assert err < 1e-4 * want.abs().max().item(), f"max |Δlogits| {err:.3e} (logits up to {want.abs().max():.2f})"


def test_importing_transformers_from_the_repository_root_works():
    """No module of ours shadows a PyPI package: transformers ≥ 5 imports Hugging Face's `kernels`,
    which a root-level kernels.py used to hide."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = "import transformers; from transformers import LlamaForCausalLM; import elastic_attention"
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
