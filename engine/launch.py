"""Starting the engine process: its settings, its sockets, its first steps -- without torch.

    launched = launch(config)          # sockets bound, the process spawned, nothing awaited
    client = MPClient(config, observer, launched=launched)
    await client.start()               # waits for the engine to say it is serving

Nothing here imports torch, so ``nodraft serve`` starts the engine process first thing, and
the engine's interpreter imports torch, loads the checkpoints and its compiled graphs while
the API process is still importing its own modules: the two starts overlap, on cores of
their own. The process's first steps (``engine_main``) are cheap and come before any
import: it asks to die with its parent, ignores SIGINT and SIGTERM (the API process stops
it), and moves to its cores -- it was spawned with the API process's affinity -- and only
then imports the engine (``engine.process.run_engine_process``).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import zmq

PR_SET_PDEATHSIG = 1
PREFIX_CACHE_BYTES = 64 << 20  # per model: the prompt blocks kept (engine.prefix_cache)
# the KV cache's element types: float32 (the model's own), or float16 for float32 models,
# which halves the bytes a batch's attention reads (micro/csrc/block.cpp; docs/ARCHITECTURE.md)
KV_CACHE_DTYPES = ("float32", "float16")
SOCKETS_PREFIX = "nodraft-engine-"  # + the API process's pid: its sockets' folder


@dataclass
class EngineConfig:
    """Everything the engine needs, as plain data (it crosses into the engine process)."""

    checkpoints: str
    # Registry.targets() of the API's registry; {}: the built-ins and installed plugins
    drafters: dict[str, str] = field(default_factory=dict)
    max_running: int = 32
    max_waiting: int = 64
    threads: int | None = None  # torch threads; None: torch's default
    compile: bool = True  # compiled single-sequence passes, built in the background
    gemm: str = "auto"
    cores: list[int] | None = None  # CPU affinity of the engine process; None: unchanged
    # CPU affinity of the engine's ZeroMQ I/O thread (it writes every output to the socket);
    # None: the engine's own cores
    io_cores: list[int] | None = None
    log_level: str = "info"
    compile_cache: str | None = None  # engine.artifacts' folder; None: its default
    # s: while sequences run, a step whose request already has a token out waits up to
    # this long to go to the API with later ones (engine.process.EngineCore); 0: every step
    stream_interval: float = 0.0
    prefix_cache_bytes: int = PREFIX_CACHE_BYTES  # 0: no prefix cache
    kv_cache_dtype: str = "float32"  # KV_CACHE_DTYPES


@dataclass
class Launched:
    """An engine process spawned and the API's ends of its sockets: ``input`` (PUSH, bound
    here) and ``output_address`` (the PULL end, bound by ``MPClient.start``; the engine's
    PUSH connects before it exists and ZeroMQ delivers once it does)."""

    config: EngineConfig
    process: multiprocessing.process.BaseProcess
    directory: str  # the sockets' folder, removed when the client closes
    context: zmq.Context
    input: zmq.Socket
    output_address: str
    adopted: bool = False  # an MPClient took it over, and closes it

    def close(self) -> None:
        """Stop the process and free its sockets, unless a client took them over (the API
        failed to start, or was stopped before it could)."""
        if self.adopted:
            return
        self.adopted = True  # once
        if self.process.pid is not None:  # started
            self.process.kill()
            self.process.join(10)
        self.input.close(linger=0)
        self.context.term()
        shutil.rmtree(self.directory, ignore_errors=True)


def launch(config: EngineConfig) -> Launched:
    """Bind the request socket and spawn the engine process (multiprocessing's ``spawn``:
    a fresh interpreter, no OpenMP or torch state inherited). Returns at once."""
    remove_stale_socket_folders()
    directory = tempfile.mkdtemp(prefix=f"{SOCKETS_PREFIX}{os.getpid()}-")
    inbox, outbox = f"ipc://{directory}/in", f"ipc://{directory}/out"
    context = io_context(config)  # (this process moves to those cores next)
    process = multiprocessing.get_context("spawn").Process(
        target=engine_main, name="nodraft-engine", args=(config, inbox, outbox, os.getpid()))
    launched = Launched(config, process, directory, context, context.socket(zmq.PUSH), outbox)
    try:
        launched.input.setsockopt(zmq.LINGER, 0)
        launched.input.bind(inbox)
        process.start()
    except BaseException:  # a failed bind or spawn, a signal meanwhile: leave nothing
        launched.close()
        raise
    return launched


def io_context(config: EngineConfig) -> zmq.Context:
    """A ZeroMQ context whose I/O thread -- it does the socket writes -- runs on the API's
    cores (``config.io_cores``) when there are some: on the engine's core it preempted the
    engine thread at every message (docs/ARCHITECTURE.md, "The engine core is a process of
    its own"). The thread starts with the first socket, after this."""
    context = zmq.Context()
    for core in config.io_cores or ():
        context.set(zmq.THREAD_AFFINITY_CPU_ADD, core)
    return context


def remove_stale_socket_folders() -> None:
    """The socket folders of servers that are gone (one killed with SIGKILL cannot remove
    its own): each folder is named after its server's pid."""
    for folder in Path(tempfile.gettempdir()).glob(f"{SOCKETS_PREFIX}*-*"):
        pid = folder.name[len(SOCKETS_PREFIX):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def engine_main(config: EngineConfig, input_address: str, output_address: str,
                parent_pid: int) -> None:
    """The engine process's entry (multiprocessing's target): its cheap first steps, then
    the engine."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # spawned while the API blocked them (server.main): what this process starts (the
    # artifact build) must be stoppable
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    if config.cores:
        os.sched_setaffinity(0, config.cores)
    if config.compile:  # before torch's imports, which settle inductor's cache folder
        from nodraft.engine.artifacts import cache_home, use_inductor_cache

        use_inductor_cache(cache_home(config.compile_cache))
    from nodraft.engine.process import run_engine_process

    run_engine_process(config, input_address, output_address, parent_pid)


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies; exit now if it already has."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:
        os._exit(0)


def stop_children(sig: int = signal.SIGTERM) -> list[int]:
    """Send ``sig`` to every process whose parent is this one, and return their ids: what
    an exiting engine leaves would otherwise run on. Its build process dies with it
    (``die_with_parent``), but the compilers of nodraft's kernels are ``ninja``'s, which
    torch's extension build starts from the warm-up thread -- a server stopped midway
    left them compiling for minutes, into the build folder its next start builds in
    (``ninja`` stops its compilers when it is stopped). Reads ``/proc``; elsewhere a
    no-op."""
    me, stopped = os.getpid(), []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return stopped
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            # pid (comm) state ppid ...: comm may hold spaces and parentheses
            ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == me:
            try:
                os.kill(int(entry), sig)
                stopped.append(int(entry))
            except OSError:
                pass
    return stopped
