"""report.py — what train_router.py shows you: the results table, the plots, the hardware line,
and the mean ± sd over seeds (`train_router.py --seeds`), closed by Elastic's margin over each head
set paired by seed. Nothing here changes a number; it only reads results.json files.

    python -m elastic_lab.report runs/tiny-FA-SSA-seed0                    # table + plots of one run again
    python -m elastic_lab.report runs/tiny-FA-SSA/seed0 runs/tiny-FA-SSA/seed1 --out runs/tiny-FA-SSA   # aggregate

Scores: accuracy in % of answer tokens (synthetic tasks) or of exact answers (real-text tasks), or
a next-token NLL in nats for tasks whose metric is "nll" (lower is better).
"""
import argparse
import importlib.util
import json
import math
import os
import platform
import statistics
import sys

if __name__ == "__main__":  # as a command: OpenMP threads that sleep when idle (read as torch loads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

import elastic_attention  # noqa: E402

# Fixed head sets are deployed at Elastic's mean Ω_MSR over the evaluation mix; "Elastic count" gives
# each input Elastic's number of sparse heads, in the trained static gates' order; the oracle picks one
# set per category with the task label; the swap control runs sensitive inputs with a robust input's
# routing.
METHODS = [("dense", "dense"), ("elastic", "Elastic"), ("static", "static score"),
           ("static_trained", "static trained"), ("router_set", "Elastic's set"), ("elastic_count", "Elastic count"),
           ("oracle", "oracle by cat."), ("keyword", "keyword rule"), ("swap", "swap control"),
           ("all_sparse", "all sparse")]
RANKINGS = {"score": "retrieval score", "router_set": "routers' FULL rate", "static_trained": "trained static gate"}


def hardware(device):
    """The machine in words: CPU model and cores, GPU name, torch version."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return dict(cpu=cpu, cpu_count=os.cpu_count(), gpu=gpu, torch=torch.__version__, platform=platform.platform())


def machine_line(hw):
    return hw["gpu"] or f"{hw['cpu']} ({hw['cpu_count']} cores)"


def _fmt(metric, values, omegas):
    """One table cell: score (Ω_MSR), or mean±sd (mean Ω_MSR) over seeds."""
    scale, digits = (1, 2) if metric == "nll" else (100, 1)
    vals = [v * scale for v in values]
    score = f"{vals[0]:.{digits}f}" if len(vals) == 1 else \
        f"{statistics.mean(vals):.{digits}f}±{statistics.stdev(vals):.{digits}f}"
    return f"{score} ({statistics.mean(omegas):.2f})".replace("(0.", "(.").replace("(1.00)", "(1.0)")


def table(runs):
    """The results table (≤ 100 columns) of one run or of several seeds of one setting."""
    first = runs[0]
    tasks, metrics = list(first["tasks"]), first["metrics"]
    width = 16 if len(runs) > 1 else 13
    lines = []
    seeds = ", ".join(str(r["seed"]) for r in runs)
    title = f"{'smoke' if first.get('smoke') else first['preset']} {first['settings']['config']['head_config']}"
    wall = statistics.mean(r["wall_time_s"] for r in runs)
    lines.append(f"results: {title} | seed{'s' if len(runs) > 1 else ''} {seeds} | "
                 f"{machine_line(first['hardware'])} | {wall:.0f} s per run")
    nll = any(metrics[t] == "nll" for t in tasks)
    lines.append(f"accuracy %{' (* NLL, nats)' if nll else ''}{' mean±sd' if len(runs) > 1 else ''} with (Ω_MSR) "
                 "per task; Ω_ESR (all layers) last")
    heads = [(t + ("*" if metrics[t] == "nll" else ""))[:width - 1] for t in tasks]
    lines.append(f"{'method':<15}" + "".join(f"{h:<{width}}" for h in heads) + "Ω_ESR")
    keys = [k for k in first["results"] if k.split("@")[0] in dict(METHODS)]
    left_out = [k for k in keys if not all(k in r["results"] for r in runs)]   # e.g. another longest length
    keys = [k for k in keys if k not in left_out]
    order = {m: i for i, (m, _) in enumerate(METHODS)}
    keys.sort(key=lambda k: (len(k.split("@")), int(k.split("@")[-1]) if "@" in k else 0, order[k.split("@")[0]]))
    for key in keys:
        if "@" in key and key.startswith("dense@"):   # a longer evaluation length: its own block
            lines.append(f"evaluated at {key.split('@')[1]} tokens:")
        cells = "".join(f"{_fmt(metrics[t], [r['results'][key][t]['score'] for r in runs], [r['results'][key][t]['omega_msr'] for r in runs]):<{width - 1}} "
                        if all(t in r["results"][key] for r in runs) else " " * width for t in tasks)
        esr = statistics.mean(statistics.mean(v["omega_esr"] for v in r["results"][key].values()) for r in runs)
        lines.append(f"{dict(METHODS)[key.split('@')[0]]:<15}{cells}{esr:.2f}")
    if "gate_share_end" in first:
        def ms(values, digits=2):  # mean ± sd of the finite values (a category absent from a short run is NaN)
            values = [v for v in values if v == v]
            if len(values) < 2:
                return f"{values[0]:.{digits}f}" if values else "n/a"
            return f"{statistics.mean(values):.{digits}f}±{statistics.stdev(values):.{digits}f}"
        lines.append(f"sensitive target {ms([r['calibration']['sensitive_target'] for r in runs])}; gate draws "
                     f"passing gradient, last tenth of training {ms([r['gate_share_end'] for r in runs])}")
        lines.append("Ω_MSR in training vs deployed: " + ", ".join(
            f"{c} {ms([r['omega_train_vs_deployed'][c]['train'] for r in runs])} vs "
            f"{ms([r['omega_train_vs_deployed'][c]['deployed'] for r in runs])}" for c in ("sensitive", "robust")))
    if left_out:
        lines.append(f"not in every run, left out: {', '.join(left_out)}")
    if len(runs) > 1:
        lines += margins(runs)
    return "\n".join(lines)


def margins(runs):
    """Elastic minus each fixed head set and the oracle on the sensitive accuracy tasks, paired by
    seed: the experiment's claim is that the gap is positive and larger than its spread."""
    first = runs[0]
    tasks = [t for t, c in first["tasks"].items() if c == "sensitive" and first["metrics"][t] == "accuracy"]
    if not tasks:
        return []
    lines = ["Elastic minus each method (last row: Elastic count minus static trained), points, paired by seed: "
             "mean±sd (mean/sd)",
             f"{'method':<15}" + "".join(f"{t[:16]:<17}" for t in tasks) + "sensitive mean"]
    for tag in [""] + [k[len("elastic"):] for k in first["results"] if k.startswith("elastic@")]:
        if tag:
            lines.append(f"evaluated at {tag[1:]} tokens:")
        pairs = [("elastic", m, dict(METHODS)[m]) for m in ("static", "static_trained", "router_set", "oracle")]
        for base, method, label in pairs + [("elastic_count", "static_trained", "count−trained")]:
            if any(k not in r["results"] for r in runs for k in (method + tag, base + tag)):
                continue
            gaps = [[100 * (r["results"][base + tag][t]["score"] - r["results"][method + tag][t]["score"])
                     for t in tasks] for r in runs]                                    # (seeds, tasks)
            cells = []
            for d in [[g[i] for g in gaps] for i in range(len(tasks))] + [[statistics.mean(g) for g in gaps]]:
                mu, sd = statistics.mean(d), statistics.stdev(d)
                cells.append(f"{mu:+.1f}±{sd:.1f} ({mu / sd:.1f})" if sd else f"{mu:+.1f}±0.0")
            lines.append(f"{label:<15}" + "".join(f"{c:<17}" for c in cells).rstrip())
    return lines


def auc(low, high):
    """P(a random value of `high` exceeds a random one of `low`), ties counted half: how well Ω_MSR
    parts robust inputs (high) from sensitive ones (low), input by input; 1.0 parts them all."""
    wins = sum((h > lo) + 0.5 * (h == lo) for lo in low for h in high)
    return wins / (len(low) * len(high))


def sign_test(wins, losses):
    """Two-sided exact binomial p-value of `wins` against `losses` discordant pairs (ties dropped)."""
    n, k = wins + losses, min(wins, losses)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


def _ms(values, digits=2, sign=""):
    """mean±sd of several values, or the one value; sign="+" writes the mean's sign."""
    if len(values) == 1:
        return f"{values[0]:{sign}.{digits}f}"
    return f"{statistics.mean(values):{sign}.{digits}f}±{statistics.stdev(values):.{digits}f}"


def held_out_table(runs):
    """Per held-out condition: every method per task family (score, Ω_MSR), Elastic's category gap
    and per-input AUC, and Elastic minus each other method on the sensitive families: mean ± sd over
    seeds, and the per-input paired sign test over all seeds' inputs."""
    first = runs[0]
    if not first.get("held_out"):
        return ""
    cats = {**first["tasks"], **first.get("held_out_tasks", {})}
    metrics = first["metrics"]
    lines = ["held-out prompts (test set frozen before the run): score % (NLL*) with (Ω_MSR); mean±sd over seeds"
             if len(runs) > 1 else "held-out prompts (test set frozen before the run): score % (NLL*) with (Ω_MSR)"]
    for condition, res in first["held_out"].items():
        names = list(res["elastic"])
        sens = [t for t in names if cats[t] == "sensitive"]
        rob = [t for t in names if cats[t] == "robust"]
        per_run = []
        for r in runs:
            e = r["held_out"][condition]["elastic"]
            low = [w for t in sens for w in e[t]["omegas"]]
            high = [w for t in rob for w in e[t]["omegas"]]
            per_run.append((auc(low, high) if low and high else float("nan"),
                            statistics.mean(high) - statistics.mean(low) if low and high else float("nan")))
        lines.append(f"{condition}: Elastic category gap {_ms([g for _, g in per_run])}, per-input AUC "
                     f"{_ms([a for a, _ in per_run])}")
        lines.append(f"{'method':<15}" + "".join(f"{(t + ('*' if metrics[t] == 'nll' else ''))[:13]:<14}"
                                               for t in names))
        for key, label in METHODS:
            if not all(key in r["held_out"][condition] for r in runs):
                continue
            cells = "".join(f"{_fmt(metrics[t], [r['held_out'][condition][key][t]['score'] for r in runs], [r['held_out'][condition][key][t]['omega_msr'] for r in runs]):<13} "
                            for t in names)
            lines.append(f"{label:<15}{cells}")
        scored = [t for t in sens if metrics[t] == "accuracy"]
        others = ("static", "static_trained", "router_set", "keyword", "oracle", "dense")
        for base, keys in (("elastic", others), ("elastic_count", ("static_trained", "dense"))):
            if not scored or not all(base in r["held_out"][condition] for r in runs):
                continue
            cells = []
            for key in keys:
                if not all(key in r["held_out"][condition] for r in runs):
                    continue
                gaps, wins, losses = [], 0, 0
                for r in runs:
                    h = r["held_out"][condition]
                    a = [x for t in scored for x in h[base][t]["scores"]]
                    b = [x for t in scored for x in h[key][t]["scores"]]
                    gaps.append(100 * (statistics.mean(a) - statistics.mean(b)))
                    wins += sum(x > y for x, y in zip(a, b))
                    losses += sum(x < y for x, y in zip(a, b))
                cells.append(f"{dict(METHODS)[key]} {_ms(gaps, 1, '+')} (+{wins}/-{losses}, p {sign_test(wins, losses):.2g})")
            lines.append(f"  {dict(METHODS)[base]} minus, sensitive families: " + "; ".join(cells))
    return "\n".join(lines)


def print_table(summary):
    print("\n" + table([summary]))
    if summary.get("held_out"):
        print("\n" + held_out_table([summary]))


# -----------------------------------------------------------------------------
# Plots (matplotlib, headless).

def savefig(fig, path):
    """fig as a PNG at path, written atomically (elastic_attention.write_atomic): never a half image."""
    elastic_attention.write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110))


def can_plot():
    return importlib.util.find_spec("matplotlib") is not None


def plots(summary, out_dir):
    """The five figures of one run, as PNG files in out_dir (nothing without matplotlib)."""
    if not can_plot():
        print("matplotlib not installed: no plots")
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    targets = dict(zip(("sensitive", "robust"), summary["settings"]["targets"]))
    targets["sensitive"] = summary.get("calibration", {}).get("sensitive_target", targets["sensitive"])  # resolves 'auto'
    c = dict(res=summary["results"], tasks=list(summary["tasks"]), cats=summary["tasks"], metrics=summary["metrics"],
             targets=targets, title=f"{'smoke' if summary.get('smoke') else summary['preset']} "
                                    f"{summary['settings']['config']['head_config']}, "
                                    f"seed {summary['seed']}")
    for figure in (_routing_heatmap, _omega_per_task, _progressive, _omega_per_input, _training):
        figure(plt, summary, c, out_dir)
    plt.close("all")


def _routing_heatmap(plt, summary, c, out_dir):
    """Which heads each task keeps FULL (paper Fig. 6)."""
    res, tasks, cats, metrics, targets, title = (c[k] for k in ("res", "tasks", "cats", "metrics", "targets", "title"))
    frac = [torch.tensor(res["elastic"][t]["full_frac"]) for t in tasks]      # (L, Hkv) each
    L, H = frac[0].shape
    fig, axes = plt.subplots(1, len(tasks), figsize=(1.2 + (0.9 + 0.35 * H) * len(tasks), 1.6 + 0.16 * L),
                             sharey=True, squeeze=False, constrained_layout=True)
    for ax, t, f in zip(axes[0], tasks, frac):
        im = ax.imshow(f.numpy(), vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_title(f"{t}\n({cats[t]})", fontsize=9)
        ax.set_xticks(range(H))
        ax.set_xlabel("KV head")
    axes[0][0].set_ylabel("layer")
    axes[0][0].set_yticks(range(0, L, max(1, L // 8)))
    fig.colorbar(im, ax=axes[0].tolist(), label="fraction of inputs routed FULL", shrink=0.9)
    fig.suptitle(f"Elastic routing per task — {title}", fontsize=10)
    savefig(fig, os.path.join(out_dir, "routing_heatmap.png"))


def _omega_per_task(plt, summary, c, out_dir):
    """Sparsity per task, with the targets the routers were given."""
    res, tasks, cats, metrics, targets, title = (c[k] for k in ("res", "tasks", "cats", "metrics", "targets", "title"))
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(tasks), 3.6), constrained_layout=True)
    x = range(len(tasks))
    ax.bar([i - 0.2 for i in x], [res["elastic"][t]["omega_msr"] for t in tasks], 0.4, label="Elastic Ω_MSR")
    ax.bar([i + 0.2 for i in x], [res["elastic"][t]["omega_esr"] for t in tasks], 0.4, label="Elastic Ω_ESR")
    for i, t in enumerate(tasks):
        ax.hlines(targets[cats[t]], i - 0.45, i + 0.45, colors="k", linestyles=":",
                  label="Ω_MSR target" if i == 0 else None)
    if "static_trained" in res:
        omega = res["static_trained"][tasks[0]]["omega_msr"]
        ax.axhline(omega, color="C3", ls="--", lw=1, label=f"trained static Ω_MSR ({omega:.2f})")
    ax.set_xticks(list(x), [f"{t}\n({cats[t]})" for t in tasks], fontsize=8)
    ax.set_ylabel("sparsity ratio")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Sparsity per task — {title}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    savefig(fig, os.path.join(out_dir, "omega_per_task.png"))


def _progressive(plt, summary, c, out_dir):
    """Accuracy against Ω_MSR (paper Fig. 2 / Table 5), one panel per task: the static frontiers
    (one head set for every input, by three rankings) as curves, Elastic and the per-category
    oracle as points at their Ω for that task, and Elastic again (hollow) at its mean Ω over the
    evaluation mix: the cost a fixed set is compared at, so that is where it should beat the curves.
    Accuracy panels share one 0-100 axis, so a drop looks its true size; NLL panels say "zoomed"."""
    res, tasks, cats, metrics, targets, title = (c[k] for k in ("res", "tasks", "cats", "metrics", "targets", "title"))
    curves = summary["progressive"][str(summary["experiment"]["seq_len"])]
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.3 * len(tasks), 3.9), squeeze=False, constrained_layout=True)
    styles = (("o", "-"), ("s", "--"), ("^", ":"))   # frontiers that coincide stay readable
    for ax, t in zip(axes[0], tasks):
        scale = 1 if metrics[t] == "nll" else 100
        for j, (name, curve) in enumerate(curves.items()):
            marker, ls = styles[j % len(styles)]
            ax.plot([float(k) for k in curve], [scale * curve[k][t] for k in curve], color=f"C{j}", marker=marker,
                    ms=4, ls=ls, lw=1.4, alpha=0.8, label=f"static by {RANKINGS.get(name, name)}")
        if "oracle" in res:   # hollow, drawn first: Elastic's star shows through it
            ax.plot(res["oracle"][t]["omega_msr"], scale * res["oracle"][t]["score"], marker="D", ms=11, mfc="none",
                    mew=1.5, color="C3", ls="none", label="oracle per category")
        if "elastic" in res:
            mean = sum(res["elastic"][u]["omega_msr"] for u in tasks) / len(tasks)
            ax.plot(mean, scale * res["elastic"][t]["score"], marker="o", ms=11, mfc="none", mew=1.5, color="k",
                    ls="none", label="Elastic at its mean Ω")
            ax.plot(res["elastic"][t]["omega_msr"], scale * res["elastic"][t]["score"], marker="*", ms=10,
                    color="k", ls="none", label="Elastic")
        nll = metrics[t] == "nll"
        ax.set_title(f"{t} ({cats[t]})" + (", y zoomed" if nll else ""), fontsize=9)
        ax.set_xlabel("Ω_MSR (fraction of KV heads sparse)")
        ax.set_ylabel("NLL (nats), lower is better" if nll else "accuracy %")
        ax.set_xlim(-0.03, 1.03)
        if not nll:
            ax.set_ylim(-2, 102)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), fontsize=8, frameon=False)
    fig.suptitle(f"Accuracy vs sparsity — {title}", fontsize=10)
    savefig(fig, os.path.join(out_dir, "progressive.png"))


def _omega_per_input(plt, summary, c, out_dir):
    """Ω_MSR of every held-out input, per task: routing that reads the prompt spreads by input."""
    res, tasks, cats, metrics, targets, title = (c[k] for k in ("res", "tasks", "cats", "metrics", "targets", "title"))
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(tasks), 3.4), constrained_layout=True)
    for i, t in enumerate(tasks):
        w = res["elastic"][t].get("omegas", [])
        jitter = [((k * 0.618) % 1 - 0.5) * 0.5 for k in range(len(w))]
        ax.scatter([i + j for j in jitter], w, s=8, alpha=0.6, color="C0" if cats[t] == "sensitive" else "C1")
    ax.set_xticks(range(len(tasks)), [f"{t}\n({cats[t]})" for t in tasks], fontsize=8)
    ax.set_ylabel("Ω_MSR per input")
    ax.set_ylim(-0.03, 1.03)
    ax.set_title(f"Elastic Ω_MSR per held-out input — {title}", fontsize=10)
    savefig(fig, os.path.join(out_dir, "omega_per_input.png"))


def _training(plt, summary, c, out_dir):
    """Training curves."""
    res, tasks, cats, metrics, targets, title = (c[k] for k in ("res", "tasks", "cats", "metrics", "targets", "title"))
    log = summary["train_log"]
    steps = [r["step"] for r in log]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4), constrained_layout=True)
    lm = [r["lm"] for r in log]
    smooth, ema = [], lm[0]
    for v in lm:
        ema = 0.95 * ema + 0.05 * v
        smooth.append(ema)
    axes[0].plot(steps, lm, color="C0", alpha=0.25, lw=0.8, label="per step")
    axes[0].plot(steps, smooth, color="C0", label="moving average (0.95)")
    axes[0].set_ylabel("LM loss (nats, answer tokens)")
    for key, c in (("sensitive", "C0"), ("robust", "C1")):
        axes[1].plot(steps, [r[f"omega_{key}"] for r in log], color=c, lw=1, label=f"Ω_MSR {key}")
        axes[1].axhline(targets[key], color=c, ls=":", label=f"target {key} ({targets[key]:.2f})")
        axes[2].plot(steps, [r[f"lambda1_{key}"] for r in log], color=c, label=f"λ1 {key} (mean)")
    axes[1].set_ylabel("Ω_MSR of the training gates")
    axes[1].set_ylim(-0.03, 1.03)
    axes[2].axhline(0, color="k", lw=0.5)
    axes[2].set_ylabel("λ1")
    for ax in axes:
        ax.set_xlabel("router step")
        ax.legend(fontsize=8)
    fig.suptitle(f"Router training — {title}", fontsize=10)
    savefig(fig, os.path.join(out_dir, "training.png"))


# -----------------------------------------------------------------------------
# Seeds.

def aggregate(run_dirs, out_dir):
    """Read results.json of each run, print the mean ± sd table, write out_dir/results.json."""
    runs = []
    for d in run_dirs:
        with open(os.path.join(d, "results.json")) as f:
            runs.append(json.load(f))
    seeds = [r["seed"] for r in runs]
    if len(set(seeds)) < len(seeds):
        raise SystemExit(f"error: the runs repeat a seed ({seeds}); mean ± sd and the margins need distinct seeds")
    setting = lambda r: {k: v for k, v in r["settings"].items() if k not in ("seed", "backbone_sha256")}
    first = setting(runs[0])
    for d, r in zip(run_dirs[1:], runs[1:]):
        mine = setting(r)
        diff = sorted(k for k in mine.keys() | first.keys() if mine.get(k) != first.get(k))
        if diff:
            raise SystemExit(f"error: {d!r} was run with other settings than {run_dirs[0]!r}: {', '.join(diff)}")
    keys = [k for k in runs[0]["results"] if all(k in r["results"] for r in runs)]
    summary = dict(runs=run_dirs, seeds=[r["seed"] for r in runs], hardware=runs[0]["hardware"], methods={})
    for key in keys:
        summary["methods"][key] = {
            t: {stat: dict(mean=statistics.mean(r["results"][key][t][stat] for r in runs),
                           sd=statistics.stdev(r["results"][key][t][stat] for r in runs))
                for stat in ("score", "omega_msr", "omega_esr", "omega_esr_last")}
            for t in runs[0]["results"][key]}
    os.makedirs(out_dir, exist_ok=True)
    # atomic: a kill or a full disk mid-write keeps the previous results.json whole
    elastic_attention.write_atomic(os.path.join(out_dir, "results.json"),
                                   lambda f: f.write(json.dumps(summary, indent=1).encode()))
    text = table(runs)
    if runs[0].get("held_out"):
        text += "\n\n" + held_out_table(runs)
    elastic_attention.write_atomic(os.path.join(out_dir, "table.txt"), lambda f: f.write((text + "\n").encode()))
    print("\n" + text)
    print(f"mean ± sd over {len(runs)} seeds in {out_dir}/results.json and table.txt")


def read_run(d):
    """results.json of one train_router.py run folder, or SystemExit with one line saying why not."""
    try:
        with open(os.path.join(d, "results.json"), encoding="utf-8") as f:
            s = json.load(f)
    except (OSError, ValueError) as e:
        reason = "no results.json there" if isinstance(e, FileNotFoundError) else f"its results.json: {e}"
        raise SystemExit(f"error: {d!r} is not a finished train_router.py run folder ({reason})")
    if isinstance(s, dict) and "methods" in s and "runs" in s:
        raise SystemExit(f"error: {d!r} holds the aggregate of {len(s['runs'])} runs, not one run: "
                         f"pass the run folders themselves")
    if not isinstance(s, dict) or not {"settings", "results", "seed"} <= s.keys():
        raise SystemExit(f"error: {d!r}: its results.json is not a train_router.py run's "
                         f"(no settings, results and seed)")
    return s


def is_run_folder(d):
    try:
        with open(os.path.join(d, "results.json"), encoding="utf-8") as f:
            return "settings" in json.load(f)
    except (OSError, ValueError, TypeError):
        return False


if __name__ == "__main__":
    for stream in (sys.stdout, sys.stderr):   # a non-UTF-8 locale prints Ω as \u03a9, not a traceback
        stream.reconfigure(errors="backslashreplace")
    parser = argparse.ArgumentParser(description="Table and plots of train_router.py runs.", allow_abbrev=False)
    parser.add_argument("runs", nargs="+", help="run folders holding results.json")
    parser.add_argument("--out", help="with several runs: where the aggregate goes (default: the first's parent)")
    a = parser.parse_args()
    runs = [read_run(d) for d in a.runs]  # a wrong folder is one line, not a traceback from the plots
    if len(a.runs) == 1:
        plots(runs[0], a.runs[0])
        print_table(runs[0])
    else:
        out = a.out or os.path.dirname(os.path.abspath(a.runs[0]))
        if is_run_folder(out):  # the aggregate's results.json would replace the run's
            raise SystemExit(f"error: --out {out!r} is a run folder; its results.json would be replaced: "
                             f"choose another folder")
        try:
            aggregate(a.runs, out)
        except OSError as e:
            raise SystemExit(f"error: cannot write the aggregate into {out!r}: {e.strerror or e}")
