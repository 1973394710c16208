"""``nodraft::mm``: the matrix product of the compiled passes, for the few rows they carry.

A decode step multiplies 1 row by each weight matrix; a verification pass 2-17. MKL's
sgemm, which ``torch.mm`` calls, is built for large products: a 2-row product costs far
more than a 1-row one though every row reads the same weights. ``csrc/gemm.cpp`` holds a
tile of a few rows by a block of columns in registers and reads each weight once for all
of its rows: up to 6 rows by 64 columns on AVX-512, up to 6 rows by 16 columns on AVX2
(there one to three rows of a packed weight by several 16-column blocks at once, so that
enough sums are in flight: each multiply-add of a sum waits on the one before it).
The compiled passes and nodraft's one-call passes give it their weights packed (``pack``:
each 16-column block contiguous, read in order, so a weight that is not in cache streams
in instead of being fetched a 64-byte piece of a long row at a time). Whole compiled passes with each product, alternated in
one run: ``benchmarks/passes.py`` (docs/passes.json; docs/BENCHMARKS.md, "What a pass
costs").

It is also **batch-invariant**: every output element is one sum over k in order, however
many rows the call has and however its columns are split between threads
(tests/micro/test_gemm.py). A token's products are bit-identical whether the engine
verifies it alone or behind 16 drafted tokens: one place fewer where a 1-row and a k-row
pass disagree in the last bits. The attention around them still differs between block
sizes, so that speculative greedy equals plain greedy still rests on the equivalence
tests, as before.

The same library carries ``nodraft::race`` (``csrc/race.cpp``), seeded and unseeded
sampling's race (``engine.sampling``), which a process uses once it has loaded this one,
``nodraft::attend`` (``csrc/attend.cpp``), the packed graphs' attention for one-row
blocks (``attention``; micro/compiled.py), each slot over its own cached rows only, and
``nodraft::block`` / ``nodraft::packed_block`` (``csrc/block.cpp``), a lone sequence's and
a batch's whole pass in one call, which call this kernel directly (``csrc/gemm.h``).

Built at first use with ``torch.utils.cpp_extension`` (g++ -O3 with -mavx512f or -mavx2
-mfma -mf16c, 10-20 s once; then cached in torch's extensions folder, ``TORCH_EXTENSIONS_DIR``,
a folder per vector unit and per content of the sources, ``NAME``; a build stopped midway
never blocks the next, ``build_lock``),
on CPUs that report AVX-512 or AVX2 (``torch.backends.cpu.get_cpu_capability()``).
Elsewhere, or if the build fails, ``choose`` picks ``torch.mm`` and a warning says why.
``NODRAFT_GEMM=torch`` chooses ``torch.mm`` everywhere (the A/B the benchmarks run).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger("nodraft.gemm")

SOURCE = Path(__file__).with_name("csrc") / "gemm.cpp"
# built with it, into the same library: seeded sampling's race (engine/sampling.py) and
# the packed passes' attention for one-row blocks (micro/compiled.py)
SOURCES = (SOURCE, SOURCE.with_name("race.cpp"), SOURCE.with_name("attend.cpp"),
           SOURCE.with_name("block.cpp"))
HEADERS = (SOURCE.with_name("simd.h"), SOURCE.with_name("gemm.h"))


def _digest() -> str:
    """The sources' and headers' content, hashed: part of the extension's name, so that
    a library built from other sources is never loaded (torch's build, like ninja's,
    decides by file times, and a source replaced by an older-dated one, or edited while
    it compiled, left a library without the ops its code calls)."""
    h = hashlib.sha256()
    for f in SOURCES + HEADERS:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


# the extension's name, and its folder under TORCH_EXTENSIONS_DIR (one per content)
NAME = f"nodraft_gemm_{_digest()}"
CHOICES = ("auto", "torch")

_lock = threading.Lock()
_state: dict[str, object] = {}  # "loaded": bool, "why": str


# per vector unit: the extension's name (its own build folder) and compiler flags
BUILDS = {"AVX512": (NAME, ["-O3", "-mavx512f", "-mfma", "-mf16c"]),
          "AVX2": (NAME + "_avx2", ["-O3", "-mavx2", "-mfma", "-mf16c"])}
PACK = 16  # columns per block of a packed weight


def _build() -> tuple[bool, str]:
    unit = torch.backends.cpu.get_cpu_capability()
    if unit not in BUILDS:
        return False, f"this CPU's vector unit is {unit}, not AVX512 or AVX2"
    name, flags = BUILDS[unit]
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        with build_lock(Path(_get_build_directory(name, verbose=False))):
            load(name, [str(f) for f in SOURCES], extra_cflags=flags, is_python_module=False,
                 verbose=False)
    except Exception as e:  # no compiler, no headers: torch.mm serves
        return False, (f"building {', '.join(f.name for f in SOURCES)} failed: "
                       f"{str(e).strip().splitlines()[-1][:300]}")

    @torch.library.register_fake("nodraft::mm")
    def _(a: Tensor, b: Tensor) -> Tensor:
        return a.new_empty((a.shape[0], b.shape[0] * b.shape[2] if b.dim() == 3 else b.shape[1]))

    @torch.library.register_fake("nodraft::attend")
    def _(q: Tensor, k: Tensor, v: Tensor, kc: Tensor, vc: Tensor, src: Tensor,
          starts: Tensor, scale: float) -> Tensor:
        return q.new_empty((src.shape[0], q.shape[1], q.shape[2]))

    return True, f"built for {unit}"


@contextlib.contextmanager
def build_lock(directory: Path):
    """Hold the extension's build folder for this process: an ``flock``, which the kernel
    releases when its holder dies however it dies (SIGKILL included). torch's own build
    lock is a file (``lock``) that a build stopped midway leaves behind, and every later
    build then waits on it for ever; under this lock no other nodraft process can be
    building, so such a file is stale: it is logged and removed."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "nodraft.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another live process building: wait for it
        try:
            baton = directory / "lock"
            if baton.exists():
                log.warning("nodraft: removing %s, left by a build of %s that was stopped "
                            "before it finished", baton, NAME)
                baton.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def load() -> bool:
    """Build and register ``nodraft::mm`` once per process; True when it serves."""
    with _lock:
        if "loaded" not in _state:
            ok, why = _build()
            _state.update(loaded=ok, why=why,
                          unit=torch.backends.cpu.get_cpu_capability() if ok else None)
            if not ok:
                log.warning("nodraft::mm unavailable (%s); the compiled passes use torch.mm", why)
        return bool(_state["loaded"])


def loaded() -> bool:
    """Whether ``load()`` has run in this process and the library serves (never builds)."""
    return _state.get("loaded") is True


def unit() -> str | None:
    """The vector unit ``nodraft::mm`` was built for ('AVX512' or 'AVX2'); None before
    ``load()`` or where it did not build."""
    return _state.get("unit")  # type: ignore[return-value]


def pack(w: Tensor) -> Tensor:
    """A (K, N) weight as ``nodraft::mm`` reads it fastest: (N / 16, K, 16), each block of
    16 columns contiguous, once the library is loaded (float32, N a multiple of 16);
    otherwise ``w`` itself. Either way ``nodraft::mm(a, pack(w))`` equals
    ``nodraft::mm(a, w)`` bit for bit."""
    if unit() is None or w.dim() != 2 or w.dtype != torch.float32 or w.shape[1] % PACK:
        return w
    K, N = w.shape
    return w.detach().reshape(K, N // PACK, PACK).permute(1, 0, 2).contiguous()


def why() -> str:
    """Why ``load()`` returned what it did ('' before it ran)."""
    return str(_state.get("why", ""))


def expected(gemm: str | None = None) -> str:
    """What ``choose`` will pick on this CPU, without building anything: 'nodraft' where
    ``gemm`` (as in ``choose``) is 'auto' and the CPU has a vector unit the kernel is
    written for, else 'torch'. (A build that then fails still falls back to torch.mm.)
    The compiled passes' cache key uses this, so that reading the key never waits on a
    compiler (a first start would otherwise build the kernel before it serves)."""
    gemm = _parse(gemm)
    return "nodraft" if gemm == "auto" and torch.backends.cpu.get_cpu_capability() in BUILDS \
        else "torch"


def _parse(gemm: str | None) -> str:
    gemm = (gemm or os.environ.get("NODRAFT_GEMM") or "auto").strip().lower()
    if gemm not in CHOICES:
        raise ValueError(f"gemm must be one of {', '.join(CHOICES)}, not {gemm!r}")
    return gemm


def choose(gemm: str | None = None) -> str:
    """'nodraft' or 'torch': the product the compiled passes will use. ``gemm`` (default:
    ``NODRAFT_GEMM``, else 'auto'): 'auto' takes nodraft's kernel where it loads."""
    return "nodraft" if _parse(gemm) == "auto" and load() else "torch"


def attention(kind: str, head_dim: int, dtype: torch.dtype):
    """``nodraft::attend`` where ``kind`` is 'nodraft' (``choose``), the weights float32 and
    heads at most 128 wide (the kernel's contract, csrc/attend.cpp); else None."""
    if kind == "nodraft" and dtype == torch.float32 and 1 <= head_dim <= 128:
        return torch.ops.nodraft.attend.default
    return None


def matmul(kind: str):
    """The product function for ``kind`` ('nodraft' or 'torch'): f(a (M, K), b (K, N))."""
    return torch.ops.nodraft.mm.default if kind == "nodraft" else torch.mm
