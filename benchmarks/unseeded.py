"""Sampling without a seed, in process: this checkout's engine against another's.

    git worktree add /tmp/before <commit>
    python benchmarks/unseeded.py --before /tmp/before [--tokens 256] [--rounds 7]
                                  [--streams 8] [--top-p 1.0] [--out FILE.json]

What most sampled requests are -- OpenAI clients send no seed -- timed in the engine with
no server around it, compiled passes ready, 1 torch thread on the first core: each checkout
in a worker process of its own (``checkouts.checkout_env``), the two alternated in every
round (the order flipped each round), the prompt of ``serving.py``:

- one stream of ``none``, ``--tokens`` tokens, temperature 0.8 (top-k off, top-p
  ``--top-p``: 1.0, off, unless given), unseeded; greedy and seeded beside it, the
  references an unseeded token is compared with;
- ``--streams`` ``none`` streams at once (packed passes), seeded and unseeded, microseconds
  a token of their aggregate.

Reported: microseconds a token (the median of the rounds, and their range), each case's
after/before (the median and range of the rounds' own ratios), and what a sampled token
costs over a greedy one in each checkout. Unseeded texts differ between the checkouts
(torch's global stream, seeded with the round, feeds each rule differently),
and every request runs to its ``--tokens`` (the end of text does not stop it).

Drafters are left out: their speed follows their text (a loop repays prompt lookup many
times over), and the two checkouts' unseeded texts differ, so a drafter's before/after
would measure two texts. What the verification rule changes for them -- nothing in
expectation for drafts without q (``engine/verify.py``) -- the distribution tests check.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

try:  # run as a script
    from checkouts import checkout_env, imported_from
    from inprocess import compiled_engine
except ImportError:  # imported as benchmarks.unseeded
    from benchmarks.checkouts import checkout_env, imported_from
    from benchmarks.inprocess import compiled_engine

PROMPT = "def add(a, b):\n    return a + b\n\ndef mul(a, b):"
TEMPERATURE = 0.8
SINGLE = [("none", 0.0, False), ("none", TEMPERATURE, True), ("none", TEMPERATURE, False)]


def worker(tokens: int, top_p: float) -> None:
    """Reads ``method temperature seeded streams round`` lines; answers each with (tokens,
    seconds). Every request generates its ``tokens`` (the end of text does not stop it);
    torch's global stream, where unseeded requests draw their randomness, is seeded with the
    round before each case, so a checkout's unseeded texts are the same from run to run."""
    import torch

    from nodraft.engine.core import GenerationRequest
    from nodraft.engine.verify import SamplingParams
    from nodraft.micro.checkpoint import load_tokenizer

    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    engine = compiled_engine(max_running=32)
    prompt = load_tokenizer().encode(PROMPT)
    engine.eot_id = None  # every request runs to its max_tokens
    print("ready", flush=True)
    for line in sys.stdin:
        name, temperature, seeded, streams, round_ = line.split()
        torch.manual_seed(int(round_))
        seed = int(round_) if seeded == "1" else None
        method, params = engine.registry.parse({"method": name})
        count = [0]
        lock = threading.Lock()

        def on(event) -> None:
            if event.kind == "step":
                with lock:
                    count[0] += len(event.step.tokens)

        t0 = time.perf_counter()
        for _ in range(int(streams)):
            engine.submit(GenerationRequest("micro", prompt, tokens,
                                            SamplingParams(float(temperature), top_p=top_p,
                                                           seed=seed),
                                            method,
                                            params), on)
        while engine.busy:
            engine.run_once()
        print(f"{count[0]} {time.perf_counter() - t0}", flush=True)


class Worker:
    def __init__(self, env: dict, tokens: int, top_p: float):
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", "--tokens",
                                      str(tokens), "--top-p", str(top_p)], env=env,
                                     stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def run(self, method: str, temperature: float, seeded: bool, streams: int,
            round_: int) -> float:
        """Microseconds a generated token."""
        self.proc.stdin.write(f"{method} {temperature} {int(seeded)} {streams} {round_}\n")
        self.proc.stdin.flush()
        n, seconds = self.proc.stdout.readline().split()
        return float(seconds) / int(n) * 1e6

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def summary(us: dict[str, dict[str, list[float]]]) -> dict:
    out: dict = {"us_per_token": {}, "range": {}, "after_over_before": {}}
    for case, runs in us["after"].items():
        before = us["before"][case]
        out["us_per_token"][case] = {k: round(statistics.median(us[k][case]), 1)
                                     for k in ("before", "after")}
        out["range"][case] = {k: [round(min(us[k][case]), 1), round(max(us[k][case]), 1)]
                              for k in ("before", "after")}
        ratios = [b / a for a, b in zip(runs, before)]  # tokens/s after over before
        out["after_over_before"][case] = {"median": round(statistics.median(ratios), 3),
                                          "range": [round(min(ratios), 3),
                                                    round(max(ratios), 3)]}
    greedy = "none, greedy, 1 stream"
    out["sampled_over_greedy_us"] = {
        k: {case: round(v[k] - out["us_per_token"][greedy][k], 1)
            for case, v in out["us_per_token"].items() if case != greedy and "1 stream" in case}
        for k in ("before", "after")}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", help="another checkout (git worktree); required")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--top-p", type=float, default=1.0, help="sampled requests' top_p")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.tokens, args.top_p)
        return
    if not args.before:
        ap.error("--before CHECKOUT is required")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    env = checkout_env(args.before)
    here = Path(__file__).resolve().parents[1]
    assert imported_from(env, "nodraft.engine.core").is_relative_to(Path(args.before).resolve())
    workers = {"before": Worker(env, args.tokens, args.top_p),
               "after": Worker(os.environ.copy(), args.tokens, args.top_p)}
    assert imported_from(os.environ.copy(), "nodraft.engine.core").is_relative_to(here)
    cases = [(m, t, sd, 1) for m, t, sd in SINGLE] + [
        ("none", TEMPERATURE, sd, args.streams) for sd in (True, False)]

    def label(m: str, t: float, seeded: bool, s: int) -> str:
        kind = "greedy" if t == 0 else f"t={t} {'seeded' if seeded else 'unseeded'}"
        return f"{m}, {kind}, {s} stream{'s' * (s > 1)}"

    us = {k: {label(*c): [] for c in cases} for k in workers}
    try:
        for r in range(args.rounds + 1):  # the first round warms both up
            for case in cases:
                order = ["before", "after"] if (r + cases.index(case)) % 2 else ["after", "before"]
                for k in order:
                    t = workers[k].run(*case, r)
                    if r:
                        us[k][label(*case)].append(t)
            print(f"round {r} done", file=sys.stderr, flush=True)
    finally:
        for w in workers.values():
            w.close()
    result = {"command": "python benchmarks/unseeded.py " + " ".join(argv or sys.argv[1:]),
              "machine": platform.processor() or platform.machine(),
              "started_utc": started,
              "tokens": args.tokens, "rounds": args.rounds, "top_p": args.top_p,
              **summary(us), "raw_us": us}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
