"""What every checkpoint and variant knows about held-out text (``nodraft eval [--json]``,
whose command, in ``drafters.evaluation``, adds the trained drafters' figures).

For each checkpoint and variant (``micro.variants``): parameters, bytes, held-out loss
(nats per token), bits per byte, greedy decode tokens/s; the held-out loss when exiting
after each layer (the logit lens); and in-context copying (``copy``):

- **copy accuracy**: held-out passages of 64 tokens, each shown twice in a row; the greedy
  top-1 accuracy over the second occurrence (its tokens 2..64: the first token of a repeat
  cannot be known to be one), and the mean loss over the same positions of the first and
  of the second occurrence;
- **edit follow**: the first copy has one identifier renamed (every occurrence of one
  word token replaced by another word token); the share of the renamed positions in the
  second copy where the model predicts the new name.

For scale: the held-out text's bits per byte under ``gzip -9`` and under a bigram model
fitted on the train split. Bits per byte = total nats over the held-out token stream
(documents joined by end-of-text) / ln 2 / the documents' UTF-8 bytes.

The corpus manifest recorded with the checkpoints is compared with this interpreter's
standard library; any difference is said plainly.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from nodraft.micro.checkpoint import CHECKPOINT_DIR, available_models, load_model, load_tokenizer
from nodraft.micro.corpus import compare_manifest, split_text
from nodraft.micro.data import token_stream
from nodraft.micro.model import KVCache, Micro
from nodraft.micro.tokenizer import Tokenizer
from nodraft.micro.variants import VARIANTS, make_variant

COPY_LEN = 64


@torch.no_grad()
def evaluate_loss(model: Micro, stream, T: int = 512, max_tokens: int = 200_000,
                  exit_layers: tuple[int, ...] | None = None) -> dict[int, float]:
    """Mean next-token loss (nats) over consecutive non-overlapping windows of ``stream``,
    for the full model and each exit layer asked for (the logit lens)."""
    model.eval()
    ids = torch.as_tensor(stream[: max_tokens + 1], dtype=torch.long)
    n = (len(ids) - 1) // T
    layers = exit_layers or (model.config.n_layers,)
    totals = {k: 0.0 for k in layers}
    count = 0
    for b in range(0, n, 8):
        rows = min(8, n - b)
        x = ids[b * T:(b + rows) * T + 1]
        inp, tgt = x[:-1].view(rows, T), x[1:].view(rows, T)
        hidden: list[torch.Tensor] = []
        model(inp, hidden=hidden)
        for k in layers:
            logits = model.head(hidden[k])
            totals[k] += F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="sum").item()
        count += tgt.numel()
    return {k: v / count for k, v in totals.items()}


def bits_per_byte(loss_nats: float, n_tokens: int, n_bytes: int) -> float:
    return loss_nats * n_tokens / math.log(2) / n_bytes


def bigram_bpb(train: np.ndarray, heldout: np.ndarray, val: np.ndarray, V: int,
               n_bytes: int) -> float:
    """A bigram with a unigram Dirichlet prior, p(b|a) = (c(a,b) + alpha p(b)) / (c(a) + alpha),
    alpha chosen on the validation split."""
    pair = np.bincount(train[:-1].astype(np.int64) * V + train[1:], minlength=V * V).reshape(V, V)
    uni = (np.bincount(train, minlength=V) + 1.0) / (len(train) + V)
    row = pair.sum(1)

    def nats(s: np.ndarray, alpha: float) -> float:
        a, b = s[:-1], s[1:]
        p = (pair[a, b] + alpha * uni[b]) / (row[a] + alpha)
        return float(-np.log(p).sum())

    alpha = min((0.1, 1.0, 10.0, 100.0), key=lambda al: nats(val, al))
    return nats(heldout, alpha) / math.log(2) / n_bytes


def _passages(stream: np.ndarray, count: int, eot: int, seed: int = 0) -> list[list[int]]:
    """``count`` held-out passages of COPY_LEN tokens with no end-of-text inside."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < count:
        a = int(rng.integers(0, len(stream) - COPY_LEN))
        p = stream[a:a + COPY_LEN].tolist()
        if eot not in p:
            out.append(p)
    return out


def _word_tokens(tok: Tokenizer) -> list[int]:
    """Token ids that decode to an identifier-like word (a name one could rename)."""
    words = []
    for i in range(tok.vocab_size):
        s = tok.token_bytes(i).decode("utf-8", "replace").strip()
        if len(s) >= 3 and s.isidentifier():
            words.append(i)
    return words


@torch.no_grad()
def copy_eval(model: Micro, tok: Tokenizer, stream: np.ndarray, count: int = 64,
              edits: bool = True) -> dict:
    passages = _passages(stream, count, tok.eot_id)
    x = torch.tensor([p + p for p in passages])  # (count, 128)
    logits = model(x)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(),
                           reduction="none").view(count, -1)
    # predictions of tokens 1..63 of each occurrence: logits row t predicts token t+1
    first = loss[:, 0:COPY_LEN - 1]
    second = loss[:, COPY_LEN:2 * COPY_LEN - 1]
    pred = logits[:, COPY_LEN:2 * COPY_LEN - 1].argmax(-1)
    accuracy = (pred == x[:, COPY_LEN + 1:]).float().mean().item()
    result = {"accuracy": round(accuracy, 4), "loss_first": round(first.mean().item(), 4),
              "loss_second": round(second.mean().item(), 4), "passages": count}
    if not edits:
        return result

    words = set(_word_tokens(tok))
    rng = np.random.default_rng(1)
    word_list = sorted(words)
    follow, total = 0, 0
    for p in passages:
        candidates = [t for t in p[1:] if t in words]
        if not candidates:
            continue
        old = candidates[int(rng.integers(len(candidates)))]
        new = word_list[int(rng.integers(len(word_list)))]
        while new in p:
            new = word_list[int(rng.integers(len(word_list)))]
        edited = [new if t == old else t for t in p]
        seq = torch.tensor([edited + edited])
        preds = model(seq)[0].argmax(-1)
        for j in range(1, COPY_LEN):
            if edited[j] == new:
                total += 1
                follow += int(preds[COPY_LEN + j - 1] == new)
    return result | {"edit_follow": round(follow / max(total, 1), 4)}


@torch.inference_mode()
def decode_tokens_per_s(model: Micro, prompt: list[int], n_tokens: int = 128, repeats: int = 3) -> float:
    """Plain greedy decoding with a KV cache, one token per forward (prefill excluded)."""
    rates = []
    for _ in range(repeats):
        cache = KVCache(model.config, 1)
        model(torch.tensor([prompt[:-1]]), cache=cache)
        cache.advance(0, len(prompt) - 1)
        token = prompt[-1]
        t0 = time.perf_counter()
        for _ in range(n_tokens):
            logits = model(torch.tensor([[token]]), cache=cache)
            cache.advance(0, 1)
            token = int(logits[0, -1].argmax())
        rates.append(n_tokens / (time.perf_counter() - t0))
    return statistics.median(rates)


DRAFTER_SUFFIXES = ("-medusa", "-eagle")  # trained drafters' weights beside a checkpoint


def is_model_file(path) -> bool:
    """A micro checkpoint: its config in the metadata, and not a drafter's weights."""
    from safetensors import safe_open

    if Path(path).stem.endswith(DRAFTER_SUFFIXES):
        return False
    with safe_open(str(path), "pt") as f:
        return "config" in (f.metadata() or {})


def evaluate(directory=CHECKPOINT_DIR, max_tokens: int | None = None,
             variants: tuple[str, ...] = VARIANTS) -> dict:
    local = directory / "tokenizer.json"
    tok = load_tokenizer(local if local.exists() else None)
    heldout = token_stream(tok, "heldout")
    text = split_text("heldout").encode()
    n_bytes = len(text)
    if max_tokens:  # a quick look: the same bytes-per-token ratio, fewer tokens
        n_bytes = int(n_bytes * min(max_tokens, len(heldout)) / len(heldout))
        heldout = heldout[:max_tokens]
    n_tok = len(heldout) - 1
    prompt = heldout[1000:1064].tolist()
    out = {"checkpoints": [], "heldout": {"bytes": len(text), "tokens": int(len(heldout)),
                                          "sha256": hashlib.sha256(text).hexdigest()}}
    names = available_models(directory)  # micro, micro-layerskip, then any other checkpoint
    names += sorted(p.stem for p in directory.glob("*.safetensors")
                    if p.stem not in names and is_model_file(p))  # not drafters' heads
    for name in names:
        model = load_model(name, directory)
        L = model.config.n_layers
        entry = {"name": name, "params": model.num_params(), "layers": L, "variants": []}
        for variant in variants:
            vm, nbytes = make_variant(model, variant)
            losses = evaluate_loss(vm, heldout, max_tokens=n_tok,
                                   exit_layers=tuple(range(1, L + 1)) if variant == "fp32" else None)
            loss = losses[L]
            entry["variants"].append({
                "variant": variant, "bytes": nbytes, "heldout_loss": round(loss, 4),
                "heldout_bpb": round(bits_per_byte(loss, n_tok, n_bytes), 4),
                "tokens_per_s": round(decode_tokens_per_s(vm, prompt), 1)})
            if variant == "fp32":
                entry["exit_layers"] = [{"layer": k, "heldout_loss": round(losses[k], 4)}
                                        for k in range(1, L + 1)]
        entry["copy"] = copy_eval(model, tok, heldout)
        out["checkpoints"].append(entry)
    train = token_stream(tok, "train")
    val = token_stream(tok, "validation")
    out["reference"] = {
        "gzip_bpb": round(len(gzip.compress(text, 9)) * 8 / len(text), 4),
        "bigram_bpb": round(bigram_bpb(train, heldout, val, tok.vocab_size, n_bytes), 4)}
    manifest_path = directory / "manifest.json"
    if manifest_path.exists():
        notes = compare_manifest(json.loads(manifest_path.read_text()))
        out["manifest"] = {"matches": not notes, "notes": notes}
    return out


def render(r: dict) -> str:
    lines = []
    m = r.get("manifest")
    if m and not m["matches"]:
        lines.append("WARNING: this Python's standard library differs from the one micro was "
                     "trained on, so the held-out text differs too:")
        lines += [f"  - {n}" for n in m["notes"]]
        lines.append("")
    h = r["heldout"]
    lines.append(f"held-out text: {h['bytes']} bytes, {h['tokens']} tokens, sha256 {h['sha256'][:16]}")
    ref = r["reference"]
    lines.append(f"reference: gzip -9 {ref['gzip_bpb']:.3f} bits/byte, bigram {ref['bigram_bpb']:.3f} bits/byte")
    for c in r["checkpoints"]:
        lines.append("")
        lines.append(f"{c['name']}: {c['params']:,} parameters, {c['layers']} layers")
        lines.append(f"  {'variant':9s} {'bytes':>9s} {'loss':>7s} {'bits/B':>7s} {'tok/s':>8s}")
        for v in c["variants"]:
            lines.append(f"  {v['variant']:9s} {v['bytes']:9d} {v['heldout_loss']:7.4f} "
                         f"{v['heldout_bpb']:7.4f} {v['tokens_per_s']:8.1f}")
        lines.append("  exit after layer: " + ", ".join(
            f"{e['layer']}: {e['heldout_loss']:.3f}" for e in c["exit_layers"]))
        cp = c["copy"]
        lines.append(f"  copy: accuracy {cp['accuracy']:.1%}, loss first {cp['loss_first']:.3f} "
                     f"-> second {cp['loss_second']:.3f}, edit followed {cp['edit_follow']:.1%}")
    return "\n".join(lines)

