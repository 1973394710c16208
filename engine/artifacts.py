"""Compiled passes built once per machine, off the serving path, and loaded at start.

``nodraft compile`` (or the server, the first time it starts on a machine) builds every
graph the engine's compiled passes use -- each model's single-sequence passes (one row and
several, every early-exit range) and EAGLE's draft steps -- in a process of its own (which
starts one compiling process per core, at most 4 -- half as many when a server starts it
-- that share the families out by claiming them: ``--workers``), and saves them with
``torch.compile``'s AOT precompilation (``micro.compiled.Precompiled``): a saved graph
loads in a fraction of a second and runs without dynamo tracing it again. The kernels
inductor generated for them sit in inductor's cache beside them
(``TORCHINDUCTOR_CACHE_DIR`` defaults to ``<cache>/inductor``).

Layout, under ``<cache>/compiled`` (``<cache>``: ``--compile-cache``, else
``$NODRAFT_COMPILE_CACHE``, else ``$XDG_CACHE_HOME/nodraft``, else ``~/.cache/nodraft``)::

    <key>/manifest.json       written last: the build is complete
    <key>/<model>/*.pt2       one graph per file (and a .json naming its family)
    <key>/<model>/eagle-*/    EAGLE's draft steps for that model
    <key>.lock                held (flock) by the process building <key>
    <key>.building-<pid>/     a build in progress (claims/: who compiles which family);
                              renamed to <key>/ when done
    <key>.failed              why the last build failed
    <key>.log                 the log of a build the server started

The key is a hash of everything that invalidates the graphs: torch's and Python's
versions, the CPU's vector unit and flags, every checkpoint file (hashed), the code that
defines the graphs, the matrix product in use and the KV cache's shape (``--max-running``).

Nothing can wedge it. The lock is an ``flock``, which the kernel releases when its holder
dies however it dies; a build that finds a ``.building-*`` folder under the lock knows its
builder is gone, logs it and removes it. A failed build writes why, and the server stays
eager and says so on ``/health``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("nodraft.artifacts")

ROOT = Path(__file__).resolve().parents[1]
# the code that defines the graphs and how they are saved: any change rebuilds them
CODE = ("micro/compiled.py", "micro/model.py", "micro/ops.py", "micro/gemm.py",
        "micro/csrc/gemm.cpp", "micro/csrc/gemm.h", "micro/csrc/attend.cpp", "micro/csrc/simd.h",
        "drafters/eagle/head.py", "drafters/eagle/compiled.py")
BUILD_NICE = 19  # build_niceness()'s default
VERSION = 2  # of this layout and of how graphs are saved: a change rebuilds them


def cache_home(explicit: str | os.PathLike | None = None) -> Path:
    if explicit:
        return Path(explicit)
    if os.environ.get("NODRAFT_COMPILE_CACHE"):
        return Path(os.environ["NODRAFT_COMPILE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nodraft"


def use_inductor_cache(home: Path) -> None:
    """Point inductor's cache beside the artifacts, unless the user chose one: the loaded
    graphs' kernels are found there, not built again. Before dynamo is imported: its import
    settles the folder (torch's default unless the variable is set)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(home / "inductor"))


# What a loaded graph's generated code imports (its header), a few seconds of imports the
# first time: ``import_runtime`` does them before the engine serves.
RUNTIME_MODULES = ("torch._inductor.codecache", "torch._inductor.async_compile",
                   "torch._inductor.select_algorithm", "torch._inductor.codegen.memory_planning",
                   "torch._inductor.hooks", "torch._inductor.utils",
                   "torch._functorch._aot_autograd.aot_autograd_result")


def import_runtime() -> None:
    """Import what loading and running a saved graph needs (a name this torch lacks is
    skipped: the load imports what it needs all the same, only later)."""
    for name in RUNTIME_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            log.debug("nodraft: no module %s in this torch", name)


def _vec_isa() -> str:
    """The vector instruction set inductor's kernels were generated for on this machine
    (it compiles and loads a probe the first time a process asks)."""
    from torch._inductor import cpu_vec_isa

    return str(cpu_vec_isa.pick_vec_isa())


def trust_the_build(manifest: dict) -> None:
    """Skip inductor's probe of the vector unit (a C++ compile and a process that loads
    it), which every process that loads a kernel runs again, when the build on this
    machine recorded its result (``manifest["vec_isa"]``; the key holds the CPU's flags
    and torch's version). The unit is trusted only when inductor, told so, picks what the
    build picked -- the kernels' command lines, so their cache keys, name it; else it
    probes as before. A choice the user made (``TORCHINDUCTOR_VEC_ISA_OK``) stands.
    (Inductor's precompiled header stays on: turning it off changes the cpp_wrapper
    modules' keys, and they would be built again.)"""
    from torch._inductor import config, cpu_vec_isa

    built = manifest.get("vec_isa")
    if built is None or config.cpp.vec_isa_ok is not None:  # an older store; the user's
        return
    config.cpp.vec_isa_ok = built != str(cpu_vec_isa.invalid_vec_isa)
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    if str(cpu_vec_isa.pick_vec_isa()) != built:
        config.cpp.vec_isa_ok = None
        cpu_vec_isa.valid_vec_isa_list.cache_clear()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def key_parts(config) -> dict:
    """What the key hashes, readable (``manifest.json`` keeps it)."""
    import torch

    from nodraft.micro import gemm

    directory = Path(config.checkpoints)
    return {
        "layout": VERSION,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": hashlib.sha256(_cpu_flags().encode()).hexdigest()[:16],
        "product": gemm.expected(config.gemm),  # never builds: a start must not wait
        "max_running": config.max_running,
        "checkpoints": {p.name: _file_hash(p)[:16]
                        for p in sorted(directory.glob("*.safetensors"))},
        "code": hashlib.sha256(b"".join((ROOT / c).read_bytes() for c in CODE)).hexdigest()[:16],
    }


class Store:
    """The artifacts of one engine configuration on this machine."""

    def __init__(self, config, home: str | os.PathLike | None = None):
        self.config = config
        self.home = cache_home(home)
        self.parts = key_parts(config)
        self.key = hashlib.sha256(json.dumps(self.parts, sort_keys=True).encode()).hexdigest()[:20]
        self.root = self.home / "compiled"
        self.path = self.root / self.key
        self.lock_path = self.root / f"{self.key}.lock"
        self.failed_path = self.root / f"{self.key}.failed"
        self.log_path = self.root / f"{self.key}.log"

    def complete(self) -> bool:
        return (self.path / "manifest.json").is_file()

    def manifest(self) -> dict:
        return json.loads((self.path / "manifest.json").read_text())

    def failure(self) -> str | None:
        try:
            return json.loads(self.failed_path.read_text())["error"]
        except (OSError, ValueError, KeyError):
            return None

    @contextlib.contextmanager
    def locked(self):
        """The build lock: an ``flock``, released by the kernel when its holder dies."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.lock_path, "a") as held:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("nodraft: another process is building %s; waiting for it", self.path)
                fcntl.flock(held, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(held, fcntl.LOCK_UN)

    # -- building (in a process of its own) --------------------------------------------------
    def build(self, workers: int | None = None) -> Path:
        """Build every graph into this store; a complete store is left as it is. Returns
        the store's folder. ``workers``: processes that compile side by side, each family
        by whichever claims it first (``build_workers()`` by default; 1: this process
        compiles)."""
        with self.locked():
            if self.complete():
                log.info("nodraft: the compiled passes are already built: %s", self.path)
                return self.path
            self._remove_stale_builds()
            self.failed_path.unlink(missing_ok=True)
            tmp = self.root / f"{self.key}.building-{os.getpid()}"
            t0 = time.perf_counter()
            try:
                n = build_workers() if workers is None else max(1, workers)
                graphs = self._compile_into(tmp) if n == 1 else self._compile_by(n, tmp)
            except BaseException as e:
                shutil.rmtree(tmp, ignore_errors=True)
                if not isinstance(e, KeyboardInterrupt):
                    self.failed_path.write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
                raise
            manifest = {"key": self.key, "parts": self.parts, "graphs": graphs,
                        "seconds": round(time.perf_counter() - t0, 1), "built": time.time(),
                        "vec_isa": _vec_isa()}
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
            if self.path.exists():  # an incomplete folder of an older layout
                shutil.rmtree(self.path)
            os.rename(tmp, self.path)
            log.info("nodraft: %d compiled graphs built in %.0f s: %s", graphs,
                     manifest["seconds"], self.path)
            return self.path

    def _remove_stale_builds(self) -> None:
        """Partial builds whose builder is gone (their key's lock is free; ours is held):
        this key's, and those other configurations left behind."""
        for stale in self.root.glob("*.building-*"):
            key = stale.name.split(".building-")[0]
            if key != self.key:
                with open(self.root / f"{key}.lock", "a") as other:
                    try:
                        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        continue  # being built right now
                    fcntl.flock(other, fcntl.LOCK_UN)
            log.warning("nodraft: removing %s, a build that was stopped before it finished%s",
                        stale, "; building again" if key == self.key else "")
            shutil.rmtree(stale, ignore_errors=True)

    def _compile_into(self, folder: Path, claim=None) -> int:
        """Compile every family into ``folder`` in this process; with ``claim(stem)``, only
        the families it grants (a worker of ``_compile_by``)."""
        import torch

        from nodraft.engine.process import build_engine
        from nodraft.micro.compiled import Precompiled

        torch.set_num_threads(1)  # the graphs are generated for one thread (Engine.warm_up)
        Precompiled.claim = claim
        engine = build_engine(dataclasses.replace(self.config, compile=True))
        for name, model in engine.models.items():
            model.compiled.export_to = folder / name
            model.compiled.lazy = True
        engine._compile_all()
        if engine.compiled_error is not None:
            raise RuntimeError(engine.compiled_error)
        return sum(1 for _ in folder.rglob("*.pt2"))

    def _compile_by(self, workers: int, folder: Path) -> int:
        """Compile with ``workers`` processes side by side (``--worker-of``). Each walks
        every family in the same order and compiles those it claims first -- a file made
        with ``O_EXCL`` in ``folder``, one per family name, which covers that family for
        every checkpoint (their graphs' code is the same, so the second one's compile
        finds the first's kernels in inductor's cache). Raises if any worker fails."""
        argv = self._build_argv("--worker-of", str(folder))
        # inductor's own pool of C++ compilers would only contend with the other workers
        env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        log.info("nodraft: %d processes compile side by side", workers)
        procs = [subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL)
                 for _ in range(workers)]
        try:
            codes = [p.wait() for p in procs]
        finally:
            for p in procs:  # stopped (a signal, an exception): take them along
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(codes):
            raise RuntimeError(f"a compiling process failed (exit statuses {codes}); the log "
                               "above says why")
        shutil.rmtree(folder / "claims")
        return sum(1 for _ in folder.rglob("*.pt2"))

    def _build_argv(self, *extra: str) -> list[str]:
        """A build process for this store's configuration, dying with this process."""
        return [sys.executable, "-m", "nodraft.engine.artifacts", "build",
                "--checkpoints", str(self.config.checkpoints),
                "--max-running", str(self.config.max_running), "--gemm", self.config.gemm,
                "--compile-cache", str(self.home), "--parent-pid", str(os.getpid()), *extra]

    # -- the server's side -------------------------------------------------------------------
    def ensure(self) -> Path:
        """The store's folder, built first by a process of its own if it is not complete
        (below the requests' priority, on every core, dying with its parent). Raises with the
        reason when the build fails."""
        if self.complete():
            return self.path
        self.root.mkdir(parents=True, exist_ok=True)
        argv = self._build_argv("--workers", str(build_workers(serving=True)))
        log.info("nodraft: building the compiled passes in a process of their own (log: "
                 "%s); served eager until then", self.log_path)
        with open(self.log_path, "ab") as out:
            child = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
            rc = child.wait()
        if rc != 0 or not self.complete():
            why = self.failure() or _last_line(self.log_path) or f"exit status {rc}"
            raise RuntimeError(f"building the compiled passes failed ({why}); log: {self.log_path}")
        return self.path


def build_workers(serving: bool = False) -> int:
    """How many processes compile side by side by default: ``NODRAFT_BUILD_WORKERS``, else
    one per usable core, at most 4 (each holds a compiler's memory, about a GB) -- half as
    many for a server's build (``serving``), which leaves the other half to the requests
    it serves meanwhile (docs/BENCHMARKS.md, "First start")."""
    if os.environ.get("NODRAFT_BUILD_WORKERS"):
        return max(1, int(os.environ["NODRAFT_BUILD_WORKERS"]))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(cores // 2 if serving else cores, 4))


def claimer(folder: Path):
    """A worker's ``claim(stem)``: True for the families it is first to claim in
    ``folder`` (and again for those it claimed), False for another worker's."""
    claims = folder / "claims"
    claims.mkdir(parents=True, exist_ok=True)
    mine: set[str] = set()

    def claim(stem: str) -> bool:
        if stem in mine:
            return True
        try:
            os.close(os.open(claims / stem, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        mine.add(stem)
        return True

    return claim


def build_niceness() -> int:
    """The niceness a server's own builds run at (its kernels' compile in the engine's
    warm-up thread, its compiled passes' build process): ``NODRAFT_BUILD_NICE`` (0-19),
    else ``BUILD_NICE``, the lowest priority -- the requests keep the CPU they use, and
    the build, on every core (``as_a_build``), takes what they leave (docs/BENCHMARKS.md,
    "First start under load"). A value that is not a number is logged and the default
    used."""
    value = os.environ.get("NODRAFT_BUILD_NICE", "").strip()
    if not value:
        return BUILD_NICE
    try:
        return min(19, max(0, int(value)))
    except ValueError:
        log.warning("nodraft: NODRAFT_BUILD_NICE=%r is not a niceness (0-19); using %d",
                    value, BUILD_NICE)
        return BUILD_NICE


def as_a_build() -> None:
    """This thread (and what it starts from now on) as a build's: ``build_niceness()``
    (never made less nice than it is) and every core of the machine, not the engine's
    alone -- the requests' processes keep theirs, and a build pinned beside the engine's
    loop waited on it while another core idled (docs/BENCHMARKS.md, "First start under
    load")."""
    with contextlib.suppress(AttributeError, OSError):
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me,
                       max(build_niceness(), os.getpriority(os.PRIO_PROCESS, me)))
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))


def _as_a_background_build(parent_pid: int) -> None:
    """The server's builder: below the requests' priority (``build_niceness``), every core
    (not the engine's affinity), and death with the engine that started it
    (``PR_SET_PDEATHSIG``; gone already: exit)."""
    from nodraft.engine.launch import die_with_parent

    die_with_parent(parent_pid)
    as_a_build()


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][-300:] if lines else ""


def load(engine, folder: Path) -> int:
    """Load a store's graphs into the engine's compiled models; returns how many."""
    n = 0
    for name, model in engine.models.items():
        if model.compiled is not None and (folder / name).is_dir():
            n += model.compiled.load(folder / name)
    return n


# -- nodraft compile -----------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    from nodraft.micro.checkpoint import CHECKPOINT_DIR
    from nodraft.engine.launch import EngineConfig

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["build"]:  # the server's builder: the same, quieter
        argv = argv[1:]
    p = argparse.ArgumentParser(
        prog="nodraft compile", description="Build the compiled passes for this machine "
        "ahead of time (a Docker build stage, an init container); the server loads them "
        "at start. Use the server's --checkpoints, --max-running and --gemm.")
    p.add_argument("--checkpoints", default=str(CHECKPOINT_DIR))
    p.add_argument("--max-running", type=int, default=32,
                   help="as the server's --max-running: the KV cache's shape (32)")
    p.add_argument("--gemm", default="auto", choices=("auto", "torch"))
    p.add_argument("--compile-cache", default=None, help="as the server's --compile-cache: "
                   "where to keep them (default: "
                   "$NODRAFT_COMPILE_CACHE, else $XDG_CACHE_HOME/nodraft, else ~/.cache/nodraft)")
    p.add_argument("--print-path", action="store_true",
                   help="only print the folder this configuration's artifacts go to")
    p.add_argument("--workers", type=int, default=None,
                   help="processes compiling side by side (default: $NODRAFT_BUILD_WORKERS, "
                   "else one per core, at most 4; a server's own build: half as many)")
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-of", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.parent_pid is not None:  # started by a server's engine, or by a build
        _as_a_background_build(args.parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    home = cache_home(args.compile_cache)
    use_inductor_cache(home)
    store = Store(EngineConfig(args.checkpoints, max_running=args.max_running, gemm=args.gemm),
                  home)
    if args.worker_of is not None:  # one of a build's compiling processes
        folder = Path(args.worker_of)
        store._compile_into(folder, claimer(folder))
        return
    if args.print_path:
        print(store.path)
        return
    print(f"nodraft compile: {store.path}", flush=True)
    try:
        store.build(args.workers)
    except Exception as e:
        print(f"nodraft compile: failed: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"nodraft compile: done: {store.path}", flush=True)


if __name__ == "__main__":
    main()
