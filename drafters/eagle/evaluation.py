"""Measuring an EAGLE head: the target's features, held-out top-1 accuracy by tree depth
(on the target's greedy continuations too: ``micro.greedy``), and the CPU time of a draft
step (used by ``nodraft train eagle`` and ``nodraft eval``; never by serving)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import Tensor

from nodraft.drafters.base import DraftContext, DrafterEnv
from nodraft.drafters.eagle.drafter import Eagle
from nodraft.drafters.eagle.head import EagleHead, features, save_head, unroll, values
from nodraft.micro.model import Micro


@torch.no_grad()
def target_features(model: Micro, ids: Tensor, fused: tuple[int, ...] = ()
                    ) -> tuple[Tensor, Tensor, Tensor | None]:
    """(features f (B, T, dim), the final layer's residual stream h (B, T, dim), the value
    rows of the ``fused`` layers (B, T, fused·dim; ``head.values``) or None) of ids."""
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    hidden: list[Tensor] = []
    h = model.run_layers(model.embed(ids), pos, 0, model.config.n_layers, hidden=hidden)
    return features(model, h), h, (values(model, hidden, fused) if fused else None)


@torch.no_grad()
def evaluate_head(model: Micro, head_state: dict[str, Tensor], stream, depth: int = 5,
                  windows: int = 64, seq_len: int = 256, seed: int = 0,
                  rows: Tensor | None = None, first: int = 0) -> dict:
    """Held-out top-1 accuracy of the head by position (depth 1..depth).

    ``windows`` random windows of ``seq_len + 1`` tokens of ``stream`` (an id array, e.g.
    the held-out split's). At every position the head drafts ``depth`` tokens greedily with
    its own predicted features, as at run time, reading the window's tokens as the drafted
    path (teacher forcing on tokens); the draft token at depth d is compared with the
    target's greedy token at that position given the true prefix. So ``top1[d-1]`` is the
    accuracy at depth d *given* the path so far -- approximately the chance that a chain of
    top-1 drafts with d-1 accepted tokens has its d-th accepted too (the path read is the
    text's, where at run time it is the target's own greedy continuation).
    ``vocab_coverage`` is the share of the target's greedy tokens inside the draft
    vocabulary (the ceiling on every figure).

    ``rows`` (W, seq_len + 1) replaces the windows, e.g. ``micro.greedy.greedy_rows``: the target's own
    greedy continuations, where the path read *is* the run-time path and ``top1[d-1]`` the
    chance that a chain's d-th draft is accepted after d-1 were; ``first`` then counts only
    positions from there on (the continuation, not its prompt)."""
    model.eval()
    dtype = model.tok_embeddings.weight.dtype
    head = EagleHead.from_state(model.config, head_state).to(dtype)
    if rows is None:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.as_tensor(stream, dtype=torch.long)
        starts = torch.randint(0, len(ids) - seq_len - 1, (windows,), generator=gen)
        rows = torch.stack([ids[s:s + seq_len + 1] for s in starts.tolist()])  # (W, T+1)
    windows = rows.shape[0]
    correct = torch.zeros(depth)
    counted = torch.zeros(depth)
    covered = 0
    W_draft = head.draft_weight(model)
    for b in range(0, windows, 16):
        x = rows[b:b + 16]
        f, h, vals = target_features(model, x, head.fused)
        greedy = model.head(h).argmax(-1)  # (B, T+1): the target's token after position t
        outs = unroll(head, model, x[:, 1:], f[:, :-1], depth,
                      vals=None if vals is None else vals[:, :-1])
        want = greedy[:, 1:]  # row p predicts the token after position p + 1
        covered += int(torch.isin(want[:, first:], head.draft_vocab).sum())
        for j, out in enumerate(outs):
            got = head.draft_vocab[(out @ W_draft.T).argmax(-1)]
            ok = (got == want)[:, max(j, first):]  # rows p >= j: a valid input at step j + 1
            correct[j] += ok.sum()
            counted[j] += ok.numel()
    return {"top1_by_position": [round(float(c / n), 4) for c, n in zip(correct, counted)],
            "positions": int(counted[0]), "draft_vocab": int(head.draft_vocab.numel()),
            "vocab_coverage": round(covered / float(rows[:, 1 + first:].numel()), 4)}


# -- measurement ------------------------------------------------------------------------------
@torch.inference_mode()
def time_draft_step(model: Micro, head_state: dict[str, Tensor], prompt: list[int],
                    params: Eagle.Params = Eagle.Params(), repeats: int = 200,
                    vocab_sizes: tuple[int, ...] | None = None) -> dict:
    """Median time (µs of this thread's CPU time, which other processes on a shared machine
    do not inflate as they do wall time) of one draft step (``Eagle.propose`` after one
    committed row: the catch-up and the tree) for each draft-vocabulary size (the same
    weights; N takes the N most frequent of the trained vocabulary, or the whole target
    vocabulary), and of a 1-token target pass for scale; the variants are timed in turn,
    repeat by repeat."""
    import statistics
    import tempfile

    from nodraft.micro.model import KVCache

    V = model.config.vocab_size
    trained = head_state["draft_vocab"]
    sizes = vocab_sizes or (int(trained.numel()), V)
    cache = KVCache(model.config, 1)
    hidden: list[Tensor] = []
    model(torch.tensor([prompt[:-1]]), cache=cache, hidden=hidden)
    cache.advance(0, len(prompt) - 1)
    runs = {}
    for N in sizes:
        vocab = torch.arange(V) if N >= V else trained[:N]
        with tempfile.TemporaryDirectory() as d:
            head = EagleHead.from_state(model.config, dict(head_state, draft_vocab=vocab))
            save_head(head, "timing", Path(d), {})
            drafter = Eagle(params, DrafterEnv("timing", model, {}, checkpoint_dir=Path(d)))
        ctx = DraftContext(list(prompt), len(prompt), model, cache, 0, hidden[-1][0])
        drafter.propose(ctx, 64)  # the prompt's catch-up
        runs[min(N, V)] = (drafter, ctx)
    times: dict[str, list[float]] = {f"vocab_{N}_us": [] for N in runs} | {"target_pass_us": []}
    clock = time.thread_time
    x = torch.tensor([[prompt[-1]]])
    for _ in range(repeats):
        for N, (drafter, ctx) in runs.items():  # a step: one new committed row, then the tree
            st = ctx.state["eagle"]
            st.rows, st.root = len(prompt) - 2, None
            ctx.last_hidden = hidden[-1][0, -1:]
            t0 = clock()
            drafter.propose(ctx, 64)
            times[f"vocab_{N}_us"].append(clock() - t0)
        t0 = clock()
        model(x, cache=cache)
        times["target_pass_us"].append(clock() - t0)
    out: dict = {k: round(statistics.median(v) * 1e6, 1) for k, v in times.items()}
    out["params"] = {"depth": params.depth, "top_k": params.top_k,
                     "total_tokens": params.total_tokens}
    return out
