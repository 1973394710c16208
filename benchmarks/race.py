"""What the sampling race costs a token: this tree's ``engine.sampling.race`` against
another tree's (``--before DIR``: a checkout, e.g. ``git worktree add /tmp/before REV``), or
this tree's two implementations of it against each other (``--kernel``: numpy array
operations against ``nodraft::race``, micro/csrc/race.cpp).

    python benchmarks/race.py (--before DIR | --kernel) [--rounds 12] [--tokens 256]
                              [--out FILE.json]

Three parts, one thread, the two races alternated (odd rounds in reverse order):

1. **agreement**: both races on the same random rows (some tokens removed, as top-k and
   top-p remove them) with the same seeds and positions: how often they pick the same
   token (the same race computed two ways agrees everywhere but at rounding ties);
2. **alone**: one call's time for 1, 4 and 16 rows of micro's vocabulary, logits over the
   temperature (the best of 7 repeats of 2,000 calls);
3. **in the engine**: ``none`` on micro, compiled passes loaded as the server loads them,
   one request of ``--tokens`` tokens at a time, greedy and seeded sampling (temperature
   0.8) with each race; microseconds per token (median over rounds) and the sampled
   token's cost over the greedy one. The sampled texts of both races are compared too.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from nodraft.engine import sampling, verify
from nodraft.engine.core import GenerationRequest
from nodraft.engine.verify import SamplingParams
from nodraft.micro import gemm

try:  # run as a script
    from inprocess import compiled_engine
except ImportError:  # imported as benchmarks.race
    from benchmarks.inprocess import compiled_engine


def load_before(tree: Path):
    """``engine/sampling.py`` of another checkout, as a module of its own."""
    spec = importlib.util.spec_from_file_location("before_sampling",
                                                  tree / "engine" / "sampling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def races(before) -> dict:
    """name -> race(scaled, noises, positions[, temperatures]) taking this tree's
    ``PositionNoise``."""
    kept: dict[int, object] = {}

    def old(scaled, noises, positions, temperatures=None):
        ns = [kept.setdefault(n.seed, before.PositionNoise(n.seed, n.vocab_size))
              for n in noises]
        if temperatures is not None:  # an older race takes logits over the temperature
            scaled = scaled.float() / torch.tensor(temperatures)[:, None]
        return before.race(scaled, ns, positions)

    return {"before": old, "after": sampling.race}


def kernels() -> dict:
    """This tree's two races: numpy's, then ``nodraft::race``."""
    if not gemm.load():
        raise SystemExit(f"nodraft's kernels did not load: {gemm.why()}")
    return {"numpy": sampling.race_numpy, "kernel": sampling.race_kernel}


def agreement(fns: dict, draws: int, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    noise = sampling.PositionNoise(9, vocab)
    same = total = 0
    for t in range(draws):
        rows = torch.randn(3, vocab, generator=gen) * 3
        rows[0, : vocab // 40] = float("-inf")  # removed tokens, as a filter removes them
        picks = [fn(rows.contiguous(), [noise] * 3, [t, t + 1, t + 2]) for fn in fns.values()]
        same += sum(a == b for a, b in zip(*picks))
        total += 3
    return {"rows": total, "same_token": same}


def alone(fns: dict, vocab: int, rounds: int) -> dict:
    out = {}
    noise = sampling.PositionNoise(9, vocab)
    for r in (1, 4, 16):
        rows = (torch.randn(r, vocab) * 3).contiguous()
        args = (rows, [noise] * r, list(range(r)))
        best = {k: float("inf") for k in fns}
        for i in range(rounds):
            for name in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
                fn = fns[name]
                for _ in range(200):
                    fn(*args)
                t0 = time.perf_counter()
                for _ in range(2000):
                    fn(*args)
                best[name] = min(best[name], (time.perf_counter() - t0) / 2000 * 1e6)
        out[f"{r} rows"] = {k: round(v, 1) for k, v in best.items()}
    return out


def in_engine(fns: dict, tokens: int, rounds: int) -> dict:
    from nodraft.micro.checkpoint import load_tokenizer

    engine = compiled_engine(max_running=8)
    prompt = load_tokenizer().encode("def add(a, b):\n    return a + b\n\ndef mul(a, b):")
    method, params = engine.registry.parse({"method": "none"})

    def run(sp: SamplingParams) -> tuple[float, list[int]]:
        got: list[int] = []

        def on(event) -> None:
            if event.kind == "step":
                got.extend(event.step.tokens)

        t0 = time.perf_counter()
        engine.submit(GenerationRequest("micro", prompt, tokens, sp, method, params), on)
        while engine.busy:
            engine.run_once()
        return (time.perf_counter() - t0) / len(got) * 1e6, got

    kinds = {"greedy": None, **{f"sampled, race {k}": k for k in fns}}
    us: dict[str, list[float]] = {k: [] for k in kinds}
    texts: dict[str, set] = {k: set() for k in fns}
    original = verify.race
    try:
        for i in range(rounds + 2):  # two rounds of warm-up
            order = list(kinds) if i % 2 == 0 else list(kinds)[::-1]
            for kind in order:
                race = kinds[kind]
                if race is None:
                    sp = SamplingParams()
                else:
                    verify.race = fns[race]
                    sp = SamplingParams(0.8, 1.0, 0, seed=i)
                t, got = run(sp)
                if i >= 2:
                    us[kind].append(t)
                    if race is not None:
                        texts[race].add((i, tuple(got)))
    finally:
        verify.race = original
    med = {k: statistics.median(v) for k, v in us.items()}
    old, new = fns
    return {"us_per_token": {k: round(v, 1) for k, v in med.items()},
            "range": {k: [round(min(v), 1), round(max(v), 1)] for k, v in us.items()},
            "sampled_over_greedy_us": {k: round(med[k] - med["greedy"], 1)
                                       for k in med if k != "greedy"},
            f"{new}_over_{old}_tokens_per_s": round(
                med[f"sampled, race {old}"] / med[f"sampled, race {new}"], 3),
            "same_sampled_text": texts[new] == texts[old]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--before", help="a checkout whose race to compare with")
    which.add_argument("--kernel", action="store_true",
                       help="numpy's race against nodraft::race, both of this tree")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--draws", type=int, default=3000)
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    fns = kernels() if args.kernel else races(load_before(Path(args.before)))
    vocab = 4096
    result = {
        "command": "python benchmarks/race.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{platform.machine()}, torch {torch.__version__}, "
                   f"{torch.backends.cpu.get_cpu_capability()}, 1 thread",
        "agreement": agreement(fns, args.draws, vocab),
        "alone_us_per_call": alone(fns, vocab, 7),
        "engine": in_engine(fns, args.tokens, args.rounds),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
