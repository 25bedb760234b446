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

With --routers, it routes instead: the Ω_MSR a train_router.py run's trained routers give that run's
own evaluation prompts, in-template and per held-out condition, with each category gap and per-input
AUC, beside the keyword rule's call on the same prompts. Ranked routers with one global count
decide from the pre-pass alone, so this needs no 4K forward: minutes on a CPU, the same Ω as the
run's results.json. Any train_router.py flag the run was given (say --test-per-task 16) rebuilds
its inputs; preset, seed and length come from router.pt.

    python -m elastic_lab.probe --routers smollm2_routers.pt
    python -m elastic_lab.probe --routers smollm2_routers.pt --dev   # the conditions' development twins

--accuracy CONDITION then scores dense and Elastic on that condition's prompts, family by family:
a forward of every prompt, so about 25 s a 4K prompt on 2 CPU cores (--test-per-task 16: 13 min a
family), against hours for a CPU run of every method on every condition.
"""
import argparse
import json
import os
import statistics
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


def fit_probe(x, y, steps=200, l2=1e-2, whiten=False):
    """Logistic regression on standardised features: x (N, F), y (N,) 1 = robust. Returns a scorer.
    whiten=True whitens them instead, as the count router does (router.fit_whitening)."""
    if whiten:
        r = router_lib.CountRouter(x.shape[1])
        router_lib.fit_whitening(r, x)
        transform = lambda t: (t - r.in_shift.float()) @ r.whiten.float()
    else:
        mu, sd = x.mean(0), x.std(0).clamp(min=1e-6)
        transform = lambda t: (t - mu) / sd
    w, b = router_lib.fit_logistic(transform(x), y, l2, steps)
    return lambda x2: transform(x2) @ w + b


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


def select_depth(model, tokenizer, n, seq_len, seed, extra=()):
    """The development protocol that chooses the pre-pass depth without a held-out family, wording or
    text: {reader: {layer: {check: AUC}}} of the last-token residual, for the standardised and the
    whitened (count router's) reader. Checks, all on development wordings of trained families:
    "families", leave one sensitive and one robust trained family out of the fit, score those two
    (mean over the 4 × 3 pairs); "wordings", "question_only", "decoys" as the test conditions are made.
    extra: smollm2.EXTRA families a run would also train on; they join every fit and are never scored."""
    smollm2.trained_tasks(extra)   # refuses a name that is not an extra family
    names = smollm2.TRAIN_NAMES
    x, y = collect(model, tokenizer, names + list(extra), n, seq_len, seed)
    family = torch.arange(len(names) + len(extra)).repeat_interleave(n)   # x's rows, extra families last
    dev = {c: collect(model, tokenizer, names, n, seq_len, seed + 2, c, dev=True)
           for c in ("wordings", "question_only", "decoys")}
    dev_family = family[:len(names) * n]
    pairs = [(i, j) for i, a in enumerate(names) for j, b in enumerate(names)
             if smollm2.get_task(a).category == "sensitive" and smollm2.get_task(b).category == "robust"]
    auc = lambda score, yy: report.auc(score[yy == 0].tolist(), score[yy == 1].tolist())
    table = {}
    for reader in ("standardised", "whitened"):
        for layer in range(1, model.cfg.n_layers):   # layer d: the residual after d layers
            xs = x["last"][layer]
            probe = fit_probe(xs, y, whiten=reader == "whitened")
            row = {c: auc(probe(tx["last"][layer]), ty) for c, (tx, ty) in dev.items()}
            lofo = []
            for i, j in pairs:
                keep = (family != i) & (family != j)
                held = (dev_family == i) | (dev_family == j)
                probe = fit_probe(xs[keep], y[keep], whiten=reader == "whitened")
                lofo.append(auc(probe(dev["wordings"][0]["last"][layer][held]), dev["wordings"][1][held]))
            row["families"] = statistics.mean(lofo)
            table.setdefault(reader, {})[layer] = row
        print(f"{reader}: done", file=sys.stderr, flush=True)
    return table


def args_device(model):
    return model.lm_head.weight.device


@torch.no_grad()
def route_held_out(run, model, conditions=None, dev=False):
    """{condition: {family: [Ω_MSR per input]}}: what the model's trained routers decide for a
    train_router Run's evaluation prompts ("in_template": its split "eval") and each held-out
    condition's test prompts (dev=True: their development twins) or those named, from
    Transformer.routing alone (the pre-pass and one global count)."""
    if model.shift_router is None or model.cfg.deploy != "global":
        raise ValueError("routing alone needs ranked routers deployed by one global count (the smollm2 preset's): "
                         "other routers decide layer by layer, inside the forward")
    model.eval()
    out = {}
    for condition in conditions or run.suite.conditions:
        out[condition] = {}
        for name, b in condition_batches(run, condition, dev):
            x = None if model.cfg.prepass_layers else model.embed_tokens(b["tokens"])   # layer 0's keys need it
            r = model.routing(b["tokens"], x, None, None, None, b.get("lengths"), b["prompt_lengths"], None, True)
            out[condition].setdefault(name, []).extend(   # L × (B, Hkv) → (B,)
                (1 - torch.stack(r.deployed).float().mean((0, 2))).tolist())
    return out


def condition_split(run, condition, dev=False):
    """(the run's split name, its families) for one condition's prompts."""
    if condition == "in_template":
        return "eval", run.suite.names
    return f"{'dev' if dev else 'test'}:{condition}", run.suite.conditions[condition]


def condition_batches(run, condition, dev=False):
    """(family, batch) over one condition's prompts, as the run's evaluation draws them."""
    split, names = condition_split(run, condition, dev)
    for name in names:
        for i in range(run.n_batches(split)):
            yield name, run.held_out(name, i, None, split)


@torch.no_grad()
def accuracy(run, model, condition, dev=False):
    """{family: {"dense", "elastic": per-input scores, "omegas": Elastic's Ω_MSR}} on one condition's
    prompts: every head FULL against the routers' modes, scored as the run scores them. A forward of
    every prompt per method (a 4K one takes about 25 s on 2 CPU cores), where routing needs only the pre-pass."""
    import train_router
    model.eval()
    split, names = condition_split(run, condition, dev)
    dense = train_router.fixed(model, torch.arange(model.cfg.n_layers * model.cfg.n_kv_heads), 0.0)
    out = {}
    for name in names:
        d, e = (train_router.evaluate(run, model, choose, names=[name], split=split)[name] for choose in (dense, None))
        out[name] = dict(dense=d["scores"], elastic=e["scores"], omegas=e["omegas"])
        print(f"{condition:<14}{name:<14} dense {100 * statistics.mean(d['scores']):5.1f}  Elastic "
              f"{100 * statistics.mean(e['scores']):5.1f} (Ω {statistics.mean(e['omegas']):.2f}), "
              f"{len(d['scores'])} prompts", flush=True)
    return out


def load_run(routers, device, flags=()):
    """(Run, model with the routers, their settings): a smollm2 run's evaluation inputs rebuilt from its
    router.pt (preset, seed, length, text) and any train_router flags the run was given."""
    import train_router
    try:
        s = elastic_attention.read_checkpoint(routers, keys=("settings", "routers"))["settings"]
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: --routers {routers!r}: {e}")
    argv = ["--preset", s["preset"], "--seed", str(s["seed"]), "--seq-len", str(s["seq_len"]), "--device", device,
            "--backend", "torch", *(["--haystack", ",".join(s["haystack"])] if s.get("haystack") else []),
            *(["--extra-families", ",".join(s["extra_families"])] if s.get("extra_families") else []),
            *(["--decoy-share", str(s["decoy_share"])] if s.get("decoy_share") else []),
            *(["--more-questions"] if s.get("more_questions") else []), *flags]
    run_args = train_router.build_parser().parse_args(argv)
    P, _ = train_router.settings_from(run_args)
    if P["suite"] != "smollm2":
        raise SystemExit(f"error: {routers!r} is a {P['suite']} run's: routing alone is for the smollm2 preset")
    suite, model, cfg = train_router.load_suite(P, run_args, 0, 1)
    run = train_router.Run(P, run_args, torch.device(device), suite, out_dir=None)
    model, _ = train_router.build_backbone(run, cfg, model)
    differ = {k: (v, getattr(cfg, k)) for k, v in s["config"].items() if k != "backend" and v != getattr(cfg, k, v)}
    if differ:
        raise SystemExit(f"error: the routers were trained with {', '.join(f'{k} {a}' for k, (a, _) in differ.items())}; "
                         f"these inputs' run has {', '.join(f'{k} {b}' for k, (_, b) in differ.items())}: "
                         "give the flags the run was given")
    try:
        smollm2.load_routers(model, smollm2.read_routers(routers, cfg.n_layers, cfg.head_dim, cfg.n_kv_heads, cfg.dim))
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    if run.P["fail_safe"]:   # fitted afresh: the point may differ from the run's
        train_router.deploy_fail_safe(run, model)
    return run, model, s


def route_main(args, flags):
    """--routers: route the run's prompts and print Ω per family, the category gap and the AUC, and
    beside them how the keyword rule (the baseline a learned router must beat) calls the same prompts."""
    import train_router
    run, model, s = load_run(args.routers, args.device, flags)
    cats = {t.name: t.category for t in smollm2.TASKS}
    print(f"routing of {args.routers} on its run's {'development' if args.dev else 'test'} prompts (preset "
          f"{s['preset']}, seed {s['seed']}, "
          f"{s['seq_len']} tokens, {args.device}): Ω_MSR per family; category gap; per-input AUC\n"
          f"text: {smollm2.text_fingerprint(run.P['haystack'])} (in-template prompts are the run's where its "
          "results.json names the same; pydoc's differs between Python releases)", flush=True)
    keywords = set(train_router.keyword_rule(run.suite, run.P["haystack"]))
    table, routes = {}, {}
    for condition in run.suite.conditions:
        fams = routes[condition] = route_held_out(run, model, [condition], args.dev)[condition]
        low = [w for t, ws in fams.items() if cats[t] == "sensitive" for w in ws]
        high = [w for t, ws in fams.items() if cats[t] == "robust" for w in ws]
        fired = {"sensitive": [], "robust": []}   # the keyword rule's call on the same prompts (1: sensitive set)
        for name, b in condition_batches(run, condition, args.dev):
            fired[cats[name]] += train_router.keyword_fires(run, model, keywords, b)
        row = table[condition] = dict(sensitive=statistics.mean(low), robust=statistics.mean(high),
                                      gap=statistics.mean(high) - statistics.mean(low), auc=report.auc(low, high),
                                      families={t: statistics.mean(ws) for t, ws in fams.items()},
                                      keyword_auc=report.auc([1 - f for f in fired["sensitive"]],
                                                              [1 - f for f in fired["robust"]]),
                                      keyword_fires={c: statistics.mean(f) for c, f in fired.items()})
        print(f"{condition:<14} sensitive {row['sensitive']:.2f}  robust {row['robust']:.2f}  gap {row['gap']:+.2f}  "
              f"AUC {row['auc']:.2f}   " + " ".join(f"{t} {w:.2f}" for t, w in row["families"].items()) +
              f"   keyword rule: AUC {row['keyword_auc']:.2f}, fires on {row['keyword_fires']['sensitive']:.0%} "
              f"sensitive, {row['keyword_fires']['robust']:.0%} robust", flush=True)
    scores = accuracy(run, model, args.accuracy, args.dev) if args.accuracy else None
    if args.out:
        summary = dict(routers=args.routers, flags=flags, dev=args.dev, table=table, omegas=routes, accuracy=scores)
        elastic_attention.write_atomic(args.out, lambda f: f.write(json.dumps(summary, indent=1).encode()))


def select_main(args, table):
    """Print select_depth's table and the depth with the best mean, per reader."""
    checks = list(next(iter(table["whitened"].values())))
    print(f"development AUC of the last-token residual by pre-pass depth ({args.per_task} prompts per trained family, "
          f"{args.pool_tokens} tokens at each end; families: one sensitive and one robust family left out of the fit"
          f"{'; in every fit: ' + args.extra_families if args.extra_families else ''})")
    print(f"{'depth':<7}" + "".join(f"{r[:5]} {c[:10]:<11}" for r in table for c in checks))
    for layer in table["whitened"]:
        print(f"{layer:<7}" + "".join(f"{table[r][layer][c]:<17.3f}" for r in table for c in checks))
    for reader, rows in table.items():
        mean = {layer: statistics.mean(row.values()) for layer, row in rows.items()}
        best = max(mean, key=mean.get)
        print(f"{reader}: best depth {best} (mean {mean[best]:.3f})")
    if args.out:
        summary = dict(per_task=args.per_task, seq_len=args.seq_len, pool_tokens=args.pool_tokens, seed=args.seed,
                       extra_families=args.extra_families, select=table)
        elastic_attention.write_atomic(args.out, lambda f: f.write(json.dumps(summary, indent=1).encode()))


def main(argv=None):
    # --routers first: every other flag then belongs to the run (train_router.py's), none to the probe
    route = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    route.add_argument("--routers")
    route.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    route.add_argument("--out")
    route.add_argument("--dev", action="store_true")
    route.add_argument("--accuracy", choices=list(smollm2.CONDITIONS))
    r, flags = route.parse_known_args(argv)
    if r.routers:
        return route_main(r, flags)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--per-task", type=int, default=16, help="prompts per task family and condition (default 16)")
    p.add_argument("--seq-len", type=int, default=4096, help="prompt length in tokens (default 4096)")
    p.add_argument("--pool-tokens", type=int, default=32, help="tokens read at each end of the prompt (default 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dev", action="store_true", help="test on the development set (dev wordings, other "
                                                      "seeds), where choices are made; default: the test set")
    p.add_argument("--select", action="store_true", help="choose the pre-pass depth on development prompts "
                                                         "of the trained families only (select_depth)")
    p.add_argument("--extra-families", default="", help="with --select: extra families (smollm2.EXTRA, comma-"
                                                        "separated) in every fit, as train_router's flag trains them")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="write the AUC table (with --routers: the routing table) here as JSON")
    p.add_argument("--routers", help="a smollm2 run's router.pt: route that run's evaluation prompts instead "
                                     "(then any train_router.py flag the run was given)")
    p.add_argument("--accuracy", choices=list(smollm2.CONDITIONS), help="with --routers: then score dense and "
                   "Elastic on this condition's prompts (a forward of every prompt)")
    args = p.parse_args(argv)
    if args.per_task < 2:
        raise SystemExit(f"error: --per-task must be >= 2, got {args.per_task}")
    if args.accuracy:
        raise SystemExit(f"error: --accuracy {args.accuracy} scores a run's routers: it needs --routers")
    extra = tuple(args.extra_families.split(",")) if args.extra_families else ()
    if extra and not args.select:
        raise SystemExit("error: --extra-families goes with --select")
    try:
        smollm2.trained_tasks(extra)
    except ValueError as e:
        raise SystemExit(f"error: --extra-families: {e}")
    model, tokenizer = smollm2.from_gguf(smollm2.fetch_gguf(), backend="torch", pool_tokens=args.pool_tokens)
    model.to(args.device)
    model.cfg.prepass_layers = model.cfg.n_layers     # run every layer: the hooks read each one
    if args.select:
        return select_main(args, select_depth(model, tokenizer, args.per_task, args.seq_len, args.seed, extra))
    train_names = smollm2.TRAIN_NAMES
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
