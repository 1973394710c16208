"""Train Medusa heads for a checkpoint: ``nodraft train medusa --model NAME``.

Medusa-1 (Cai et al., 2024): the target is frozen; K heads (``drafters.medusa``) learn to
predict tokens 2..K+1 ahead from its final-layer residual stream.

- rows of ``--seq-len`` + 1 tokens from the train split, ``--copy-frac`` of them copy rows
  (``micro.data.RowSampler``, as micro itself was trained), so the heads see the repeats
  the target learned to copy;
- one frozen forward per batch (no_grad; bf16 autocast where the CPU computes bf16
  natively, ``--precision``) gives every position's hidden state h_j; head i is scored
  at every position j with token j + 2 + i in the row;
- loss: the unweighted sum of the heads' cross-entropies; each head's backward runs right
  after its forward (the hidden states are detached), so only one head's (B, T, V) logits
  are alive at a time;
- AdamW, no weight decay, peak lr ``--lr``, short warm-up then cosine decay to 0 over the
  ``--minutes`` time budget (or ``--steps``), gradient clipping at 1.0. The default is
  1e-2, not Medusa's 1e-3: in equal 2.5-minute runs on micro (--threads 1) 1e-2 reached
  held-out top-1 0.148 / 0.090 / 0.066 / 0.057 (heads 0-3), 1e-3 only 0.109 / 0.065 /
  0.048 / 0.044 -- a CPU budget sees a few hundred steps, not Medusa's thousands;
- ``--self-distill F`` (Medusa-2's self-distillation, as ``nodraft train eagle`` has it): a
  share F of every batch is the target's own greedy continuations of train-split prompts
  (``--distill-rows`` rows generated once before training), the text the heads draft on at
  run time; ``--init MODEL`` goes on from that model's trained heads (their record nests
  as ``init``);
- a tqdm bar and ``<out>/<model>-medusa.log``; every ``--log-every`` steps the mean loss
  per head, and every tenth log the top-1 accuracy per head on a validation slice.

At the end the heads are measured on the **held-out** split (``drafters.medusa.
evaluate_heads``: top-1..top-k accuracy per head) and on the target's greedy continuations
of held-out prompts (``heldout_greedy``: what a head must guess when it drafts on greedy
output), and weights and record land beside the
checkpoint as ``<model>-medusa.safetensors`` / ``.json``. The drafter builds its tree from
those held-out accuracies. A model without a draft vocabulary gets one beside them too (its
ids ranked by their count in the train split: ``drafters.draft_vocab``), which the heads'
default ``draft_vocab`` reads.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tqdm import tqdm

from nodraft.drafters import draft_vocab
from nodraft.drafters.medusa import MedusaHeads, heads_from_state, save_heads, weights_path
from nodraft.micro.checkpoint import CHECKPOINT_DIR, load_model, load_tokenizer
from nodraft.micro.data import RowSampler, token_stream
from nodraft.micro.greedy import GREEDY_PROMPT, greedy_rows, self_distill_rows
from nodraft.micro.model import Micro
from nodraft.micro.train import add_precision, lr_at, use_bf16


# -- held-out accuracy ------------------------------------------------------------------------
@torch.no_grad()
def evaluate_heads(model: Micro, heads: MedusaHeads | dict | str | Path, stream,
                   top_k: int = 10, T: int = 512, max_tokens: int = 65_536,
                   batch: int = 8, rows: torch.Tensor | None = None, first: int = 0) -> dict:
    """Top-1..top-k accuracy of each head on ``stream`` (held-out: ``token_stream(tok,
    "heldout")``), over consecutive windows of T + 1 tokens; head i at position j is scored
    against token j + 2 + i of its window. ``heads`` is a MedusaHeads, its state dict, or
    a ``.safetensors`` path. ``rows`` (W, T + 1) replaces the windows (``stream`` unused),
    e.g. ``greedy_rows``: the target's own continuations; then only positions j >= ``first``
    are scored (the continuation's, not the prompt's).

    Returns {"tokens", "top_k", "accuracy": [[top-1, ..., top-k] per head], "top1": [per
    head], "target_top1": the target's own next-token top-1 on the same windows}."""
    if isinstance(heads, (str, Path)):
        heads = load_file(str(heads))
    if isinstance(heads, dict):
        heads = heads_from_state(heads)
    dtype = model.tok_embeddings.weight.dtype
    if heads.weight.dtype != dtype:
        heads = copy.deepcopy(heads).to(dtype)
    K, L = heads.num_heads, model.config.n_layers
    top_k = min(top_k, model.config.vocab_size)
    if rows is None:
        ids = torch.as_tensor(np.asarray(stream[:max_tokens + 1]), dtype=torch.long)
        n_windows = (len(ids) - 1) // T
        windows = [ids[w * T:(w + 1) * T + 1] for w in range(n_windows)]
    else:
        windows, T = list(rows), rows.shape[1] - 1
    hits = torch.zeros(K, top_k, dtype=torch.long)
    counts = torch.zeros(K, dtype=torch.long)
    target_hits = target_count = 0
    for b in range(0, len(windows), batch):
        x = torch.stack(windows[b:b + batch])  # (B, T+1)
        pos = torch.arange(T + 1).expand(x.shape[0], T + 1)
        h = model.run_layers(model.embed(x), pos, 0, L)  # (B, T+1, dim)
        target_hits += int((model.head(h[:, first:-1]).argmax(-1) == x[:, first + 1:]).sum())
        target_count += x[:, first + 1:].numel()
        for i in range(K):
            span = T + 1 - (2 + i)  # positions j whose label j + 2 + i is in the window
            if span <= first:
                continue
            logits = model.head(heads.block(h[:, first:span], i))  # (B, span - first, V)
            top = logits.topk(top_k, dim=-1).indices
            found = (top == x[:, first + 2 + i:, None]).flatten(0, 1)  # (N, k), one per row at most
            hits[i] += found.cumsum(-1).clamp_max(1).sum(0)
            counts[i] += found.shape[0]
    accuracy = [[round(float(hits[i, r]) / max(1, int(counts[i])), 4) for r in range(top_k)]
                for i in range(K)]
    return {"tokens": int(len(windows) * (T - first)), "top_k": top_k, "accuracy": accuracy,
            "top1": [row[0] for row in accuracy],
            "target_top1": round(target_hits / max(1, target_count), 4)}


def train(args: argparse.Namespace, command: str) -> dict:
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoints = Path(args.checkpoints)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"{args.model}-medusa"
    log = open(out / f"{name}.log", "w")

    def say(msg: str) -> None:
        log.write(msg + "\n")
        log.flush()

    model = load_model(args.model, checkpoints)  # eval mode, requires_grad False: frozen
    c = model.config
    local = checkpoints / "tokenizer.json"
    tok = load_tokenizer(local if local.exists() else None)
    train_ids = token_stream(tok, "train")
    val_ids = token_stream(tok, "validation")
    heldout_ids = token_stream(tok, "heldout")
    heads, init_record = MedusaHeads(args.heads, c.dim), None
    if args.init:  # go on from trained heads (their weights; their record nests as "init")
        init_path = weights_path(checkpoints, args.init)
        heads = heads_from_state(load_file(str(init_path)))
        if heads.num_heads != args.heads or heads.weight.shape[-1] != c.dim:
            raise SystemExit(f"--init {args.init}: {heads.num_heads} heads of dim "
                             f"{heads.weight.shape[-1]}, not --heads {args.heads} of {c.dim}")
        heads = heads.float().requires_grad_(True)
        init_record = json.loads(init_path.with_suffix(".json").read_text())
    pool, n_distill = None, round(args.batch_size * args.self_distill)
    if n_distill:  # the target's own greedy continuations: the text the heads draft on
        pool = self_distill_rows(model, train_ids, args.distill_rows, args.seq_len, args.seed, say)
    say(f"command: {command}")
    say(f"target {args.model} ({model.num_params()} params, frozen); {args.heads} heads of "
        f"{heads.weight[0].numel() + heads.bias[0].numel()} params; train tokens {len(train_ids)}")
    sampler = RowSampler(train_ids, args.seq_len, args.copy_frac, random_frac=args.random_frac,
                         vocab=(len(tok.special_ids), c.vocab_size), seed=args.seed)
    opt = torch.optim.AdamW(heads.parameters(), lr=args.lr, weight_decay=0.0)
    bf16 = use_bf16(args.precision)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    L, K, T = c.n_layers, args.heads, args.seq_len

    def step_loss(x: torch.Tensor) -> list[float]:
        """One batch (B, T+1): forward the frozen target once, then each head; backward."""
        with torch.no_grad(), autocast:
            pos = torch.arange(T + 1).expand(x.shape[0], T + 1)
            h = model.run_layers(model.embed(x), pos, 0, L)  # (B, T+1, dim)
        losses = []
        for i in range(K):
            span = T + 1 - (2 + i)  # positions j with a label j + 2 + i in the row
            with autocast:
                logits = model.head(heads.block(h[:, :span], i))  # (B, span, V)
                loss = F.cross_entropy(logits.flatten(0, 1), x[:, 2 + i:].flatten())
            loss.backward()  # the sum of the heads' losses, one head at a time
            losses.append(loss.item())
        return losses

    budget = args.minutes * 60
    t0 = time.time()
    step, tokens = 0, 0
    total = args.steps if args.steps is not None else int(budget)
    bar = tqdm(total=total, unit="step" if args.steps is not None else "s", desc=name,
               file=sys.stderr, mininterval=5)
    history: list[dict] = []
    running = [0.0] * K
    while True:
        elapsed = time.time() - t0
        progress = elapsed / budget if args.steps is None else step / args.steps
        if progress >= 1.0:
            break
        lr = lr_at(progress, args.lr, warmup=0.02, floor=0.0)
        for g in opt.param_groups:
            g["lr"] = lr
        x = sampler.batch(args.batch_size - n_distill)
        if n_distill:
            pick = torch.randint(0, len(pool), (n_distill,), generator=sampler.gen)
            x = torch.cat([x, pool[pick]])
        opt.zero_grad(set_to_none=True)
        losses = step_loss(x)
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x.shape[0] * T
        running = [r + l for r, l in zip(running, losses)]
        bar.update(step - bar.n if args.steps is not None else int(time.time() - t0) - bar.n)
        if step % args.log_every == 0:
            mean = [r / args.log_every for r in running]
            running = [0.0] * K
            msg = (f"step {step} t {time.time() - t0:.0f}s lr {lr:.2e} loss "
                   + " ".join(f"{m:.3f}" for m in mean)
                   + f" tok/s {tokens / (time.time() - t0):.0f}")
            if step % (args.log_every * 10) == 0:
                val = evaluate_heads(model, heads, val_ids, top_k=1, max_tokens=args.val_tokens)
                history.append({"step": step, "seconds": round(time.time() - t0),
                                "loss": [round(m, 4) for m in mean], "val_top1": val["top1"]})
                msg += " val top-1 " + " ".join(f"{a:.3f}" for a in val["top1"])
            say(msg)
            bar.set_postfix_str("loss " + " ".join(f"{m:.2f}" for m in mean))
    bar.close()
    minutes = (time.time() - t0) / 60
    heads.eval().requires_grad_(False)
    t_eval = time.time()
    heldout = evaluate_heads(model, heads, heldout_ids, top_k=args.top_k,
                             max_tokens=args.heldout_tokens)
    say(f"held-out ({heldout['tokens']} tokens, {time.time() - t_eval:.0f}s): top-1 per head "
        + " ".join(f"{a:.3f}" for a in heldout["top1"])
        + f"; the target's own next-token top-1 {heldout['target_top1']:.3f}")
    own = evaluate_heads(model, heads, None, top_k=args.top_k, first=GREEDY_PROMPT - 2,
                         rows=greedy_rows(model, heldout_ids, windows=args.eval_windows,
                                          prompt_len=GREEDY_PROMPT,
                                          seq_len=min(256, c.max_positions - 1)))
    say("held-out prompts, the target's greedy continuations: top-1 per head "
        + " ".join(f"{a:.3f}" for a in own["top1"]))
    target_file = checkpoints / f"{args.model}.safetensors"
    record = {
        "name": name, "target": args.model,
        "target_sha256": hashlib.sha256(target_file.read_bytes()).hexdigest(),
        "command": command,
        "minutes": round(minutes, 1), "steps": step, "tokens": tokens,
        "num_heads": K, "seed": args.seed, "batch_size": args.batch_size,
        "seq_len": args.seq_len, "copy_frac": args.copy_frac, "random_frac": args.random_frac,
        "lr": args.lr, "bf16": bf16,
        "threads": torch.get_num_threads(),
        "self_distill": args.self_distill, "distill_rows": args.distill_rows if n_distill else 0,
        "init": init_record,
        "heldout": heldout, "heldout_greedy": own,
        "history": history,
    }
    path = save_heads(heads, args.model, record, checkpoints)
    say(json.dumps(record))
    say(f"wrote {path} and {path.with_suffix('.json').name}")
    if not draft_vocab.weights_path(checkpoints, args.model).exists():
        # the heads' default reads the most frequent ids: their ranking goes beside them
        vocab, _ = draft_vocab.write_ranking(
            args.model, c.vocab_size, checkpoints, command + " (the draft vocabulary)",
            train_ids, heldout_ids, time.perf_counter())
        say(f"wrote {vocab} (the ids ranked by frequency, for draft_vocab)")
    log.close()
    assert path == weights_path(checkpoints, args.model)
    return record


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="micro", help="the checkpoint to train heads for")
    p.add_argument("--heads", type=int, default=4, help="K: head i predicts token t+2+i")
    p.add_argument("--minutes", type=float, default=10.0, help="wall-clock budget")
    p.add_argument("--steps", type=int, default=None, help="a step budget instead of minutes")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-2,
                   help="peak learning rate, cosine decay (Medusa-1 uses 1e-3: slower here)")
    p.add_argument("--copy-frac", type=float, default=0.5, help="share of copy rows")
    p.add_argument("--random-frac", type=float, default=0.25,
                   help="share of copy rows whose passage is random tokens")
    p.add_argument("--top-k", type=int, default=10, help="held-out top-1..top-k per head")
    p.add_argument("--heldout-tokens", type=int, default=65_536,
                   help="held-out tokens measured at the end")
    p.add_argument("--val-tokens", type=int, default=8_192,
                   help="validation tokens measured during training")
    add_precision(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out", default="runs", help="folder for the log")
    p.add_argument("--checkpoints", default=str(CHECKPOINT_DIR),
                   help="where the target is, and where the heads go")
    p.add_argument("--init", default=None, metavar="MODEL",
                   help="go on from MODEL's trained heads (same --heads)")
    p.add_argument("--self-distill", type=float, default=0.0,
                   help="share of every batch that is the target's own greedy continuations "
                        "of train-split prompts (Medusa-2's self-distillation)")
    p.add_argument("--distill-rows", type=int, default=512,
                   help="greedy rows generated once, before training, for --self-distill")
    p.add_argument("--eval-windows", type=int, default=64,
                   help="held-out prompts continued greedily for the heldout_greedy figures")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="nodraft train medusa")
    add_arguments(p)
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.heads < 1:
        p.error("--heads must be at least 1")
    if not 0.0 <= args.self_distill < 1.0 or args.distill_rows < 1:
        p.error("--self-distill must be in [0, 1) and --distill-rows at least 1")
    record = train(args, " ".join(["nodraft train medusa", *argv]))
    print(json.dumps({k: v for k, v in record.items() if k != "history"}, indent=1))


if __name__ == "__main__":
    main()
