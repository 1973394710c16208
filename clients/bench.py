"""``nodraft bench``: the workload suite -- every drafter measured on the kinds of text people
generate, greedy and sampled, in process.

Categories (Spec-Bench's, mapped to micro's domain); every prompt is built at run time from
held-out text of the Python standard library (never trained on), functions taken in a fixed
order (``held_out_functions``):

- ``code``: a function's signature and docstring, continued -- fresh code;
- ``edit``: a function shown whole, then its opening again with the function renamed -- the
  continuation copies with a change (code editing);
- ``rag``: a function's docstring as a comment block in the context, then its signature and
  the docstring's first words -- the continuation quotes the source (RAG-like);
- ``chat``: two turns through the chat template (``server.chat``): the code and a question,
  an answer, a follow-up; the reply ends at the turn's end;
- ``long``: a long held-out passage (about 1,500 characters), continued.

Regimes: ``greedy``, and sampled at temperature 0.7 and 1.0 with ``top_p`` 0.95. Each repeat
samples with a seed of its own, and seeded sampling is drafter-invariant (the Gumbel-max
race over per-position noise): a drafter decodes the same text as ``none`` with that seed,
so the speed-up compares like with like; the harness checks that the tokens are the same.

Per (category, prompt, model, regime, drafter): acceptance rate, tokens per target pass,
the **measured speed-up** (``none``'s time over the drafter's, decoding only, runs
alternated, each repeat its own seed: the median of ``--repeats`` and its range; ``none``
itself is a column too, measured against itself alike: how far from 1.0x a figure can
read with nothing changed, which a drafter's speed-up must clear to be resolved) and the
**loop share** of the text: the fraction of generated tokens that complete a ``LOOP_N``-gram
already generated. A speed-up bought by a loop shows as a loop share near 1. Drafters start
each run from a fresh server (no state from an earlier request: suffix decoding's store is
empty, ``auto`` has no estimates yet), or with ``--server warm`` from the state of a server
that has served the other categories' prompts once in the same regime with the same drafter
(``auto``'s beliefs, step overheads and rests; suffix decoding's store is still empty, so no
run is helped by an earlier response).

    nodraft bench [--models micro,micro-layerskip] [--categories code,edit,rag,chat,long]
                  [--regimes greedy,t0.7,t1.0] [--methods ...] [--prompts 2] [--tokens 128]
                  [--repeats 5] [--threads 1] [--eager] [--server fresh|warm]
                  [--json-out F] [--md-out F] [--plot F]

A ``--methods`` item is a drafter's name, or its name and parameters as ``nodraft loadtest``
takes them -- ``lookahead:window=1:ngram=3:guesses=2`` -- so settings can be compared side
by side; each item is a column, labelled as given.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from nodraft.clients.loadtest import speculation
from nodraft.clients.measure import alternated, warmed_server
from nodraft.drafters.registry import Registry
from nodraft.engine.verify import SamplingParams
from nodraft.micro.checkpoint import CHECKPOINT_DIR, load_model, load_tokenizer
from nodraft.micro.corpus import split_documents
from nodraft.micro.tokenizer import Tokenizer

CATEGORIES = ("code", "edit", "rag", "chat", "long")
REGIMES = {"greedy": SamplingParams(),
           "t0.7": SamplingParams(temperature=0.7, top_p=0.95),
           "t1.0": SamplingParams(temperature=1.0, top_p=0.95)}
# ``none`` first: plain decoding measured against itself, as every drafter is -- the run's
# resolution (a speed-up within its spread of 1.0x is not resolved); never "best single"
METHODS = ("none", "prompt_lookup", "suffix", "early_exit", "medusa", "eagle", "lookahead",
           "auto")
LOOP_N = 4  # a token completing a 4-gram already generated counts as looping
SEED0 = 1000  # repeat r samples with seed SEED0 + r


# -- the prompts ---------------------------------------------------------------------------
def held_out_functions(min_lines: int = 6, max_chars: int = 1200) -> list[dict]:
    """Functions with a docstring from the held-out split's sources, the first of each
    module, in a fixed order (by module): each one's source, name, docstring and signature
    line."""
    out = []
    for doc in sorted(split_documents("heldout"), key=lambda d: d.unit):
        try:
            tree = ast.parse(doc.text)
        except SyntaxError:
            continue
        lines = doc.text.splitlines()
        found = []
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            docstring = ast.get_docstring(node)
            if not docstring or node.end_lineno - node.lineno + 1 < min_lines:
                continue
            src = "\n".join(lines[node.lineno - 1:node.end_lineno])
            body = node.body[0]
            head = "\n".join(lines[node.lineno - 1:body.end_lineno])  # signature + docstring
            if len(src) > max_chars or len(docstring) < 40 or head.count("\n") < 1:
                continue
            indent = len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())
            found.append({"unit": doc.unit, "line": node.lineno, "name": node.name,
                          "source": _dedent(src, indent), "head": _dedent(head, indent),
                          "docstring": docstring,
                          "signature": lines[node.lineno - 1].strip()})
        if found:
            out.append(min(found, key=lambda f: f["line"]))
    return out


def _label(f: dict) -> str:
    return f"{f['unit']}.{f['name']}"


def _dedent(text: str, n: int) -> str:
    return "\n".join(line[n:] if line[:n].strip() == "" else line for line in text.splitlines())


def _passages(n: int, chars: int = 1500) -> list[tuple[str, str]]:
    docs = sorted((d for d in split_documents("heldout") if len(d.text) > 3 * chars),
                  key=lambda d: d.unit)
    return [(d.unit, d.text[len(d.text) // 2:len(d.text) // 2 + chars]) for d in docs[:n]]


def build_prompts(tok: Tokenizer, per_category: int = 2) -> dict[str, list[dict]]:
    """category -> prompts: ``{"name", "ids", "stop_ids"}``; each category takes its own
    functions (no two categories share one)."""
    from nodraft.server.chat import render, stop_token_ids

    funcs = held_out_functions()
    need = per_category * 4
    if len(funcs) < need:
        raise RuntimeError(f"only {len(funcs)} held-out functions with docstrings; need {need}")
    pick = {c: funcs[i * per_category:(i + 1) * per_category]
            for i, c in enumerate(("code", "edit", "rag", "chat"))}
    out: dict[str, list[dict]] = {c: [] for c in CATEGORIES}
    for f in pick["code"]:
        out["code"].append({"name": _label(f), "ids": tok.encode(f["head"] + "\n")})
    for f in pick["edit"]:
        renamed = f["name"] + "_v2"
        opening = "\n".join(f["source"].splitlines()[:3]).replace(f["name"], renamed, 1)
        out["edit"].append({"name": _label(f),
                            "ids": tok.encode(f["source"] + "\n\n\n" + opening + "\n")})
    for f in pick["rag"]:
        notes = "\n".join("# " + line for line in f["docstring"].splitlines())
        words = " ".join(f["docstring"].split()[:3])
        text = f"# Reference for {f['name']}:\n{notes}\n\n{f['signature']}\n    \"\"\"{words}"
        out["rag"].append({"name": _label(f), "ids": tok.encode(text)})
    for f in pick["chat"]:
        first = f["docstring"].split("\n\n")[0].replace("\n", " ")
        ids = render([("user", f"What does this function do?\n\n{f['source']}"),
                      ("assistant", first),
                      ("user", "Write a shorter version of it.")], tok)
        out["chat"].append({"name": _label(f), "ids": ids,
                            "stop_ids": sorted(stop_token_ids(tok))})
    for unit, text in _passages(per_category):
        out["long"].append({"name": f"{unit} (middle)", "ids": tok.encode(text)})
    return out


# -- the measurement -----------------------------------------------------------------------
def loop_share(tokens: list[int], n: int = LOOP_N) -> float:
    """The fraction of ``tokens`` that complete an ``n``-gram already seen earlier in them."""
    seen: set[tuple[int, ...]] = set()
    looping = 0
    for i in range(n - 1, len(tokens)):
        gram = tuple(tokens[i - n + 1:i + 1])
        if gram in seen:
            looping += 1
        seen.add(gram)
    return looping / len(tokens) if tokens else 0.0


def regime_sampling(regime: str, repeat: int) -> SamplingParams:
    """The sampling parameters of ``regime``'s repeat ``repeat``: greedy as it is; sampled
    with seed SEED0 + repeat (every drafter decodes the same text for it)."""
    sp = REGIMES[regime]
    if sp.greedy:
        return sp
    return SamplingParams(sp.temperature, sp.top_p, sp.top_k, seed=SEED0 + repeat)


def measure(model, name: str, prompt: dict, regime: str, method: str, params: dict,
            tokens: int, repeats: int, registry: Registry, heads: Path | None = None,
            shared=None) -> dict:
    """One row: ``method`` against ``none`` on one prompt in one regime, alternated;
    ``heads``: where trained drafters' weights are (default: the bundled checkpoints');
    ``shared``: a function returning the server-wide state each run starts from (default:
    a fresh server's)."""
    pairs = alternated(model, prompt["ids"], tokens, method, params, repeats, name, shared,
                       heads=heads, registry=registry,
                       sampling=lambda r: regime_sampling(regime, r),
                       stop_ids=frozenset(prompt.get("stop_ids", ())))
    ratios = [b.seconds / run.seconds for b, run in pairs]
    base = [len(b.tokens) / b.seconds for b, _ in pairs]
    runs = [run for _, run in pairs]
    passes = sum(r.stats.target_passes for r in runs)
    drafted = sum(r.stats.drafted for r in runs)
    return {"method": method, "params": params,
            "speedup": statistics.median(ratios), "speedup_min": min(ratios),
            "speedup_max": max(ratios),
            "tokens_per_pass": (sum(r.stats.accepted for r in runs) + passes) / max(passes, 1),
            "acceptance_rate": (sum(r.stats.accepted for r in runs) / drafted) if drafted else None,
            "loop_share": statistics.median(loop_share(r.tokens) for r in runs),
            "tokens": statistics.median(len(r.tokens) for r in runs),
            "none_tokens_per_s": statistics.median(base)}


def summarise(rows: list[dict]) -> list[dict]:
    """Per (model, regime, category): each method's speed-up, the median over the
    category's prompts, and which single drafter was best (neither ``auto`` nor ``none``,
    measured against itself; None if no other was run)."""
    groups: dict[tuple, dict[str, list]] = {}
    for row in rows:
        key = (row["model"], row["regime"], row["category"])
        groups.setdefault(key, {}).setdefault(row["method"], []).append(row)
    out = []
    for (model, regime, category), by_method in groups.items():
        speedups = {m: statistics.median(r["speedup"] for r in rs) for m, rs in by_method.items()}
        singles = {m: s for m, s in speedups.items() if m.split(":")[0] not in ("auto", "none")}
        best = max(singles, key=singles.get) if singles else None
        out.append({"model": model, "regime": regime, "category": category,
                    "speedups": speedups, "best": best,
                    "loop_share": statistics.median(r["loop_share"] for rs in by_method.values()
                                                    for r in rs),
                    "tokens_per_pass": {m: statistics.median(r["tokens_per_pass"] for r in rs)
                                        for m, rs in by_method.items()}})
    return out


def render(result: dict) -> str:
    methods = result["methods"]
    state = ("every run from a fresh server" if result.get("server", "fresh") == "fresh" else
             "every run from a server that has served the other categories' prompts")
    lines = [f"Command: `{result['command']}` ({result['tokens']} tokens, median of "
             f"{result['repeats']} alternated runs, {result['machine']}; {state})", "",
             "| model | regime | category | loop share | " + " | ".join(methods)
             + " | best single |",
             "|---|---|---|---|" + "---|" * len(methods) + "---|"]
    for s in result["summary"]:
        cells = []
        for m in methods:
            x = s["speedups"].get(m)
            cell = "n/a" if x is None else f"{x:.2f}x ({s['tokens_per_pass'][m]:.2f})"
            cells.append(f"**{cell}**" if m == s["best"] else cell)
        lines.append(f"| {s['model']} | {s['regime']} | {s['category']} | "
                     f"{s['loop_share']:.0%} | " + " | ".join(cells) + f" | {s['best']} |")
    lines += ["", "Each cell: measured speed-up against `none` (tokens per target pass); "
              "loop share: the generated tokens that complete a 4-gram already generated."]
    if "none" in methods:
        lines[-1] += (" The `none` column is plain decoding measured against itself: how "
                      "far from 1.00x a figure reads with nothing changed.")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(s["model"], s["regime"]) for s in result["summary"]})
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.6 * len(panels)), squeeze=False)
    methods = result["methods"]
    for ax, (model, regime) in zip(axes[:, 0], panels):
        rows = [s for s in result["summary"] if (s["model"], s["regime"]) == (model, regime)]
        width = 0.8 / len(methods)
        for j, m in enumerate(methods):
            ax.bar([i + j * width for i in range(len(rows))],
                   [s["speedups"].get(m, 0) for s in rows], width, label=m)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))],
                      [s["category"] for s in rows])
        ax.set_title(f"{model}, {regime}: measured speed-up against none")
    axes[0, 0].legend(ncol=len(methods), fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="nodraft bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="micro,micro-layerskip")
    p.add_argument("--categories", default=",".join(CATEGORIES))
    p.add_argument("--regimes", default=",".join(REGIMES))
    p.add_argument("--methods", default=",".join(METHODS),
                   help="drafters, each a name or name:key=value[:...]")
    p.add_argument("--prompts", type=int, default=2, help="prompts per category")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eager", action="store_true", help="eager passes (default: compiled)")
    p.add_argument("--checkpoints", default=str(CHECKPOINT_DIR))
    p.add_argument("--server", choices=("fresh", "warm"), default="fresh",
                   help="the server-wide state every run starts from: a fresh server's, or "
                   "(warm) one that has served the other categories' prompts once in the "
                   "same regime with the same drafter (auto's beliefs and rests; never "
                   "suffix decoding's store of responses)")
    p.add_argument("--json-out", default=None)
    p.add_argument("--md-out", default=None)
    p.add_argument("--plot", default=None, help="a PNG of speed-up by category and drafter")
    args = p.parse_args(argv)
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    categories, regimes, methods = split(args.categories), split(args.regimes), split(args.methods)
    for bad, known, what in ((set(categories) - set(CATEGORIES), CATEGORIES, "categories"),
                             (set(regimes) - set(REGIMES), tuple(REGIMES), "regimes")):
        if bad:
            p.error(f"unknown {what} {sorted(bad)}; known: {', '.join(known)}")
    registry = Registry()
    specs = {}
    for item in methods:
        try:
            spec = speculation(item)
            registry.parse(spec)
        except ValueError as e:  # SpeculationError is one
            p.error(f"--methods {item!r}: {e}")
        specs[item] = (spec.pop("method"), spec)
    if len(specs) < len(methods):
        p.error("--methods lists an item twice")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot needs matplotlib (pip install matplotlib)")
    torch.set_num_threads(args.threads)
    tok = load_tokenizer()
    prompts = build_prompts(tok, args.prompts)
    rows, t0 = [], time.time()

    @functools.lru_cache(maxsize=None)
    def warm(model, name: str, category: str, regime: str, method: str):
        """The state of a server that has served the other categories' prompts once, in
        ``regime`` (sampled: seed ``SEED0 - 1``, a text no measured repeat decodes)."""
        others = [q for c in CATEGORIES if c != category for q in prompts[c]]
        sp = REGIMES[regime]
        if not sp.greedy:
            sp = SamplingParams(sp.temperature, sp.top_p, sp.top_k, seed=SEED0 - 1)
        meth, params = specs[method]
        return warmed_server(model, others, args.tokens, meth, name, None if sp.greedy else sp,
                             Path(args.checkpoints), params)

    for name in split(args.models):
        model = load_model(name, Path(args.checkpoints)).compile(not args.eager)
        for category in categories:
            for prompt in prompts[category]:
                for regime in regimes:
                    for method in methods:
                        shared = None
                        if args.server == "warm":
                            shared = warm(model, name, category, regime, method)
                        row = measure(model, name, prompt, regime, *specs[method], args.tokens,
                                      args.repeats, registry, Path(args.checkpoints), shared)
                        row.update(method=method, model=name, category=category,
                                   prompt=prompt["name"], regime=regime)
                        rows.append(row)
                        print(f"{time.time() - t0:6.0f}s {name:15s} {category:5s} "
                              f"{prompt['name'][:28]:28s} {regime:6s} {method:13s} "
                              f"{row['speedup']:.2f}x ({row['speedup_min']:.2f}-"
                              f"{row['speedup_max']:.2f}) tok/pass {row['tokens_per_pass']:.2f} "
                              f"loops {row['loop_share']:.0%}", file=sys.stderr, flush=True)
    result = {"command": "nodraft bench " + " ".join(argv if argv is not None else sys.argv[1:]),
              "server": args.server,
              "machine": f"{platform.processor() or platform.machine()}, torch "
                         f"{torch.__version__}, {args.threads} thread(s), "
                         f"{'eager' if args.eager else 'compiled'} passes",
              "tokens": args.tokens, "repeats": args.repeats, "methods": methods,
              "rows": rows, "summary": summarise(rows)}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1) + "\n")
    text = render(result)
    if args.md_out:
        Path(args.md_out).write_text(text + "\n")
    if args.plot:
        plot(result, args.plot)
    print(text)


if __name__ == "__main__":
    main()
