"""Continuous batching's pass: many sequences' blocks (``Segment``) in one target pass over
a shared KV cache (``forward_packed``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from nodraft.micro.compiled import PACKED_DRAFTED_ROWS
from nodraft.micro.model import KVCache, Micro
from nodraft.micro.ops import apply_rope, cat_ints, inference, longs


@dataclass
class Segment:
    """One sequence's rows in a packed pass: ids at cache rows [start, start+T) of ``slot``,
    rotary positions ``pos`` (a tree's nodes share positions by depth), and ``mask``, the
    (T, T) attention within the segment (None = causal). The segment also sees its slot's
    rows [0, start). ``logits`` False skips the head (prefill chunks)."""

    slot: int
    start: int
    ids: Tensor | list[int]  # (T,) int64, or a list (a one-row block: no tensor of its own)
    pos: Tensor | list[int]  # (T,) int64, or a list
    mask: Tensor | None = None
    logits: bool = True

    def __len__(self) -> int:
        return len(self.ids)


NARROW = 16  # segments up to this many rows share one padded attention call


def packed_draft_cap(drafting: int) -> int:
    """The most draft tokens each of ``drafting`` sequences' blocks may carry for a
    compiled packed pass to take them all: blocks of at most ``NARROW`` rows (the current
    token and the draft), padded to the longest within ``PACKED_DRAFTED_ROWS``. Past it
    the blocks run in an eager pass besides (``forward_packed``)."""
    return min(NARROW, PACKED_DRAFTED_ROWS // max(2, drafting)) - 1


def _packed_attention_plan(segments: list[Segment], offsets: list[int], n_rows: int):
    """Index maps and masks for one packed pass, built once and reused by every layer.

    Narrow segments (current tokens and the drafts being verified) attend in groups, one
    SDPA call per group: the one-row segments together, the longer ones together, so the
    sequences that are not drafting (most of a large batch) are never padded to the
    longest draft. A group is a batch over its slots, queries padded to its longest
    segment, keys up to its longest context: read in place from the cache (a view of the
    slot range, no copy) when the group fills at least half of that range, gathered
    otherwise; a boolean (B, 1, Tq, ctx) mask. Wide segments (prefill chunks) attend one
    by one, each with its own causal mask.
    """
    narrow = [i for i, s in enumerate(segments) if len(s) <= NARROW]
    wide = [i for i, s in enumerate(segments) if len(s) > NARROW]
    plan = {"wide": [], "narrow": []}
    for i in wide:
        s = segments[i]
        T = len(s)
        m = torch.ones(T, s.start + T, dtype=torch.bool).tril(s.start)
        if s.mask is not None:
            m[:, s.start:] = s.mask
        plan["wide"].append((torch.arange(offsets[i], offsets[i] + T), s.slot, s.start + T, m))
    for members in ([i for i in narrow if len(segments[i]) == 1],
                    [i for i in narrow if len(segments[i]) > 1]):
        if members:
            plan["narrow"].append(_narrow_group(segments, members, offsets, n_rows))
    return plan


def _narrow_group(segments: list[Segment], members: list[int], offsets: list[int],
                  n_rows: int) -> tuple:
    """(slots, lo, hi, Tq, ctx, src, mask, rows, dest) for one group: ``slots`` None reads
    the slot range [lo, hi) in place, else the cache rows of those slots are gathered."""
    lo = min(segments[i].slot for i in members)
    hi = max(segments[i].slot for i in members) + 1
    gather = 2 * len(members) < hi - lo
    # each member's batch index: its place in the group, or its slot's offset in the range
    where = list(range(len(members))) if gather else [segments[i].slot - lo for i in members]
    B = len(members) if gather else hi - lo
    Tq = max(len(segments[i]) for i in members)
    ctx = max(segments[i].start + len(segments[i]) for i in members)
    # built from Python lists and broadcasts: a handful of tensor ops whatever the batch
    src = [n_rows] * (B * Tq)  # n_rows = a zero row
    starts, lens = [0] * B, [0] * B
    rows, dest = [], []
    for i, b in zip(members, where):
        s = segments[i]
        T = len(s)
        starts[b], lens[b] = s.start, T
        src[b * Tq: b * Tq + T] = range(offsets[i], offsets[i] + T)
        rows.extend(range(offsets[i], offsets[i] + T))
        dest.extend(range(b * Tq, b * Tq + T))
    t = torch.arange(Tq)[None, :, None]
    key = torch.arange(ctx)[None, None, :]
    start_b = longs(starts)[:, None, None]
    # row t of a chain sees the slot's committed rows and its own rows up to t
    mask = (t < longs(lens)[:, None, None]) & (key <= start_b + t)
    mask[:, :, 0] = True  # padding rows see one key (no empty softmax); discarded
    for i, b in zip(members, where):
        s = segments[i]
        if s.mask is not None:  # a tree: its own mask within the segment
            mask[b, :len(s), s.start:s.start + len(s)] = s.mask
    slots = longs([segments[i].slot for i in members]) if gather else None
    return (slots, lo, hi, Tq, ctx, longs(src), mask[:, None], longs(rows),
            longs(dest))


@inference
def forward_packed(model: Micro, segments: list[Segment], cache: KVCache
                   ) -> list[tuple[Tensor | None, Tensor]]:
    """ONE target pass over every segment: per segment, (logits (T, V) or None, final
    hidden (T, dim)). The linear layers see all rows packed together (one matmul per
    weight for the whole batch); attention keeps each sequence to its own slot. Keys and
    values are written to each segment's rows; committed lengths do not change.

    With compiled passes (``Micro.compile``) the blocks that want logits (at most
    ``NARROW`` rows each: current tokens and drafts) run as one compiled packed pass
    (``CompiledPasses.packed``), each prompt's chunk through the compiled prefill
    (``CompiledPasses.prefill``), and only what neither takes (drafts too many for the
    compiled pass, a family not compiled yet) eagerly, in a packed pass of its own. Where
    nodraft's one-call passes serve (``CompiledPasses.block_serves``), every block, of any
    size, goes through ``nodraft::packed_block`` in one call instead.
    """
    compiled = model.compiled
    if compiled is None:
        return _eager(model, segments, cache)
    if compiled.block_serves():  # one call for every block, whatever its size
        got = compiled.packed_block(segments, cache)
        if got is not None:
            return got
    out: list = [None] * len(segments)
    narrow = [i for i, s in enumerate(segments) if s.logits and len(s) <= NARROW]
    if len(narrow) >= 2:
        got = compiled.packed([segments[i] for i in narrow], cache)
        if got is not None:
            for i, o in zip(narrow, got):
                out[i] = o
    for i, s in enumerate(segments):
        if out[i] is None and not s.logits:
            hidden = compiled.prefill(model.embed(cat_ints([s.ids])), cache, s.slot,
                                      start=s.start)
            if hidden is not None:
                out[i] = (None, hidden)
    rest = [i for i in range(len(segments)) if out[i] is None]
    if rest:
        for i, o in zip(rest, _eager(model, [segments[i] for i in rest], cache)):
            out[i] = o
    return out


def _eager(model: Micro, segments: list[Segment], cache: KVCache
           ) -> list[tuple[Tensor | None, Tensor]]:
    c = model.config
    H, D = c.n_heads, c.head_dim
    ids = cat_ints([s.ids for s in segments])
    pos = cat_ints([s.pos for s in segments])
    N = ids.numel()
    slot_idx = longs([s.slot for s in segments for _ in range(len(s))])
    row_idx = longs([r for s in segments for r in range(s.start, s.start + len(s))])
    offsets = _offsets(segments)
    plan = _packed_attention_plan(segments, offsets, N)
    cos, sin = model.rope_cos[pos][:, None, None], model.rope_sin[pos][:, None, None]
    h = model.embed(ids)  # (N, dim)
    for li, layer in enumerate(model.layers):
        an, fn = layer.attention_norm, layer.ffn_norm
        x = F.rms_norm(h, an.weight.shape, an.weight, an.eps)
        qkv = F.linear(x, layer.attention.wqkv.weight).view(N, 3, H, D)
        qk = apply_rope(qkv[:, :2], cos, sin)  # (N, 2, H, D)
        q, k, v = qk[:, 0], qk[:, 1], qkv[:, 2]
        k_cache, v_cache = cache.k[li], cache.v[li]  # (slots, H, max_len, D)
        k_cache[slot_idx, :, row_idx] = k.to(k_cache.dtype)
        v_cache[slot_idx, :, row_idx] = v.to(v_cache.dtype)
        y = torch.empty(N, H, D, dtype=q.dtype)
        for rows, slot, end, m in plan["wide"]:
            yw = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None],
                                                k_cache[slot, :, :end][None].to(q.dtype),
                                                v_cache[slot, :, :end][None].to(q.dtype),
                                                attn_mask=m)
            y[rows] = yw[0].transpose(0, 1)
        if plan["narrow"]:
            q0 = torch.cat([q, q.new_zeros(1, H, D)])  # the zero row pads short segments
        for slots, lo, hi, Tq, ctx, src, mask, rows, dest in plan["narrow"]:
            B = hi - lo if slots is None else slots.numel()
            qp = q0[src].view(B, Tq, H, D).transpose(1, 2)
            if slots is None:
                keys, values = k_cache[lo:hi, :, :ctx], v_cache[lo:hi, :, :ctx]
            else:
                keys = k_cache[:, :, :ctx].index_select(0, slots)
                values = v_cache[:, :, :ctx].index_select(0, slots)
            yn = F.scaled_dot_product_attention(qp, keys.to(q.dtype), values.to(q.dtype),
                                                attn_mask=mask)
            y[rows] = yn.transpose(1, 2).reshape(B * Tq, H, D)[dest]
        h = h + F.linear(y.view(N, H * D), layer.attention.wo.weight)
        h = h + layer.feed_forward.forward(F.rms_norm(h, fn.weight.shape, fn.weight, fn.eps))
    if any(s.logits for s in segments):
        sel = longs([r for s, o in zip(segments, offsets) if s.logits
                            for r in range(o, o + len(s))])
        logits = model.head(h[sel])
    out, j = [], 0
    for s, o in zip(segments, offsets):
        lg = None
        if s.logits:
            lg, j = logits[j:j + len(s)], j + len(s)
        out.append((lg, h[o:o + len(s)]))
    return out


def head_rows(model: Micro, h: Tensor) -> Tensor:
    """The final norm and head over a few rows (T, dim) between passes (a prompt's last
    row, once its prefill is done). Where nodraft's one-call passes serve, by
    ``nodraft::head`` from the head matrix those passes read (``CompiledPasses.head_rows``:
    in the caches after a batch's pass, and the same bits as a pass's head); else, once a
    compiled graph is built or loaded, the head's (in, out) copy that every compiled graph
    reads; before either, ``Micro.head`` (building the copies resolves the compiled passes'
    product, which may build ``nodraft::mm``: seconds a request must never wait on)."""
    compiled = model.compiled
    if compiled is not None:
        got = compiled.head_rows(h)
        if got is not None:
            return got
    wt = None if compiled is None else compiled.built_weights()
    if wt is None:
        return model.head(h)
    return torch.mm(model.norm(h), wt["head"])


def _offsets(segments: list[Segment]) -> list[int]:
    out, o = [], 0
    for s in segments:
        out.append(o)
        o += len(s)
    return out
