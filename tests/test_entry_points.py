"""The commands a reader types first: they behave on a shared CPU, refuse bad flags and files in one
line before any long work, and say what they are doing. Subprocesses on the CPU, most a few seconds."""
import json
import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, env=None, timeout=120):
    env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def one_line_error(proc, *words):
    """A non-zero exit whose stderr is one `error: ...` line (argparse may print its usage above it)
    naming each of `words`, and no traceback."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "error:" in last, proc.stderr
    for w in words:
        assert w in last, (w, last)
    return last


# Each entry point as a module to run, and a flag prefix that argparse would otherwise expand.
ENTRY_POINTS = {"train_router": "--step", "elastic_lab.smollm2": "--rout", "elastic_lab.bench": "--seq",
                "elastic_lab.report": "--ou"}
# Reports the wait policy at the moment torch is first imported, then runs the entry point's --help.
WATCH_TORCH = """import os, runpy, sys
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print("policy at torch import:", os.environ.get("OMP_WAIT_POLICY"), flush=True)
            sys.meta_path.remove(self)
sys.meta_path.insert(0, Watch())
sys.argv = [sys.argv[1], "--help"]
runpy.run_module(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_entry_points_set_a_passive_wait_policy_and_print_in_any_locale(name):
    """OpenMP reads OMP_WAIT_POLICY once, when torch loads its runtime: the default must be set
    before the first torch import, and only as a default (a user's own setting wins). And --help,
    full of Ω and —, prints in a Latin-1 terminal (escaped), not as a UnicodeEncodeError."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    cases = ((None, "PASSIVE"), ("ACTIVE", "ACTIVE")) if name == "train_router" else ((None, "PASSIVE"),)
    for given, want in cases:
        proc = subprocess.run([sys.executable, "-c", WATCH_TORCH, name], cwd=ROOT, capture_output=True, timeout=120,
                              env=dict(env, PYTHONIOENCODING="latin-1", **({} if given is None else
                                                                          {"OMP_WAIT_POLICY": given})),
                              encoding="latin-1")
        assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-2000:]
        assert proc.stdout.splitlines()[0] == f"policy at torch import: {want}", proc.stdout[:500]


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_abbreviated_flags_are_refused(name):
    """argparse's prefix matching would take `--step 10` as `--steps 10`, or `--seq 8` as `--seq-lens`."""
    one_line_error(run("-m", name, ENTRY_POINTS[name], "8"), "unrecognized arguments", ENTRY_POINTS[name])


@pytest.mark.parametrize("value, on", [("true", True), ("0", False)])   # Triton takes 1, true, yes, on
def test_triton_interpret_is_read_as_triton_reads_it(value, on):
    code = "from elastic_attention import kernels; print(kernels.interpreting())"
    proc = run("-c", code, env=dict(TRITON_INTERPRET=value))
    assert proc.stdout.strip() == str(on), proc.stderr[-2000:]


def test_train_router_refuses_a_misspelt_flag_before_making_a_folder(tmp_path):
    out = tmp_path / "run"
    proc = run("train_router.py", "--step", "10", "--out", str(out))
    one_line_error(proc, "unrecognized arguments: --step 10")
    assert not out.exists()


def test_train_router_triton_on_a_cpu_needs_the_interpreter_before_anything_starts(tmp_path):
    if __import__("torch").cuda.is_available():
        pytest.skip("with CUDA, --backend triton defaults to the GPU")
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "train_router.py", "--smoke", "--backend", "triton", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    one_line_error(proc, "TRITON_INTERPRET=1")
    assert not out.exists(), "the refused run left an output folder"


def test_report_of_a_folder_without_a_run_is_one_line(tmp_path):
    one_line_error(run("-m", "elastic_lab.report", str(tmp_path / "nope")), "no results.json")
    (tmp_path / "results.json").write_text("{")
    one_line_error(run("-m", "elastic_lab.report", str(tmp_path)), "results.json")


def test_report_refuses_what_is_not_one_run_in_one_line(tmp_path):
    """A results.json of the wrong shape, or a --seeds aggregate, is named as such: no KeyError."""
    for name, content in (("empty", {}), ("list", []), ("null", None),
                          ("aggregate", {"runs": ["a", "b"], "methods": {}, "seeds": [0, 1]})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(content))
    for name in ("empty", "list", "null"):
        one_line_error(run("-m", "elastic_lab.report", str(tmp_path / name)), "not a train_router.py run's")
    one_line_error(run("-m", "elastic_lab.report", str(tmp_path / "aggregate")), "aggregate of 2 runs")


def test_report_never_writes_its_aggregate_into_a_run_folder(tmp_path):
    """`--out A` with A a run folder would replace A's results.json by the aggregate: refused, A kept.
    An --out that cannot be written is one line too."""
    for seed in (0, 1):
        (tmp_path / f"s{seed}").mkdir()
        (tmp_path / f"s{seed}" / "results.json").write_text(
            json.dumps(dict(seed=seed, settings={}, results={}, hardware={})))
    before = (tmp_path / "s0" / "results.json").read_text()
    runs = (str(tmp_path / "s0"), str(tmp_path / "s1"))
    one_line_error(run("-m", "elastic_lab.report", *runs, "--out", str(tmp_path / "s0")), "is a run folder")
    assert (tmp_path / "s0" / "results.json").read_text() == before
    (tmp_path / "a_file").write_text("")
    one_line_error(run("-m", "elastic_lab.report", *runs, "--out", str(tmp_path / "a_file")), "cannot write")


@pytest.fixture
def empty_cache(tmp_path):
    """A GGUF cache with nothing in it: a refusal that came after the download would leave a file."""
    cache = tmp_path / "cache"
    yield {"ELASTIC_ATTENTION_CACHE": str(cache)}
    assert not cache.exists() or not any(cache.iterdir()), "smollm2.py downloaded before refusing"


def test_smollm2_refuses_a_missing_or_binary_file_before_the_download(tmp_path, empty_cache):
    one_line_error(run("-m", "elastic_lab.smollm2", "--file", str(tmp_path / "nope.txt"), env=empty_cache),
                   "nope.txt", "No such file")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    one_line_error(run("-m", "elastic_lab.smollm2", "--file", str(tmp_path / "latin1.txt"), env=empty_cache), "not UTF-8")


def test_smollm2_refuses_cuda_without_a_gpu_before_the_download(empty_cache):
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA")
    one_line_error(run("-m", "elastic_lab.smollm2", "--device", "cuda", env=empty_cache), "no CUDA device")


def test_smollm2_refuses_routers_of_another_model_before_the_download(tmp_path, empty_cache):
    """A tiny run's router.pt (4 layers × 4 KV heads) on SmolLM2 (30 × 3): one line, in a second."""
    from dataclasses import asdict

    import torch

    import elastic_attention
    from elastic_attention import tasks
    cfg = elastic_attention.Config.shape("tiny", vocab_size=tasks.VOCAB_SIZE)
    model = elastic_attention.Transformer(cfg)
    model.attach_routers()
    path = tmp_path / "router.pt"
    torch.save(dict(settings=dict(config=asdict(cfg)), static=False,
                    routers=[r.state_dict() for r in model.routers]), path)
    one_line_error(run("-m", "elastic_lab.smollm2", "--routers", str(path), env=empty_cache), str(path))
    one_line_error(run("-m", "elastic_lab.smollm2", "--routers", str(tmp_path / "none.pt"), env=empty_cache), "none.pt")
    for name, crafted in (("nosettings", dict(settings={}, routers=[])), ("norouters", dict(settings=dict(config={}),
                                                                                            routers=None))):
        torch.save(crafted, tmp_path / f"{name}.pt")
        one_line_error(run("-m", "elastic_lab.smollm2", "--routers", str(tmp_path / f"{name}.pt"), env=empty_cache),
                       "is not a train_router.py router.pt")


def test_smollm2_help_explains_every_option():
    out = run("-m", "elastic_lab.smollm2", "--help").stdout
    description = out.split("\n\n")[1]
    assert description.replace("\n", " ").strip().endswith("."), description
    options = re.findall(r"^  (-{1,2}[\w-]+|question)(.*)\n((?:\s{20,}.*\n)*)", out, re.M)
    assert {o[0] for o in options} >= {"question", "--file", "--routers", "--gguf", "--cache-dir", "--device",
                                       "--max-new-tokens"}
    for name, rest, more in options:
        assert (rest + more).strip(), f"{name} has no help"


def test_readme_route_your_input_snippet_routes_its_inputs_differently():
    """The README's snippet, run as written on the shipped tiny_model.pt, prints one line per input
    in the order it asked for, and the trained routers keep more heads FULL for the passkey than for
    the periodic input (it is what the snippet is there to show)."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        code = re.search(r"```python\n(.*?)```", f.read(), re.S).group(1)
    assert '"tiny_model.pt"' in code
    proc = run("-c", code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line.split() for line in proc.stdout.strip().splitlines()]
    assert [line[0] for line in lines] == ["passkey", "periodic"], proc.stdout
    omega = {line[0]: float(line[line.index("Ω_MSR") + 1]) for line in lines}
    assert omega["passkey"] < omega["periodic"], proc.stdout


def test_importing_bench_runs_nothing(tmp_path):
    """Notebooks and tests import bench for its peers and helpers: no output, no folder, and the
    interpreter switch (which only `python -m elastic_lab.bench` on a CPU flips) left alone."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", "import os, elastic_lab.bench; print(os.environ.get('TRITON_INTERPRET'))"],
                          cwd=tmp_path, env=dict(env, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "None\n", proc.stdout
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())


def test_importing_train_router_runs_nothing(tmp_path):
    """train_router is a module of functions too: importing it prints nothing, makes no folder,
    parses no command line, and its stages can be called one by one (main is the outline)."""
    code = ("import sys; sys.argv = ['x', '--no-such-flag']; import train_router; "
            "print(callable(train_router.main), callable(train_router.evaluate))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "True True\n", proc.stdout
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())


def test_bench_refuses_a_long_sequence_on_a_cpu_before_making_a_folder(tmp_path):
    if __import__("torch").cuda.is_available():
        pytest.skip("with CUDA, long sequences are the point")
    out = tmp_path / "bench"
    one_line_error(run("-m", "elastic_lab.bench", "--seq-lens", "256,65536", "--out", str(out)), "[65536]", "CPU")
    assert not out.exists()
    one_line_error(run("-m", "elastic_lab.bench", "--tables", "decode", "--out", "README.md"), "cannot make")


def test_bench_cpu_smoke_peers_agree_and_the_cache_saves_its_ideal(tmp_path):
    """Three of the five tables, cut down (under a minute): FlexAttention and the split baseline,
    their masks built from masks.py's predicates, give our kernel's output; the compact decode
    cache holds exactly the bytes its layout promises and decodes as the masked reference does;
    a router-training step with the GPU presets' terms (consistency, logit penalty) runs and gives a
    finite loss."""
    if __import__("torch").cuda.is_available():
        pytest.skip("on a GPU bench.py times the full shapes")
    proc = run("-m", "elastic_lab.bench", "--tables", "forward", "decode", "train", "--fracs", "0.5", "--out", str(tmp_path),
               timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with open(tmp_path / "bench.json", encoding="utf-8") as f:
        results = json.load(f)
    forward = {r["setting"]: r for r in results["forward"]}
    assert list(forward) == ["f=0.50", "bsparse"], list(forward)
    assert forward["f=0.50"]["flex_diff"] < 1e-2 and forward["f=0.50"]["split_diff"] < 1e-2, forward
    assert forward["bsparse"]["flex_diff"] < 1e-2, forward
    assert len(results["decode"]) == 8, results["decode"]
    for r in results["decode"]:
        assert r["saved"] == pytest.approx(r["ideal_saved"]), r
        assert r["ours_diff"] < 1e-2, r
    assert any(r.get("flex_diff") is not None and r["flex_diff"] < 1e-2 for r in results["decode"])
    assert [r["preset"] for r in results["train"]] == ["gpu"] and math.isfinite(results["train"][0]["loss"])
    assert "_ms" not in proc.stdout and "_us" not in proc.stdout, "an interpreter's times were printed"


@pytest.mark.parametrize("S, q_len, H, G", [(1024, None, 8, 2), (1024, 1, 8, 4), (640, None, None, 2),
                                            (2048, 1, None, 1)])
def test_bench_block_masks_equal_flex_own(S, q_len, H, G):
    """bench's chunked BlockMask (no S×S mask held) has exactly the blocks create_block_mask finds,
    for per-head modes with block-sparse heads, one decode query, and a mask shared by every head."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask
    from elastic_lab import bench
    from elastic_attention import masks
    g = torch.Generator().manual_seed(S + G)
    modes = torch.randint(0, 2, (1, 4 if H is None else H // G), generator=g)
    modes[0, 0] = masks.BLOCK_SPARSE
    blocks = torch.rand(1, modes.shape[1], S // 64, S // 64, generator=g) < 0.3
    modes, blocks = modes.to(bench.DEVICE), blocks.to(bench.DEVICE)   # where bench builds its masks
    pred = bench.mode_predicate(modes, 16, 128, blocks, 64) if H is not None else masks.streaming(16, 128)
    ours = bench.flex_block_mask(pred, H, G, S, q_len)
    ql = q_len or S
    ref = create_block_mask(lambda b, h, q, k: pred(b, h // G, q + S - ql, k), None, H, ql, S, device=bench.DEVICE)
    for mine, theirs in ((ours.to_dense(), ref.to_dense()), (ours.full_kv_num_blocks, ref.full_kv_num_blocks),
                         (ours.kv_num_blocks, ref.kv_num_blocks)):
        assert torch.equal(mine.cpu(), theirs.cpu())
