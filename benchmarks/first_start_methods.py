"""A new user's first start, every method, then a warm start. Run it from a fresh clone's
venv; every cache it uses is empty at the start (a temporary folder).

    python benchmarks/first_start_methods.py [--kill-after 20] [--seconds 900] [--every 5]
                                             [--port 8123] [--warm-starts 3]
                                             [--other-max-running 64] [--json-out FILE]

1. **Eager reference**: a ``--compile false`` server; each method's 32-token sampled
   completion (temperature 0.8, seeded), the median of 3, so the requests below have a
   latency to be compared with, measured in the same run.
2. **Cold start**: a server started with empty caches and killed (SIGKILL, its process
   group: the engine and the build with it) ``--kill-after`` seconds in; then one started
   again, sent a completion of each of five methods every ``--every`` seconds from its
   first second until its compiled passes are ready (or ``--seconds`` pass). Reports when
   ``/health`` first answered, when it said ``ready``, and each method's slowest latency
   meanwhile against its eager reference: each request against the same request on the
   eager server (a method's first against its first there, the later ones against the
   median of its later ones there).
3. **Warm starts**: that server stopped and a new one started on the same caches, then
   again (``--warm-starts`` in all): when ``/health`` answered and said ``ready``, and each
   method's first request after that. After the last one's five: a request of every
   drafter on both models (``GRID``: each pair's first on that server but for the five
   above), then the same again, against the same pair on the eager server (measured the
   same way in step 1) -- a request that waited on a compiler would take seconds, not
   milliseconds.
4. **Another ``--max-running``** (``--other-max-running``; 0 skips it): a server with
   that many slots on the same caches. Its cache shape is not the one built, so it builds
   its own passes while serving eagerly; once ready, the first request of every pair of
   ``GRID``, then a burst of eight concurrent requests (``none`` and ``auto``, several
   rows a pass) and the same burst again.

One HTTP client per server start, kept: a fresh httpx client per call costs about 60 ms of
CPU here (its TLS context), which an earlier version counted in every latency, and its
/health poll took a third of a core from the server it timed.
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

METHODS = ("none", "prompt_lookup", "early_exit", "eagle", "auto")
# every drafter on both bundled models: no first request of any of them, once /health
# says ready, may wait on a compiler
GRID = tuple((model, method) for model in ("micro", "micro-layerskip")
             for method in ("none", "prompt_lookup", "suffix", "lookahead", "early_exit",
                            "medusa", "eagle", "auto"))


def start(port: int, env: dict, log, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "nodraft.server.cli", "serve", "--port", str(port),
                             *extra], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop(server: subprocess.Popen, sig=signal.SIGTERM) -> None:
    os.killpg(server.pid, sig)
    server.wait(timeout=60)


def complete(client: httpx.Client, url: str, method: str,
             model: str | None = None) -> tuple[int | str, float]:
    body = {"model": model or ("micro-layerskip" if method == "early_exit" else "micro"),
            "prompt": "def add(a, b):", "max_tokens": 32, "temperature": 0.8, "seed": 1,
            "speculation": method}
    t = time.time()
    try:
        status = client.post(url + "/v1/completions", json=body, timeout=120).status_code
    except httpx.HTTPError as e:
        status = type(e).__name__
    return status, round(time.time() - t, 3)


def health(client: httpx.Client, url: str) -> str | None:
    try:
        r = client.get(url + "/health", timeout=1)
        return r.json().get("compiled") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


class Watch:
    """/health polled every 0.2 s from a server's launch: when it first answered, and when
    it first said ``ready``, in seconds since the launch."""

    def __init__(self, url: str, t0: float):
        self.url, self.t0 = url, t0
        self.answered = self.ready = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        client = httpx.Client()
        while not self.stop.is_set() and self.ready is None:
            h = health(client, self.url)
            if h is not None and self.answered is None:
                self.answered = round(time.time() - self.t0, 2)
            if h == "ready":
                self.ready = round(time.time() - self.t0, 2)
            time.sleep(0.2)

    def close(self) -> tuple[float | None, float | None]:
        self.stop.set()
        self.thread.join(timeout=5)
        return self.answered, self.ready


def grid(client: httpx.Client, url: str) -> dict[str, dict[str, float | int | str]]:
    """Each pair of ``GRID``'s first request on this server, then the same again."""
    out = {}
    for model, method in GRID:
        status, first = complete(client, url, method, model)
        status2, second = complete(client, url, method, model)
        out[f"{model}/{method}"] = {"first": first, "second": second,
                                    "status": status if status != 200 else status2}
    return out


def over_eager(pairs: dict, eager: dict) -> dict[str, float]:
    """Each pair's first request over the same pair's on the eager server."""
    return {pair: round(r["first"] / eager[pair]["first"], 2) for pair, r in pairs.items()}


def burst(url: str, n: int = 8) -> tuple[float, list]:
    """``n`` concurrent completions (``none`` and ``auto`` alternately): the wall time of
    all, and their statuses."""
    done: list = [None] * n

    def one(i: int) -> None:
        with httpx.Client() as c:
            done[i] = complete(c, url, ("none", "auto")[i % 2])

    t = time.time()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return round(time.time() - t, 3), sorted({str(st) for st, _ in done})


def wait_health(url: str, t0: float, until: str | None, timeout: float) -> tuple[float | None, float | None]:
    """(seconds until /health answered, seconds until it said ``until``)."""
    answered = said = None
    client = httpx.Client()
    while time.time() - t0 < timeout:
        h = health(client, url)
        if h is not None and answered is None:
            answered = round(time.time() - t0, 2)
        if answered is not None and (until is None or h == until):
            said = round(time.time() - t0, 2)
            break
        time.sleep(0.1)
    return answered, said


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kill-after", type=float, default=20.0)
    p.add_argument("--seconds", type=float, default=900.0)
    p.add_argument("--every", type=float, default=5.0)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--warm-starts", type=int, default=3)
    p.add_argument("--other-max-running", type=int, default=64)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    caches = tempfile.mkdtemp(prefix="nodraft-first-start-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{caches}/inductor",
               TORCH_EXTENSIONS_DIR=f"{caches}/extensions", XDG_CACHE_HOME=f"{caches}/xdg")
    env.pop("NODRAFT_COMPILE_CACHE", None)
    url = f"http://127.0.0.1:{args.port}"
    out: dict = {"caches": caches}
    with open(f"{caches}/serve.log", "a") as log:
        # 1. the eager reference
        server = start(args.port, env, log, "--compile", "false")
        wait_health(url, time.time(), None, 120)
        client = httpx.Client()
        eager, eager_first = {}, {}
        for m in METHODS:
            status, eager_first[m] = complete(client, url, m)  # its first: a fresh drafter state
            runs = [complete(client, url, m) for _ in range(3)]
            if any(st != 200 for st, _ in runs):
                raise SystemExit(f"the eager reference failed for {m}: {runs}")
            eager[m] = statistics.median(secs for _, secs in runs)
        out["eager_grid"] = grid(client, url)
        stop(server)
        out["eager_seconds"], out["eager_first_seconds"] = eager, eager_first
        print("eager reference (s):", eager, "first requests:", eager_first, flush=True)

        # 2. a cold start, killed part-way, then started again and probed until compiled
        server, t0 = start(args.port, env, log), time.time()
        answered, _ = wait_health(url, t0, None, args.kill_after)
        time.sleep(max(0.0, args.kill_after - (time.time() - t0)))
        stop(server, signal.SIGKILL)
        print(f"killed start: /health answered at {answered} s; SIGKILL at {args.kill_after} s",
              flush=True)
        client = httpx.Client()
        server, t0 = start(args.port, env, log), time.time()
        watch, rows = Watch(url, t0), []
        while time.time() - t0 < args.seconds and watch.ready is None:
            for m in METHODS:
                status, secs = complete(client, url, m)
                rows.append((round(time.time() - t0 - secs, 1), m, status, secs))
            print(rows[-5:], flush=True)
            time.sleep(args.every)
        answered, ready = watch.close()
        stop(server)
        requests = [r for r in rows if r[1] != "health"]
        served = [r for r in requests if r[2] == 200]
        worst = {m: max((r[3] for r in served if r[1] == m), default=None) for m in METHODS}
        # each request against the same request on the eager server: a method's first on a
        # server against the eager server's first (no history yet: auto's estimates, and
        # suffix decoding's tree of earlier outputs, where a repeated seeded request finds
        # its whole text), every later one against the eager server's later ones
        first = {m: next((r[3] for r in served if r[1] == m), None) for m in METHODS}
        ratios: dict[str, list[float]] = {m: [] for m in METHODS}
        for r in served:
            ratios[r[1]].append(r[3] / (eager_first if not ratios[r[1]] else eager)[r[1]])
        out["cold"] = {"killed_after": args.kill_after, "health": answered, "ready": ready,
                       "requests": len(requests), "answered_200": len(served),
                       "refused": len(requests) - len(served), "slowest": worst,
                       "slowest_over_eager": {m: round(max(ratios[m]), 2)
                                              for m in METHODS if ratios[m]},
                       "slowest_over_eager_median": {m: round(worst[m] / eager[m], 2)
                                                     for m in METHODS if worst[m]},
                       "first_over_eager_first": {m: round(first[m] / eager_first[m], 2)
                                                  for m in METHODS if first[m]},
                       "rows": rows}
        print("cold:", {k: v for k, v in out["cold"].items() if k != "rows"}, flush=True)

        # 3. warm starts on the same caches
        out["warm"] = []
        for i in range(args.warm_starts):
            client = httpx.Client()
            server, t0 = start(args.port, env, log), time.time()
            watch = Watch(url, t0)
            while watch.ready is None and time.time() - t0 < 300:
                time.sleep(0.05)
            answered, ready = watch.close()
            first = {m: complete(client, url, m) for m in METHODS}
            again = {m: complete(client, url, m)[1] for m in METHODS}
            every = grid(client, url) if i == args.warm_starts - 1 else None
            stop(server)
            out["warm"].append({"health": answered, "ready": ready,
                                "first_request": {m: s for m, (_, s) in first.items()},
                                "second_request": again,
                                "statuses": sorted({str(st) for st, _ in first.values()})})
            print("warm:", out["warm"][-1], flush=True)
        if args.warm_starts:
            out["warm_grid"] = every
            out["warm_grid_first_over_eager_first"] = over_eager(every, out["eager_grid"])
            print("every drafter after a warm start:", out["warm_grid_first_over_eager_first"],
                  flush=True)

        # 4. another --max-running: its own passes built, then every first request and bursts
        if args.other_max_running:
            client = httpx.Client()
            slots = str(args.other_max_running)
            server, t0 = start(args.port, env, log, "--max-running", slots), time.time()
            watch = Watch(url, t0)
            while watch.ready is None and time.time() - t0 < args.seconds:
                time.sleep(0.2)
            answered, ready = watch.close()
            other = {"max_running": args.other_max_running, "health": answered,
                     "ready": ready, "grid": grid(client, url),
                     "burst": [burst(url), burst(url)]}
            stop(server)
            other["grid_first_over_eager_first"] = over_eager(other["grid"], out["eager_grid"])
            out["other_max_running"] = other
            print("another --max-running:", other, flush=True)
    print(f"caches and log in {caches}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
