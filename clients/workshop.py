"""``nodraft workshop``: the course page's workshop, measured.

    nodraft workshop [--tokens 40] [--repeats 5] [--json] [--plot FILE.png]
                     [--prompt-file FILE.json] [--methods a,b] [--checkpoints DIR]
                     [--threads 1] [--compile] [--url URL [--api-key KEY]]

The course decodes 40 greedy tokens with each drafter after two prompts -- a *fresh* one,
which micro continues with new text, and one that *repeats* itself -- and reads off the
acceptance rate, the tokens per target pass and the estimated speed-up. This command does
the same on the trained checkpoints and adds what the page cannot: the **measured
speed-up** against ``none`` in the same run. Rows:

- ``none`` on micro: the baseline (tokens per pass exactly 1.00; its measured speed-up
  against itself shows the noise of the machine);
- ``early_exit`` at exit layers 1, 2 and 3, on micro and on micro-layerskip;
- every other registered drafter on micro, with its default parameters (prompt_lookup,
  suffix, then medusa, eagle, lookahead, auto and plugins as they exist). A drafter that
  cannot be built (Medusa or EAGLE heads not trained yet, say) is skipped with a note.

Each figure is defined in docs/ARCHITECTURE.md ("Words, formulas and metric names"), from
the drafter's last run:

    acceptance rate     = accepted / drafted        ("0 drafted" when nothing was drafted)
    tokens per pass     = (accepted + target passes) / target passes
    draft cost          = the drafter's compute per target pass, in target-pass units
                          (the request's total draft cost / target passes)
    estimated speed-up  = tokens per pass / (1 + draft cost per pass)
    measured speed-up   = median over alternated runs of none's time / the drafter's time

In process (the default), ``clients.measure`` times the decoding loop alone, after the
prefill, and checks every run's tokens against ``none``'s. With ``--url`` the same rows go
through a live server's API: non-streaming ``/v1/completions`` at temperature 0, the
figures taken from each response's ``speculation`` object, the time being the request's
wall time as the client sees it (HTTP and the prefill included, so speed-ups come out
closer to 1), and every drafter's text checked against ``none``'s. One difference is
real, not noise: a server keeps suffix decoding's global tree across requests, so from the
warm-up on, suffix drafts from the identical earlier responses and scores far higher
than in process, where every run starts with a fresh tree.

Beside each measured figure stands the course page's own, in brackets, where the page
gives one (for micro): early exit 12% (layer 1) and 20% (layer 3) acceptance after the
fresh prompt; 53% for layer 3 after the repeating one, estimated speed-up 0.50; prompt
lookup 1.11 tokens per pass after the fresh prompt, 1.54 after the repeating one with 74%
of draft tokens accepted and an estimated speed-up of 1.54.

``--json`` prints ``{"tokens", "repeats", "mode", "rows": [...], "skipped": [...]}``; each
row has the keys model, prompt, method, params, drafted, accepted, acceptance_rate,
target_passes, tokens_per_pass, draft_cost (per pass), estimated_speedup (the course's),
measured_cost_speedup (passes priced by their measured cost; ``engine.stats``),
measured_speedup, and course (the page's figures for that row, or null).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from nodraft.clients.loadtest import server_root

PRIMARY = "micro"
EXIT_LAYERS = (1, 2, 3)
ORDER = ("prompt_lookup", "suffix", "medusa", "eagle", "lookahead", "auto")
KEYS = ("model", "prompt", "method", "params", "drafted", "accepted", "acceptance_rate",
        "target_passes", "tokens_per_pass", "draft_cost", "estimated_speedup",
        "measured_cost_speedup", "measured_speedup")

# The course page's figures for micro: (prompt, method, exit layer) -> figures.
COURSE = {
    ("fresh", "early_exit", 1): {"acceptance_rate": 0.12},
    ("fresh", "early_exit", 3): {"acceptance_rate": 0.20},
    ("repeating", "early_exit", 3): {"acceptance_rate": 0.53, "estimated_speedup": 0.50},
    ("fresh", "prompt_lookup", None): {"tokens_per_pass": 1.11},
    ("repeating", "prompt_lookup", None): {"tokens_per_pass": 1.54, "acceptance_rate": 0.74,
                                           "estimated_speedup": 1.54},
}


class Unavailable(Exception):
    """A drafter that cannot run here (not built, weights missing, refused by the server)."""


def course_figures(model: str, prompt: str, method: str, params: dict) -> dict | None:
    if model != PRIMARY:
        return None
    return COURSE.get((prompt, method, params.get("exit_layer")))


def plan(models: list[str], methods: list[str], only: list[str] | None = None
         ) -> list[tuple[str, str, dict]]:
    """The workshop's rows, as (model, method, params), in the order they are shown."""
    primary = PRIMARY if PRIMARY in models else models[0]
    rows: list[tuple[str, str, dict]] = []
    if "none" in methods:
        rows.append((primary, "none", {}))
    if "early_exit" in methods:
        rows += [(m, "early_exit", {"exit_layer": e}) for m in models for e in EXIT_LAYERS]
    rest = sorted(set(methods) - {"none", "early_exit"},
                  key=lambda m: (ORDER.index(m) if m in ORDER else len(ORDER), m))
    rows += [(primary, m, {}) for m in rest]
    return [r for r in rows if only is None or r[1] in only]


def make_row(model: str, prompt: str, method: str, params: dict, spec: dict,
             measured: float) -> dict:
    """One row from a response-shaped ``speculation`` dict (``SpecStats.to_dict``)."""
    passes = spec["target_passes"]
    return {
        "model": model, "prompt": prompt, "method": method, "params": params,
        "drafted": spec["drafted"], "accepted": spec["accepted"],
        "acceptance_rate": spec["acceptance_rate"], "target_passes": passes,
        "tokens_per_pass": spec["tokens_per_pass"],
        "draft_cost": round(spec["draft_cost"] / passes, 4) if passes else 0.0,
        "estimated_speedup": spec["estimated_speedup"],
        "measured_cost_speedup": spec.get("measured_cost_speedup"),
        "measured_speedup": round(measured, 4),
        "course": course_figures(model, prompt, method, params),
    }


# -- the two ways to measure ---------------------------------------------------------------
class InProcess:
    """The checkpoints loaded here; decoding timed by ``clients.measure``."""

    mode = "in process"

    def __init__(self, checkpoints: Path | None, threads: int | None, compile: bool = False):
        import torch

        from nodraft.micro.checkpoint import CHECKPOINT_DIR, available_models, load_tokenizer

        if threads:
            torch.set_num_threads(threads)
        self.directory = Path(checkpoints or CHECKPOINT_DIR)
        names = available_models(self.directory)
        if not names:
            raise SystemExit(f"nodraft workshop: no checkpoint in {self.directory}")
        tokenizer = self.directory / "tokenizer.json"
        self.tokenizer = load_tokenizer(tokenizer if tokenizer.exists() else None)
        self.names = names
        self.compile = compile
        self._models: dict = {}

    def model(self, name: str):
        from nodraft.micro.checkpoint import load_model

        if name not in self._models:
            self._models[name] = load_model(name, self.directory).compile(self.compile)
        return self._models[name]

    def models(self) -> list[str]:
        return list(self.names)

    def methods(self) -> list[str]:
        from nodraft.drafters.registry import Registry

        return Registry().names()

    def measure(self, model: str, prompt: str, method: str, params: dict, tokens: int,
                repeats: int) -> tuple[dict, float]:
        from nodraft.clients.measure import measured_speedup
        from nodraft.drafters.registry import DrafterEnv, Registry

        target = self.model(model)
        registry = Registry()
        try:  # try to build it once: a drafter that cannot is skipped, not fatal
            registry.build(*registry.parse({"method": method, **params}),
                           DrafterEnv(model, target, {}))
        except Exception as e:
            raise Unavailable(f"{type(e).__name__}: {e}") from None
        speedup, run, _ = measured_speedup(target, self.tokenizer.encode(prompt), tokens,
                                           method, params, repeats, model)
        return run.stats.to_dict(), speedup


class OverHTTP:
    """A live server: non-streaming completions at temperature 0, timed by the client."""

    mode = "over HTTP"

    def __init__(self, url: str, api_key: str | None, timeout: float = 120):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=server_root(url), headers=headers, timeout=timeout)
        listing = self.client.get("/v1/models")
        listing.raise_for_status()
        self.cards = listing.json()["data"]

    def models(self) -> list[str]:
        return [c["id"] for c in self.cards]

    def methods(self) -> list[str]:
        described = self.cards[0].get("speculation_methods", {}) if self.cards else {}
        return sorted(described) or ["none"]

    def complete(self, model: str, prompt: str, method: str, params: dict, tokens: int
                 ) -> tuple[float, str, dict]:
        """(wall seconds, text, speculation figures) of one greedy completion."""
        body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                "speculation": {"method": method, **params}}
        t0 = time.perf_counter()
        r = self.client.post("/v1/completions", json=body)
        seconds = time.perf_counter() - t0
        if r.status_code != 200:
            message = f"HTTP {r.status_code}: {_error_message(r)}"
            if method == "none":
                raise RuntimeError(f"the baseline, none, failed on {model}: {message}")
            raise Unavailable(message)
        data = r.json()
        return seconds, data["choices"][0]["text"], data["speculation"]

    def measure(self, model: str, prompt: str, method: str, params: dict, tokens: int,
                repeats: int) -> tuple[dict, float]:
        self.complete(model, prompt, method, params, tokens)  # warm-up
        ratios, spec = [], {}
        for _ in range(repeats):  # alternated, so drift on the machine hits both
            t_none, text_none, _ = self.complete(model, prompt, "none", {}, tokens)
            t_mine, text, spec = self.complete(model, prompt, method, params, tokens)
            if text != text_none:
                raise AssertionError(f"{method} {params} changed the greedy text on {model}")
            ratios.append(t_none / t_mine)
        return spec, statistics.median(ratios)


def _error_message(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text[:200]


# -- the run -------------------------------------------------------------------------------
def load_prompts(path: str | None) -> dict[str, str]:
    if path is None:
        from nodraft.clients.measure import default_prompts

        return default_prompts()
    data = json.loads(Path(path).read_text())
    if (not isinstance(data, dict) or set(data) != {"fresh", "repeating"}
            or not all(isinstance(v, str) and v for v in data.values())):
        raise SystemExit("nodraft workshop: --prompt-file must hold a JSON object with "
                         "exactly two non-empty strings, 'fresh' and 'repeating'")
    return {"fresh": data["fresh"], "repeating": data["repeating"]}


def run(backend, prompts: dict[str, str], tokens: int, repeats: int,
        only: list[str] | None = None, log=print) -> dict:
    rows, skipped, unavailable = [], [], set()
    plan_rows = plan(backend.models(), backend.methods(), only)
    for prompt_name, text in prompts.items():
        for model, method, params in plan_rows:
            key = (model, method, json.dumps(params, sort_keys=True))
            if key in unavailable:
                continue
            try:
                spec, measured = backend.measure(model, text, method, params, tokens, repeats)
            except Unavailable as e:
                unavailable.add(key)
                skipped.append({"model": model, "method": method, "params": params,
                                "reason": str(e)})
                log(f"workshop: skipped {label(method, params)} on {model}: {e}")
                continue
            rows.append(make_row(model, prompt_name, method, params, spec, measured))
            log(f"workshop: {model} {prompt_name} {label(method, params)}: "
                f"{_num(spec['tokens_per_pass'])} tokens/pass, measured {measured:.2f}x")
    return {"tokens": tokens, "repeats": repeats, "mode": backend.mode, "rows": rows,
            "skipped": skipped}


# -- showing it ----------------------------------------------------------------------------
def label(method: str, params: dict) -> str:
    name = method.replace("_", " ")
    rest = {k: v for k, v in params.items() if k != "exit_layer"}
    if "exit_layer" in params:
        name += f" L{params['exit_layer']}"
    return name + "".join(f" {k}={v}" for k, v in rest.items())


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def render(result: dict) -> str:
    """The table, with the course page's figures in brackets beside the measured ones."""
    head = ("model", "prompt", "drafter", "acceptance", "tokens/pass", "draft cost/pass",
            "est. speed-up", "measured-cost est.", "measured")
    lines = [f"nodraft workshop ({result['mode']}): {result['tokens']} greedy tokens after "
             f"each prompt; measured speed-up = median of {result['repeats']} alternated "
             "runs against none", "[x] = the course page's figure for micro", ""]
    table = [head]
    for r in result["rows"]:
        course = r["course"] or {}
        acc = "0 drafted" if r["drafted"] == 0 else _pct(r["acceptance_rate"])
        cells = [acc, _num(r["tokens_per_pass"]), _num(r["draft_cost"]),
                 _num(r["estimated_speedup"]), _num(r.get("measured_cost_speedup"))]
        for i, key, fmt in ((0, "acceptance_rate", _pct), (1, "tokens_per_pass", _num),
                            (3, "estimated_speedup", _num)):
            if key in course:
                cells[i] += f" [{fmt(course[key])}]"
        table.append((r["model"], r["prompt"], label(r["method"], r["params"]), *cells,
                      f"{r['measured_speedup']:.2f}x"))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    for s in result["skipped"]:
        lines.append(f"skipped: {label(s['method'], s['params'])} on {s['model']}: "
                     f"{s['reason']}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Grouped bars: one group per drafter, one bar per prompt. Three panels: acceptance
    rate, tokens per target pass, measured speed-up (estimated speed-up as circles); the
    course page's figures as black diamonds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    prompts = list(dict.fromkeys(r["prompt"] for r in rows))
    drafters = list(dict.fromkeys((r["model"], r["method"], json.dumps(r["params"]))
                                  for r in rows))
    names = [label(m, json.loads(p)) + ("" if model == PRIMARY else f"\n({model})")
             for model, m, p in drafters]
    panels = (("acceptance_rate", "acceptance rate", "acceptance_rate"),
              ("tokens_per_pass", "tokens per target pass", "tokens_per_pass"),
              ("measured_speedup", "measured speed-up vs none", "estimated_speedup"))
    width = 0.8 / len(prompts)
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 0.9 * len(drafters) + 2), 10),
                             sharex=True)
    for ax, (key, title, course_key) in zip(axes, panels):
        course = []  # (x, the course page's figure)
        for j, prompt in enumerate(prompts):
            mine = [(drafters.index((r["model"], r["method"], json.dumps(r["params"])))
                     + (j - (len(prompts) - 1) / 2) * width, r)
                    for r in rows if r["prompt"] == prompt]
            ax.bar([x for x, _ in mine], [r[key] or 0.0 for _, r in mine], width,
                   label=prompt)
            if key == "measured_speedup":
                ax.scatter([x for x, _ in mine], [r["estimated_speedup"] or 0 for _, r in mine],
                           marker="o", facecolors="white", edgecolors="black", zorder=3,
                           label="estimated" if j == 0 else None)
            course += [(x, r["course"][course_key]) for x, r in mine
                       if course_key in (r["course"] or {})]
        if course:
            ax.scatter(*zip(*course), marker="D", color="black", zorder=4,
                       label="course page" + (" (estimated)" if course_key != key else ""))
        if key != "acceptance_rate":
            ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_ylabel(title)
        ax.legend(fontsize="small")
    axes[-1].set_xticks(range(len(drafters)), names, rotation=30, ha="right", fontsize="small")
    fig.suptitle(f"nodraft workshop ({result['mode']}): {result['tokens']} greedy tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nodraft workshop",
                                description="The course's workshop table, measured.")
    p.add_argument("--tokens", type=int, default=40, help="greedy tokens per decode (40)")
    p.add_argument("--repeats", type=int, default=5,
                   help="alternated none/drafter runs per row, median taken (at least 5)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write grouped bar charts here")
    p.add_argument("--prompt-file", help="JSON object with 'fresh' and 'repeating' strings")
    p.add_argument("--methods", help="only these drafters, comma-separated (default: all)")
    p.add_argument("--checkpoints", type=Path, help="in process: the checkpoint folder")
    p.add_argument("--threads", type=int, default=1,
                   help="in process: torch threads (1: micro is small, and one thread is "
                        "the fastest single stream; more only contend on a busy machine)")
    p.add_argument("--compile", action="store_true",
                   help="in process: compiled passes, as the server runs them (default: eager, "
                        "as the course measures)")
    p.add_argument("--url", help="measure through this live server's API instead")
    p.add_argument("--api-key", help="with --url: the server's API key")
    args = p.parse_args(argv)
    if args.repeats < 5:
        p.error("--repeats must be at least 5 (a measured speed-up is the median of at least 5)")
    if args.tokens < 1:
        p.error("--tokens must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    prompts = load_prompts(args.prompt_file)
    backend = (OverHTTP(args.url, args.api_key) if args.url
               else InProcess(args.checkpoints, args.threads, args.compile))
    only = [m.strip() for m in args.methods.split(",")] if args.methods else None
    result = run(backend, prompts, args.tokens, args.repeats, only,
                 log=lambda s: print(s, file=sys.stderr, flush=True))
    if args.plot:
        plot(result, args.plot)
    print(json.dumps(result, indent=1) if args.json else render(result))


if __name__ == "__main__":
    main()
