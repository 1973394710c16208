"""A draft vocabulary: the target's token ids ranked by their frequency in the train split.

FR-Spec (Zhao et al., 2025) drafts over the most frequent tokens only: a drafter's own LM
head then reads a few hundred rows of the target's 4096-row head instead of all of them,
and verification still scores every token with the full head, so the output is unchanged
(a draft outside the subset is simply never proposed). Early exit reads the first
``draft_vocab`` ids of this ranking (``drafters.early_exit``); EAGLE's head carries its
own 1024 in its weights, ranked the same way (``draft_vocabulary``).

    nodraft train draft-vocab [--model micro] [--checkpoints DIR]

writes ``<model>-draft-vocab.safetensors`` (``ranked`` (V,) int64, most frequent first;
``counts`` (V,) int64, each id's count in the train split) and ``<model>-draft-vocab.json``
(the command, the time it took, and how much of the held-out split the first n ids cover)
beside the checkpoint. The ranking depends on the tokenizer and the train split only; the
two committed checkpoints share both, so their files are equal.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from nodraft.drafters.base import DrafterEnv, SpeculationError, loaded_weights
from nodraft.micro.checkpoint import CHECKPOINT_DIR, load_config, load_tokenizer
from nodraft.micro.model import Micro

SUFFIX = "draft-vocab"
COVERAGE_SIZES = (128, 256, 512, 768, 1024, 2048)


def weights_path(directory: Path, model_name: str) -> Path:
    return Path(directory) / f"{model_name}-{SUFFIX}.safetensors"


def draft_vocabulary(stream: np.ndarray, n: int, vocab_size: int) -> Tensor:
    """The n most frequent token ids of ``stream``, most frequent first (ties: lower id)."""
    counts = np.bincount(stream, minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))
    return torch.from_numpy(order[:n].astype(np.int64))


def coverage(ranked: Tensor, stream: np.ndarray, sizes=COVERAGE_SIZES) -> dict[str, float]:
    """For each n in ``sizes``: the share of ``stream``'s tokens among the first n ids."""
    counts = np.bincount(stream, minlength=ranked.numel())
    total = max(int(counts.sum()), 1)
    order = ranked.numpy()
    return {str(n): round(float(counts[order[:n]].sum()) / total, 4) for n in sizes}


def save(ranked: Tensor, counts: Tensor, model_name: str, directory: Path, record: dict) -> Path:
    from safetensors.torch import save_file

    path = weights_path(directory, model_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"ranked": ranked.to(torch.int64).contiguous(),
               "counts": counts.to(torch.int64).contiguous()}, str(path))
    path.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    return path


def check(env: DrafterEnv, n: int) -> None:
    """Before a request is queued (no weights needed): the model has a ranking, of at
    least ``n`` ids."""
    path = weights_path(env.checkpoint_dir, env.model_name)
    try:
        st = path.stat()
    except OSError:
        raise SpeculationError(
            f"no draft vocabulary for model {env.model_name!r}; rank one with `nodraft train "
            f"draft-vocab --model {env.model_name}`, or ask for draft_vocab 0 (the full head)",
            "speculation.draft_vocab") from None
    size = _ranked_ids(str(path), st.st_mtime_ns, st.st_size)
    if n > size:
        raise SpeculationError(f"draft_vocab must be at most the model's vocabulary, {size}",
                               "speculation.draft_vocab")


@functools.lru_cache(maxsize=16)
def _ranked_ids(path: str, mtime_ns: int, size: int) -> int:
    """How many ids the ranking at ``path`` holds, from its header (the file's modification
    time and size key the cache: a file ranked again is read again)."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return int(f.get_slice("ranked").get_shape()[0])


def head_rows(env: DrafterEnv, n: int) -> tuple[Tensor, Tensor]:
    """The first ``n`` ids of env's model's ranking (n,) and their rows of the tied LM head
    (n, dim), contiguous, in the model's dtype: loaded once per model, file and size and
    shared by every request (``drafters.base.loaded_weights``)."""
    path = weights_path(env.checkpoint_dir, env.model_name)
    dtype = env.model.tok_embeddings.weight.dtype
    return loaded_weights(env.model, path, f"draft-vocab {n} {dtype}",
                          lambda: _head_rows(env, path, n))


def _head_rows(env: DrafterEnv, path: Path, n: int) -> tuple[Tensor, Tensor]:
    from safetensors.torch import load_file

    check(env, n)
    ranked = load_file(str(path))["ranked"]
    V = env.model.config.vocab_size
    if ranked.numel() != V or int(ranked.max()) >= V:
        raise SpeculationError(
            f"the draft vocabulary for {env.model_name!r} ranks {ranked.numel()} ids, the "
            f"model has {V}; rank it again with `nodraft train draft-vocab --model "
            f"{env.model_name}`", "speculation.draft_vocab")
    ids = ranked[:n].clone()
    with torch.inference_mode(False), torch.no_grad():
        rows = env.model.tok_embeddings.weight[ids].contiguous()
    return ids, rows


def write_untrained(model: Micro, model_name: str, directory: Path) -> Path:
    """A ranking for a test model: a permutation of its ids, seeded by its name (a tiny
    random model has no train split of its own)."""
    V = model.config.vocab_size
    seed = int.from_bytes(hashlib.sha256(model_name.encode()).digest()[:4], "big")
    ranked = torch.randperm(V, generator=torch.Generator().manual_seed(seed))
    counts = torch.arange(V, 0, -1)
    record = {"name": f"{model_name}-{SUFFIX}", "target": model_name, "untrained": True,
              "command": "drafters.draft_vocab.write_untrained (a seeded permutation for tests)"}
    return save(ranked, counts, model_name, directory, record)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="nodraft train draft-vocab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="micro")
    p.add_argument("--checkpoints", default=str(CHECKPOINT_DIR),
                   help="the folder of the checkpoint and its tokenizer (default: the bundled)")
    args = p.parse_args(argv)
    from nodraft.micro.data import token_stream

    t0 = time.perf_counter()
    directory = Path(args.checkpoints)
    config = load_config(args.model, directory)
    local_tok = directory / "tokenizer.json"
    tok = load_tokenizer(local_tok if local_tok.exists() else None)
    path, record = write_ranking(args.model, config.vocab_size, directory,
                                 "nodraft train draft-vocab " + " ".join(argv or sys.argv[1:]),
                                 token_stream(tok, "train"), token_stream(tok, "heldout"), t0)
    print(f"wrote {path}: {config.vocab_size} ids ranked over {record['train_tokens']} train "
          "tokens; held-out coverage "
          + ", ".join(f"first {n}: {c:.1%}" for n, c in record["heldout_coverage"].items()))


def write_ranking(model_name: str, vocab_size: int, directory: Path, command: str,
                  train: np.ndarray, heldout: np.ndarray, t0: float) -> tuple[Path, dict]:
    """Rank the ids by their count in ``train``, and write the ranking and its record
    (``command``, the seconds since ``t0``, the held-out coverage) beside the checkpoint."""
    ranked = draft_vocabulary(train, vocab_size, vocab_size)
    counts = torch.from_numpy(np.bincount(train, minlength=vocab_size).astype(np.int64))
    record = {"name": f"{model_name}-{SUFFIX}", "target": model_name, "command": command,
              "seconds": round(time.perf_counter() - t0, 1), "train_tokens": int(train.size),
              "heldout_coverage": coverage(ranked, heldout)}
    return save(ranked, counts, model_name, directory, record), record


if __name__ == "__main__":
    main()
