"""Warm starts of two checkouts, alternated: how long each takes from launch until
``/health`` answers and until it says ``"ready"``.

    python benchmarks/warm_start_ab.py --old DIR --new DIR [--starts 4] [--port 8140]
                                       [--compile-cache DIR] [--json-out FILE]

``--old`` and ``--new`` are checkouts of this repository (``git worktree add /tmp/old
<commit>``), each run with this interpreter on its own code (``checkouts.checkout_env``:
an editable install would otherwise run its own checkout for both). Both use one compile cache (default: a temporary
folder), and each checkout's artifacts are built first (``nodraft compile``, untimed), so
every timed start is a warm one. Starts alternate old/new, then new/old, so drift on a
shared machine hits both; ``/health`` is polled every 0.1 s on one kept HTTP client (a new
httpx client per poll costs tens of milliseconds of CPU, taken from the server timed).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

try:
    from checkouts import checkout_env, imported_from  # run as a script
except ImportError:  # imported as benchmarks.<name> (the tests)
    from benchmarks.checkouts import checkout_env, imported_from


def warm_start(cwd: str, env: dict, port: int, timeout: float = 120) -> tuple[float, float]:
    client = httpx.Client(timeout=1)
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "nodraft.server.cli", "serve", "--port", str(port)],
                            cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    health = ready = None
    try:
        while ready is None and time.time() - t0 < timeout:
            try:
                compiled = client.get(f"http://127.0.0.1:{port}/health").json().get("compiled")
                health = health or round(time.time() - t0, 2)
                if compiled == "ready":
                    ready = round(time.time() - t0, 2)
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    if ready is None:
        raise RuntimeError(f"{cwd}: not ready within {timeout} s")
    return health, ready


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--old", required=True)
    p.add_argument("--new", required=True)
    p.add_argument("--starts", type=int, default=4, help="timed starts of each")
    p.add_argument("--port", type=int, default=8140)
    p.add_argument("--compile-cache", default=None)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    cache = args.compile_cache or tempfile.mkdtemp(prefix="nodraft-warm-ab-")
    dirs = {"old": args.old, "new": args.new}
    envs = {name: checkout_env(cwd, {**os.environ, "NODRAFT_COMPILE_CACHE": cache})
            for name, cwd in dirs.items()}
    for name, cwd in dirs.items():  # untimed: the artifacts of each checkout
        where = imported_from(envs[name])
        assert where.is_relative_to(os.path.realpath(cwd)), (name, where)
        subprocess.run([sys.executable, "-m", "nodraft.server.cli", "compile"], cwd=cwd,
                       env=envs[name], check=True)
    out: dict[str, list] = {k: [] for k in dirs}
    for i in range(args.starts):
        for name in (("old", "new") if i % 2 == 0 else ("new", "old")):
            out[name].append(warm_start(dirs[name], envs[name], args.port))
            print(name, *out[name][-1], flush=True)
            time.sleep(1)
    result = {name: {"starts": v, "health_median": statistics.median(h for h, _ in v),
                     "ready_median": statistics.median(r for _, r in v)}
              for name, v in out.items()}
    result["ready_new_over_old"] = round(result["new"]["ready_median"]
                                         / result["old"]["ready_median"], 3)
    print(json.dumps(result, indent=1))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
