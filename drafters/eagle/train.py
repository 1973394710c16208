"""``nodraft train eagle``: train the EAGLE head of a checkpoint (``drafters.eagle.head``).

    nodraft train eagle --model micro [--minutes 20 | --steps N] [--ttt-steps 2] [--threads 1]
                        [--fuse-layers auto | none | 1,2,3] [--init micro --self-distill 0.5]

The target is frozen. Each step takes rows of ``--seq-len`` + 1 train-split tokens
(``micro.data.RowSampler``, ``--copy-frac`` of them copy rows, as micro itself was trained),
runs the target over them once (no head) for its features f_t = norm(h_t) -- the final-normed
hidden states, the tensor the drafter rebuilds at run time from ``ctx.last_hidden`` -- and
trains the head on every position at once:

    step 1:  f^ = head(token_{t+1}, f_t + U(-noise/2, noise/2)[, v_t])   (real features;
             v_t: the value rows of the ``--fuse-layers``, EAGLE-3's fused features)
    step j:  f^ = head(token_{t+1}, step j-1's prediction of f_t)  (``--ttt-steps`` > 1:
             EAGLE-3's training-time test, the head fed its own features as when drafting
             a tree's deeper levels; attention as at run time, ``head.unroll``)
    loss  =  sum_j 0.8^(j-1) · [ 1.0 · SmoothL1(f^, f_{t+1})
                                + w · CE(f^ · E_N^T, softmax(f_{t+1} · E_N^T)) ]

with w = ``--ce-weight`` (EAGLE's 0.1 by default).

``--self-distill F`` makes a share F of every batch the target's own greedy continuations
of train-split prompts (16-128 tokens, continued to ``--seq-len`` + 1; ``--distill-rows``
rows generated once before training, batched, ``micro.greedy.greedy_continue``): at run
time the head drafts on the target's greedy output, which for a small model loops and
repeats in ways natural text does not. ``--init MODEL`` goes on from a trained head (its
weights and draft vocabulary; the record nests that head's record as ``init``; fused
features it lacks start at zero). The committed heads: a first stage on natural text, then
``--init <model> --self-distill 0.5 --lr 3e-3`` (docs/MICRO.md, "EAGLE heads", which also
has the fused heads trained on from them, measured and not kept).

E_N is the target's tied embedding restricted to the draft vocabulary: the ``--draft-vocab``
most frequent train-split tokens (both distributions over those N tokens; the target's is
renormalised over them). AdamW (0.9, 0.95), linear warm-up then cosine decay to 10%
(``micro.train.lr_at``) over the step or time budget, bf16 autocast where the CPU computes
bf16 natively (``--precision``; float32 elsewhere), gradient clip 1.0.

The defaults were chosen by measurement (docs/MICRO.md, "EAGLE heads").

At the end: the held-out split's top-1 accuracy by position (``evaluate_head``: drafting
greedily with its own features, against the target's greedy tokens), the same on the
target's greedy continuations of held-out prompts (``heldout_greedy``), the wall time of one
draft step with the reduced and with the full vocabulary, and the weights with their
record in ``<checkpoints>/<model>-eagle.safetensors`` / ``.json``. Progress goes to a tqdm
bar and to ``<out>/<model>-eagle.log``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from nodraft.drafters.draft_vocab import draft_vocabulary
from nodraft.drafters.eagle.drafter import Eagle
from nodraft.drafters.eagle.evaluation import evaluate_head, target_features, time_draft_step
from nodraft.drafters.eagle.head import EagleHead, load_head_state, save_head, unroll
from nodraft.micro.checkpoint import CHECKPOINT_DIR, load_model, load_tokenizer
from nodraft.micro.data import RowSampler, token_stream
from nodraft.micro.greedy import GREEDY_PROMPT, greedy_rows, self_distill_rows
from nodraft.micro.train import add_precision, lr_at, use_bf16


def head_loss(head: EagleHead, model, x: torch.Tensor, ttt_steps: int, noise: float,
              w_draft: torch.Tensor, ce_weight: float = 0.1) -> tuple[torch.Tensor, list[float]]:
    """The weighted loss over unrolled steps, and each step's top-1 agreement with the
    target's most likely draft-vocabulary token (a cheap training-time figure)."""
    f, _, vals = target_features(model, x, head.fused)  # (B, T+1, dim), no grad
    f = f.float()
    inp_f, tgt_f = f[:, :-1], f[:, 1:]
    with torch.no_grad():
        tgt_logits = tgt_f @ w_draft.T
        tgt_p = tgt_logits.softmax(-1)
        tgt_top = tgt_logits.argmax(-1)
    outs = unroll(head, model, x[:, 1:], inp_f, ttt_steps, noise=noise,
                  vals=None if vals is None else vals[:, :-1].float())
    total = 0.0
    agree = []
    for j, out in enumerate(outs):
        out = out[:, j:].float()  # rows with a valid input at step j + 1
        logits = out @ w_draft.T
        feat_loss = F.smooth_l1_loss(out, tgt_f[:, j:])
        ce = F.cross_entropy(logits.flatten(0, 1), tgt_p[:, j:].flatten(0, 1))
        total = total + 0.8 ** j * (feat_loss + ce_weight * ce)
        agree.append(float((logits.argmax(-1) == tgt_top[:, j:]).float().mean()))
    return total, agree


def train(args: argparse.Namespace, command: str) -> dict:
    torch.manual_seed(args.seed)
    # bf16 activations meet fp32 norm weights under autocast: correct, only not fused
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoints = Path(args.checkpoints)
    name = f"{args.model}-eagle"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / f"{name}.log", "w")

    def say(msg: str) -> None:
        log.write(msg + "\n")
        log.flush()

    model = load_model(args.model, checkpoints)
    local_tok = checkpoints / "tokenizer.json"
    tok = load_tokenizer(local_tok if local_tok.exists() else None)
    train_ids = token_stream(tok, "train")
    config = model.config
    init_record = None
    if args.init:  # go on from a trained head (its draft vocabulary too)
        init_config, init_state = load_head_state(Path(args.init_from or checkpoints), args.init)
        head = EagleHead.from_state(init_config, init_state)
        vocab = head.draft_vocab
        init_path = Path(args.init_from or checkpoints) / f"{args.init}-eagle.json"
        if init_path.exists():
            init_record = json.loads(init_path.read_text())
    else:
        vocab = draft_vocabulary(train_ids, args.draft_vocab, config.vocab_size)
        head = EagleHead(config, vocab)
    fuse = default_fuse_layers(config.n_layers) if args.fuse_layers == "auto" else args.fuse_layers
    if fuse:  # EAGLE-3's fused features, at zero to start
        head = head.with_fused(fuse)
    head.train().requires_grad_(True)
    w_draft = model.tok_embeddings.weight[vocab].detach()
    sampler = RowSampler(train_ids, args.seq_len, args.copy_frac, random_frac=args.random_frac,
                         vocab=(len(tok.special_ids), config.vocab_size), seed=args.seed)
    pool = None
    n_distill = round(args.batch_size * args.self_distill)
    if n_distill:
        t_pool = time.time()
        pool = self_distill_rows(model, train_ids, args.distill_rows, args.seq_len, args.seed, say)
        pool_minutes = (time.time() - t_pool) / 60
    params = list(head.parameters())
    bf16 = use_bf16(args.precision)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    say(f"command: {command}")
    say(f"head params {sum(p.numel() for p in params)} draft vocab {args.draft_vocab} "
        f"train tokens {len(train_ids)}")

    budget = args.minutes * 60
    t0 = time.time()
    step, tokens = 0, 0
    history = []
    bar = tqdm(total=args.steps or int(budget), unit="step" if args.steps else "s", desc=name,
               file=sys.stderr, mininterval=5)
    while True:
        elapsed = time.time() - t0
        progress = step / args.steps if args.steps else elapsed / budget
        if progress >= 1.0:
            break
        lr = lr_at(progress, args.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        x = sampler.batch(args.batch_size - n_distill)
        if n_distill:
            pick = torch.randint(0, len(pool), (n_distill,), generator=sampler.gen)
            x = torch.cat([x, pool[pick]])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, agree = head_loss(head, model, x, args.ttt_steps, args.noise, w_draft,
                                    args.ce_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        tokens += x[:, 1:].numel()
        bar.update(step - bar.n if args.steps else int(time.time() - t0) - bar.n)
        if step % args.log_every == 0:
            entry = {"step": step, "seconds": round(time.time() - t0), "lr": round(lr, 6),
                     "loss": round(loss.item(), 4), "agree": [round(a, 3) for a in agree]}
            history.append(entry)
            say(json.dumps(entry))
            bar.set_postfix_str(f"loss {loss.item():.3f} top1 {agree[0]:.2f}")
    bar.close()
    minutes = (time.time() - t0) / 60
    head.eval().requires_grad_(False)
    state = {k: v.detach().clone() for k, v in head.state_dict().items()}
    heldout = evaluate_head(model, state, token_stream(tok, "heldout"), depth=args.eval_depth,
                            windows=args.eval_windows)
    say(f"held-out: {json.dumps(heldout)}")
    own = evaluate_head(model, state, None, depth=args.eval_depth,
                        rows=greedy_rows(model, token_stream(tok, "heldout"),
                                         windows=args.eval_windows, prompt_len=GREEDY_PROMPT),
                        first=GREEDY_PROMPT - 2)
    say(f"held-out prompts, the target's greedy continuations: {json.dumps(own)}")
    prompt = token_stream(tok, "heldout")[1000:1064].tolist()
    timing = time_draft_step(model, state, prompt, Eagle.Params(), args.timing_repeats)
    say(f"draft step: {json.dumps(timing)}")
    record = {
        "name": name, "command": command, "model": args.model,
        "minutes": round(minutes, 1), "steps": step, "tokens": tokens, "seed": args.seed,
        "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr,
        "draft_vocab": args.draft_vocab, "ttt_steps": args.ttt_steps, "noise": args.noise,
        "ce_weight": args.ce_weight, "fuse_layers": list(head.fused),
        "copy_frac": args.copy_frac, "random_frac": args.random_frac,
        "self_distill": args.self_distill,
        "distill_rows": args.distill_rows if n_distill else 0,
        "distill_minutes": round(pool_minutes, 1) if n_distill else 0.0,
        "init": init_record,
        "threads": torch.get_num_threads(), "precision": "bf16" if bf16 else "fp32",
        "features": "final-normed hidden state (model.norm of the last layer's output)"
                    + (f"; value rows of target layers {list(head.fused)}" if head.fused else ""),
        "heldout": heldout, "heldout_greedy": own, "draft_step": timing, "history": history,
    }
    save_head(head, args.model, Path(args.save_to or checkpoints), record)
    say(json.dumps({k: v for k, v in record.items() if k != "history"}))
    return record


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="micro", help="the target checkpoint's name")
    p.add_argument("--minutes", type=float, default=20.0, help="wall-clock budget")
    p.add_argument("--steps", type=int, default=None, help="a step budget instead of minutes")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-2,
                   help="peak learning rate (3-minute runs, held-out top-1 at depth 1: "
                        "2e-3 0.39, 5e-3 0.50, 1e-2 0.52)")
    p.add_argument("--draft-vocab", type=int, default=1024,
                   help="the N most frequent train-split tokens the draft head reads")
    p.add_argument("--ttt-steps", type=int, default=1,
                   help="unrolled steps fed their own features (EAGLE-3's training-time test)")
    p.add_argument("--fuse-layers", type=_layers, default="none",
                   help="EAGLE-3's fused features: the target layers (e.g. 1,2,3) whose "
                        "value rows the head reads besides the top feature (added at zero "
                        "to an --init head that lacks them); auto: low, middle and high "
                        "(every layer but the first for micro's four); none (the default: "
                        "on micro they cost more time than their acceptance gave, "
                        "docs/MICRO.md)")
    p.add_argument("--ce-weight", type=float, default=0.1,
                   help="weight of the token loss against the feature loss (weight 1.0)")
    p.add_argument("--noise", type=float, default=0.2,
                   help="width of the uniform noise on input features")
    p.add_argument("--copy-frac", type=float, default=0.5, help="share of copy rows")
    p.add_argument("--random-frac", type=float, default=0.25,
                   help="share of copy rows whose passage is random tokens")
    p.add_argument("--self-distill", type=float, default=0.0,
                   help="share of each batch's rows that are the target's own greedy "
                        "continuations of train-split prompts (self-distillation)")
    p.add_argument("--distill-rows", type=int, default=2048,
                   help="greedy rows generated once, before training, for --self-distill")
    p.add_argument("--init", default=None,
                   help="go on from this model's trained head (e.g. micro), its draft "
                        "vocabulary included")
    p.add_argument("--init-from", default=None,
                   help="where --init's head is (default: --checkpoints)")
    add_precision(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-depth", type=int, default=5, help="held-out accuracy up to this depth")
    p.add_argument("--eval-windows", type=int, default=64, help="held-out windows of 256 tokens")
    p.add_argument("--timing-repeats", type=int, default=200,
                   help="draft steps timed, with the reduced and the full vocabulary")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--checkpoints", default=str(CHECKPOINT_DIR), help="where the target is")
    p.add_argument("--save-to", default=None, help="where the head goes (default: --checkpoints)")
    p.add_argument("--out", default="runs", help="where the log goes")


def default_fuse_layers(n_layers: int) -> tuple[int, ...]:
    """The layers whose value rows a fused head reads by default: every layer but the
    first (its values read the embedding) up to four layers, else a low, a middle and a
    high one, as EAGLE-3 picks three."""
    if n_layers <= 4:
        return tuple(range(1, n_layers))
    return (1, n_layers // 2, n_layers - 1)


def _layers(text: str) -> tuple[int, ...] | str:
    if text in ("auto", "none"):
        return "auto" if text == "auto" else ()
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of layer indices: {text!r}") from None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="nodraft train eagle")
    add_arguments(p)
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.draft_vocab < 1 or args.ttt_steps < 1:
        p.error("--draft-vocab and --ttt-steps must be at least 1")
    if not 0.0 <= args.self_distill <= 1.0 or args.distill_rows < 1:
        p.error("--self-distill must be in [0, 1] and --distill-rows at least 1")
    record = train(args, " ".join(["nodraft train eagle", *argv]))
    print(json.dumps({k: v for k, v in record.items() if k != "history"}, indent=1))


if __name__ == "__main__":
    main()
