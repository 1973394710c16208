"""What sampling one token costs: top-p's nucleus from a full sort of the vocabulary,
from the top-k first (``engine.verify.kept``'s array operations), and by ``nodraft::kept``'s
radix select (micro/csrc/race.cpp; where nodraft's kernels load).

    python benchmarks/nucleus.py [--model micro] [--top-p 0.95] [--repeats 50] [--out FILE.json]

Rows of real logits: micro over held-out text of the standard library (``clients.bench``'s
code prompts), at temperature 0.7 and 1.0. For each row, ``target_probs`` is timed each way
in turn (one thread, median per row, then the median over rows); the top-k way is checked
to keep the sort's tokens exactly, the kernel's to keep them but where a token's mass
above lies within rounding of ``top_p`` (rows where any token differs are counted).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from nodraft.clients.bench import build_prompts
from nodraft.engine import verify
from nodraft.engine.verify import SamplingParams, target_probs
from nodraft.micro import gemm
from nodraft.micro.checkpoint import load_model, load_tokenizer


def full_sort(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """The reference: every token ranked (what ``target_probs`` did before)."""
    probs = (logits.float() / sp.temperature).softmax(-1)
    vals, order = probs.sort(dim=-1, descending=True)
    keep = (vals.cumsum(-1) - vals) < sp.top_p
    keep[..., 0] = True
    probs = probs.masked_fill(~keep.scatter(-1, order, keep), 0.0)
    return probs / probs.sum(-1, keepdim=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="micro")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--rows", type=int, default=64, help="logit rows per temperature")
    p.add_argument("--repeats", type=int, default=50, help="timings per row and way")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, tok = load_model(args.model), load_tokenizer()
    ids = [t for prompt in build_prompts(tok, 2)["code"] for t in prompt["ids"]]
    with torch.inference_mode():
        out = model(torch.tensor([ids[:1000]]))
    logits = (out[0] if isinstance(out, tuple) else out)[0]
    step = max(1, logits.shape[0] // args.rows)
    rows = logits[::step][:args.rows]
    result = {"command": "python benchmarks/nucleus.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "top_p": args.top_p, "rows": len(rows), "temperatures": {}}
    native = gemm.load()
    ways = ["full sort", "top-k first"] + ["nodraft::kept"] * native

    def probs(way: str, row: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
        if way == "full sort":
            return full_sort(row, sp)
        if way == "top-k first":
            os.environ["NODRAFT_RACE"] = "numpy"
        try:
            return target_probs(row, sp)
        finally:
            os.environ.pop("NODRAFT_RACE", None)

    for temperature in (0.7, 1.0):
        sp = SamplingParams(temperature=temperature, top_p=args.top_p)
        times: dict[str, list[float]] = {w: [] for w in ways}
        sizes, differ = [], 0
        for row in rows:
            want = full_sort(row, sp) > 0
            assert torch.equal(want, probs("top-k first", row, sp) > 0)
            if native:
                differ += not torch.equal(want, probs("nodraft::kept", row, sp) > 0)
            samples: dict[str, list[float]] = {w: [] for w in ways}
            for i in range(args.repeats):
                for way in (ways if i % 2 == 0 else ways[::-1]):
                    t = time.perf_counter()
                    probs(way, row, sp)
                    samples[way].append(time.perf_counter() - t)
            for way in ways:
                times[way].append(statistics.median(samples[way]))
            n = int(want.sum())
            sizes.append(next((k for k in verify.NUCLEUS_TOPK if n < k), "sort"))
        result["temperatures"][str(temperature)] = {
            "us": {w: round(statistics.median(times[w]) * 1e6, 1) for w in ways},
            "over_full_sort": {w: round(statistics.median(b / a for a, b in zip(
                times["full sort"], times[w])), 3) for w in ways[1:]},
            "found_in": {str(k): sizes.count(k) for k in (*verify.NUCLEUS_TOPK, "sort")},
            "kernel_rows_differing_from_the_sort": differ if native else None}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
