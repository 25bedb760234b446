"""The documents hold to what they promise: the README's test command is the one CI runs, every file
the README and RESULTS.md name exists, the README stays a front door, its debugger command stops in
the kernel's inner loop, and every document cited by name is shipped. Plain text checks, fast, CPU."""
import os
import re

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


def test_readme_is_a_front_door():
    lines = read("README.md").splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines; results belong in RESULTS.md"


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


def test_readme_breakpoint_is_in_the_inner_loop():
    """The README's debugger command stops where the README says: its kernels.py line is the q kᵀ
    statement in the body of _attn_fwd_inner (edits above it move the line; update the README)."""
    stop = "qk = tl.dot(q, tl.trans(k)"
    readme = read("README.md")
    lines = read("elastic_attention/kernels.py").splitlines()
    refs = [int(n) for n in re.findall(r"kernels\.py:(\d+)", readme)]
    assert refs and stop in readme, "the README names no kernels.py line for the debugger"
    start = next(i for i, line in enumerate(lines) if "def _attn_fwd_inner(" in line)
    end = next(i for i in range(start + 1, len(lines)) if lines[i].strip().startswith(("def ", "@triton.jit")))
    want = [i + 1 for i in range(start, end) if stop in lines[i]]
    for n in refs:
        assert n in want, f"README breaks at kernels.py:{n}; the statement `{stop}` of _attn_fwd_inner is at {want}"


def test_cited_documents_exist():
    """Every document the code and the docs cite by name (METHOD.md, RESULTS.md, ...) is shipped."""
    missing = []
    for path in source_files():
        with open(path, encoding="utf-8") as f:
            for name in set(re.findall(r"\b[A-Z][A-Z_]*\.md\b", f.read())):
                if not os.path.exists(os.path.join(ROOT, name)):
                    missing.append(f"{os.path.relpath(path, ROOT)}: {name}")
    assert not missing, missing
