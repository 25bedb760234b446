"""The experiment script end to end (a few steps, seconds on CPU), its checkpoints, its bad input,
and the retrieval score it ranks heads by."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import elastic_attention as E
import tasks as T

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = ["--backbone-steps", "2", "--steps", "3", "--eval-per-task", "4", "--batch-size", "5"]


def run_script(*args, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)  # the script's CPU path never needs the interpreter
    return subprocess.run([sys.executable, os.path.join(ROOT, "train_router.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    proc = run_script("--backbone", "train", *QUICK, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_pipeline_writes_sane_outputs(quick_run):
    out, proc = quick_run
    for name in ("results.json", "backbone.pt", "router.pt", "routing_heatmap.png", "omega_per_task.png",
                 "progressive.png", "training.png"):
        assert (out / name).exists(), name
    res = json.loads((out / "results.json").read_text())
    assert set(res["results"]) == {"dense", "elastic", "static", "all_sparse"}
    for method, per_task in res["results"].items():
        assert set(per_task) == set(T.TASK_NAMES)
        for r in per_task.values():
            assert 0 <= r["accuracy"] <= 1 and 0 <= r["omega_msr"] <= 1 and 0 <= r["omega_esr"] <= 1
    assert all(r["omega_msr"] == 0 and r["omega_esr"] == 0 for r in res["results"]["dense"].values())
    assert all(r["omega_msr"] == 1 for r in res["results"]["all_sparse"].values())
    assert len(res["progressive"]) == 11 and len(res["train_log"]) == 3
    assert len(res["retrieval_scores"]) == res["config"]["n_layers"]
    assert res["hardware"]["torch"] == torch.__version__ and res["wall_time_s"] > 0
    assert "static hybrid" in proc.stdout and "elastic" in proc.stdout


def test_resume_continues_from_the_router_checkpoint(quick_run, tmp_path):
    out, _ = quick_run
    proc = run_script("--backbone", str(out / "backbone.pt"), "--resume", str(out / "router.pt"),
                      *QUICK[2:], "--steps", "5", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    log = json.loads((tmp_path / "results.json").read_text())["train_log"]
    assert [r["step"] for r in log] == [0, 1, 2, 3, 4]


def test_ctrl_c_leaves_a_loadable_router_checkpoint(quick_run, tmp_path):
    out, _ = quick_run
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_router.py"), "--backbone",
                             str(out / "backbone.pt"), "--steps", "100000", "--batch-size", "5",
                             "--out", str(tmp_path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:  # wait until a few router steps have run
        if line.startswith("  10 |"):
            break
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "interrupted after" in rest, rest[-2000:]
    ckpt = torch.load(tmp_path / "router.pt", weights_only=False)
    assert ckpt["step"] >= 10 and len(ckpt["log"]) == ckpt["step"]
    assert ckpt["scheduler"]["last_epoch"] == ckpt["step"]  # the optimizer is exactly that many updates in


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--targets", "1.5,1.0"], "--targets must lie in [0, 1]"),
    (["--targets", "0.7"], "--targets must be two numbers"),
    (["--preset", "huge"], "invalid choice: 'huge'"),
    (["--gate", "coin"], "invalid choice: 'coin'"),
    (["--backbone", "no/such/file.pt"], "not found"),
    (["--resume", "no/such/router.pt"], "not found"),
])
def test_bad_arguments_fail_before_training(args, message):
    proc = run_script(*args, timeout=60)
    assert proc.returncode != 0
    assert message in proc.stderr + proc.stdout


def test_backbone_stages_train_shortest_first(tmp_path):
    """The gpu preset's length curriculum, at CPU size: 2 steps on 128-token inputs, then 2 on 256."""
    proc = run_script("--backbone", "train", "--backbone-stages", "128:2:4:3e-3,256:2:4:1e-3", *QUICK[2:],
                      "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "backbone 128 tokens" in proc.stderr and "backbone 256 tokens" in proc.stderr  # tqdm bars
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["backbone"] == "trained here (2 steps × 4 at 128 tokens, 2 steps × 4 at 256 tokens)"
    ckpt = torch.load(tmp_path / "backbone.pt", weights_only=False)
    assert ckpt["stages"] == [(128, 2, 4, 3e-3), (256, 2, 4, 1e-3)]


@pytest.mark.parametrize("stages, message", [
    ("256-2-4-1e-3", "must look like 'tokens:steps:batch:lr"),
    ("512:2:4:1e-3", "needs 1 <= tokens <= 256"),
    ("256:0:4:1e-3", "steps >= 1"),
    ("64:2:4:1e-3", "too short for the tasks"),
])
def test_bad_backbone_stages_fail_before_training(stages, message, tmp_path):
    proc = run_script("--backbone", "train", "--backbone-stages", stages, "--out", str(tmp_path), timeout=60)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "backbone.pt").exists()


def test_backbone_of_another_config_is_refused(tmp_path):
    other = E.Transformer(E.Config.preset("tiny", vocab_size=T.VOCAB_SIZE, dim=64))
    E.save_checkpoint(str(tmp_path / "other.pt"), other)
    proc = run_script("--backbone", str(tmp_path / "other.pt"), *QUICK[2:], "--out", str(tmp_path), timeout=60)
    assert proc.returncode != 0 and "different config" in proc.stderr


def test_checkpoint_round_trip_with_routers(tmp_path):
    cfg = E.Config.preset("tiny", vocab_size=T.VOCAB_SIZE, n_layers=2)
    model = E.Transformer(cfg)
    model.attach_routers()
    E.save_checkpoint(str(tmp_path / "m.pt"), model, step=7)
    loaded, ckpt = E.load_checkpoint(str(tmp_path / "m.pt"), cfg)
    assert ckpt["step"] == 7 and loaded.routers is not None
    idx = torch.randint(0, T.VOCAB_SIZE, (2, 40))
    a, ia = model.eval()(idx)
    b, ib = loaded.eval()(idx)
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ia["log_alpha"], ib["log_alpha"]))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        E.load_checkpoint(str(tmp_path / "missing.pt"))


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
    scores = T.retrieval_scores(rows, needle_pos, n_kv_heads=2)
    want = torch.zeros(L, 2)
    want[0, 0] = ((0.6 + 1.0) / 2 + (0.5 + 0.0) / 2) / 2
    torch.testing.assert_close(scores, want)


def test_shipped_backbone_solves_every_task_dense():
    """The premise of the experiment: the shipped tiny backbone, all heads FULL, answers ≥ 95 % of
    held-out answer tokens on every task (samples the script never evaluates on)."""
    cfg = E.Config.preset("tiny", vocab_size=T.VOCAB_SIZE)
    model, ckpt = E.load_checkpoint(os.path.join(ROOT, "tiny_backbone.pt"), cfg)
    for task in T.TASKS:
        b = T.make_batch([task.name], 64, 256, cfg.window, cfg.sink, seed=T.split_seed("eval", 99_000 + task.task_id),
                         margin=T.relay_margin(cfg.n_layers, cfg.window))
        with torch.no_grad():
            logits, _ = model(b["tokens"])
        acc = T.answer_accuracy(logits, b["targets"]).mean().item()
        assert acc >= 0.95, f"{task.name}: dense accuracy {acc:.3f}"
