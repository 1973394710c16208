"""Continuous batching in process: the engine alone, no HTTP, ``none`` against ``auto``.

    python benchmarks/engine_load.py [--concurrency 1,8,32] [--requests-per-stream 6]
                                     [--max-tokens 64] [--rounds 2] [--threads 1]
                                     [--sampling 0,0.8] [--seed 0]
                                     [--no-response-store] [--prefix-cache-mb 64[,0]]
                                     [--kv-cache-dtype float32[,float16]]
                                     [--compile] [--out FILE.json]

Submits ``concurrency * requests-per-stream`` requests (the loadtest's built-in prompts, in
turn) to an ``Engine`` with ``concurrency`` slots and reports generated tokens/s until the
last finishes, methods alternated, ``--rounds`` times, the median; and *sustained*
tokens/s, counted until the last request's first step, while requests waited for every
slot that freed (``sustained_rate``: the whole run's figure does not count steps a drafter
saved some requests and not others). Without the server, the
event loop streaming responses does not share the engine thread's GIL and CPU, so this
shows what the engine itself does (``benchmarks/batching.py`` measures the served whole).

``--no-response-store``: suffix decoding keeps no previous responses (its ``close`` does
nothing). The built-in prompts repeat, so otherwise from the second request on a prompt the
store holds its greedy answer, and ``auto`` drafts it whole; this shows auto without that
help.

``--prefix-cache-mb``: the engine's prefix cache (``engine.prefix_cache``), fresh for each
run; several sizes are alternated, each row also over the first size's. The built-in
prompts repeat, so with a cache a prompt's blocks are kept from its first request on: a
best case for the cache, as real traffic shares less (a system prompt, a conversation's
earlier turns); ``0``: none, every prompt prefilled whole.

``--kv-cache-dtype``: the engine's KV cache element (``nodraft serve --kv-cache-dtype``);
several are alternated, each row also over the first's.

``--sampling``: temperatures, each measured apart (0: greedy); a sampled request i is seeded
``--seed + i`` (seeded sampling's drafter-invariant rule, as ``nodraft loadtest --seed``).

Eager passes unless ``--compile``: then the engine is built as the engine process builds it
and loads the compiled graphs built for this machine (``nodraft compile``; built first if
there are none), single-sequence and packed, and waits until they are ready. The packed
graphs are built for the server's cache (``--max-running``, 32 slots by default); an engine
here has one slot per stream, so only at 32 streams does the batch's pass run compiled.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from nodraft.clients.loadtest import PROMPTS
from nodraft.drafters.registry import Registry
from nodraft.micro.checkpoint import CHECKPOINT_DIR, load_model, load_tokenizer
from nodraft.engine.core import Engine, GenerationRequest
from nodraft.engine.launch import PREFIX_CACHE_BYTES
from nodraft.engine.verify import SamplingParams


def run(model, prompts: list[list[int]], registry: Registry, method: str, streams: int,
        requests: int, max_tokens: int, threads: int, temperature: float = 0.0,
        seed: int = 0, prefix_cache_bytes: int = PREFIX_CACHE_BYTES,
        kv_cache_dtype: str = "float32") -> tuple[float, float | None]:
    """Generated tokens/s of ``requests`` requests through an engine with ``streams`` slots
    (and a prefix cache of ``prefix_cache_bytes``, fresh: 0, none; a KV cache of
    ``kv_cache_dtype``): over the whole run, and sustained (``sustained_rate``; None when
    every request fits in the first batch)."""
    engine = Engine({"micro": model}, registry, eot_id=None, max_running=streams,
                    max_waiting=requests, threads=threads, prefix_cache_bytes=prefix_cache_bytes,
                    kv_cache_dtype=kv_cache_dtype)
    meth, params = registry.parse(method)
    done = threading.Semaphore(0)
    tokens = [0]
    errors: list[str] = []
    steps: list[tuple[float, int]] = []  # (when, tokens) of every step, in order
    last_admitted: list[float] = []  # when the last request submitted had its first step

    def callback(ev, last=False):
        if ev.kind == "step":
            tokens[0] += len(ev.step.tokens)
            steps.append((time.perf_counter(), len(ev.step.tokens)))
            if last and not last_admitted:
                last_admitted.append(steps[-1][0])
        elif ev.kind in ("finish", "error"):
            if ev.kind == "error":
                errors.append(ev.error)
            done.release()

    engine.start()
    try:
        t0 = time.perf_counter()
        for i in range(requests):
            sp = SamplingParams(temperature, seed=seed + i) if temperature else SamplingParams()
            engine.submit(GenerationRequest("micro", prompts[i % len(prompts)], max_tokens,
                                            sampling=sp, method=meth, params=params),
                          functools.partial(callback, last=i == requests - 1))
        for _ in range(requests):
            done.acquire()
        seconds = time.perf_counter() - t0
    finally:
        engine.stop()
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    sustained = (sustained_rate(steps, t0, last_admitted[0])
                 if requests > streams and last_admitted else None)
    return tokens[0] / seconds, sustained


def sustained_rate(steps: list[tuple[float, int]], start: float, end: float) -> float:
    """Tokens/s of the steps made from ``start`` until ``end``, the last request's first
    step: while requests waited, so every slot a request left was filled at once. The
    whole run's figure is its makespan's: equal requests finishing at about the same time,
    a drafter that ends some of them early (sampled text copies sporadically) frees slots
    only in the tail, where nothing waits to take them -- the same passes, as many as
    without it -- so its saved steps count only here."""
    return sum(n for t, n in steps if t <= end) / (end - start)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--methods", default="none,auto")
    p.add_argument("--requests-per-stream", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-response-store", action="store_true",
                   help="suffix decoding stores no previous responses")
    p.add_argument("--sampling", default="0", help="temperatures, comma-separated (0: greedy)")
    p.add_argument("--seed", type=int, default=0, help="sampled request i is seeded SEED + i")
    p.add_argument("--compile", action="store_true",
                   help="the compiled graphs built for this machine (built first if missing)")
    p.add_argument("--prefix-cache-mb", default=str(PREFIX_CACHE_BYTES >> 20),
                   help="the engine's prefix cache, MiB, comma-separated to alternate (0: none)")
    p.add_argument("--kv-cache-dtype", default="float32",
                   help="the KV cache's element, comma-separated to alternate: float32, float16")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from nodraft.drafters.suffix import SuffixDecoding
    close = SuffixDecoding.close
    if args.no_response_store:
        SuffixDecoding.close = lambda self, ctx: None
    try:
        measure(args, argv)
    finally:
        SuffixDecoding.close = close


def measure(args, argv) -> None:
    tok = load_tokenizer()
    model = load_model("micro", CHECKPOINT_DIR)
    if args.compile:
        model = compiled_engine(args.threads).models["micro"]
    prompts = [tok.encode(text) for text in PROMPTS.values()]
    registry = Registry()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    temperatures = [float(t) for t in args.sampling.split(",")]
    caches = [float(c) for c in args.prefix_cache_mb.split(",")]
    kvs = [k.strip() for k in args.kv_cache_dtype.split(",") if k.strip()]
    rows = []
    for streams in (int(c) for c in args.concurrency.split(",")):
        n = streams * args.requests_per_stream
        got = {(t, m, c, k): [] for t in temperatures for m in methods for c in caches
               for k in kvs}
        for k in kvs:  # warm-up
            run(model, prompts, registry, methods[0], streams, min(n, streams), args.max_tokens,
                args.threads, kv_cache_dtype=k)
        for _ in range(args.rounds):
            for t in temperatures:
                for m in methods:
                    for c in caches:
                        for k in kvs:
                            got[t, m, c, k].append(run(
                                model, prompts, registry, m, streams, n, args.max_tokens,
                                args.threads, t, args.seed, int(c * (1 << 20)), k))
        for t in temperatures:
            for c in caches:
                for k in kvs:
                    def med(m, c=c, k=k, i=0):
                        xs = [r[i] for r in got[t, m, c, k] if r[i] is not None]
                        return statistics.median(xs) if xs else None
                    base, base_s = med(methods[0]), med(methods[0], i=1)
                    for m in methods:
                        tps, sus = med(m), med(m, i=1)
                        rows.append({
                            "concurrency": streams, "temperature": t, "method": m,
                            "prefix_cache_mb": c, "kv_cache_dtype": k, "tokens_per_s": tps,
                            "runs": [r[0] for r in got[t, m, c, k]],
                            "x_first_method": tps / base,
                            "sustained_tokens_per_s": sus,
                            "sustained_runs": [r[1] for r in got[t, m, c, k]],
                            "sustained_x_first_method": None if sus is None else sus / base_s,
                            "x_first_prefix_cache": tps / med(m, caches[0]),
                            "x_first_kv_cache_dtype": tps / med(m, c, kvs[0])})
                        print(json.dumps(rows[-1]), file=sys.stderr)
    result = {"command": "python benchmarks/engine_load.py " + " ".join(argv or sys.argv[1:]),
              "threads": args.threads, "rows": rows}
    print(f"Command: `{result['command']}`\n")
    print(f"| streams | temperature | method | prefix cache MiB | KV cache | tokens/s | "
          f"x {methods[0]} | sustained tokens/s | x {methods[0]} | x prefix cache "
          f"{caches[0]:g} | x KV cache {kvs[0]} |\n"
          f"|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        sus = r["sustained_tokens_per_s"]
        sus_cols = ("- | -" if sus is None else
                    f"{sus:.0f} | {r['sustained_x_first_method']:.2f}")
        print(f"| {r['concurrency']} | {r['temperature']:g} | {r['method']} | "
              f"{r['prefix_cache_mb']:g} | {r['kv_cache_dtype']} | {r['tokens_per_s']:.0f} | "
              f"{r['x_first_method']:.2f} | {sus_cols} | {r['x_first_prefix_cache']:.2f} | "
              f"{r['x_first_kv_cache_dtype']:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def compiled_engine(threads: int):
    """An engine as the engine process builds it (not started): the compiled graphs built
    for this machine, loaded (and built first, in processes of their own, if there are
    none)."""
    from nodraft.engine.launch import EngineConfig
    from nodraft.engine.process import build_engine, start_warm_up

    config = EngineConfig(checkpoints=str(CHECKPOINT_DIR), threads=threads)
    engine = build_engine(config)
    start_warm_up(engine, config)
    while not (engine.compiled_ready or engine.compiled_error):
        time.sleep(0.2)
    if engine.compiled_error:
        raise RuntimeError(f"compiled passes failed: {engine.compiled_error}")
    return engine


if __name__ == "__main__":
    main()
