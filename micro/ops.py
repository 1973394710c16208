"""The operations micro's eager passes (micro/model.py), its compiled passes
(micro/compiled.py) and the EAGLE head share: rotary tables and their application, and
SDPA's additive mask. One definition, so the graphs compute what the eager code does.
And ``inference``, the decorator the passes' entry points run under."""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor


def inference(fn):
    """``fn`` run in inference mode, as ``@torch.inference_mode()`` runs it, but entered
    only where the caller is not in it already: a pass's entry points are called from the
    engine's iteration, which is, once per token or more, and ``torch.inference_mode``'s
    own decorator enters and leaves a context object each call, nested or not."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return run


def rope_tables(config) -> tuple[Tensor, Tensor]:
    """cos, sin: (max_positions, head_dim) in the rotate-half layout; cos's halves repeated,
    sin's first half negated (``apply_rope``'s signed table)."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
    angles = torch.arange(config.max_positions, dtype=torch.float64)[:, None] * inv_freq
    cos, sin = angles.cos().float(), angles.sin().float()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """SDPA's float form of a boolean mask: 0 where ``allowed``, -inf elsewhere (for the
    short query blocks of verification, SDPA runs it faster than the boolean mask on CPU)."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE: x * cos + [-x2, x1] * sin. With ``sin`` the signed table of
    ``rope_tables`` ([-sin, sin]) that is x * cos + roll(x, D/2) * sin: the same numbers,
    bit for bit, in two fewer operations (chunk, neg, cat become one roll).
    x: (..., D); cos, sin broadcast to it."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def longs(values) -> Tensor:
    """``torch.tensor(values, dtype=torch.long)`` for a (nested) list of Python ints: the
    same tensor, made by way of NumPy, which builds it from a list several times faster
    (the passes and a draft make a few small ones at every step)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def cat_ints(parts: list) -> Tensor:
    """int64 pieces -- Python lists or 1-D tensors, in any mix -- as one int64 tensor, in
    order: a batch's one-row blocks carry their token and position as lists (no tensor
    each), drafted blocks and prompts' chunks as tensors."""
    if all(isinstance(p, list) for p in parts):
        return longs([x for p in parts for x in p])
    flat: list[int] = []
    for p in parts:
        flat += p if isinstance(p, list) else p.tolist()
    return longs(flat)
