"""The documents hold to what they promise: the README's test command is the one CI runs, every file
the README and RESULTS.md name exists, its debugger command stops in the kernel's inner loop, and
every document cited by name is shipped. CPU; the debugger test runs the command (~20 s)."""
import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ("README.md", "RESULTS.md")
TEST_COMMAND = 'pip install -e ".[test]"'


def read(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def source_files():
    """The repository's own .py and .md files (not hidden folders, run outputs or build folders)."""
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__")) and d not in ("runs", "build")
                   and not d.endswith(".egg-info")]
        for f in files:
            if f.endswith((".py", ".md")):
                yield os.path.join(folder, f)


def test_readme_test_command_is_what_ci_runs():
    readme = [line.split("#")[0].strip() for line in read("README.md").splitlines()
              if line.startswith(TEST_COMMAND)]
    ci = [line.strip() for line in read(".ci/run").splitlines() if line.startswith(TEST_COMMAND)]
    assert len(readme) == 1 and len(ci) == 1, (readme, ci)
    assert readme == ci


def test_named_files_exist():
    """Links and backticked file names are repository files, or files the code writes into a run
    folder (their name appears in a .py file, e.g. results.json, router.pt)."""
    code = "".join(read(os.path.relpath(p, ROOT)) for p in source_files() if p.endswith(".py"))
    missing = []
    for doc in DOCS:
        text = read(doc)
        links = re.findall(r"\]\(([^)#\s]+)\)", text)
        named = re.findall(r"`([\w./-]+\.(?:py|md|png|pt|json|toml|txt))(?:::\w+|:\d+)?`", text)
        for name in links + named:
            if "://" in name:
                continue
            if not os.path.exists(os.path.join(ROOT, name)) and os.path.basename(name) not in code:
                missing.append(f"{doc}: {name}")
    assert not missing, missing


def test_readme_debugger_command_stops_in_the_inner_loop(tmp_path):
    """The README's pdb command, run as written (plus `where`, then quit), stops at the q kᵀ
    statement of _attn_fwd_inner: edits that move the line break this test, not the reader."""
    command = re.search(r"TRITON_INTERPRET=1 python -m pdb (.*)", read("README.md")).group(1)
    args = shlex.split(command)
    at = max(i for i, a in enumerate(args) if a == "-c") + 2   # after the README's own pdb commands
    args = ["-m", "pdb", *args[:at], "-c", "where", "-c", "q", *args[at:], "--out", str(tmp_path / "run")]
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="1"),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    stop = proc.stdout.split("(Pdb)")[0] if "(Pdb)" in proc.stdout else proc.stdout
    assert re.search(r"kernels\.py\(\d+\)_attn_fwd_inner\(\)\n-> qk = tl\.dot\(q, tl\.trans\(k\)", proc.stdout), \
        stop[-3000:] + proc.stderr[-2000:]


def test_cited_documents_exist():
    """Every document the code and the docs cite by name (METHOD.md, RESULTS.md, ...) is shipped."""
    missing = []
    for path in source_files():
        with open(path, encoding="utf-8") as f:
            for name in set(re.findall(r"\b[A-Z][A-Z_]*\.md\b", f.read())):
                if not os.path.exists(os.path.join(ROOT, name)):
                    missing.append(f"{os.path.relpath(path, ROOT)}: {name}")
    assert not missing, missing
