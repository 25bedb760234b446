"""report.py — what train_router.py shows you: the results table, the four plots, the hardware line,
and the mean ± sd over seeds (`train_router.py --seeds`). Nothing here changes a number; it only
reads results.json files.

    python report.py runs/tiny-FA-SSA-seed0                    # table + plots of one run again
    python report.py runs/tiny-FA-SSA/seed0 runs/tiny-FA-SSA/seed1 --out runs/tiny-FA-SSA   # aggregate

Scores: accuracy in % of answer tokens (synthetic tasks) or of exact answers (real-text tasks), or
a next-token NLL in nats for tasks whose metric is "nll" (lower is better).
"""
import argparse
import json
import os
import platform
import statistics

if __name__ == "__main__":  # as a command: OpenMP threads that sleep when idle (read as torch loads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

METHODS = [("dense", "dense"), ("elastic", "Elastic"), ("static", "static score"),
           ("static_trained", "static trained"), ("all_sparse", "all sparse")]


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
    order = {m: i for i, (m, _) in enumerate(METHODS)}
    keys.sort(key=lambda k: (len(k.split("@")), k.split("@")[-1] if "@" in k else "", order[k.split("@")[0]]))
    for key in keys:
        if "@" in key and key.startswith("dense@"):   # a longer evaluation length: its own block
            lines.append(f"evaluated at {key.split('@')[1]} tokens:")
        cells = "".join(f"{_fmt(metrics[t], [r['results'][key][t]['score'] for r in runs], [r['results'][key][t]['omega_msr'] for r in runs]):<{width - 1}} "
                        for t in tasks)
        esr = statistics.mean(statistics.mean(v["omega_esr"] for v in r["results"][key].values()) for r in runs)
        lines.append(f"{dict(METHODS)[key.split('@')[0]]:<15}{cells}{esr:.2f}")
    return "\n".join(lines)


def print_table(summary):
    print("\n" + table([summary]))


# -----------------------------------------------------------------------------
# Plots (matplotlib, headless).

def plots(summary, out_dir):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots")
        return
    res, tasks, cats, metrics = summary["results"], list(summary["tasks"]), summary["tasks"], summary["metrics"]
    targets = dict(zip(("sensitive", "robust"), summary["settings"]["targets"]))
    title = f"{summary['preset']} {summary['settings']['config']['head_config']}, seed {summary['seed']}"

    # 1. Which heads each task keeps FULL (paper Fig. 6).
    frac = [torch.tensor(res["elastic"][t]["full_frac"]) for t in tasks]      # (L, Hkv) each
    L, H = frac[0].shape
    fig, axes = plt.subplots(1, len(tasks), figsize=(1.2 + (0.9 + 0.35 * H) * len(tasks), 1.6 + 0.16 * L),
                             sharey=True, squeeze=False, constrained_layout=True)
    for ax, t, f in zip(axes[0], tasks, frac):
        im = ax.imshow(f, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_title(f"{t}\n({cats[t]})", fontsize=9)
        ax.set_xticks(range(H))
        ax.set_xlabel("KV head")
    axes[0][0].set_ylabel("layer")
    axes[0][0].set_yticks(range(0, L, max(1, L // 8)))
    fig.colorbar(im, ax=axes[0].tolist(), label="fraction of inputs routed FULL", shrink=0.9)
    fig.suptitle(f"Elastic routing per task — {title}", fontsize=10)
    fig.savefig(os.path.join(out_dir, "routing_heatmap.png"), dpi=110)

    # 2. Sparsity per task, with the targets the routers were given.
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
    fig.savefig(os.path.join(out_dir, "omega_per_task.png"), dpi=110)

    # 3. Progressive sparsification (paper Fig. 2 / Table 5) with the operating points of Elastic
    # and both static baselines: does the router beat a static choice at equal Ω_MSR?
    curve = summary["progressive"][str(summary["experiment"]["seq_len"])]
    xs = [float(k) for k in curve]

    def rel(t, value):  # relative to dense; NLL inverted so that 1 = as good as dense, lower = worse
        dense = res["dense"][t]["score"]
        return dense / value if metrics[t] == "nll" else value / max(dense, 1e-9)

    groups = [c for c in ("sensitive", "robust") if any(cats[t] == c for t in tasks)]
    fig, axes = plt.subplots(1, len(groups), figsize=(5.2 * len(groups), 3.8), squeeze=False, sharey=True,
                             constrained_layout=True)
    markers = "osD^v"
    for ax, group in zip(axes[0], groups):
        for i, t in enumerate(t for t in tasks if cats[t] == group):
            color = f"C{tasks.index(t)}"
            ax.plot(xs, [rel(t, curve[k][t]) for k in curve], color=color, marker=markers[i % 5], ms=4,
                    ls=["-", "--", ":", "-."][i % 4], lw=1.2, label=f"{t}: static by retrieval score")
            ax.plot(res["elastic"][t]["omega_msr"], rel(t, res["elastic"][t]["score"]), marker="*", ms=14,
                    color=color, mec="k", ls="none", label=f"{t}: Elastic")
            if "static_trained" in res:
                ax.plot(res["static_trained"][t]["omega_msr"], rel(t, res["static_trained"][t]["score"]),
                        marker="X", ms=10, color=color, mec="k", ls="none", label=f"{t}: trained static")
        ax.set_title(f"{group} tasks", fontsize=10)
        ax.set_xlabel("Ω_MSR (fraction of KV heads sparse)")
        ax.set_xlim(-0.03, 1.03)
        ax.legend(fontsize=7, loc="lower left")
    axes[0][0].set_ylabel("score / dense score")
    fig.suptitle(f"Accuracy vs sparsity — {title}", fontsize=10)
    fig.savefig(os.path.join(out_dir, "progressive.png"), dpi=110)

    # 4. Training curves.
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
    fig.savefig(os.path.join(out_dir, "training.png"), dpi=110)
    plt.close("all")


# -----------------------------------------------------------------------------
# Seeds.

def aggregate(run_dirs, out_dir):
    """Read results.json of each run, print the mean ± sd table, write out_dir/results.json."""
    runs = []
    for d in run_dirs:
        with open(os.path.join(d, "results.json")) as f:
            runs.append(json.load(f))
    keys = [k for k in runs[0]["results"] if all(k in r["results"] for r in runs)]
    summary = dict(runs=run_dirs, seeds=[r["seed"] for r in runs], hardware=runs[0]["hardware"], methods={})
    for key in keys:
        summary["methods"][key] = {
            t: {stat: dict(mean=statistics.mean(r["results"][key][t][stat] for r in runs),
                           sd=statistics.stdev(r["results"][key][t][stat] for r in runs))
                for stat in ("score", "omega_msr", "omega_esr", "omega_esr_last")}
            for t in runs[0]["tasks"]}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(summary, f, indent=1)
    text = table(runs)
    with open(os.path.join(out_dir, "table.txt"), "w") as f:
        f.write(text + "\n")
    print("\n" + text)
    print(f"mean ± sd over {len(runs)} seeds in {out_dir}/results.json and table.txt")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Table and plots of train_router.py runs.", allow_abbrev=False)
    parser.add_argument("runs", nargs="+", help="run folders holding results.json")
    parser.add_argument("--out", help="with several runs: where the aggregate goes (default: the first's parent)")
    a = parser.parse_args()
    for d in a.runs:  # a wrong folder is one line, not a traceback from deep inside the plots
        try:
            with open(os.path.join(d, "results.json")) as f:
                json.load(f)
        except (OSError, ValueError) as e:
            reason = "no results.json there" if isinstance(e, FileNotFoundError) else f"its results.json: {e}"
            raise SystemExit(f"error: {d!r} is not a finished train_router.py run folder ({reason})")
    if len(a.runs) == 1:
        with open(os.path.join(a.runs[0], "results.json")) as f:
            s = json.load(f)
        plots(s, a.runs[0])
        print_table(s)
    else:
        aggregate(a.runs, a.out or os.path.dirname(os.path.abspath(a.runs[0])))
