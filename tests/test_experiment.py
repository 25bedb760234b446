"""The experiment script end to end (a few steps, seconds on CPU), its checkpoints, its bad input,
and the retrieval score it ranks heads by."""
import json
import math
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

import elastic_attention
from elastic_lab import report
from elastic_attention import tasks

try:
    import fcntl
except ImportError:
    fcntl = None
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = ["--backbone-steps", "2", "--steps", "3", "--static-steps", "3", "--eval-per-task", "4", "--batch-size", "5", "--curve-points", "3"]
# Runs on quick_run's backbone that check no scores (and do not resume its router.pt, which would
# refuse another calibration size: eval-per-task sets it): the fewest held-out inputs and curve points.
LATER = ["--steps", "3", "--static-steps", "3", "--eval-per-task", "2", "--batch-size", "5", "--curve-points", "2"]


def run_script(*args, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)  # the script's CPU path never needs the interpreter
    return subprocess.run([sys.executable, os.path.join(ROOT, "train_router.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


# `python train_router.py ARGS` for each ARGS, one after the other in one interpreter: the script
# runs as __main__, and an uncaught SystemExit or exception becomes the exit status and stderr the
# way the interpreter turns it into them.
RUN_MANY = """import gc, io, json, os, runpy, sys, traceback
script, cases, results = sys.argv[1], json.loads(sys.argv[2]), []
sys.path.insert(0, os.path.dirname(script))   # as `python script.py` does
for argv in cases:
    sys.argv = [script, *argv]
    sys.stdout, sys.stderr = (io.TextIOWrapper(io.BytesIO(), encoding="utf-8") for _ in range(2))
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:   # None is 0, an int the status; anything else is printed, status 1
        code = 0 if e.code is None else e.code
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    results.append([code, *(s.flush() or s.buffer.getvalue().decode() for s in (sys.stdout, sys.stderr))])
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    gc.collect()   # closes what a refused run left open, as its process's exit would
print(json.dumps(results))
"""


def run_script_many(cases, timeout=300):
    """run_script(*args) for each args in cases, in one process: a refusal costs milliseconds, not the
    ~3 s a process spends importing torch. Returns one CompletedProcess per case."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", RUN_MANY, os.path.join(ROOT, "train_router.py"), json.dumps(cases)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [subprocess.CompletedProcess(args, code, out, err)
            for args, (code, out, err) in zip(cases, json.loads(proc.stdout), strict=True)]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    # --backbone-steps 2 cuts the one stage given here to 2 steps (of 8 inputs: the default 64 take seconds)
    proc = run_script("--backbone", "train", "--backbone-stages", "256:5:8:3e-3", *QUICK, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_pipeline_writes_sane_outputs(quick_run):
    out, proc = quick_run
    for name in ("results.json", "backbone.pt", "router.pt", "static.pt", "model.pt", "routing_heatmap.png",
                 "omega_per_task.png", "omega_per_input.png", "progressive.png", "training.png"):
        assert (out / name).exists(), name
    for name in ("backbone.pt", "router.pt", "static.pt", "model.pt"):  # plain data: loads without unpickling code
        assert isinstance(torch.load(out / name, weights_only=True), dict), name
    res = json.loads((out / "results.json").read_text())
    assert res["backbone"] == "trained here (2 steps × 8 at 256 tokens)"
    assert set(res["results"]) == {"dense", "elastic", "static", "static_trained", "router_set", "elastic_count",
                                   "oracle", "swap", "all_sparse"}
    for method, per_task in res["results"].items():
        assert set(per_task) == set(tasks.SENSITIVE if method == "swap" else tasks.TASK_NAMES)
        for r in per_task.values():
            assert 0 <= r["score"] <= 1 and 0 <= r["omega_msr"] <= 1 and 0 <= r["omega_esr"] <= 1
    assert all(r["omega_msr"] == 0 and r["omega_esr"] == 0 for r in res["results"]["dense"].values())
    assert all(r["omega_msr"] == 1 for r in res["results"]["all_sparse"].values())
    # Fixed head sets are one choice for every input, deployed by rank at Elastic's mean Ω_MSR over
    # the tasks: the same Ω_MSR on every task, equal to that mean up to one head.
    elastic = sum(r["omega_msr"] for r in res["results"]["elastic"].values()) / len(tasks.TASK_NAMES)
    n_heads = res["settings"]["config"]["n_layers"] * res["settings"]["config"]["n_kv_heads"]
    for method in ("static", "static_trained", "router_set"):
        omegas = {round(r["omega_msr"], 9) for r in res["results"][method].values()}
        assert len(omegas) == 1 and abs(omegas.pop() - elastic) <= 0.5 / n_heads + 1e-9, method
    assert len(res["static_trained_gates"]) == res["settings"]["config"]["n_layers"]
    # Elastic count: Elastic's number of sparse heads for each input, in another order.
    for t in tasks.TASK_NAMES:
        assert res["results"]["elastic_count"][t]["omegas"] == res["results"]["elastic"][t]["omegas"], t
    # The oracle: one set per category, at Elastic's Ω of that category (up to one head).
    for c in ("sensitive", "robust"):
        names = tasks.SENSITIVE if c == "sensitive" else tasks.ROBUST
        want = sum(res["results"]["elastic"][t]["omega_msr"] for t in names) / len(names)
        assert {round(res["results"]["oracle"][t]["omega_msr"], 9) for t in names} == \
            {round(round(want * n_heads) / n_heads, 9)}
    curves = res["progressive"]["256"]
    assert set(curves) == {"score", "router_set", "static_trained"}
    assert all(list(c) == ["0.000", "0.500", "1.000"] for c in curves.values())
    assert len(res["train_log"]) == 3 and len(res["static_log"]) == 3
    # The evaluation stages' progress bars end full: they planned the batches the stages ran.
    assert res["evaluation_batches"]["done"] == res["evaluation_batches"]["planned"]
    assert "stages: 1 backbone" in proc.stdout
    assert len(res["results"]["elastic"]["passkey"]["omegas"]) == 4  # one Ω per held-out input
    per_input = res["results"]["elastic"]["passkey"]["scores"]
    assert len(per_input) == 4 and sum(per_input) / 4 == pytest.approx(res["results"]["elastic"]["passkey"]["score"])
    assert len(res["retrieval_scores"]) == res["settings"]["config"]["n_layers"]
    assert res["hardware"]["torch"] == torch.__version__ and res["wall_time_s"] > 0
    for label in ("Elastic", "static score", "static trained", "all sparse"):
        assert label in proc.stdout
    table = proc.stdout[proc.stdout.index("results:"):proc.stdout.index("outputs in")].splitlines()
    assert max(len(line) for line in table) <= 100, "the table must fit 100 columns"
    # Each step table says which stage it logs; the last line names every file the run wrote.
    assert "routers: step | loss" in proc.stdout and "static gates: step | loss" in proc.stdout
    assert "router.pt, static.pt, backbone.pt, plots" in proc.stdout.splitlines()[-1]


def test_model_pt_routes_an_input_after_the_run(quick_run):
    """The README's "afterwards" recipe: model.pt holds backbone + routers and routes on its own."""
    out, _ = quick_run
    model, _ = elastic_attention.load_checkpoint(str(out / "model.pt"))
    idx = tasks.make_batch(None, 3, 256, 32, 4, seed=5, margin=tasks.relay_margin(4, 32))["tokens"]
    logits, info = model.eval()(idx)
    assert model.routers is not None and len(info["modes"]) == model.cfg.n_layers
    assert all(la is not None for la in info["log_alpha"]) and info["omega_msr"].shape == (3,)


def test_resume_continues_from_the_router_checkpoint(quick_run, tmp_path):
    out, _ = quick_run
    # --deploy count where the run had threshold: deploy acts after training, so resuming is allowed
    proc = run_script("--backbone", str(out / "backbone.pt"), "--resume", str(out / "router.pt"),
                      *QUICK[2:], "--steps", "5", "--no-static", "--deploy", "count", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    log = json.loads((tmp_path / "results.json").read_text())["train_log"]
    assert [r["step"] for r in log] == [0, 1, 2, 3, 4]
    # Each row logs the lr its step used: warm-up to the peak at step 1 (of 3), then the cosine
    # re-planned for 5 steps from where the first run stopped (its own schedule had reached 0).
    peak = log[1]["lr"]
    assert peak > 0 and log[0]["lr"] == pytest.approx(peak / 2)
    assert [r["lr"] for r in log[3:]] == pytest.approx([peak * 0.5 * (1 + math.cos(math.pi * p)) for p in (0.5, 0.75)])


def ctrl_c(args, header=1, sig=signal.SIGINT, at="step | loss", said="interrupted after", group=False):
    """Run the script and press Ctrl-C (or send `sig`) as the `header`-th training loop starts (its
    signal handler is in place once the loop prints its header), or as the `header`-th line holding
    `at` is printed; group=True sends it to the run's whole process group, worker processes included,
    as a terminal's Ctrl-C, `timeout` or a scheduler does. Returns everything the run printed, which
    must hold `said` and no traceback."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_router.py"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=group)
    for line in proc.stdout:
        header -= at in line  # e.g. the header of a training loop (routers: or static gates:)
        if not header:
            break
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    rest, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0 and said in rest and "Traceback" not in rest, rest[-2000:]
    return rest


def test_a_diverging_run_stops_in_one_line(quick_run, tmp_path):
    """A router lr of 1e30 makes log α NaN within a step or two: one error line naming the step."""
    out, _ = quick_run
    proc = run_script("--backbone", str(out / "backbone.pt"), *LATER, "--router-lr", "1e30", "--no-static",
                      "--out", str(tmp_path))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert re.search(r"error: step \d+: the loss is nan", proc.stderr), proc.stderr[-2000:]


def test_sigterm_saves_as_ctrl_c_does_and_says_so_at_any_stage(quick_run, tmp_path):
    """A scheduler's SIGTERM in training saves router.pt and names the --resume that continues it;
    before training (the backbone just loaded) it says there is nothing to continue from."""
    out, _ = quick_run
    args = ["--backbone", str(out / "backbone.pt"), *LATER, "--steps", "100000", "--no-static"]
    said = ctrl_c([*args, "--out", str(tmp_path / "term")], sig=signal.SIGTERM)
    assert f"continue with --resume {tmp_path / 'term' / 'router.pt'}" in said, said[-2000:]
    assert torch.load(tmp_path / "term" / "router.pt", weights_only=True)["step"] >= 1
    ctrl_c([*args, "--out", str(tmp_path / "early")], sig=signal.SIGTERM, at="backbone:",
           said="interrupted (SIGTERM): nothing saved yet")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_process_group_with_batch_workers_saves(quick_run, tmp_path, sig):
    """`timeout`, a scheduler or a terminal's Ctrl-C signal the batch-building worker processes too
    (the GPU default has 4): the workers must leave the stop to the main process, which saves."""
    out, _ = quick_run
    said = ctrl_c(["--backbone", str(out / "backbone.pt"), *LATER, "--steps", "100000", "--no-static",
                   "--data-workers", "2", "--out", str(tmp_path)], sig=sig, at="   0 | ", group=True)
    assert f"continue with --resume {tmp_path / 'router.pt'}" in said, said[-2000:]
    assert torch.load(tmp_path / "router.pt", weights_only=True)["step"] >= 1


def test_sigterm_to_a_seeds_run_reaches_the_child_and_says_how_to_go_on(quick_run, tmp_path):
    """--seeds: a SIGTERM to the parent alone is passed to the running child, which saves; the parent
    then names the seed, its --resume, and no traceback from either process."""
    out, _ = quick_run
    args = ["--backbone", str(out / "backbone.pt"), *LATER, "--steps", "100000", "--no-static",
            "--seeds", "0,1", "--out", str(tmp_path)]
    said = ctrl_c(args, sig=signal.SIGTERM, said="the run with seed 0 stopped")
    assert f"--resume {tmp_path / 'seed0' / 'router.pt'}" in said, said[-2000:]
    assert (tmp_path / "seed0" / "router.pt").exists() and not (tmp_path / "seed1").exists()


def test_ctrl_c_then_resume_equals_the_uninterrupted_run(quick_run, tmp_path):
    """Ctrl-C saves router.pt after the step in flight; --resume continues it bit for bit: the same
    routers, λ, optimizer state and log as a run never interrupted (the gate noise of a step comes
    from the seed and the step, not from the global RNG, whose state the checkpoint lacks)."""
    out, _ = quick_run
    args = ["--backbone", str(out / "backbone.pt"), *LATER, "--steps", "6", "--no-static"]
    said = ctrl_c([*args, "--out", str(tmp_path / "cut")])
    ckpt = torch.load(tmp_path / "cut" / "router.pt", weights_only=True)
    assert 1 <= ckpt["step"] < 6 and len(ckpt["log"]) == ckpt["step"]
    assert ckpt["scheduler"]["last_epoch"] == ckpt["step"]  # the optimizer is exactly that many updates in
    resume = said.split("continue with ")[1].split()  # follow the message
    assert resume == ["--resume", str(tmp_path / "cut" / "router.pt")]
    for name, extra in (("cut", resume), ("whole", [])):
        proc = run_script(*args, *extra, "--out", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr[-3000:]
    cut, whole = (torch.load(tmp_path / name / "router.pt", weights_only=True) for name in ("cut", "whole"))
    assert cut["step"] == whole["step"] == 6
    for a, b in zip(cut["routers"] + [cut["lagrangian"]], whole["routers"] + [whole["lagrangian"]]):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(cut["optimizer"]["state"][i][k], whole["optimizer"]["state"][i][k])
               for i in whole["optimizer"]["state"] for k in whole["optimizer"]["state"][i])
    assert [dict(r, ms=0) for r in cut["log"]] == [dict(r, ms=0) for r in whole["log"]]


def test_ctrl_c_in_the_static_stage_says_what_resumes(quick_run, tmp_path):
    """The static gates are not resumable on their own; the message names what is: router.pt (its
    routers finished), from which --resume reruns the evaluation and the static stage."""
    out, _ = quick_run
    args = ["--backbone", str(out / "backbone.pt"), *LATER, "--out", str(tmp_path)]
    said = ctrl_c([*args, "--static-steps", "100000"], header=2)
    assert "steps of the static gates; the routers are done" in said, said[-2000:]
    resume = said.split("the routers are done: ")[1].split()[:2]
    assert resume == ["--resume", str(tmp_path / "router.pt")]
    proc = run_script(*args, *resume)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(json.loads((tmp_path / "results.json").read_text())["static_log"]) == 3
    # --ranking static trains static gates before the routers: there, nothing is resumable yet
    said = ctrl_c(["--backbone", str(out / "backbone.pt"), *LATER, "--router", "ranked", "--ranking", "static",
                   "--static-steps", "100000", "--out", str(tmp_path / "ranking")])
    assert "steps of the ranking, before the routers: nothing to resume" in said, said[-2000:]


BAD_ARGUMENTS = [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--targets", "1.5,1.0"], "--targets must lie in [0, 1]"),
    (["--targets", "0.7"], "--targets must be two numbers"),
    (["--preset", "huge"], "invalid choice: 'huge'"),
    (["--gate", "coin"], "invalid choice: 'coin'"),
    (["--deploy", "top-k"], "invalid choice: 'top-k'"),
    (["--deploy", "global"], "--deploy global ranks every layer's heads at once, which needs --router ranked"),
    (["--ranking", "static"], "--ranking static fixes the ranking of --router ranked (got mlp)"),
    (["--backbone", "no/such/file.pt"], "not found"),
    (["--resume", "no/such/router.pt"], "not found"),
    (["--resume", ""], "--resume is empty"),
    (["--out", ""], "--out is empty"),
    (["--resume", "tests"], "--resume 'tests' is a folder: give its router.pt"),
    (["--backbone-stages", "256:3:4:inf"], "a finite lr > 0"),
    (["--router-lr", "nan"], "--router-lr must be a finite number > 0, got nan"),
    (["--lambda-lr", "-1"], "--lambda-lr must be a finite number > 0, got -1.0"),
    (["--static-lr", "0"], "--static-lr must be a finite number > 0, got 0.0"),
    (["--static-steps", "0"], "--static-steps must be >= 1"),
    (["--logit-penalty", "-0.1"], "--logit-penalty must be a finite number >= 0, got -0.1"),
    (["--consistency", "-1"], "--consistency must be a finite number >= 0, got -1.0"),
    (["--router-init", "nan"], "--router-init must be a finite number, got nan"),
    (["--clip", "-1"], "--clip must be a finite number > 0, got -1.0"),
    (["--router-norm", "maybe"], "argument --router-norm: expected true or false, got 'maybe'"),
    (["--data-workers", "-1"], "--data-workers must be >= 0, got -1"),
    (["--device", "tpu"], "--device must be cpu, cuda or cuda:N, got 'tpu'"),
    (["--out", "README.md"], "is a file, not a folder"),
    (["--out", "/proc/nope"], "cannot create the output folder"),
    (["--out", "/proc/self"], "cannot write into the output folder"),   # as a read-only folder (root ignores modes)
    (["--backbone", "README.md"], "cannot load the backbone 'README.md'"),
    (["--resume", "tiny_backbone.pt"], "is a model checkpoint"),
    (["--resume", "README.md"], "checkpoint 'README.md' is not a file written by torch.save"),
    (["--seeds", "0"], "--seeds needs at least two distinct seeds"),
    (["--seeds="], "--seeds must be comma-separated integers, got ''"),
    (["--smoke", "--eval-per-task", "10"], "--eval-per-task 10 is not a whole number of evaluation batches of 8"),
    (["--smoke", "--calib-per-task", "10"], "--calib-per-task 10 is not a whole number of evaluation batches of 8"),
    (["--smoke", "--preset", "gpu"], "--smoke is a cut-down tiny preset"),
    (["--extra-families", "recent_date"], "--extra-families adds SmolLM2 task families: it needs --preset smollm2"),
    (["--preset", "smollm2", "--seq-len", "896", "--device", "cpu", "--extra-families", "place"],
     "--extra-families: extra training families must be distinct names from ['recent_date'], got ['place']"),
    (["--decoy-share", "0.2"], "--decoy-share rewords SmolLM2 training prompts: it needs --preset smollm2"),
    (["--count-readout", "probe"], "--count-readout probe fits a direction of the whitened pre-pass: it needs"),
    (["--fail-safe", "0.1"], "--fail-safe moves the count of --router ranked (got mlp)"),
    (["--fail-safe", "1"], "--fail-safe is a point between the calibration medians, in [0, 1), got 1.0"),
    (["--fail-safe", "nan"], "--fail-safe is a point between the calibration medians, in [0, 1), got nan"),
    (["--preset", "smollm2", "--seq-len", "896", "--device", "cpu", "--decoy-share", "1"],
     "--decoy-share must be in [0, 1), got 1.0"),
] + ([(["--device", "cuda:99"], "this machine has cuda:0 to")] if torch.cuda.is_available() else [
    (["--device", "cuda:0"], "no CUDA device is available"),
    (["--preset", "gpu", "--device", "cpu"], "hours on a CPU"),
])


@pytest.fixture(scope="module")
def bad_argument_runs(tmp_path_factory):
    """{args: the run of train_router.py with args} for each of BAD_ARGUMENTS, all in one process."""
    cases = [args + ([] if "--out" in args else ["--out", str(tmp_path_factory.mktemp("bad"))])
             for args, _ in BAD_ARGUMENTS]
    return {tuple(args): proc for (args, _), proc in zip(BAD_ARGUMENTS, run_script_many(cases))}


@pytest.mark.parametrize("args, message", BAD_ARGUMENTS)
def test_bad_arguments_fail_before_training(args, message, bad_argument_runs):
    proc = bad_argument_runs[tuple(args)]
    assert proc.returncode != 0
    assert message in proc.stderr + proc.stdout, (proc.stderr + proc.stdout)[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.skipif(fcntl is None, reason="no fcntl: runs are not locked on this platform")
def test_a_run_folder_belongs_to_one_run(quick_run, tmp_path):
    """Another run's files in --out are refused by name and kept; a folder a live run holds is
    refused; --overwrite replaces the old run whole (none of its files left beside the new ones)."""
    for name in ("results.json", "router.pt", "static.pt"):
        (tmp_path / name).write_text("old")
    out, _ = quick_run
    args = ["--backbone", str(out / "backbone.pt"), *LATER, "--no-static", "--out", str(tmp_path)]
    proc = run_script(*args, timeout=120)
    assert proc.returncode != 0 and "holds another run's results.json, router.pt, static.pt" in proc.stderr, \
        proc.stderr[-2000:]
    assert (tmp_path / "results.json").read_text() == "old"
    with open(tmp_path / ".lock", "w") as held:   # as a run still writing there holds it
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = run_script(*args, "--overwrite", timeout=120)
    assert proc.returncode != 0 and "another run is writing into" in proc.stderr, proc.stderr[-2000:]
    proc = run_script(*args, "--overwrite")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "results.json").read_text())["seed"] == 0
    assert not (tmp_path / "static.pt").exists()   # --no-static: the old run's static gates are gone


def test_presets_change_only_settings_of_the_table_and_flags_reach_them():
    """A preset's typo would be a setting nothing reads: every preset key is in SETTINGS. A flag
    named after a setting overrides the preset's value, booleans as a bare flag or true/false."""
    import train_router
    for name, preset in train_router.PRESETS.items():
        assert set(preset) <= set(train_router.SETTINGS), (name, set(preset) - set(train_router.SETTINGS))
    argv = ["--abs-lagrangian", "--router-norm", "false", "--clip", "2", "--targets", "auto,0.9", "--steps", "7"]
    P, targets = train_router.settings_from(train_router.build_parser().parse_args(argv))
    assert (P["abs_lagrangian"], P["router_norm"], P["clip"], P["steps"]) == (True, False, 2.0, 7)
    assert targets == P["targets"] == ["auto", 0.9]
    P, _ = train_router.settings_from(train_router.build_parser().parse_args(["--preset", "gpu", "--seq-len", "512",
                                                                                 "--device", "cpu"]))
    assert (P["router"], P["lambda_lr"], P["eval_seq_lens"]) == ("ranked", 6e-2, (512,))   # the preset's, scaled


@pytest.mark.parametrize("argv, deploy", [([], "threshold"), (["--deploy", "count"], "count"),
                                          (["--deploy", "global", "--router", "ranked"], "global")])
def test_deploy_rule_reaches_the_model_config(argv, deploy):
    import train_router
    args = train_router.build_parser().parse_args(argv)
    P, _ = train_router.settings_from(args)
    _, _, cfg = train_router.load_suite(P, args, 0, 1)
    assert P["deploy"] == cfg.deploy == deploy


def test_resume_refuses_other_settings(quick_run, tmp_path):
    """--resume with other targets / learning rates / gate / calibration size would silently keep the
    saved ones (with --targets auto the calibration size sets the sensitive target). A router.pt saved
    before count_readout existed resumes: its readout was the trained one."""
    out, _ = quick_run
    changes = (("--targets", "0.5,1.0"), ("--router-lr", "1e-3"), ("--lambda-lr", "1e-3"),
               ("--lambda-schedule", "constant"), ("--gate", "gumbel"), ("--calib-per-task", "2"))
    old = torch.load(out / "router.pt", map_location="cpu", weights_only=False)   # as saved before --count-readout
    del old["settings"]["count_readout"]
    torch.save(old, tmp_path / "old_router.pt")
    procs = run_script_many([["--backbone", str(out / "backbone.pt"), "--resume", str(out / "router.pt"), *QUICK[2:],
                              flag, value, "--out", str(tmp_path / flag[2:])] for flag, value in changes]
                            + [["--backbone", str(out / "backbone.pt"), "--resume", str(tmp_path / "old_router.pt"),
                                *QUICK[2:], "--out", str(tmp_path / "old")]])
    for (flag, value), proc in zip(changes, procs):
        assert proc.returncode != 0 and "was trained with other settings" in proc.stderr, (flag, proc.stderr[-1500:])
    assert procs[-1].returncode == 0, procs[-1].stderr[-1500:]   # a setting it predates takes the one it had


def test_resume_refuses_other_backbones_lengths_and_files(quick_run, pickle_payload, tmp_path):
    """router.pt records what its routers were trained on; --resume names each difference, and a file
    that is no router.pt gets one line saying what it is (no traceback, no code run from it)."""
    out, _ = quick_run
    good = torch.load(out / "router.pt", weights_only=True)
    torch.save({k: v for k, v in good.items() if k != "lagrangian"}, tmp_path / "no-lambda.pt")
    torch.save(dict(good, step="30"), tmp_path / "step-text.pt")
    torch.save(dict(good, step=-10), tmp_path / "step-negative.pt")
    (tmp_path / "cut.pt").write_bytes((out / "router.pt").read_bytes()[:5000])
    evil = pickle_payload[0](tmp_path / "evil.pt", ["config", "model", *good])
    backbone = ["--backbone", str(out / "backbone.pt")]
    cases = (
            (["--resume", str(out / "router.pt")], "backbone_sha256 saved"),           # the shipped backbone
            ([*backbone, "--resume", str(out / "router.pt"), "--seq-len", "320"], "seq_len saved 256, now 320"),
            ([*backbone, "--resume", str(out / "router.pt"), "--steps", "2"], "has run 3 steps, more than --steps 2"),
            ([*backbone, "--resume", str(tmp_path / "no-lambda.pt")], "expected a dict with the keys"),
            ([*backbone, "--resume", str(tmp_path / "step-text.pt")], "its step must be a whole number >= 0, got '30'"),
            ([*backbone, "--resume", str(tmp_path / "step-negative.pt")], "its step must be a whole number >= 0, got -10"),
            ([*backbone, "--resume", str(tmp_path / "cut.pt")], "a torch file that is truncated or damaged"),
            ([*backbone, "--resume", evil], "could run code"),
            (["--backbone", evil], "could run code"))
    procs = run_script_many([[*QUICK[2:], *args, "--out", str(tmp_path / f"run{i}")] for i, (args, _) in enumerate(cases)])
    for (args, message), proc in zip(cases, procs):
        assert proc.returncode != 0 and message in proc.stderr, (args, proc.stderr[-1500:])
        assert "Traceback" not in proc.stderr and proc.stderr.count("error:") == 1, proc.stderr[-1500:]
    assert not os.path.exists(pickle_payload[1])


def test_small_batches_still_train_every_task():
    """Batch 2 with 5 tasks: consecutive batches continue the cycle, so 5 samples see all 5 tasks."""
    seen = [name for index in range(3) for name in tasks.rotate(tasks.TASK_NAMES, index, 2)]
    assert seen[:5] == tasks.TASK_NAMES and seen[5] == tasks.TASK_NAMES[0]
    b = tasks.make_batch(tasks.rotate(tasks.TASK_NAMES, 1, 2), 2, 256, 32, 4, seed=0)
    assert sorted(b["task_ids"].tolist()) == [2, 3]


def test_routing_reads_the_prompt_only(quick_run):
    """The routers decide from tokens[:query_pos + 1], exactly as at deployment: routing a training
    input (prompt + answers) with prompt_lengths gives the decisions of routing its prompt alone."""
    out, _ = quick_run
    model, _ = elastic_attention.load_checkpoint(str(out / "model.pt"))
    model.eval()
    b = tasks.make_batch(None, 10, 256, 32, 4, seed=11, margin=tasks.relay_margin(4, 32))
    with torch.no_grad():
        _, whole = model(b["tokens"], prompt_lengths=b["query_pos"] + 1)
        for i in range(10):
            prompt = b["tokens"][i:i + 1, :b["query_pos"][i] + 1]
            _, alone = model(prompt)
            for la_whole, la_alone in zip(whole["log_alpha"], alone["log_alpha"]):
                torch.testing.assert_close(la_whole[i:i + 1], la_alone, rtol=1e-4, atol=1e-5)
            for m_whole, m_alone in zip(whole["modes"], alone["modes"]):
                assert torch.equal(m_whole[i:i + 1], m_alone)
        _, leaky = model(b["tokens"])  # pooling the answers too: the decisions are not the same input's
    assert any(not torch.allclose(a, c) for a, c in zip(whole["log_alpha"], leaky["log_alpha"]))


def test_elastic_count_on_the_routers_own_ranking_is_elastic(tmp_path):
    """Ranked routers deployed by one global count decide two things per input: how many heads go
    sparse, and (from one shared ranking) which. on_order with that ranking must give back exactly
    Elastic's modes, scores and Ω, batch by batch: so "Elastic count" on another order changes only
    which heads. Random ranking and a strong count router, so inputs get different counts."""
    sys.path.insert(0, ROOT)
    import train_router as tr
    args = tr.build_parser().parse_args(["--router", "ranked", "--deploy", "global", "--eval-per-task", "8",
                                         "--out", str(tmp_path)])
    P, _ = tr.settings_from(args)
    P["eval_batch"] = 4                                              # two batches per task: the offsets matter
    suite, _, cfg = tr.load_suite(P, args, 0, 1)
    model, _ = elastic_attention.load_checkpoint(P["backbone"], cfg, map_location="cpu")
    torch.manual_seed(0)
    model.attach_routers(ranked=True)
    run = tr.Run(P, args, torch.device("cpu"), suite, str(tmp_path))
    model.eval()
    tr.fit_router_inputs(run, model)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.router.log_alpha.normal_(0, 0.5)
        last, first = model.shift_router.router_mlp[-1], model.layers[0]
        last.weight.mul_(3e4)                                            # shifts of ±1 or so between inputs,
        b = run.held_out(suite.names[0], 0, split="calib")
        k = first.self_attn.router_keys(first.input_layernorm(model.embed_tokens(b["tokens"])))
        last.bias -= model.shift_router(k, b["prompt_lengths"]).mean()   # around no shift
    elastic = tr.evaluate(run, model)
    assert len({w for r in elastic.values() for w in r["omegas"]}) > 2, "the counts should differ between inputs"
    ranking = torch.stack([layer.self_attn.router.log_alpha.detach() for layer in model.layers]).flatten()
    again = tr.evaluate(run, model, tr.on_order(run, model, ranking.argsort(stable=True), elastic))
    for t in suite.names:
        for key in ("scores", "omegas", "full_frac"):
            assert again[t][key] == elastic[t][key], (t, key)


def test_a_fixed_ranking_stays_fixed_while_the_count_router_trains(tmp_path, monkeypatch):
    """--ranking static: the ranked routers' per-head logits are given (here random) and stay
    exactly so through training; the count router alone is optimised, and it moves."""
    sys.path.insert(0, ROOT)
    import train_router as tr
    args = tr.build_parser().parse_args(["--router", "ranked", "--ranking", "static", "--steps", "3",
                                         "--batch-size", "4", "--out", str(tmp_path)])
    P, _ = tr.settings_from(args)
    suite, _, cfg = tr.load_suite(P, args, 0, 1)
    model, _ = elastic_attention.load_checkpoint(P["backbone"], cfg, map_location="cpu")
    run = tr.Run(P, args, torch.device("cpu"), suite, str(tmp_path))
    start, build = [], tr.router_lib.build_optimizer
    def snapshot(params, *a, **kw):   # the count router as training starts
        start.extend(p.detach().clone() for p in params)
        return build(params, *a, **kw)
    monkeypatch.setattr(tr.router_lib, "build_optimizer", snapshot)
    torch.manual_seed(0)
    ranking = [torch.randn(cfg.n_kv_heads) for _ in range(cfg.n_layers)]
    _, params = tr.train_gates(run, model, tr.router_settings(run, model, [0.7, 1.0]), False,
                               [0.7] * len(suite.tasks), str(tmp_path / "router.pt"), ranking=ranking)
    for r, logits in zip(model.routers, ranking):
        assert torch.equal(r.log_alpha.detach(), logits) and not r.log_alpha.requires_grad
    assert {id(p) for p in params} == {id(p) for p in model.shift_router.parameters()}
    assert len(start) == len(params) and any(not torch.equal(a, b) for a, b in zip(start, params))


def test_backbone_stages_train_shortest_first(tmp_path):
    """The gpu preset's length curriculum, at CPU size: 2 steps on 128-token inputs, then 2 on 256."""
    proc = run_script("--backbone", "train", "--backbone-stages", "128:2:4:3e-3,256:2:4:1e-3", *LATER,
                      "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "backbone 128 tokens" in proc.stderr and "backbone 256 tokens" in proc.stderr  # tqdm bars
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["backbone"] == "trained here (2 steps × 4 at 128 tokens, 2 steps × 4 at 256 tokens)"
    ckpt = torch.load(tmp_path / "backbone.pt", weights_only=True)
    assert ckpt["stages"] == [(128, 2, 4, 3e-3), (256, 2, 4, 1e-3)]


BAD_STAGES = [
    ("256-2-4-1e-3", "must look like 'tokens:steps:batch:lr"),
    ("512:2:4:1e-3", "needs 1 <= tokens <= 256"),
    ("256:0:4:1e-3", "steps >= 1"),
    ("64:2:4:1e-3", "too short for the tasks"),
]


@pytest.fixture(scope="module")
def bad_stage_runs(tmp_path_factory):
    """{stages: (the run with --backbone-stages stages, its --out)} for BAD_STAGES, in one process."""
    outs = [tmp_path_factory.mktemp("stages") for _ in BAD_STAGES]
    procs = run_script_many([["--backbone", "train", "--backbone-stages", stages, "--out", str(out)]
                             for (stages, _), out in zip(BAD_STAGES, outs)])
    return {stages: (proc, out) for (stages, _), proc, out in zip(BAD_STAGES, procs, outs)}


@pytest.mark.parametrize("stages, message", BAD_STAGES)
def test_bad_backbone_stages_fail_before_training(stages, message, bad_stage_runs):
    proc, out = bad_stage_runs[stages]
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert not (out / "backbone.pt").exists()


def test_backbone_of_another_config_is_refused(tmp_path):
    other = elastic_attention.Transformer(elastic_attention.Config.shape("tiny", vocab_size=tasks.VOCAB_SIZE, dim=64))
    elastic_attention.save_checkpoint(str(tmp_path / "other.pt"), other)
    proc = run_script("--backbone", str(tmp_path / "other.pt"), *LATER, "--out", str(tmp_path), timeout=60)
    assert proc.returncode != 0 and "different config" in proc.stderr


def test_checkpoint_round_trip_with_routers(tmp_path):
    cfg = elastic_attention.Config.shape("tiny", vocab_size=tasks.VOCAB_SIZE, n_layers=2)
    model = elastic_attention.Transformer(cfg)
    model.attach_routers()
    elastic_attention.save_checkpoint(str(tmp_path / "m.pt"), model, step=7)
    loaded, ckpt = elastic_attention.load_checkpoint(str(tmp_path / "m.pt"), cfg)
    assert ckpt["step"] == 7 and loaded.routers is not None
    idx = torch.randint(0, tasks.VOCAB_SIZE, (2, 40))
    a, ia = model.eval()(idx)
    b, ib = loaded.eval()(idx)
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ia["log_alpha"], ib["log_alpha"]))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        elastic_attention.load_checkpoint(str(tmp_path / "missing.pt"))


def test_retrieval_score_on_a_hand_made_pattern():
    """Two layers, four query heads sharing two KV heads, needles at 3 and 7 for sample 0 and
    at 5 for sample 1: the score is the needle mass, averaged over a KV head's query heads and
    over samples."""
    L, B, Hq, S = 2, 2, 4, 10
    rows = torch.zeros(L, B, Hq, S)
    rows[0, 0, 0, 3], rows[0, 0, 0, 0] = 0.6, 0.4    # layer 0, head 0: 0.6 on a needle
    rows[0, 0, 1, 7] = 1.0                           # head 1 (same KV head 0): 1.0 on a needle
    rows[0, 1, 0, 5] = 0.5                           # sample 1, head 0: 0.5 on its needle
    rows[1, :, 3, 9] = 1.0                           # layer 1, head 3: all mass off the needles
    needle_pos = torch.tensor([[3, 7, -1], [5, -1, -1]])
    scores = tasks.retrieval_scores(rows, needle_pos, n_kv_heads=2)
    want = torch.zeros(L, 2)
    want[0, 0] = ((0.6 + 1.0) / 2 + (0.5 + 0.0) / 2) / 2
    torch.testing.assert_close(scores, want)


def test_shipped_backbone_solves_every_task_dense():
    """The premise of the experiment: the shipped tiny backbone, all heads FULL, answers ≥ 95 % of
    held-out answer tokens on every task (samples the script never evaluates on)."""
    cfg = elastic_attention.Config.shape("tiny", vocab_size=tasks.VOCAB_SIZE)
    model, ckpt = elastic_attention.load_checkpoint(os.path.join(ROOT, "tiny_backbone.pt"), cfg)
    for task in tasks.TASKS:
        b = tasks.make_batch([task.name], 64, 256, cfg.window, cfg.sink, seed=tasks.split_seed("eval", 99_000 + task.task_id),
                         margin=tasks.relay_margin(cfg.n_layers, cfg.window))
        with torch.no_grad():
            logits, _ = model(b["tokens"])
        acc = tasks.token_accuracy(logits, b["targets"]).mean().item()
        assert acc >= 0.95, f"{task.name}: dense accuracy {acc:.3f}"


@pytest.mark.parametrize("router", ["mlp", "ranked"])
def test_two_processes_train_the_same_routers_as_one(tmp_path, router):
    """torchrun with 2 processes (gloo, CPU): each rank trains on its shard of the same global batch,
    so the routers end identical on both ranks and equal to a one-process run of that batch. The
    two-process run builds its batches in a worker process (--data-workers 1, the GPU default's
    path), the one-process run in place: the same batches either way. Both train a backbone first,
    which the ranks then share (rank 0's)."""
    common = ["--steps", "3", "--batch-size", "4", "--eval-per-task", "4", "--no-static", "--curve-points", "2",
              "--router", router, "--backbone", "train", "--backbone-stages", "256:2:8:3e-3"]
    one = run_script(*common, "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-3000:]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          os.path.join(ROOT, "train_router.py"), *common, "--data-workers", "1",
                          "--out", str(tmp_path / "two")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    res = json.loads((tmp_path / "two" / "results.json").read_text())
    assert res["world_size"] == 2 and res["max_param_diff_between_ranks"] == {"routers": 0.0}
    assert res["backbone_same_on_every_rank"] is True   # rank 0's trained backbone, broadcast
    a = torch.load(tmp_path / "one" / "router.pt", weights_only=True)
    b = torch.load(tmp_path / "two" / "router.pt", weights_only=True)
    assert (a["shift_router"] is None) == (b["shift_router"] is None) == (router == "mlp")
    for ra, rb in zip(a["routers"] + [a["shift_router"] or {}], b["routers"] + [b["shift_router"] or {}]):
        for name in ra:
            torch.testing.assert_close(ra[name], rb[name], rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(a["lagrangian"]["lambda1"], b["lagrangian"]["lambda1"], rtol=1e-5, atol=1e-7)
    # Evaluation is split over the ranks and gathered: the same held-out scores.
    res_one = json.loads((tmp_path / "one" / "results.json").read_text())
    for method in ("dense", "elastic"):
        for task, r in res_one["results"][method].items():
            for stat in ("score", "omega_msr", "omega_esr"):
                assert r[stat] == pytest.approx(res["results"][method][task][stat], abs=1e-6), (method, task, stat)



@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("router", ["mlp", "ranked"])
def test_graphed_steps_train_what_eager_steps_train(tmp_path, router):
    """On one GPU each training step replays a CUDA graph (elastic_lab.runs.StepGraph): the same log and
    routers as --eager, op by op. Batches of 2 rotate the tasks, so the answer length K (a batch's
    shape) changes between steps, and the step is recorded afresh; the static stage records its own."""
    common = ["--device", "cuda", "--backend", "auto", "--router", router, "--steps", "8", "--static-steps", "4",
              "--batch-size", "2", "--eval-per-task", "4", "--curve-points", "2"]
    eager = run_script(*common, "--eager", "--out", str(tmp_path / "eager"))
    graph = run_script(*common, "--out", str(tmp_path / "graph"))
    assert eager.returncode == 0 and graph.returncode == 0, eager.stderr[-3000:] + graph.stderr[-3000:]
    logs = [json.loads((tmp_path / d / "results.json").read_text()) for d in ("eager", "graph")]
    for key in ("train_log", "static_log"):
        for a, b in zip(logs[0][key], logs[1][key], strict=True):
            for stat in ("loss", "omega_sensitive", "omega_robust", "lambda1_sensitive", "gate_active"):
                assert a[stat] == pytest.approx(b[stat], rel=1e-5, abs=1e-6, nan_ok=True), (key, a["step"], stat)
    a, b = (torch.load(tmp_path / d / "router.pt", weights_only=True) for d in ("eager", "graph"))
    for ra, rb in zip(a["routers"] + [a["shift_router"] or {}], b["routers"] + [b["shift_router"] or {}],
                      strict=True):
        for name in ra:
            torch.testing.assert_close(ra[name], rb[name], rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(a["lagrangian"]["lambda1"], b["lagrangian"]["lambda1"], rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_replay_graphs_and_train_what_eager_steps_train(tmp_path):
    """torchrun on two GPUs: each process replays its shard's step as a CUDA graph and the gradients
    are summed after the replay; the routers and λ end as with --eager, and equal on both ranks."""
    common = ["--device", "cuda", "--backend", "auto", "--router", "ranked", "--steps", "8", "--batch-size", "4",
              "--eval-per-task", "4", "--no-static", "--curve-points", "2"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    for name, extra in (("graph", []), ("eager", ["--eager"])):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               os.path.join(ROOT, "train_router.py"), *common, *extra, "--out", str(tmp_path / name)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        res = json.loads((tmp_path / name / "results.json").read_text())
        assert res["world_size"] == 2 and res["max_param_diff_between_ranks"] == {"routers": 0.0}
        assert res["backbone_same_on_every_rank"] is True
    a, b = (torch.load(tmp_path / d / "router.pt", weights_only=True) for d in ("graph", "eager"))
    for ra, rb in zip(a["routers"] + [a["shift_router"]], b["routers"] + [b["shift_router"]], strict=True):
        for name in ra:
            torch.testing.assert_close(ra[name], rb[name], rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(a["lagrangian"]["lambda1"], b["lagrangian"]["lambda1"], rtol=1e-5, atol=1e-7)


def test_seeds_run_one_process_each_and_aggregate(tmp_path):
    """--seeds: one run per seed in <out>/seed<N>, then mean ± sd over them in <out>/results.json."""
    proc = run_script("--seeds", "0,1", "--steps", "2", "--eval-per-task", "2", "--batch-size", "2",
                      "--curve-points", "2", "--no-static", "--out", str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [json.loads((tmp_path / f"seed{s}" / "results.json").read_text()) for s in (0, 1)]
    assert [r["seed"] for r in runs] == [0, 1]
    agg = json.loads((tmp_path / "results.json").read_text())
    assert agg["seeds"] == [0, 1] and "mean±sd" in (tmp_path / "table.txt").read_text()
    for task, stats in agg["methods"]["elastic"].items():
        scores = [r["results"]["elastic"][task]["score"] for r in runs]
        assert stats["score"]["mean"] == pytest.approx(sum(scores) / 2)
        assert stats["score"]["sd"] == pytest.approx(abs(scores[0] - scores[1]) / 2 ** 0.5)
    # report.py refuses runs it cannot pair by seed, and a method one run lacks is left out, named
    with pytest.raises(SystemExit, match=r"repeat a seed \(\[0, 0\]\)"):
        report.aggregate([str(tmp_path / "seed0")] * 2, str(tmp_path / "again"))
    other = dict(runs[1], settings=dict(runs[1]["settings"], steps=3))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "results.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="was run with other settings than .*: steps"):
        report.aggregate([str(tmp_path / "seed0"), str(tmp_path / "other")], str(tmp_path / "again"))
    del runs[1]["results"]["swap"]
    assert "not in every run, left out: swap" in report.table(runs)   # not a KeyError


def test_report_margins_pair_elastic_with_each_head_set_by_seed():
    """The closing block of a several-seed table: Elastic minus each head set on the sensitive
    accuracy tasks, paired by seed, with the mean in sd units; a method a run lacks is left out."""
    tasks = {"far": "sensitive", "near": "sensitive", "text": "robust"}
    metrics = {"far": "accuracy", "near": "accuracy", "text": "nll"}

    def run(elastic, static, static_long):
        res = lambda far, near: {"far": {"score": far}, "near": {"score": near}, "text": {"score": 3.0}}
        return dict(tasks=tasks, metrics=metrics, results={
            "elastic": res(*elastic), "static": res(*static), "router_set": res(*elastic),
            "elastic@8": res(*elastic), "static@8": res(*static_long)})

    runs = [run((1.0, 0.9), (0.5, 0.8), (0.2, 0.9)), run((1.0, 0.8), (0.7, 0.8), (0.4, 0.8)),
            run((0.9, 1.0), (0.6, 0.9), (0.3, 1.0))]
    lines = report.margins(runs)
    assert lines[1].split() == ["method", "far", "near", "sensitive", "mean"]
    # far: +50, +30, +30 points -> +36.7 ± 11.5 (3.2); near: +10, 0, +10 -> +6.7 ± 5.8 (1.2);
    # their mean per seed: +30, +15, +20 -> +21.7 ± 7.6 (2.8)
    assert lines[2].split() == ["static", "score", "+36.7±11.5", "(3.2)", "+6.7±5.8", "(1.2)", "+21.7±7.6", "(2.8)"]
    assert lines[3].split() == ["Elastic's", "set", "+0.0±0.0", "+0.0±0.0", "+0.0±0.0"]
    assert lines[4] == "evaluated at 8 tokens:"
    # at 8: far +80, +60, +60; near 0, 0, 0
    assert lines[5].split() == ["static", "score", "+66.7±11.5", "(5.8)", "+0.0±0.0", "+33.3±5.8", "(5.8)"]
    assert len(lines) == 6  # no oracle, no trained static gates, no router_set@8 in these runs


def test_report_held_out_table_gap_auc_and_paired_sign_test():
    """The held-out block: per condition Elastic's category gap (robust minus sensitive Ω_MSR) and
    per-input AUC, every method per family, and Elastic minus each method on the sensitive families
    with the per-input sign test pooled over seeds."""
    assert report.auc([0.1, 0.2], [0.9, 0.8]) == 1.0 and report.auc([0.9], [0.1]) == 0.0
    assert report.auc([0.5, 0.1], [0.5, 0.9]) == 0.875            # one tie of four pairs counts half
    assert report.sign_test(0, 0) == 1.0 and report.sign_test(5, 0) == pytest.approx(2 / 32)
    assert report.sign_test(3, 3) == 1.0

    def run(e_far, s_far, omegas):
        res = lambda scores, w_far, w_near: {
            "far": dict(score=sum(scores) / len(scores), scores=scores, omega_msr=w_far, omegas=[w_far] * len(scores)),
            "near": dict(score=1.0, scores=[1.0, 1.0], omega_msr=w_near, omegas=[w_near] * 2)}
        return dict(tasks={"far": "sensitive"}, held_out_tasks={"near": "robust"},
                    metrics={"far": "accuracy", "near": "accuracy"},
                    held_out={"families": {"elastic": res(e_far, *omegas), "static": res(s_far, 0.7, 0.7)}})

    runs = [run([1.0, 1.0], [0.0, 1.0], (0.4, 0.9)), run([1.0, 0.0], [0.0, 0.0], (0.5, 0.9))]
    text = report.held_out_table(runs)
    assert "families: Elastic category gap 0.45±0.07, per-input AUC 1.00±0.00" in text
    # Elastic − static on "far": +50, +50 points; inputs: seed 0 one win, seed 1 one win -> +2/-0
    assert "static score +50.0±0.0 (+2/-0, p 0.5)" in text
