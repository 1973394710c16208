"""Run another checkout of this repository with this interpreter: for A/B benchmarks.

    from checkouts import checkout_env   # a benchmark script's own folder is on sys.path
    env = checkout_env("/tmp/old")       # git worktree add /tmp/old <commit>
    subprocess.Popen([sys.executable, "-m", "nodraft.server.cli", "serve"], env=env)

The project installs as the ``nodraft`` namespace (``nodraft.server`` is the repository's
``server/`` folder, and so on: pyproject's package-dir mapping). An editable install
answers for ``nodraft.*`` from ITS checkout whatever the working directory is, so running
``python -m nodraft...`` inside another checkout would run this one's code. The
environment made here puts a folder first on ``PYTHONPATH`` whose ``nodraft/`` links to
the other checkout's folders (removed when the process that made it exits): imports find
it before the editable finder is asked. It also gives the checkout a
``TORCH_EXTENSIONS_DIR`` of its own (keyed by its path), so the two checkouts' builds of
nodraft's kernels -- one extension name, two sources -- never share a build folder.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

PACKAGES = ("micro", "drafters", "engine", "server", "clients")


def checkout_env(checkout: str | os.PathLike, base: dict | None = None) -> dict:
    """An environment (``base``, default this process's) whose ``python -m nodraft...``
    runs ``checkout``'s code."""
    checkout = Path(checkout).resolve()
    shim = Path(tempfile.mkdtemp(prefix="nodraft-checkout-")) / "nodraft"
    shim.mkdir()
    atexit.register(shutil.rmtree, shim.parent, ignore_errors=True)  # with this process
    for name in PACKAGES:
        if (checkout / name).is_dir():
            (shim / name).symlink_to(checkout / name)
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(shim.parent), *filter(None, [env.get("PYTHONPATH")])])
    key = hashlib.sha1(str(checkout).encode()).hexdigest()[:10]
    env["TORCH_EXTENSIONS_DIR"] = str(Path(tempfile.gettempdir()) / f"nodraft-extensions-{key}")
    return env


def imported_from(env: dict, module: str = "nodraft.server.cli") -> Path:
    """Where ``module`` is imported from under ``env`` (to check a shim took)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", f"import {module} as m; print(m.__file__)"],
                         env=env, capture_output=True, text=True, check=True)
    return Path(out.stdout.strip()).resolve()


def alternate(cmd: list[str], checkouts: dict[str, str | os.PathLike], rounds: int
              ) -> dict[str, list[dict]]:
    """``cmd`` run once per named checkout (under its ``checkout_env``) as a worker that
    first prints one JSON line -- ``{"error": why}`` if it cannot serve -- then answers each
    line it reads with one JSON line; each worker asked ``rounds`` times, the order of the
    checkouts alternated round by round (first to last, then last to first). Returns each
    checkout's answers in order; raises SystemExit with a worker's error."""
    import json
    import subprocess

    workers = {}
    try:
        for name, checkout in checkouts.items():  # one at a time: each may build first
            w = subprocess.Popen(cmd, env=checkout_env(checkout), stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
            workers[name] = w
            first = json.loads(w.stdout.readline() or '{"error": "the worker exited"}')
            if "error" in first:
                raise SystemExit(f"{name}: {first['error']}")
        answers: dict[str, list[dict]] = {name: [] for name in workers}
        order = list(workers)
        for r in range(rounds):
            for name in (order if r % 2 == 0 else order[::-1]):
                w = workers[name]
                w.stdin.write("round\n")
                w.stdin.flush()
                answers[name].append(json.loads(w.stdout.readline()))
        return answers
    finally:
        for w in workers.values():
            w.stdin.close()
            try:
                w.wait(timeout=120)
            except subprocess.TimeoutExpired:
                w.kill()
