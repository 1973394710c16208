"""A build of nodraft::mm stopped midway (SIGKILL included) never blocks the next one
(micro/gemm.py, ``build_lock``): torch's own lock file is left behind by a killed build,
and every later build would wait on it for ever. And the build is named by its sources'
content, so a build of other sources is never loaded."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from torch.utils.file_baton import FileBaton

from nodraft.micro import gemm

ROOT = Path(__file__).resolve().parents[2]

# A build in progress, as torch runs one: nodraft's lock held, torch's baton taken, then
# the compiler running (here: sleeping) until the process is killed.
BUILDER = """
import sys, time
from pathlib import Path
from torch.utils.file_baton import FileBaton
from nodraft.micro import gemm
with gemm.build_lock(Path(sys.argv[1])):
    assert FileBaton(str(Path(sys.argv[1]) / "lock")).try_acquire()
    print("building", flush=True)
    time.sleep(120)
"""


def acquire_within(directory: Path, seconds: float) -> bool:
    """Whether ``build_lock`` is acquired within ``seconds`` (then torch's baton is free)."""
    got = threading.Event()

    def take():
        with gemm.build_lock(directory):
            free = FileBaton(str(directory / "lock")).try_acquire()
            (directory / "lock").unlink(missing_ok=True)  # as torch releases it
            if free:
                got.set()
    threading.Thread(target=take, daemon=True).start()
    return got.wait(seconds)


def test_a_build_killed_midway_leaves_nothing_that_blocks_the_next(tmp_path):
    builder = subprocess.Popen([sys.executable, "-c", BUILDER, str(tmp_path)], cwd=ROOT,
                               stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert builder.stdout.readline().strip() == "building"
        assert (tmp_path / "lock").exists()
        # while the builder lives, its lock holds: a second build would wait for it
        with open(tmp_path / "nodraft.lock", "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                raise AssertionError("the builder's lock was not held")
            except BlockingIOError:
                pass
    finally:
        builder.send_signal(signal.SIGKILL)
        builder.wait(timeout=10)
    assert (tmp_path / "lock").exists()  # torch's lock, stale: what wedged servers before
    t0 = time.monotonic()
    assert acquire_within(tmp_path, 10)
    assert time.monotonic() - t0 < 10


def test_a_stale_torch_lock_is_removed(tmp_path, caplog):
    (tmp_path / "lock").write_text("")
    with gemm.build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert "stopped before it finished" in caplog.text


def test_the_extensions_name_follows_its_sources_content(tmp_path, monkeypatch):
    """A library built from other sources is never the one loaded: the build folder's
    name carries the sources' hash (a stale build, dated after an edit, was loaded
    without the ops the code called)."""
    from nodraft.micro import gemm

    assert gemm.NAME == f"nodraft_gemm_{gemm._digest()}"
    copies = []
    for f in gemm.SOURCES + gemm.HEADERS:
        (tmp_path / f.name).write_bytes(f.read_bytes())
        copies.append(tmp_path / f.name)
    monkeypatch.setattr(gemm, "SOURCES", tuple(copies[:len(gemm.SOURCES)]))
    monkeypatch.setattr(gemm, "HEADERS", tuple(copies[len(gemm.SOURCES):]))
    same = gemm._digest()
    copies[-1].write_text(copies[-1].read_text() + "\n// another line\n")  # the header alone
    assert gemm._digest() != same == gemm.NAME.rsplit("_", 1)[1]
