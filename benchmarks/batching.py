"""Continuous batching under load: ``nodraft loadtest`` at several concurrencies, ``none``
against ``auto``, against one real server started here.

    python benchmarks/batching.py [--concurrency 1,8,32] [--methods none,auto]
                                  [--requests-per-stream 6] [--max-tokens 64]
                                  [--rounds 3] [--threads 1] [--eager] [--out FILE.json]

For each concurrency the methods run in alternation, ``--rounds`` times, and the median
of each figure is reported (this machine is shared and noisy: only ratios in one run
carry). Each run sends ``concurrency * requests-per-stream`` streamed requests, every
request with the loadtest's built-in prompts (fresh and repeating, in turn). Reported per
(concurrency, method): aggregate generated tokens/s, TTFT and inter-token latency p50/p99,
errors; and the throughput at each concurrency over the single stream's.

The server is ``nodraft serve`` in a subprocess (``--threads`` torch threads, default 1,
so the load generator has a core of its own on a 2-core machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from nodraft.clients.loadtest import LoadConfig, run_loadtest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(threads: int, max_running: int, compile: bool = True
                 ) -> tuple[subprocess.Popen, str]:
    """The server, once it answers and its compiled passes are ready (their background
    compile would otherwise share the CPU with the first measurements)."""
    port = free_port()
    cmd = [sys.executable, "-m", "nodraft.server.cli", "serve", "--port", str(port),
           "--threads", str(threads), "--max-running", str(max_running),
           "--compile", "true" if compile else "false"]
    # its log goes to a file: a pipe nobody reads would fill with access lines and block it
    log = tempfile.NamedTemporaryFile("w+", prefix="nodraft-bench-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
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


def one(url: str, concurrency: int, method: str, n: int, max_tokens: int) -> dict:
    cfg = LoadConfig(url=url, concurrency=concurrency, requests=n, methods=[method],
                     max_tokens=max_tokens, stream=True, timeout=300)
    r = asyncio.run(run_loadtest(cfg))
    lat = r["latency_s"]
    return {
        "tokens_per_s": r["throughput"]["generated_tokens_per_s"],
        "ttft_p50_ms": 1e3 * lat["ttft"]["p50"], "ttft_p99_ms": 1e3 * lat["ttft"]["p99"],
        "itl_p50_ms": 1e3 * lat["inter_token"]["p50"], "itl_p99_ms": 1e3 * lat["inter_token"]["p99"],
        "errors": sum(r["errors"].values()), "requests": r["requests"]["sent"],
        "tokens_per_pass": (r["methods"][method] or {}).get("tokens_per_pass"),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--methods", default="none,auto")
    p.add_argument("--requests-per-stream", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eager", action="store_true", help="serve eager passes (default: compiled)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    methods = args.methods.split(",")
    proc, url = start_server(args.threads, max(levels), not args.eager)
    results: dict = {"command": "python benchmarks/batching.py " + " ".join(argv or sys.argv[1:]),
                     "cpus": os.cpu_count(), "threads": args.threads, "rows": []}
    try:
        for m in methods:  # warm up every code path once
            one(url, 2, m, 2, 8)
        for c in levels:
            runs: dict[str, list[dict]] = {m: [] for m in methods}
            for _ in range(args.rounds):
                for m in methods:
                    runs[m].append(one(url, c, m, c * args.requests_per_stream, args.max_tokens))
            for m in methods:
                row = {"concurrency": c, "method": m}
                for key in runs[m][0]:
                    vals = [r[key] for r in runs[m] if r[key] is not None]
                    row[key] = statistics.median(vals) if vals else None
                row["errors"] = sum(r["errors"] for r in runs[m])
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    single = {r["method"]: r["tokens_per_s"] for r in results["rows"] if r["concurrency"] == levels[0]}
    for r in results["rows"]:
        r["x_single_stream"] = r["tokens_per_s"] / single[r["method"]]
        none = next(x for x in results["rows"] if x["concurrency"] == r["concurrency"] and x["method"] == methods[0])
        r["x_" + methods[0]] = r["tokens_per_s"] / none["tokens_per_s"]
    print(render(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


def render(results: dict) -> str:
    lines = ["| streams | method | tokens/s | x one stream | x none | TTFT p50 / p99 ms | ITL p50 / p99 ms | errors |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        lines.append(f"| {r['concurrency']} | {r['method']} | {r['tokens_per_s']:.0f} | "
                     f"{r['x_single_stream']:.2f} | {r.get('x_none', float('nan')):.2f} | "
                     f"{r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} | "
                     f"{r['itl_p50_ms']:.2f} / {r['itl_p99_ms']:.2f} | {r['errors']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
