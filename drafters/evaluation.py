"""``nodraft eval``: micro's figures (``micro.eval``) and, for each checkpoint with trained
drafters beside it, their held-out accuracy by position.

- ``medusa``: top-1 (and top-k) accuracy of head i against the held-out token i + 2 ahead,
  on held-out text and on the target's greedy continuations of held-out prompts
  (``on_greedy``, positions in the continuation only: the text the heads draft on);
- ``eagle``: top-1 accuracy at draft depth d against the target's own greedy token, the
  head drafting with its own predicted features as at run time -- on held-out text, and on
  the target's greedy continuations of held-out prompts (``on_greedy``: the path drafted
  is then the one met at run time).

It lives in ``drafters`` (not ``micro``) because the imports go one way, micro <- drafters.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from nodraft.micro.checkpoint import CHECKPOINT_DIR, load_model, load_tokenizer
from nodraft.micro.data import token_stream
from nodraft.micro.greedy import GREEDY_PROMPT, greedy_rows
from nodraft.micro.eval import VARIANTS, evaluate, render


def evaluate_drafters(directory: Path, names: list[str], max_tokens: int | None = None) -> dict:
    from nodraft.drafters import medusa
    from nodraft.drafters.medusa_train import evaluate_heads
    from nodraft.drafters.eagle import evaluation as eagle_eval, head as eagle

    local = directory / "tokenizer.json"
    tok = load_tokenizer(local if local.exists() else None)
    heldout = token_stream(tok, "heldout")
    out = {}
    for name in names:
        entry = {}
        mpath = medusa.weights_path(directory, name)
        epath = eagle.weights_path(directory, name)
        if not (mpath.exists() or epath.exists()):
            continue
        model = load_model(name, directory)
        rows = None
        if mpath.exists():
            r = evaluate_heads(model, mpath, heldout, max_tokens=max_tokens or 65_536)
            rows = greedy_rows(model, heldout, prompt_len=GREEDY_PROMPT)
            g = evaluate_heads(model, mpath, None, rows=rows, first=GREEDY_PROMPT - 2)
            entry["medusa"] = {"top1_by_head": r["top1"], "topk_by_head": [a[-1] for a in r["accuracy"]],
                               "top_k": r["top_k"], "tokens": r["tokens"],
                               "on_greedy": {"top1_by_head": g["top1"], "tokens": g["tokens"]}}
        if epath.exists():
            _, state = eagle.load_head_state(directory, name)
            entry["eagle"] = eagle_eval.evaluate_head(model, state, heldout)
            if rows is None:
                rows = greedy_rows(model, heldout, prompt_len=GREEDY_PROMPT)
            entry["eagle"]["on_greedy"] = eagle_eval.evaluate_head(model, state, None, rows=rows,
                                                              first=GREEDY_PROMPT - 2)
        out[name] = entry
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="nodraft eval")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--checkpoints", default=str(CHECKPOINT_DIR))
    p.add_argument("--max-tokens", type=int, default=None, help="evaluate a prefix only")
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args(argv)
    directory = Path(args.checkpoints)
    r = evaluate(directory, args.max_tokens, tuple(args.variants.split(",")))
    heads = evaluate_drafters(directory, [c["name"] for c in r["checkpoints"]], args.max_tokens)
    for c in r["checkpoints"]:
        if c["name"] in heads:
            c["drafters"] = heads[c["name"]]
    if args.json:
        print(json.dumps(r, indent=1))
        return
    print(render(r))
    for c in r["checkpoints"]:
        d = c.get("drafters", {})
        if "medusa" in d:
            m = d["medusa"]
            print(f"{c['name']} medusa heads, held-out top-1 by head: "
                  + " / ".join(f"{a:.1%}" for a in m["top1_by_head"])
                  + f"; top-{m['top_k']}: " + " / ".join(f"{a:.1%}" for a in m["topk_by_head"])
                  + "; on the target's greedy continuations, top-1: "
                  + " / ".join(f"{a:.1%}" for a in m["on_greedy"]["top1_by_head"]))
        if "eagle" in d:
            e = d["eagle"]
            print(f"{c['name']} eagle head, held-out top-1 by depth (given the path so far): "
                  + " / ".join(f"{a:.1%}" for a in e["top1_by_position"])
                  + f"; draft vocabulary {e['draft_vocab']} covers {e['vocab_coverage']:.1%}")
            g = e["on_greedy"]
            print(f"{c['name']} eagle head, on the target's greedy continuations of held-out "
                  "prompts (the run-time path): top-1 by depth "
                  + " / ".join(f"{a:.1%}" for a in g["top1_by_position"]))
