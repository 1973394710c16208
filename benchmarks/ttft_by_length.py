"""Time to first token by prompt length, on two running servers, alternated.

    python benchmarks/ttft_by_length.py --url A=http://127.0.0.1:8301 \\
                                        --url B=http://127.0.0.1:8302 \\
                                        [--lengths 4,70,250,1000] [--requests 15]

Start the servers first (``nodraft serve --port 8301 --threads 1`` and ``--threads 2``, say;
or two checkouts, ``checkouts.checkout_env``), with their compiled passes ready. Prompts are
N tokens of the standard library's ``argparse.py``, from a place of their own for every
request (never a prompt sent before: a server's prefix cache finds none of its blocks, and
each request times a whole prefill); each request is streamed,
greedy, ``none``, 2 tokens, timed from sending to the first generated token on one kept
HTTP client per server. Every length once on each server first (untimed), then
``--requests`` rounds, servers alternated. Prints the median ms per length and server,
and B over A.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import httpx

from nodraft.micro.checkpoint import load_tokenizer


def ttft(client: httpx.Client, prompt: str) -> float:
    body = {"model": "micro", "prompt": prompt, "max_tokens": 2, "stream": True,
            "temperature": 0, "speculation": "none"}
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("nodraft"):
                return 1e3 * (time.perf_counter() - t0)
    raise RuntimeError("no token")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", action="append", required=True, help="NAME=URL, twice")
    p.add_argument("--lengths", default="4,70,250,1000")
    p.add_argument("--requests", type=int, default=15)
    args = p.parse_args(argv)
    urls = dict(u.split("=", 1) for u in args.url)
    assert len(urls) == 2, "two servers: --url A=... --url B=..."
    tok = load_tokenizer()
    ids = tok.encode(open(os.path.join(os.path.dirname(os.__file__), "argparse.py")).read())
    lengths = [int(x) for x in args.lengths.split(",")]
    fresh = iter(range(0, len(ids), 7))  # each prompt starts 7 tokens after the last one's

    def prompt(n: int) -> str:
        start = next(fresh) % max(1, len(ids) - n)
        return tok.decode(ids[start:start + n])

    clients = {k: httpx.Client(base_url=u, timeout=60) for k, u in urls.items()}
    for c in clients.values():
        for n in lengths:
            ttft(c, prompt(n))
    times: dict[tuple[str, int], list[float]] = {}
    names = list(clients)
    for i in range(args.requests):
        for name in (names if i % 2 == 0 else names[::-1]):
            for n in lengths:
                times.setdefault((name, n), []).append(ttft(clients[name], prompt(n)))
    a, b = names
    print(f"| prompt tokens | {a} ms | {b} ms | {b} / {a} |\n|---|---|---|---|")
    for n in lengths:
        ma, mb = (statistics.median(times[(k, n)]) for k in (a, b))
        print(f"| {n} | {ma:.1f} | {mb:.1f} | {mb / ma:.2f} |")
    print(json.dumps({"command": "python benchmarks/ttft_by_length.py " + " ".join(
        argv if argv is not None else sys.argv[1:]),
        "ms": {f"{k}/{n}": v for (k, n), v in times.items()}}), file=sys.stderr)


if __name__ == "__main__":
    main()
