"""The target's own greedy text, batched: for self-distilling drafters' heads on it and for
measuring them on it (``nodraft train eagle`` / ``medusa``, ``nodraft eval``; never by
serving). At run time a drafter guesses the target's own output, which for a small model
loops and repeats in ways natural text does not."""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from nodraft.micro.model import Micro
from nodraft.micro.ops import apply_rope


@torch.no_grad()
def greedy_continue(model, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
    """The target's greedy continuation of each row of ``prompts`` (B, P) by ``n_new``
    tokens: (B, P + n_new). Batched, with a key/value cache of its own (micro's KVCache
    holds one row per slot); the same layers and arithmetic as ``Micro.forward``. For
    self-distillation (``drafters.eagle.train``) and evaluation on the target's own text."""
    B, P = prompts.shape
    c = model.config
    H, D = c.n_heads, c.head_dim
    total = P + n_new
    ks = torch.zeros(c.n_layers, B, H, total, D, dtype=model.tok_embeddings.weight.dtype)
    vs = torch.zeros_like(ks)
    out = torch.empty(B, total, dtype=torch.long)
    out[:, :P] = prompts
    x, start = prompts, 0
    for _ in range(n_new):
        T = x.shape[1]
        pos = torch.arange(start, start + T)
        cos, sin = model.rope_cos[pos][None, None], model.rope_sin[pos][None, None]
        h = model.embed(x)
        for i, layer in enumerate(model.layers):
            att, an, fn = layer.attention, layer.attention_norm, layer.ffn_norm
            qkv = F.linear(F.rms_norm(h, an.weight.shape, an.weight, an.eps), att.wqkv.weight)
            qkv = qkv.view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)
            q, k = apply_rope(qkv[:2], cos, sin).unbind(0)
            ks[i, :, :, start:start + T], vs[i, :, :, start:start + T] = k, qkv[2]
            y = F.scaled_dot_product_attention(q, ks[i, :, :, :start + T],
                                               vs[i, :, :, :start + T], is_causal=T > 1)
            h = h + F.linear(y.transpose(1, 2).reshape(B, T, c.dim), att.wo.weight)
            h = h + layer.feed_forward.forward(F.rms_norm(h, fn.weight.shape, fn.weight, fn.eps))
        nxt = model.head(h[:, -1]).argmax(-1)
        start += T
        out[:, start] = nxt
        x = nxt[:, None]
    return out


GREEDY_PROMPT = 64  # held-out prompt tokens before the target's greedy continuation


def greedy_rows(model: Micro, stream, windows: int = 64, prompt_len: int = 64,
                seq_len: int = 256, seed: int = 0) -> Tensor:
    """``windows`` prompts of ``prompt_len`` tokens from ``stream`` (e.g. the held-out
    split), each continued by the target's greedy decoding to seq_len + 1 tokens: the text
    a drafter meets at run time, where what it must guess is the target's own output."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.as_tensor(stream, dtype=torch.long)
    starts = torch.randint(0, len(ids) - prompt_len, (windows,), generator=gen)
    prompts = torch.stack([ids[s:s + prompt_len] for s in starts.tolist()])
    return greedy_continue(model, prompts, seq_len + 1 - prompt_len)


def self_distill_rows(model, stream: np.ndarray, n_rows: int, seq_len: int, seed: int,
                      say=print, batch: int = 128) -> torch.Tensor:
    """``n_rows`` rows of seq_len + 1 tokens: a train-split prompt of 16-128 tokens (a
    random length per batch) and the target's greedy continuation of it -- the text the
    head drafts at run time, where the target's own greedy output is what it must guess
    (for micro, often a loop the natural text never shows)."""
    gen = torch.Generator().manual_seed(seed + 7)
    ids = torch.from_numpy(stream.astype(np.int64))
    rows = []
    t0 = time.time()
    for b in range(0, n_rows, batch):
        B = min(batch, n_rows - b)
        P = int(torch.randint(16, 129, (1,), generator=gen))
        starts = torch.randint(0, len(ids) - P, (B,), generator=gen)
        prompts = torch.stack([ids[s:s + P] for s in starts.tolist()])
        rows.append(greedy_continue(model, prompts, seq_len + 1 - P))
        say(f"self-distillation rows: {b + B}/{n_rows} ({time.time() - t0:.0f} s)")
    return torch.cat(rows)
