"""probe.py — where a prompt's need for retrieval is readable in SmolLM2, before any router trains.

For every layer, a logistic probe reads what a router could read and tells sensitive prompts
(the answer lies far back) from robust ones (the last lines suffice). It is fitted on prompts made
the way training makes them (training families, instruction wordings and text) and tested on each
held-out condition of smollm2.CONDITIONS (unseen wordings, families, text, no instruction, decoys):

    residual  the residual stream entering the layer, in the routing pre-pass (Transformer.prepass:
              the preamble and the prompt's first and last pool_tokens tokens, nothing between)
    keys      the layer's pre-RoPE keys in that pass, all KV heads side by side (layer 0's are what
              the count router reads without a pre-pass: they do not depend on the context)

Both pooled as the routers pool (router.boundary_pool). The score is the per-input AUC on the test
prompts (1.0: every robust prompt scores above every sensitive one; 0.5: chance).

    python -m elastic_lab.probe                       # CPU is fine: the pass reads ~100 tokens per prompt
    python -m elastic_lab.probe --per-task 32 --out runs/probe.json
"""
import argparse
import json
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from . import report  # noqa: E402
import elastic_attention  # noqa: E402
from elastic_attention import router as router_lib  # noqa: E402
from . import smollm2  # noqa: E402
from elastic_attention import tasks  # noqa: E402


@torch.no_grad()
def features(model, batch):
    """{"residual": (L, B, C), "keys": (L, B, Hkv·D), "last": (L, B, C)} per layer of the pre-pass:
    the residual stream entering the layer and its keys, pooled as a router pools, and the residual
    at the last prompt token (what the count router reads, Transformer.prepass)."""
    c = model.cfg
    seen = []

    def recording(block):
        def dense(x, cos, sin):
            seen.append((x, block.self_attn.router_keys(block.input_layernorm(x))))  # (B, S', C), (B, Hkv, S', D)
            return type(block).dense(block, x, cos, sin)
        return dense

    for block in model.layers:
        block.dense = recording(block)
    try:
        _, n = model.prepass(batch["tokens"], batch["prompt_lengths"])
    finally:
        for block in model.layers:
            del block.dense
    pool = lambda t: router_lib.boundary_pool(t, n, c.pool_tokens, c.pool_skip)
    rows = torch.arange(len(n))
    return dict(residual=torch.stack([pool(x[:, None])[:, 0] for x, _ in seen]),
                keys=torch.stack([pool(k).flatten(1) for _, k in seen]),
                last=torch.stack([x[rows, n - 1] for x, _ in seen]))


def fit_probe(x, y, steps=200, l2=1e-2):
    """Logistic regression on standardised features: x (N, F), y (N,) 1 = robust. Returns a scorer."""
    mu, sd = x.mean(0), x.std(0).clamp(min=1e-6)
    z = (x - mu) / sd
    w = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.zeros((), requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z @ w + b, y) + l2 * (w ** 2).sum()
        loss.backward()
        return loss
    opt.step(closure)
    return lambda x2: (((x2 - mu) / sd) @ w + b).detach()


def collect(model, tokenizer, names, n, seq_len, seed, condition=None, dev=False):
    """Features and labels (1 = robust) of n prompts per task name."""
    feats, labels = [], []
    cfg = model.cfg
    for k, name in enumerate(names):
        s = tasks.split_seed("eval", 9_000_000 + 1000 * k, seed)
        if condition is None:   # made as training makes them: training text, wordings, styles
            b = smollm2.make_batch(tokenizer, [name], n, seq_len, s, split="train", window=cfg.window, sink=cfg.sink,
                                   haystack=("news", "pydoc"))
        else:
            b = smollm2.condition_batch(tokenizer, condition, [name], n, seq_len, s, window=cfg.window,
                                        sink=cfg.sink, dev=dev)
        b["prompt_lengths"] = b["query_pos"] + 1
        feats.append({k: v.float().cpu() for k, v in features(model, {k: v.to(args_device(model)) for k, v in b.items()}).items()})
        labels += [float(smollm2.get_task(name).category == "robust")] * n
    return {k: torch.cat([f[k] for f in feats], 1) for k in feats[0]}, torch.tensor(labels)


def args_device(model):
    return model.lm_head.weight.device


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--per-task", type=int, default=16, help="prompts per task family and condition (default 16)")
    p.add_argument("--seq-len", type=int, default=4096, help="prompt length in tokens (default 4096)")
    p.add_argument("--pool-tokens", type=int, default=32, help="tokens read at each end of the prompt (default 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dev", action="store_true", help="test on the development set (dev wordings, other "
                                                      "seeds), where choices are made; default: the test set")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="write the AUC table here as JSON")
    args = p.parse_args(argv)
    if args.per_task < 2:
        raise SystemExit(f"error: --per-task must be >= 2, got {args.per_task}")
    model, tokenizer = smollm2.from_gguf(smollm2.fetch_gguf(), backend="torch", pool_tokens=args.pool_tokens)
    model.to(args.device)
    model.cfg.prepass_layers = model.cfg.n_layers     # run every layer: the hooks read each one
    train_names = [t.name for t in smollm2.TASKS if not t.held_out]
    x, y = collect(model, tokenizer, train_names, args.per_task, args.seq_len, args.seed)
    table = {}
    for condition, spec in smollm2.CONDITIONS.items():
        tx, ty = collect(model, tokenizer, spec["families"], args.per_task, args.seq_len,
                         args.seed + (2 if args.dev else 1), condition, args.dev)
        for kind in ("residual", "keys", "last"):
            for layer in range(model.cfg.n_layers):
                score = fit_probe(x[kind][layer], y)(tx[kind][layer])
                table.setdefault(kind, {}).setdefault(layer, {})[condition] = report.auc(
                    score[ty == 0].tolist(), score[ty == 1].tolist())
        print(f"{condition}: done", file=sys.stderr, flush=True)
    conditions = list(smollm2.CONDITIONS)
    print(f"per-input AUC of a logistic probe fitted on training-style prompts ({args.per_task} per task, "
          f"{args.seq_len} tokens, {args.pool_tokens} tokens at each end), tested per held-out condition"
          f"{' (development set)' if args.dev else ''}")
    print(f"{'layer':<16}" + "".join(f"{c[:12]:<13}" for c in conditions))
    for kind in ("residual", "keys", "last"):
        for layer, row in table[kind].items():
            print(f"{kind} {layer:<7}" + "".join(f"{row[c]:<13.2f}" for c in conditions))
    held_out = [c for c in conditions if c != "in_template"]
    mean = {layer: sum(row[c] for c in held_out) / len(held_out) for layer, row in table["last"].items() if layer > 0}
    best = max(mean, key=mean.get)
    print(f"best pre-pass depth for the count router (last-token residual, mean AUC over {', '.join(held_out)}): "
          f"{best} layers, {mean[best]:.3f}")
    if args.out:
        summary = dict(per_task=args.per_task, seq_len=args.seq_len, pool_tokens=args.pool_tokens, seed=args.seed,
                       dev=args.dev, auc=table)
        elastic_attention.write_atomic(args.out, lambda f: f.write(json.dumps(summary, indent=1).encode()))


if __name__ == "__main__":
    for stream in (sys.stdout, sys.stderr):   # a non-UTF-8 locale prints Ω as \u03a9, not a traceback
        stream.reconfigure(errors="backslashreplace")
    main()
