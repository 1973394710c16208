"""What a batched pass's attention costs once its keys and values no longer fit in cache.

    python benchmarks/kv_traffic.py [--sequences 4,8,16,32] [--context 256] [--rounds 5]
                                    [--repeats 40] [--kv-cache-dtype float32[,float16]]
                                    [--out FILE.json]

A batch's pass (``nodraft::packed_block``, micro/csrc/block.cpp) carries one row per
sequence; each row attends, in each layer and head, over its own slot's cached rows. Those
rows are read once a pass, and past a few sequences they are not in any cache: at 32
sequences of ``--context`` rows micro's float32 keys and values are ``32 * 4 layers * 4
heads * context * 40 * 4 bytes * 2`` (42 MB at 256). Timed here, over micro's own weights
and a cache of the engine's shape (32 slots, on huge pages where the system gives them):

- the pass without its head at context 1 and at ``--context`` for each number of one-row
  sequences: the difference is the attention over the extra rows, reported per sequence,
  per cached row of one head (ns), and as the bytes of keys and values it read a second;
- the whole pass (head included) at ``--context`` for the largest batch, and the share of
  it that attention over the cached rows takes;
- this machine's streaming read on one core (a sum over a 64 MB float32 tensor): the
  ceiling the attention's reads approach once they come from memory.

``--kv-cache-dtype``: the cache's element types measured (``nodraft serve
--kv-cache-dtype``), each over a cache of its own, alternated pass for pass in the same
process: a float16 cache's rows are half the bytes; each figure is reported per type, and
every pass of the others over the first type's.

Shapes (and types) alternate within each of ``--rounds`` rounds; each figure is the median over
rounds of a round's median of ``--repeats`` passes. Needs nodraft's kernels (micro/gemm.py
builds them on AVX2 and AVX-512 CPUs).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from nodraft.engine.launch import KV_CACHE_DTYPES
from nodraft.micro.checkpoint import load_model
from nodraft.micro.model import KVCache
from nodraft.micro.packed import Segment


def timed(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls, after a few untimed ones."""
    for _ in range(5):
        fn()
    xs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs)


def streaming_read(repeats: int = 10) -> float:
    """Bytes a second one core reads summing a 64 MB float32 tensor (median)."""
    x = torch.randn(16 << 20)
    return x.numel() * 4 / timed(lambda: x.sum(), repeats)


def measure(sequences: list[int], context: int, rounds: int, repeats: int,
            dtypes: list[str]) -> dict:
    model = load_model("micro").eval()
    model.compile(lazy=True)
    if not model.compiled.block_serves(compile=True):
        sys.exit("nodraft's kernels do not serve on this machine: nothing to measure")
    c = model.config
    slots = max(sequences)
    caches = {d: KVCache(c, slots, dtype=getattr(torch, d)) for d in dtypes}
    if context + 2 > caches[dtypes[0]].max_len:
        sys.exit(f"--context must be below {caches[dtypes[0]].max_len - 1}")
    for cache in caches.values():
        cache.k.normal_()
        cache.v.normal_()

    def batch(d: str, n: int, start: int, logits: bool):
        segs = [Segment(slot=i, start=start, ids=[5 + i], pos=[start], logits=logits)
                for i in range(n)]
        return lambda: model.compiled.packed_block(segs, caches[d])

    shapes = [(n, start, False) for n in sequences for start in (1, context)]
    shapes.append((slots, context, True))
    got: dict[tuple, list[float]] = {(d, *s): [] for s in shapes for d in dtypes}
    roof = []
    with torch.inference_mode():
        for _ in range(rounds):
            for s in shapes:
                for d in dtypes:
                    got[(d, *s)].append(timed(batch(d, *s), repeats))
            roof.append(streaming_read())
    out = {}
    for d in dtypes:
        med = {s: statistics.median(got[(d, *s)]) for s in shapes}
        out[d] = summarise(med, sequences, context, c.head_dim, c.n_layers * c.n_heads,
                           statistics.median(roof), caches[d].k.element_size())
        out[d]["x_first"] = {f"{n},{start},{int(lg)}": statistics.median(
            a / b for a, b in zip(got[(d, n, start, lg)], got[(dtypes[0], n, start, lg)]))
            for n, start, lg in shapes}
    return out


def summarise(med: dict[tuple, float], sequences: list[int], context: int, head_dim: int,
              heads: int, roof: float, element: int = 4) -> dict:
    """The figures from the median seconds of each shape, ``med[(sequences, start,
    logits)]``: per batch, the attention over the ``context - 1`` extra cached rows (its
    pass at ``context`` less its pass at 1), per sequence, per cached row of one head
    (``heads``: layers x heads), and as keys and values of ``element`` bytes read a second;
    the whole pass of the largest batch and attention's share of it."""
    row_bytes = 2 * head_dim * element  # one cached row of one head: its key and its value
    rows = []
    for n in sequences:
        extra = med[(n, context, False)] - med[(n, 1, False)]
        per_row = extra / (n * heads * (context - 1))
        rows.append({"sequences": n, "pass_context_1_us": med[(n, 1, False)] * 1e6,
                     f"pass_context_{context}_us": med[(n, context, False)] * 1e6,
                     "attention_per_sequence_us": extra / n * 1e6,
                     "ns_per_cached_row_head": per_row * 1e9,
                     "gb_per_s": row_bytes / per_row / 1e9 if per_row else float("inf"),
                     "kv_mb_read": n * heads * context * row_bytes / 1e6})
    largest = max(sequences)
    whole = med[(largest, context, True)]
    attention = med[(largest, context, False)] - med[(largest, 1, False)]
    return {"rows": rows, "context": context, "whole_pass_us": whole * 1e6,
            "attention_share": attention / whole, "streaming_read_gb_per_s": roof / 1e9}


def render(results: dict, command: str) -> str:
    first = next(iter(results))
    lines = [f"Command: `{command}` ({platform.machine()}, torch {torch.__version__}, "
             f"1 thread; this machine reads "
             f"{results[first]['streaming_read_gb_per_s']:.1f} GB/s streaming on one core)",
             "", f"| KV cache | sequences | keys and values read, MB | pass without head, "
             f"context 1, us | same, context {results[first]['context']}, us | x {first} "
             f"| attention a sequence, us | ns a cached row of one head | GB/s read |",
             "|---|---|---|---|---|---|---|---|---|"]
    for d, r in results.items():
        ctx = r["context"]
        for row in r["rows"]:
            ratio = r["x_first"][f"{row['sequences']},{ctx},0"]
            lines.append(f"| {d} | {row['sequences']} | {row['kv_mb_read']:.1f} "
                         f"| {row['pass_context_1_us']:.0f} "
                         f"| {row[f'pass_context_{ctx}_us']:.0f} | {ratio:.2f} "
                         f"| {row['attention_per_sequence_us']:.1f} "
                         f"| {row['ns_per_cached_row_head']:.1f} | {row['gb_per_s']:.1f} |")
    lines.append("")
    for d, r in results.items():
        n, ctx = r["rows"][-1]["sequences"], r["context"]
        lines.append(f"- {d}: the whole pass of {n} sequences at context {ctx} "
                     f"{r['whole_pass_us']:.0f} us (x {first}: "
                     f"{r['x_first'][f'{n},{ctx},1']:.2f}), "
                     f"{100 * r['attention_share']:.0f}% of it attention over the cached rows.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sequences", default="4,8,16,32")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--kv-cache-dtype", default="float32",
                   help="the cache's element types, comma-separated: float32, float16")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    sequences = sorted({int(s) for s in args.sequences.split(",") if s.strip()})
    dtypes = [d.strip() for d in args.kv_cache_dtype.split(",") if d.strip()]
    if not sequences or sequences[0] < 1 or args.context < 2:
        sys.exit("--sequences must be positive and --context at least 2")
    if not dtypes or set(dtypes) - set(KV_CACHE_DTYPES):
        sys.exit(f"--kv-cache-dtype takes {', '.join(KV_CACHE_DTYPES)}")
    result = measure(sequences, args.context, args.rounds, args.repeats, dtypes)
    command = "python benchmarks/kv_traffic.py " + " ".join(argv if argv is not None
                                                           else sys.argv[1:])
    print(render(result, command.strip()))
    if args.out:
        Path(args.out).write_text(json.dumps({"command": command.strip(), **result}, indent=1))


if __name__ == "__main__":
    main()
