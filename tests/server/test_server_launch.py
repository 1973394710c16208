"""``nodraft serve`` starts its engine process first thing (``server.main``,
``engine.launch``): before this process imports torch or the application, so that the two
starts overlap; the application takes that engine over, and frees it when it cannot start."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from server_testing import alive, free_port, wait_healthy
from test_server_shutdown import engine_pid

ROOT = Path(__file__).parents[2]


def test_the_engine_is_launched_before_torch_is_imported():
    script = textwrap.dedent("""
        import sys
        import nodraft.engine.launch

        def launch(config):
            heavy = [m for m in ("torch", "fastapi", "nodraft.server.app") if m in sys.modules]
            print("imported before the launch:", heavy, "compile:", config.compile)
            sys.exit(0)

        nodraft.engine.launch.launch = launch
        from nodraft.server.main import main
        main(["--compile", "false"])
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "imported before the launch: [] compile: False" in out.stdout


def test_an_eager_engine_never_imports_dynamo(serve_checkpoints):
    """Dynamo's import (seconds) is paid by compiled passes only: not by an engine with
    ``--compile false``, nor by the drafters that share the compiled passes' constants.
    And what the built engine holds is out of the collector's reach (``freeze_heap``):
    a full collection walks only what serving made since."""
    script = textwrap.dedent(f"""
        import gc, sys
        from nodraft.engine.process import build_engine
        from nodraft.engine.launch import EngineConfig
        engine = build_engine(EngineConfig({str(serve_checkpoints)!r}, compile=False))
        assert "nodraft.drafters.eagle" in sys.modules  # every drafter's module, before serving
        print("dynamo imported:", "torch._dynamo" in sys.modules)
        print("frozen:", gc.get_freeze_count(), "collected:", len(gc.get_objects()))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "dynamo imported: False" in out.stdout
    frozen, collected = (int(x) for x in re.search(r"frozen: (\d+) collected: (\d+)",
                                                   out.stdout).groups())
    assert frozen > 50_000 and collected < frozen // 10, out.stdout


def _serve(checkpoints: Path, port: int, tmp: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmp)}  # the engine's socket folder goes there
    return subprocess.Popen(
        [sys.executable, "-m", "nodraft.server.cli", "serve", "--port", str(port), "--checkpoints",
         str(checkpoints), "--compile", "false", "--threads", "1", "--log-level", "warning",
         *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)


def test_nodraft_serve_serves_through_the_engine_it_launched(serve_checkpoints, tmp_path):
    """... and removes the socket folders of servers that are gone (a SIGKILL leaves
    one), never a live server's."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"nodraft-engine-{gone.pid}-x"  # its server is gone
    live = tmp_path / f"nodraft-engine-{os.getpid()}-y"  # this process is not
    stale.mkdir()
    live.mkdir()
    port = free_port()
    proc = _serve(serve_checkpoints, port, tmp_path)
    url = f"http://127.0.0.1:{port}"
    engine = None
    try:
        wait_healthy(url, 120, lambda: proc.poll() is None)
        engine = engine_pid(proc.pid)
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "micro", "prompt": "def add(a, b):\n", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        assert list(tmp_path.glob(f"nodraft-engine-{proc.pid}-*"))  # its sockets
        assert not stale.exists() and live.exists()
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) >= 2:  # the engine on the first core, its ZeroMQ I/O thread on the API's
            assert thread_cores(engine) == {"python": {cores[0]}, "ZMQbg/IO/0": {cores[-1]}}
            api = thread_cores(proc.pid)
            assert api["python"] == api["ZMQbg/IO/0"] == {cores[-1]}, api
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert not alive(engine)
        assert not list(tmp_path.glob(f"nodraft-engine-{proc.pid}-*"))  # freed with it
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        if engine is not None and alive(engine):
            os.kill(engine, signal.SIGKILL)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_an_engine_with_every_core_keeps_its_loop_on_the_first(serve_checkpoints, tmp_path):
    """``--threads`` = every core: the engine's pass threads may run on every core, its
    loop (the process's main thread) on the first only, the API process on the last."""
    cores = sorted(os.sched_getaffinity(0))
    port = free_port()
    proc = _serve(serve_checkpoints, port, tmp_path, "--threads", str(len(cores)))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 120, lambda: proc.poll() is None)
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "micro", "prompt": "def add(a, b):\n", "max_tokens": 4})
        assert r.status_code == 200
        engine = engine_pid(proc.pid)
        assert os.sched_getaffinity(engine) == {cores[0]}  # the main thread: the loop
        threads = [int(t.name) for t in Path(f"/proc/{engine}/task").iterdir()]
        assert any(os.sched_getaffinity(t) == set(cores) for t in threads)  # pass threads
        assert thread_cores(proc.pid)["python"] == {cores[-1]}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def thread_cores(pid: int) -> dict[str, set[int]]:
    """Each thread's name (all but ZeroMQ's reaper) and the cores it may run on."""
    out: dict[str, set[int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        name = (task / "comm").read_text().strip()
        if name != "ZMQbg/Reaper":
            out.setdefault(name, set()).update(os.sched_getaffinity(int(task.name)))
    return out


def test_a_server_that_cannot_start_frees_the_engine_it_launched(serve_checkpoints, tmp_path):
    """A bad default drafter is found by the application after the engine was launched:
    the server exits 3 (uvicorn's start failure) with the reason, and leaves no engine
    process and no socket folder behind."""
    proc = _serve(serve_checkpoints, free_port(), tmp_path, "--speculation", "no-such-drafter")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3, out
    assert "no-such-drafter" in out
    assert not list(tmp_path.glob("nodraft-engine-*")), out
    assert not started_with(f"TMPDIR={tmp_path}"), out  # no engine process left


def started_with(variable: str) -> list[int]:
    """The processes whose environment holds ``variable`` (NAME=value)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and variable.encode() in (d / "environ").read_bytes().split(b"\0"):
                found.append(int(d.name))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


def test_a_server_stopped_during_its_start_leaves_nothing_behind(serve_checkpoints, tmp_path):
    """SIGTERM while the API process still imports (the engine already launched): both
    exit, the socket folder goes with them, and the next start serves."""
    proc = _serve(serve_checkpoints, free_port(), tmp_path)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("nodraft-engine-*")) and time.monotonic() < deadline:
        time.sleep(0.01)  # the engine is launched
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0, out  # stopped, not served
    deadline = time.monotonic() + 15  # the engine dies with its parent (or was stopped)
    while started_with(f"TMPDIR={tmp_path}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not started_with(f"TMPDIR={tmp_path}")
    assert not list(tmp_path.glob("nodraft-engine-*")), out
    port = free_port()
    again = _serve(serve_checkpoints, port, tmp_path)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 120, lambda: again.poll() is None)
    finally:
        again.send_signal(signal.SIGTERM)
        assert again.wait(timeout=60) == 0


@pytest.mark.parametrize("engine_process", ["true", "false"])
def test_a_server_stopped_while_its_kernels_build_leaves_no_compiler_running(
        serve_checkpoints, tmp_path, engine_process):
    """A first start builds nodraft's kernels from the engine's warm-up thread (``ninja``
    and its compilers, children of the engine). A SIGTERM to the server alone stops the
    engine, and the engine stops them as it exits (``engine.launch.stop_children``; an
    engine in the API process, as the API process exits): left running, they compiled on
    for minutes into the folder the next start builds in."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "nodraft.server.cli", "serve", "--port", str(free_port()),
         "--checkpoints", str(serve_checkpoints), "--compile", "true",
         "--compile-cache", str(tmp_path / "cc"), "--threads", "1", "--log-level", "warning",
         "--engine-process", engine_process],
        cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marker = f"TMPDIR={tmp_path}"
    try:
        deadline = time.monotonic() + 120
        while not _named(started_with(marker), "ninja") and time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        if not _named(started_with(marker), "ninja"):
            pytest.skip("no kernel build started here (no AVX2 / AVX-512, or no compiler)")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    deadline = time.monotonic() + 15
    while started_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = {pid: _comm(pid) for pid in started_with(marker)}
    assert not left, left


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _named(pids: list[int], name: str) -> list[int]:
    return [p for p in pids if _comm(p) == name]
