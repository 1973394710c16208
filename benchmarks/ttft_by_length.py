"""Time to first token by prompt length, on two running servers, alternated.

    python benchmarks/ttft_by_length.py --url A=http://127.0.0.1:8301 \\
                                        --url B=http://127.0.0.1:8302 \\
                                        [--lengths 4,70,250,1000] [--requests 15]

Start the servers first (``nodraft serve --port 8301 --threads 1`` and ``--threads 2``, say;
or two checkouts, ``checkouts.checkout_env``), with their compiled passes ready. Prompts are
the first N tokens of the standard library's ``argparse.py``; each request is streamed,
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
    prompts = {n: tok.decode(ids[:n]) for n in (int(x) for x in args.lengths.split(","))}
    clients = {k: httpx.Client(base_url=u, timeout=60) for k, u in urls.items()}
    for c in clients.values():
        for prompt in prompts.values():
            ttft(c, prompt)
    times: dict[tuple[str, int], list[float]] = {}
    names = list(clients)
    for i in range(args.requests):
        for name in (names if i % 2 == 0 else names[::-1]):
            for n, prompt in prompts.items():
                times.setdefault((name, n), []).append(ttft(clients[name], prompt))
    a, b = names
    print(f"| prompt tokens | {a} ms | {b} ms | {b} / {a} |\n|---|---|---|---|")
    for n in prompts:
        ma, mb = (statistics.median(times[(k, n)]) for k in (a, b))
        print(f"| {n} | {ma:.1f} | {mb:.1f} | {mb / ma:.2f} |")
    print(json.dumps({"command": "python benchmarks/ttft_by_length.py " + " ".join(
        argv if argv is not None else sys.argv[1:]),
        "ms": {f"{k}/{n}": v for (k, n), v in times.items()}}), file=sys.stderr)


if __name__ == "__main__":
    main()
