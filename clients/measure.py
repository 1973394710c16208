"""In-process measurement of drafters: the figures of one greedy decode, and measured
speed-up against ``none`` (same prompt, same tokens, same process, runs alternated,
median of at least 5), as docs/ARCHITECTURE.md defines it. Used by ``nodraft workshop`` and the
benchmarks.

The two prompts of the course's workshop are built at run time from held-out text of the
Python standard library (never trained on):

- **fresh**: the opening of a held-out function, which micro continues with new text;
- **repeating**: a held-out function shown whole, then its first lines again, so the
  continuation copies the context -- what prompt lookup and suffix decoding are for.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from nodraft.drafters import costs
from nodraft.drafters.registry import DrafterEnv, Registry
from nodraft.micro.corpus import split_documents
from nodraft.micro.model import KVCache, Micro
from nodraft.micro.tokenizer import Tokenizer
from nodraft.engine.process import freeze_heap
from nodraft.engine.sequence import Sequence
from nodraft.engine.stats import SpecStats
from nodraft.engine.verify import SamplingParams

FRESH_FROM = ("functools", "def total_ordering(cls):")
REPEAT_FROM = ("functools", "def _lt_from_gt(self, other):")


def _snippet(unit: str, anchor: str, n_chars: int) -> str:
    text = next(d.text for d in split_documents("heldout") if d.unit == unit)
    i = text.find(anchor)
    if i < 0:  # another Python's library: take the unit's middle instead
        i = len(text) // 2
    return text[i:i + n_chars]


def default_prompts() -> dict[str, str]:
    fresh = _snippet(*FRESH_FROM, 240)
    passage = _snippet(*REPEAT_FROM, 420)
    return {"fresh": fresh, "repeating": passage + "\n\n" + passage[:120]}


@dataclass
class Run:
    tokens: list[int]
    stats: SpecStats
    seconds: float  # decoding only: the prefill (the same for every drafter) and the
    # drafter's close hook after the last token (``Sequence.close``) left out


def decode(model: Micro, prompt: list[int], n_tokens: int, method: str = "none",
           params: dict | None = None, registry: Registry | None = None,
           shared: dict | None = None, model_name: str = "micro",
           heads: Path | None = None, sampling: SamplingParams | None = None,
           stop_ids: frozenset[int] = frozenset()) -> Run:
    """One decode, greedy unless ``sampling`` says otherwise (seeded: the same text under
    every drafter); ``heads``: where trained drafters find their weights (default: beside
    the checkpoints); ``stop_ids``: tokens that end it (a chat turn's end)."""
    registry = registry or Registry()
    meth, p = registry.parse({"method": method, **(params or {})})
    env = DrafterEnv(model_name, model, {} if shared is None else shared)
    if heads is not None:
        env.checkpoint_dir = Path(heads)
    drafter = registry.build(meth, p, env)
    cache = KVCache(model.config, 1)
    # the measured-cost figures' table: once per model and compiled state, in this cache
    cost = costs.current(model) or costs.measure(model, cache, 0,
                                                 costs.timing_start(cache.max_len))
    seq = Sequence(model, cache, 0, prompt, drafter, n_tokens, sampling or SamplingParams(),
                   stop_ids, method=meth, pass_cost=cost)
    # the drafter's close hook runs after the last token, as the engine runs it after the
    # request's last outputs: what it does (suffix decoding's store) is for later requests
    seq.defer_close = True
    out: list[int] = []
    with torch.inference_mode():
        seq.prefill()
        t0 = time.perf_counter()
        while not seq.done:
            out += seq.step().tokens
        seconds = time.perf_counter() - t0
        seq.close()
    return Run(out, seq.stats, seconds)


def alternated(model: Micro, prompt: list[int], n_tokens: int, method: str,
               params: dict | None = None, repeats: int = 5, model_name: str = "micro",
               shared=None, heads: Path | None = None, registry: Registry | None = None,
               sampling=None, stop_ids: frozenset[int] = frozenset()) -> list[tuple[Run, Run]]:
    """``repeats`` pairs (none's run, the drafter's run), decoded in turn so drift on a
    shared machine hits both, after an untimed warm-up of the drafter (what it compiles at
    its first use; then the heap is frozen, as the engine process freezes it); each pair
    checked to give the same tokens. ``sampling(r)``: repeat
    r's sampling parameters (None: greedy; seeded sampling gives every drafter the same
    text). Each drafter run starts with fresh per-request state and, by default, a fresh
    server (``shared``: a function returning the server-wide drafter state each run
    starts from); suffix decoding's store of responses is empty either way, so no run is
    helped by an earlier identical response."""
    reg = registry or Registry()
    state = shared or dict
    sp = sampling or (lambda r: None)
    decode(model, prompt, n_tokens, method, params, reg, state(), model_name, heads, sp(0),
           stop_ids)
    # what the warm-up compiled and loaded, out of the collector's reach, as the engine
    # process has it (``freeze_heap``): else a full collection walking the compiler's
    # objects stalls whichever run it falls in for up to ~0.1 s
    freeze_heap()
    pairs = []
    for r in range(repeats):
        b = decode(model, prompt, n_tokens, "none", None, reg, None, model_name, None, sp(r),
                   stop_ids)
        run = decode(model, prompt, n_tokens, method, params, reg, state(), model_name, heads,
                     sp(r), stop_ids)
        if run.tokens != b.tokens:
            what = "greedy output" if sp(r) is None else f"text (seed {sp(r).seed})"
            raise AssertionError(f"{method} changed the {what}")
        pairs.append((b, run))
    return pairs


def measured_speedup(model: Micro, prompt: list[int], n_tokens: int, method: str,
                     params: dict | None = None, repeats: int = 5,
                     model_name: str = "micro", shared=None,
                     heads: Path | None = None) -> tuple[float, Run, float]:
    """(median of none's time / the drafter's time, the drafter's last run, none's median
    seconds), greedy, over ``alternated`` runs."""
    pairs = alternated(model, prompt, n_tokens, method, params, repeats, model_name, shared,
                       heads)
    return (statistics.median(b.seconds / run.seconds for b, run in pairs), pairs[-1][1],
            statistics.median(b.seconds for b, _ in pairs))


def warmed_server(model: Micro, prompt: list[int] | list[dict], n_tokens: int,
                  method: str = "auto", model_name: str = "micro",
                  sampling: SamplingParams | None = None, heads: Path | None = None,
                  params: dict | None = None):
    """A function returning server-wide drafter state as a server leaves it after
    ``method`` requests (with ``params``) on ``prompt`` (other prompts than the one
    measured: one prompt's ids, or several ``{"ids", "stop_ids"}``), decoded with
    ``sampling`` (None: greedy): auto's acceptance estimates per drafter and match length,
    its drafting times, step overheads and rests, each call a fresh copy. Suffix
    decoding's global store is left out: responses to this prompt would not be in a fresh
    server's store either."""
    warm: dict = {}
    items = [{"ids": prompt}] if prompt and isinstance(prompt[0], int) else prompt
    for item in items:
        decode(model, item["ids"], n_tokens, method, params, shared=warm, model_name=model_name,
               heads=heads, sampling=sampling,
               stop_ids=frozenset(item.get("stop_ids", ())))
    kept = {k: v for k, v in warm.items() if k.startswith("auto_")}

    def shared() -> dict:
        return copy.deepcopy(kept)
    return shared


def encode_prompts(tok: Tokenizer, prompts: dict[str, str]) -> dict[str, list[int]]:
    return {k: tok.encode(v) for k, v in prompts.items()}
