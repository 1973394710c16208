"""A new user's first start, every method: empty caches, a server killed part-way into its
start, then one started again and sent a 32-token sampled completion of each of five
methods every few seconds while its passes compile. Run it from a fresh clone's venv.

    python benchmarks/first_start_methods.py [--kill-after 20] [--seconds 300] [--every 5]
                                             [--port 8123]

Prints when ``/health`` first answered, then every request's (time since the restart,
method, status, seconds) and ``/health``'s compile status, and a summary: how many
requests, how many 200s, and the slowest ones -- a request that waited on a compiler shows
as seconds where the others take a fraction of one.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

METHODS = ("none", "prompt_lookup", "early_exit", "eagle", "auto")


def start(port: int, env: dict, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def probe(url: str, seconds: float, every: float) -> list[tuple]:
    t0, rows = time.time(), []
    while time.time() - t0 < seconds:
        for m in METHODS:
            t = time.time()
            body = {"model": "micro-layerskip" if m == "early_exit" else "micro",
                    "prompt": "def add(a, b):", "max_tokens": 32, "temperature": 0.8,
                    "seed": 1, "speculation": m}
            try:
                status = httpx.post(url + "/v1/completions", json=body, timeout=120).status_code
            except httpx.HTTPError as e:
                status = type(e).__name__
            rows.append((round(t - t0, 1), m, status, round(time.time() - t, 3)))
        try:
            health = httpx.get(url + "/health", timeout=5).json().get("compiled")
        except httpx.HTTPError as e:
            health = type(e).__name__
        rows.append((round(time.time() - t0, 1), "health", health, 0.0))
        time.sleep(every)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kill-after", type=float, default=20.0)
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--every", type=float, default=5.0)
    p.add_argument("--port", type=int, default=8123)
    args = p.parse_args(argv)
    caches = tempfile.mkdtemp(prefix="nodraft-first-start-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{caches}/inductor",
               TORCH_EXTENSIONS_DIR=f"{caches}/extensions", XDG_CACHE_HOME=f"{caches}/xdg")
    url = f"http://127.0.0.1:{args.port}"
    with open(f"{caches}/serve.log", "a") as log:
        server, t0, healthy = start(args.port, env, log), time.time(), None
        while time.time() - t0 < args.kill_after:
            try:
                if healthy is None and httpx.get(url + "/health", timeout=1).status_code == 200:
                    healthy = round(time.time() - t0, 1)
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        print(f"first start: /health answered at {healthy} s; SIGKILL at {args.kill_after} s")
        server = start(args.port, env, log)
        try:
            rows = probe(url, args.seconds, args.every)
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
    for row in rows:
        print(row)
    requests = [r for r in rows if r[1] != "health"]
    ok = [r for r in requests if r[2] == 200]
    print(f"{len(requests)} requests, {len(ok)} answered 200 (the first at {ok[0][0] if ok else None} s); "
          f"slowest: {sorted(ok, key=lambda r: -r[3])[:5]}; server exit {server.returncode}; "
          f"caches and log in {caches}")


if __name__ == "__main__":
    main()
