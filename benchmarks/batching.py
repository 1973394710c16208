"""Continuous batching under load: ``nodraft loadtest`` at several concurrencies, ``none``
against ``auto``, greedy and sampled, against real servers started here.

    python benchmarks/batching.py [--concurrency 1,8,32] [--methods none,auto]
                                  [--sampling 0,0.8] [--requests-per-stream 6]
                                  [--max-tokens 64] [--rounds 3] [--threads 1] [--eager]
                                  [--before CHECKOUT] [--serve-args ARGS]
                                  [--before-args ARGS] [--out FILE.json]

For each concurrency the runs alternate -- servers, temperatures and methods in turn --
``--rounds`` times, and the median of each figure is reported (this machine is shared and
noisy: only ratios in one run carry). Each run sends ``concurrency * requests-per-stream``
streamed requests, every request with the loadtest's built-in prompts (fresh and
repeating, in turn); sampled runs (a temperature above 0 in ``--sampling``) are seeded
(``nodraft loadtest --seed``, the round's seed): every method and server generates the
same text for a prompt. Reported per (server, temperature, concurrency, method):
aggregate generated tokens/s (over the whole run, and *sustained*: while every user still
had a request in flight, ``loadtest.sustained_rate`` -- a drafter that ends some equal
requests early and not others frees users only in the run's tail, so only this figure
counts the steps it saved), TTFT and inter-token latency p50/p99, errors, the CPU time
the API process, the engine process and the load generator each spent per generated token
(from /proc: where both cores are full, the figure that says which process a change made
cheaper, steadier than tokens/s); the
throughput at each concurrency over the single stream's, over the first method's, and
with ``--before``, over the other server's.

The servers are ``nodraft serve`` in subprocesses (``--threads`` torch threads, default 1),
measured once their compiled passes are ready: ``after``, this checkout, and with
``--before CHECKOUT`` (``git worktree add /tmp/before <commit>``) ``before``, that
checkout's code (``checkouts.checkout_env``), idle but while measured. ``--serve-args`` and
``--before-args``: more ``nodraft serve`` flags for each (e.g. ``--before . --serve-args
"--kv-cache-dtype float16"``: this checkout against itself with another setting). The load generator
runs on the last core, the one each server's API process keeps (the engine process has the
first): on 2 cores, a client that roamed onto the engine's core measured the contention.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from nodraft.clients.loadtest import LoadConfig, run_loadtest

try:
    from checkouts import checkout_env, imported_from  # run as a script
except ImportError:  # imported as benchmarks.batching
    from benchmarks.checkouts import checkout_env, imported_from


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(threads: int, max_running: int, compile: bool = True, env: dict | None = None,
                 extra: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """The server, once it answers and its compiled passes are ready (their background
    compile would otherwise share the CPU with the first measurements)."""
    port = free_port()
    cmd = [sys.executable, "-m", "nodraft.server.cli", "serve", "--port", str(port),
           "--threads", str(threads), "--max-running", str(max_running),
           "--compile", "true" if compile else "false", *(extra or [])]
    # its log goes to a file: a pipe nobody reads would fill with access lines and block it
    log = tempfile.NamedTemporaryFile("w+", prefix="nodraft-bench-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True, env=env)
    print(f"server log: {log.name}", file=sys.stderr)  # kept: its compile time, its errors
    url = f"http://127.0.0.1:{port}"
    client = httpx.Client()  # one for the polls: a fresh one costs ~60 ms of CPU a call
    for _ in range(3000):
        if proc.poll() is not None:
            raise RuntimeError("the server exited: " + open(log.name).read()[-2000:])
        try:
            r = client.get(url + "/health", timeout=1)
            if r.status_code == 200 and r.json()["compiled"] != "warming":
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not come up")


def cpu_seconds(pid: int) -> float | None:
    """A process's CPU time so far, its threads' together, in nanoseconds' resolution
    (/proc's schedstat; clock ticks would be 10 ms, a one-stream run's whole figure); None
    where there is none."""
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # a thread that ended meanwhile
    except OSError:
        return None
    return total / 1e9


def engine_pid(api_pid: int) -> int | None:
    """The engine process a server's API process started: its child started by
    multiprocessing's spawn (the other is multiprocessing's resource tracker)."""
    try:
        children = [c for task in Path(f"/proc/{api_pid}/task").iterdir()
                    for c in (task / "children").read_text().split()]
        return next((int(c) for c in children
                     if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()), None)
    except OSError:
        return None


def one(url: str, concurrency: int, method: str, n: int, max_tokens: int,
        temperature: float = 0.0, seed: int | None = None,
        pids: tuple[int | None, int | None] = (None, None)) -> dict:
    """One loadtest run; with ``pids`` (the API and engine processes), the CPU each of
    them and this process (the load generator) spent per generated token."""
    cfg = LoadConfig(url=url, concurrency=concurrency, requests=n, methods=[method],
                     max_tokens=max_tokens, stream=True, timeout=300, temperature=temperature,
                     seed=seed if temperature > 0 else None)
    before = [cpu_seconds(p) if p else None for p in (*pids, os.getpid())]
    r = asyncio.run(run_loadtest(cfg))
    after = [cpu_seconds(p) if p else None for p in (*pids, os.getpid())]
    tokens = r["throughput"]["generated_tokens"] or 1
    cpu = {f"cpu_us_per_token_{k}": None if a is None or b is None else 1e6 * (b - a) / tokens
           for k, a, b in zip(("api", "engine", "client"), before, after)}
    lat = r["latency_s"]

    def ms(kind: str, q: str) -> float | None:  # None: no such gap (a whole answer in one chunk)
        return None if lat[kind] is None else 1e3 * lat[kind][q]

    return {
        "tokens_per_s": r["throughput"]["generated_tokens_per_s"],
        "sustained_tokens_per_s": r["throughput"]["sustained_tokens_per_s"],
        "ttft_p50_ms": ms("ttft", "p50"), "ttft_p99_ms": ms("ttft", "p99"),
        "itl_p50_ms": ms("inter_token", "p50"), "itl_p99_ms": ms("inter_token", "p99"),
        "errors": sum(r["errors"].values()), "requests": r["requests"]["sent"],
        "tokens_per_pass": (r["methods"][method] or {}).get("tokens_per_pass"),
        **cpu,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--methods", default="none,auto")
    p.add_argument("--sampling", default="0,0.8", help="temperatures (0: greedy)")
    p.add_argument("--requests-per-stream", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eager", action="store_true", help="serve eager passes (default: compiled)")
    p.add_argument("--before", help="a checkout of this repository served beside, as 'before'")
    p.add_argument("--serve-args", default="", help="more `nodraft serve` flags for this checkout")
    p.add_argument("--before-args", default="", help="more `nodraft serve` flags for --before")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    methods = args.methods.split(",")
    temps = [float(t) for t in args.sampling.split(",")]
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    results: dict = {"command": "python benchmarks/batching.py " + shlex.join(argv or sys.argv[1:]),
                     "cpus": os.cpu_count(), "threads": args.threads, "rows": []}
    try:
        servers["after"] = start_server(args.threads, max(levels), not args.eager,
                                        extra=shlex.split(args.serve_args))
        if args.before:
            env = checkout_env(args.before)
            where = imported_from(env)
            assert where.is_relative_to(Path(args.before).resolve()), where
            servers["before"] = start_server(args.threads, max(levels), not args.eager, env,
                                             shlex.split(args.before_args))
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) >= 2:  # the load generator on the last core, the one the API keeps
            os.sched_setaffinity(0, cores[-1:])  # (the servers, started, keep their own)
        pids = {name: (proc.pid, engine_pid(proc.pid)) for name, (proc, _) in servers.items()}
        for _, url in servers.values():
            for m in methods:  # warm up every code path once
                for t in temps:
                    one(url, 2, m, 2, 8, t, 0)
        for c in levels:
            runs: dict[tuple, list[dict]] = {}
            for r in range(args.rounds):
                for t in temps:
                    for name, (_, url) in servers.items():
                        for m in methods:
                            runs.setdefault((name, t, m), []).append(
                                one(url, c, m, c * args.requests_per_stream, args.max_tokens,
                                    t, 1000 * r, pids[name]))
            for (name, t, m), got in runs.items():
                row = {"server": name, "temperature": t, "concurrency": c, "method": m}
                for key in got[0]:
                    vals = [x[key] for x in got if x[key] is not None]
                    row[key] = statistics.median(vals) if vals else None
                row["errors"] = sum(x["errors"] for x in got)
                row["rounds_tokens_per_s"] = [x["tokens_per_s"] for x in got]
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)
    rows = results["rows"]

    def find(**kw) -> dict | None:
        return next((x for x in rows if all(x[k] == v for k, v in kw.items())), None)

    for r in rows:
        same = dict(server=r["server"], temperature=r["temperature"])
        r["x_single_stream"] = r["tokens_per_s"] / find(**same, concurrency=levels[0],
                                                        method=r["method"])["tokens_per_s"]
        r["x_" + methods[0]] = r["tokens_per_s"] / find(**same, concurrency=r["concurrency"],
                                                        method=methods[0])["tokens_per_s"]
        one_s = find(**same, concurrency=levels[0], method=r["method"])["sustained_tokens_per_s"]
        first_s = find(**same, concurrency=r["concurrency"],
                       method=methods[0])["sustained_tokens_per_s"]
        sus = r["sustained_tokens_per_s"]
        r["sustained_x_single_stream"] = sus / one_s if sus and one_s else None
        r["sustained_x_" + methods[0]] = sus / first_s if sus and first_s else None
        other = find(server="before", temperature=r["temperature"],
                     concurrency=r["concurrency"], method=r["method"])
        if r["server"] == "after" and other:
            r["x_before"] = r["tokens_per_s"] / other["tokens_per_s"]
    print(render(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


def render(results: dict) -> str:
    lines = ["| server | sampling | streams | method | tokens/s | x one stream | x none | "
             "sustained tokens/s | x one stream | x none | "
             "x before | TTFT p50 / p99 ms | ITL p50 / p99 ms | CPU us a token: API / engine / "
             "load generator | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        t = "greedy" if r["temperature"] == 0 else f"t={r['temperature']}"
        before = f"{r['x_before']:.2f}" if "x_before" in r else ""
        lines.append(f"| {r['server']} | {t} | {r['concurrency']} | {r['method']} | "
                     f"{r['tokens_per_s']:.0f} | {r['x_single_stream']:.2f} | "
                     f"{r.get('x_none', float('nan')):.2f} | "
                     f"{_f(r.get('sustained_tokens_per_s'), 0)} | "
                     f"{_f(r.get('sustained_x_single_stream'), 2)} | "
                     f"{_f(r.get('sustained_x_none'), 2)} | {before} | "
                     f"{_f(r['ttft_p50_ms'], 1)} / {_f(r['ttft_p99_ms'], 1)} | "
                     f"{_f(r['itl_p50_ms'], 2)} / {_f(r['itl_p99_ms'], 2)} | "
                     f"{' / '.join(_f(r.get('cpu_us_per_token_' + k), 0) for k in CPU_OF)} | "
                     f"{r['errors']} |")
    return "\n".join(lines)


CPU_OF = ("api", "engine", "client")


def _f(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


if __name__ == "__main__":
    main()
