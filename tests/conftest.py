"""Test set-up shared by every test file.

Without a GPU the Triton kernels run under Triton's CPU interpreter, which must be switched on
before `triton` is first imported (the @triton.jit decorator reads it), so it is set here, before
any test module imports kernels.py. A user can do the same by hand to step through a kernel:
`TRITON_INTERPRET=1 python -c "import kernels; ..."`.
"""
import os

# OpenMP threads that sleep between parallel regions, as the entry points ask for: with -n auto every
# worker's threads share the cores, and spinning ones slow the others. Read when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture
def restore_rng():
    """Tests that reseed torch's global RNG get its previous state back, pass or fail."""
    state = torch.random.get_rng_state()
    yield
    torch.random.set_rng_state(state)


@pytest.fixture
def restore_default_dtype():
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)


class _Payload:
    """Unpickling this runs os.mkdir(marker): a harmless stand-in for code hidden in a checkpoint."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


@pytest.fixture
def pickle_payload(tmp_path):
    """(write(path, keys), marker): write(...) torch.saves a dict with `keys`, each holding a payload
    that creates the directory `marker` when unpickled. A reader that unpickles it leaves the marker."""
    marker = str(tmp_path / "payload-ran")

    def write(path, keys):
        torch.save({k: _Payload(marker) for k in keys}, path)
        return str(path)
    return write, marker
