"""EAGLE's tree parameters, measured: how ``depth``, ``top_k`` and ``total_tokens`` trade
tokens per target pass against draft and verification cost on this machine.

    python benchmarks/eagle_sweep.py [--model micro] [--prompt fresh] [--tokens 64] [--repeats 5]
                                     [--grid 1,1,2 2,1,3 3,2,6 ...] [--threads 1]

Each grid point is ``depth,top_k,total_tokens``; each row is ``clients.measure``'s measured
speed-up over ``none`` (same prompt, same tokens, runs alternated, median), with the run's
figures. The head is the committed one (``micro/checkpoints/<model>-eagle.safetensors``);
re-run this after retraining it, and set ``Eagle.Params``' defaults from the table.
"""

from __future__ import annotations

import argparse
import sys

import torch

from clients.measure import default_prompts, encode_prompts, measured_speedup
from micro.checkpoint import CHECKPOINT_DIR, load_model, load_tokenizer

GRID = ["1,1,2", "2,1,3", "3,1,4", "4,1,5", "2,2,4", "3,2,6", "4,2,8", "3,3,8", "4,4,12",
        "6,4,16"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="micro")
    p.add_argument("--prompt", default="fresh", choices=["fresh", "repeating"])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--grid", nargs="*", default=GRID, help="depth,top_k,total_tokens ...")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.model, CHECKPOINT_DIR)
    prompt = encode_prompts(load_tokenizer(), default_prompts())[args.prompt]
    print(f"{args.model}, {args.prompt} prompt, {args.tokens} greedy tokens, median of "
          f"{args.repeats}, {torch.get_num_threads()} thread(s)")
    print("| depth | top_k | total_tokens | acceptance | tokens/pass | draft cost/pass "
          "| est. speed-up | measured speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for point in args.grid:
        depth, top_k, total = (int(v) for v in point.split(","))
        params = {"depth": depth, "top_k": top_k, "total_tokens": total}
        speedup, run, _ = measured_speedup(model, prompt, args.tokens, "eagle", params,
                                           args.repeats, args.model)
        s = run.stats
        print(f"| {depth} | {top_k} | {total} | {s.acceptance_rate:.0%} | "
              f"{s.tokens_per_pass:.2f} | {s.draft_cost / s.target_passes:.2f} | "
              f"{s.estimated_speedup:.2f} | **{speedup:.2f}x** |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
