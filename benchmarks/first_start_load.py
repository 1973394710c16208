"""A first start under load: how long a server kept busy from its first second takes to
finish building its compiled passes, at each niceness of that build, and what the
requests get meanwhile.

    python benchmarks/first_start_load.py [--nice 19,10] [--before CHECKOUT] [--streams 1]
                                          [--seconds 600] [--after 30] [--port 8127]
                                          [--json-out FILE]

For each niceness (``NODRAFT_BUILD_NICE``, in the order given, one start each; with
``--before``, a start of that checkout's code first, then this one's: ``checkouts.py``): a server
started on empty caches (a temporary folder for ``TORCHINDUCTOR_CACHE_DIR``,
``TORCH_EXTENSIONS_DIR`` and ``XDG_CACHE_HOME``, so that it builds nodraft's kernels and
its compiled passes anew), ``--streams`` clients sending 32-token completions back to back
from the launch on (refused connections retried every 0.1 s; six methods in turn, greedy
and temperature 0.8 alternately, seeded), ``/health`` read once a second. It stops
``--after`` seconds after ``/health`` says ``ready``, or at ``--seconds``. Reports, per
start: when the first completion succeeded, when the server was ready, the completions
(all statuses), and the completion tokens a second and the median latency while it built
and after it was ready.

Run it from a checkout's venv; every start is a first start, so each takes minutes. The
machine's other work changes every figure: compare the starts of one run.
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
import threading
import time

import httpx

METHODS = ("none", "auto", "prompt_lookup", "suffix", "eagle", "early_exit")


class Load:
    """``streams`` clients, each sending completions back to back until stopped; every
    answered request kept as (start, end, status, completion tokens), seconds since t0."""

    def __init__(self, url: str, t0: float, streams: int):
        self.url, self.t0 = url, t0
        self.done: list[tuple[float, float, int | str, int]] = []
        self.refused = 0
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._user, args=(u,), daemon=True)
                        for u in range(streams)]
        for t in self.threads:
            t.start()

    def _user(self, u: int) -> None:
        client = httpx.Client(timeout=300)
        i = u
        while not self.stop.is_set():
            method = METHODS[i % len(METHODS)]
            body = {"model": "micro-layerskip" if method == "early_exit" else "micro",
                    "prompt": "def add(a, b):", "max_tokens": 32,
                    "temperature": 0.8 if (i // len(METHODS)) % 2 else 0.0, "seed": i,
                    "speculation": method}
            i += 1
            start = time.time() - self.t0
            try:
                r = client.post(self.url + "/v1/completions", json=body)
            except httpx.ConnectError:
                self.refused += 1
                time.sleep(0.1)
                continue
            except httpx.HTTPError as e:
                self.done.append((start, time.time() - self.t0, type(e).__name__, 0))
                continue
            tokens = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0
            self.done.append((start, time.time() - self.t0, r.status_code, tokens))
        client.close()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=300)


def window(done: list, lo: float, hi: float) -> dict:
    """The completions that started and ended inside [lo, hi): tokens a second, median
    latency."""
    rows = [r for r in done if r[0] >= lo and r[1] < hi and r[2] == 200]
    span = hi - lo
    return {"seconds": round(span, 1), "completions": len(rows),
            "tokens_per_s": round(sum(r[3] for r in rows) / span, 1) if span > 0 else None,
            "latency_p50_s": round(statistics.median(r[1] - r[0] for r in rows), 4) if rows else None}


def first_start(nice: int, args, code: str, base: dict) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory(prefix="nodraft-first-load-") as tmp:
        env = {**base, "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor",
               "TORCH_EXTENSIONS_DIR": f"{tmp}/extensions", "XDG_CACHE_HOME": f"{tmp}/xdg",
               "NODRAFT_BUILD_NICE": str(nice)}
        env.pop("NODRAFT_COMPILE_CACHE", None)
        with open(f"{tmp}/server.log", "wb") as log:
            t0 = time.time()
            server = subprocess.Popen([sys.executable, "-m", "nodraft.server.cli", "serve",
                                       "--port", str(args.port)], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
            load = Load(url, t0, args.streams)
            ready = None
            health = httpx.Client(timeout=5)
            try:
                while time.time() - t0 < args.seconds:
                    if ready is None:
                        try:
                            if health.get(url + "/health").json().get("compiled") == "ready":
                                ready = time.time() - t0
                        except (httpx.HTTPError, ValueError):
                            pass
                    elif time.time() - t0 > ready + args.after:
                        break
                    if server.poll() is not None:
                        raise RuntimeError(f"the server exited ({server.returncode}); "
                                           f"log: {open(f'{tmp}/server.log').read()[-2000:]}")
                    time.sleep(1.0)
            finally:
                end = time.time() - t0
                load.close()
                os.killpg(server.pid, signal.SIGTERM)
                server.wait(timeout=60)
    done = load.done
    ok = [r for r in done if r[2] == 200]
    first = min((r[1] for r in ok), default=None)
    statuses: dict[str, int] = {}
    for r in done:
        statuses[str(r[2])] = statuses.get(str(r[2]), 0) + 1
    out = {"code": code, "nice": nice, "first_200_s": round(first, 2) if first is not None else None,
           "ready_s": round(ready, 1) if ready is not None else None,
           "stopped_s": round(end, 1), "statuses": statuses, "refused": load.refused}
    if first is not None:
        out["building"] = window(done, first, ready if ready is not None else end)
        if ready is not None:
            out["ready"] = window(done, ready, end)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nice", default="19,10",
                   help="the builds' niceness, one first start each, in this order")
    p.add_argument("--before", default=None,
                   help="another checkout (git worktree add PATH REV): each niceness "
                   "started with its code too, first")
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--after", type=float, default=30.0)
    p.add_argument("--port", type=int, default=8127)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    codes = [("after", dict(os.environ))]
    if args.before:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from checkouts import checkout_env

        codes.insert(0, ("before", checkout_env(args.before)))
    runs = []
    for nice in (int(n) for n in args.nice.split(",")):
        for code, base in codes:
            runs.append(first_start(nice, args, code, base))
            print(json.dumps(runs[-1]), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
