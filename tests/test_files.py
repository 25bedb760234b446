"""The files the project writes (results, checkpoints, downloads) go through one function,
elastic_attention.write_atomic: a reader sees the whole old file or the whole new one, whatever
happens to the writer (kill -9, an error, a second writer of the same path)."""
import glob
import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

import elastic_attention
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
A, B = b"a" * (3 << 20), b"b" * (3 << 20)  # two known payloads, a few MB so that a kill lands mid-write


def child(code, **kw):
    """A python process running code from the repository root (the project imports), stdout piped."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_WAIT_POLICY="PASSIVE")
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, **kw)


def test_kill_9_mid_write_leaves_the_old_or_the_new_file(tmp_path):
    path = str(tmp_path / "results.json")
    # One process imports the project once; each line it reads forks a writer, which the test kills.
    code = f"""
import os, sys
import elastic_attention
payloads = [b"a" * {len(A)}, b"b" * {len(B)}]
def write(f, data):
    for i in range(0, len(data), 1 << 16):  # in chunks, as json.dump and torch.save write
        f.write(data[i:i + (1 << 16)])
for _ in sys.stdin:
    pid = os.fork()
    if pid == 0:
        print("ready", os.getpid(), flush=True)
        i = 0
        while True:
            elastic_attention.write_atomic({path!r}, lambda f: write(f, payloads[i % 2]))
            i += 1
    os.waitpid(pid, 0)
    print("killed", flush=True)
"""
    proc = child(code, stdin=subprocess.PIPE)
    rng = random.Random(0)
    for _ in range(6):
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        ready, pid = proc.stdout.readline().split()
        assert ready == b"ready"
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(int(pid), signal.SIGKILL)
        assert proc.stdout.readline() == b"killed\n"
        if os.path.exists(path):  # absent only if no write finished before the kill
            with open(path, "rb") as f:
                assert f.read() in (A, B)
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0
    proc.stdout.close()
    assert os.path.exists(path)  # the later kills all came after some finished write
    # A kill -9 cannot clean up: each kill may leave one stray results.json.<random>.tmp beside it.
    assert len(glob.glob(path + ".*.tmp")) <= 6


def test_two_processes_saving_one_checkpoint(tmp_path):
    path = str(tmp_path / "m.pt")
    code = f"""
import elastic_attention
cfg = elastic_attention.Config(vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                               sink=2, window=5, block_size=4, xa_stride=2, pool_tokens=4)
model = elastic_attention.Transformer(cfg)
for step in range(30):
    elastic_attention.save_checkpoint({path!r}, model, step=step)
"""
    procs = [child(code) for _ in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]  # the old shared m.pt.tmp: FileNotFoundError
    for p in procs:
        p.stdout.close()
    model, ckpt = elastic_attention.load_checkpoint(path)
    assert ckpt["step"] == 29
    assert not glob.glob(path + ".*.tmp")


def test_a_failing_write_keeps_the_old_file_and_leaves_no_temp_file(tmp_path):
    path = str(tmp_path / "table.txt")
    elastic_attention.write_atomic(path, lambda f: f.write(b"old\n"))
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~elastic_attention.model._UMASK  # the mode open() gives

    def half_then_fail(f):  # a full disk, a bug in the writer: the error comes after some bytes
        f.write(b"new, but only ha")
        raise OSError("No space left on device")
    with pytest.raises(OSError, match="No space"):
        elastic_attention.write_atomic(path, half_then_fail)

    def refuse(tmp):  # a check that finds the written file bad (as verify_gguf does a bad download)
        raise ValueError(f"{tmp}: bad")
    with pytest.raises(ValueError, match="bad"):
        elastic_attention.write_atomic(path, lambda f: f.write(b"new\n"), check=refuse)
    with open(path, "rb") as f:
        assert f.read() == b"old\n"
    assert os.listdir(tmp_path) == ["table.txt"]


def test_a_save_that_fails_as_on_a_full_disk_names_the_file(tmp_path):
    """torch.save on a full disk raises RuntimeError (basic_ios::clear): write_atomic turns it into
    an OSError naming the file, which the scripts print as one line, and leaves no temp file."""
    def full_disk(f):
        f.write(b"partial")
        raise RuntimeError("basic_ios::clear: iostream error")
    with pytest.raises(OSError, match=r"cannot write .*model\.pt: basic_ios::clear"):
        elastic_attention.write_atomic(str(tmp_path / "model.pt"), full_disk)
    assert os.listdir(tmp_path) == []


def test_a_bad_cached_model_says_to_delete_it(tmp_path):
    from elastic_lab import smollm2
    (tmp_path / smollm2.GGUF_NAME).write_bytes(b"not the model")
    with pytest.raises(ValueError, match="delete it and run again"):
        smollm2.fetch_gguf(str(tmp_path))


def test_two_first_fetches_into_one_cache_both_succeed(tmp_path, monkeypatch):
    from elastic_lab import smollm2
    blob = os.urandom(4 << 20)
    monkeypatch.setattr(smollm2, "GGUF_SIZE", len(blob))
    monkeypatch.setattr(smollm2, "GGUF_SHA256", hashlib.sha256(blob).hexdigest())
    target = str(tmp_path / smollm2.GGUF_NAME)
    for i, start in enumerate(range(0, len(blob), 1 << 20)):  # offline copy in pieces, as fetch_gguf joins
        with open(f"{target}.part-a{chr(97 + i)}", "wb") as f:
            f.write(blob[start:start + (1 << 20)])
    start = threading.Barrier(6)
    got = []

    def fetch():
        start.wait()
        try:
            got.append(smollm2.fetch_gguf(str(tmp_path)))
        except Exception as e:  # the old shared <file>.part: FileNotFoundError or a failed check
            got.append(e)
    threads = [threading.Thread(target=fetch) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [target] * 6
    assert smollm2.verify_gguf(target) == target
    assert not glob.glob(target + ".*.tmp") and not os.path.exists(target + ".part")
