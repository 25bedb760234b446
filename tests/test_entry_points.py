"""The commands a reader types first: they behave on a shared CPU, refuse bad flags and files in one
line before any long work, and say what they are doing. Subprocesses on the CPU, each a few seconds."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY_POINTS = ("train_router.py", "smollm2.py", "bench.py", "report.py")


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


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_entry_points_set_a_passive_wait_policy_before_torch_loads(name):
    """OpenMP reads OMP_WAIT_POLICY once, when torch loads its runtime: the default must be set
    above the first torch import, and only as a default (a user's own setting wins)."""
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        lines = f.read().splitlines()
    first_torch = next(i for i, line in enumerate(lines) if re.match(r"\s*(import torch|from torch)", line))
    policy = [i for i, line in enumerate(lines) if 'os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")' in line]
    assert policy and policy[0] < first_torch, f"{name}: no OMP_WAIT_POLICY default above line {first_torch + 1}"
