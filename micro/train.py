"""Train micro (plain next-token loss) or micro-layerskip (the LayerSkip recipe).

``nodraft train micro [--layerskip] [--minutes N] [--seed S]``

Both recipes see the same data and the same wall-clock budget:

- rows of 512 tokens from the train split; ``--copy-frac`` of them are copy rows
  (``micro.data``), which teach in-context copying;
- AdamW (0.9, 0.95), weight decay 0.1, peak lr 2e-3, linear warm-up then cosine decay to
  10% over the *time* budget (the step count follows from the machine's speed and is
  recorded), bf16 autocast where the CPU computes bf16 natively (``--precision``), else
  float32, ``torch.compile`` when available;
- ``--layerskip`` adds the early-exit loss with the *rotational* curriculum (one early exit
  per step in turn, so a step costs about one extra head, not three) through the shared
  final norm and head, and per-sample layer dropout rising with depth,
  ``p_l = p_max * (exp(l * ln 2 / (L - 1)) - 1)``, 0 at the first layer.

Progress goes to a tqdm bar and to ``<out>/<name>.log``; the checkpoint and its record
(command, minutes, steps, tokens, losses) land in ``micro/checkpoints``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from nodraft.micro.checkpoint import CHECKPOINT_DIR, load_tokenizer, save_model, tokenizer_path
from nodraft.micro.corpus import split_documents, write_manifest
from nodraft.micro.data import RowSampler, token_stream
from nodraft.micro.eval import copy_eval, evaluate_loss
from nodraft.micro.model import Micro, MicroConfig
from nodraft.micro.tokenizer import train_tokenizer


def layer_drop_probs(n_layers: int, p_max: float) -> list[float]:
    return [p_max * (math.exp(l * math.log(2) / (n_layers - 1)) - 1) for l in range(n_layers)]


def bf16_native() -> bool:
    """Whether this CPU computes in bfloat16 itself (AVX-512 BF16 or AMX). Elsewhere
    (AVX2) torch emulates bfloat16 products, and autocast to it made a training step ~9x
    slower than float32 (docs/LOG.md, 2026-12-06)."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # a torch without the probes: read the kernel's flags
        try:
            flags = open("/proc/cpuinfo").read()
        except OSError:
            return False
        return " avx512_bf16" in flags or " amx_bf16" in flags


def use_bf16(precision: str) -> bool:
    """``--precision``: "bf16", "fp32", or "auto" (bf16 where the CPU computes it natively,
    ``bf16_native``)."""
    return precision == "bf16" or (precision == "auto" and bf16_native())


def add_precision(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="autocast to bfloat16 or train in float32; auto: bfloat16 where the "
                        "CPU computes it natively (AVX-512 BF16, AMX), else float32")


def lr_at(progress: float, peak: float, warmup: float = 0.02, floor: float = 0.1) -> float:
    if progress < warmup:
        return peak * progress / warmup
    p = min(1.0, (progress - warmup) / (1 - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


def train(args: argparse.Namespace, command: str = "nodraft train micro",
          config: MicroConfig | None = None) -> dict:
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    name = args.name or ("micro-layerskip" if args.layerskip else "micro")
    bf16 = use_bf16(getattr(args, "precision", "auto"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / f"{name}.log", "w")

    def say(msg: str) -> None:
        log.write(msg + "\n")
        log.flush()

    if not tokenizer_path().exists():
        train_tokenizer([d.text for d in split_documents("train")]).save(tokenizer_path())
    tok = load_tokenizer()
    train_ids, val_ids = token_stream(tok, "train"), token_stream(tok, "validation")
    parent = None
    if args.init:  # continue training a checkpoint: its weights and its config
        from nodraft.micro.checkpoint import load_model, load_record

        init = Path(args.init)  # a committed checkpoint's name, or a .safetensors path
        where, stem = (init.parent, init.stem) if init.suffix == ".safetensors" else (CHECKPOINT_DIR, args.init)
        model = load_model(stem, where).train().requires_grad_(True)
        config = model.config
        parent = load_record(stem, where)
    else:
        config = config or MicroConfig(vocab_size=tok.vocab_size)
        model = Micro(config)
    say(f"command: {command}")
    say(f"params {model.num_params()} train tokens {len(train_ids)} val tokens {len(val_ids)}")

    sampler = RowSampler(train_ids, args.seq_len, args.copy_frac, random_frac=args.random_frac,
                         vocab=(len(tok.special_ids), config.vocab_size), seed=args.seed)
    copy_probe = val_ids  # copy accuracy on validation passages, logged as training goes
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    L = config.n_layers
    drop = layer_drop_probs(L, args.layer_dropout) if args.layerskip else None

    def loss_fn(x: torch.Tensor, exit_layer: int, keep: list[torch.Tensor] | None):
        inp, tgt = x[:, :-1], x[:, 1:]
        pos = torch.arange(inp.shape[1]).expand_as(inp)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            h0 = model.embed(inp)
            if exit_layer:  # run [0, E), read the early exit, then continue [E, L)
                hE = model.run_layers(h0, pos, 0, exit_layer, keep=keep)
                h = model.run_layers(hE, pos, exit_layer, L, keep=keep)
            else:
                h = model.run_layers(h0, pos, 0, L, keep=keep)
            loss = F.cross_entropy(model.head(h).float().flatten(0, 1), tgt.flatten())
            if not exit_layer:
                return loss, loss
            early = F.cross_entropy(model.head(hE).float().flatten(0, 1), tgt.flatten())
        return loss + args.exit_weight * early, loss

    step_fn = torch.compile(loss_fn) if args.compile else loss_fn
    budget = args.minutes * 60
    t0 = time.time()
    step, tokens = 0, 0
    bar = tqdm(total=int(budget), unit="s", desc=name, file=sys.stderr, mininterval=5)
    history = [{"step": 0, "seconds": 0,
                "val_loss": round(evaluate_loss(model, val_ids, max_tokens=50_000)[L], 4)}]
    while True:
        elapsed = time.time() - t0
        progress = elapsed / budget if args.steps is None else step / args.steps
        if progress >= 1.0:
            break
        lr = lr_at(progress, args.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        x = sampler.batch(args.batch_size)
        model.train()
        keep = None
        exit_layer = 0
        if args.layerskip:
            exit_layer = 1 + step % (L - 1)  # rotational curriculum over exits 1..L-1
            keep = [(torch.rand(x.shape[0], 1, 1) >= p).float() for p in drop]
        total, final = step_fn(x, exit_layer, keep)
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x[:, 1:].numel()
        bar.update(int(time.time() - t0) - bar.n)
        if step % args.log_every == 0:
            msg = f"step {step} t {time.time() - t0:.0f}s lr {lr:.2e} loss {final.item():.4f} tok/s {tokens / (time.time() - t0):.0f}"
            if step % (args.log_every * 10) == 0:
                val = evaluate_loss(model, val_ids, max_tokens=50_000)[L]
                acc = copy_eval(model, tok, copy_probe, count=32, edits=False)["accuracy"]
                history.append({"step": step, "seconds": round(time.time() - t0),
                                "val_loss": round(val, 4), "val_copy_accuracy": acc})
                msg += f" val {val:.4f} copy {acc:.3f}"
            say(msg)
            bar.set_postfix_str(f"loss {final.item():.3f}")
    bar.close()
    minutes = (time.time() - t0) / 60
    val = evaluate_loss(model, val_ids, exit_layers=tuple(range(1, L + 1)))
    record = {
        "name": name,
        "command": command,
        "recipe": "layerskip" if args.layerskip else "plain",
        "minutes": round(minutes, 1), "steps": step, "tokens": tokens,
        "seed": args.seed, "batch_size": args.batch_size, "seq_len": args.seq_len,
        "copy_frac": args.copy_frac, "random_frac": args.random_frac, "lr": args.lr,
        "layer_dropout": args.layer_dropout if args.layerskip else 0.0,
        "exit_weight": args.exit_weight if args.layerskip else 0.0,
        "threads": torch.get_num_threads(), "precision": "bf16" if bf16 else "fp32",
        "val_loss": {str(k): round(v, 4) for k, v in val.items()},
        "history": history,
    }
    if parent is not None:  # the chain of runs that made these weights, oldest first
        record["init"] = args.init
        record["parent"] = parent
        record["total_minutes"] = round(minutes + parent.get("total_minutes", parent["minutes"]), 1)
        record["total_steps"] = step + parent.get("total_steps", parent["steps"])
    say(json.dumps(record))
    save_model(model, name, record, Path(args.checkpoints))
    write_manifest(Path(args.checkpoints) / "manifest.json")
    return record


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layerskip", action="store_true", help="train micro-layerskip")
    p.add_argument("--minutes", type=float, default=40.0, help="wall-clock budget")
    p.add_argument("--steps", type=int, default=None, help="a step budget instead of minutes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", default=None, metavar="NAME",
                   help="continue training this checkpoint (name or .safetensors path) with a new "
                        "warm-up and cosine schedule; use a new --seed for new rows")
    p.add_argument("--name", default=None)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--copy-frac", type=float, default=0.5, help="share of copy rows")
    p.add_argument("--random-frac", type=float, default=0.25,
                   help="share of copy rows whose passage is random tokens")
    p.add_argument("--layer-dropout", type=float, default=0.1, help="p_max (LayerSkip)")
    p.add_argument("--exit-weight", type=float, default=0.5, help="early-exit loss weight")
    p.add_argument("--threads", type=int, default=0)
    add_precision(p)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--out", default="runs")
    p.add_argument("--checkpoints", default=str(CHECKPOINT_DIR))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="nodraft train micro")
    add_arguments(p)
    argv = sys.argv[1:] if argv is None else argv
    record = train(p.parse_args(argv), " ".join(["nodraft train micro", *argv]))
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
