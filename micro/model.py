"""micro: a Llama-style decoder in one file.

RMSNorm, rotary position embeddings (RoPE, Hugging Face's rotate-half layout), SwiGLU,
tied input/output embeddings, no biases. Four layers of width 160: about 1.8M parameters.

The forward pass is written for speculative decoding:

- explicit ``pos`` (rotary positions) apart from where the keys and values are *stored*:
  a tree of draft tokens stores its nodes in consecutive cache rows while nodes at the same
  depth share a position;
- an optional block mask over the new tokens (tree attention); the cached prefix is always
  visible;
- a preallocated, position-indexed KV cache (``KVCache``): a forward writes rows
  ``[start, start + T)`` of one slot and never changes the slot's committed length, so the
  caller accepts by advancing it and rolls back by simply not doing so;
- ``run_layers(h, lo, hi)`` runs any contiguous range of layers, so early exit (layers
  ``[0, E)`` then the final norm and head) and its continuation (layers ``[E, L)``) reuse
  the same cache rows.
"""

from __future__ import annotations

import ctypes
import math
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nodraft.micro.ops import additive_mask, apply_rope, inference, longs, rope_tables  # noqa: F401 (also micro.model's API)


@dataclass(frozen=True)
class MicroConfig:
    vocab_size: int = 4096
    dim: int = 160
    n_layers: int = 4
    n_heads: int = 4
    ffn_dim: int = 384
    max_positions: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)


def layer_macs(c: MicroConfig) -> int:
    """Multiply-accumulates of one decoder layer per token (its weights: wqkv, wo, w13, w2);
    the drafters' FLOP cost models divide by ``n_layers * layer_macs + vocab_size * dim``,
    a whole pass's."""
    return 4 * c.dim * c.dim + 3 * c.dim * c.ffn_dim


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux's madvise advice


def zeros_on_huge_pages(shape: tuple, dtype: torch.dtype) -> Tensor:
    """``torch.zeros(shape, dtype=dtype)``, its 2 MiB-aligned part asked onto transparent
    huge pages before its first write (Linux ``madvise(MADV_HUGEPAGE)``; elsewhere, or
    refused, ordinary pages -- the same tensor either way).

    A packed pass reads every running sequence's cached rows: short runs of rows, one per
    slot and head, ~160 KB apart, from a cache of tens of MB. On 4 KiB pages that is a TLB
    miss every few rows; on huge pages the one-row blocks' attention took 0.70-0.83x the
    time (``benchmarks/packed_attention.py``, "kernel" against "kernel, 4 KiB pages")."""
    t = torch.empty(shape, dtype=dtype)
    start = t.data_ptr()
    lo = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    hi = (start + t.numel() * t.element_size()) // _HUGE_PAGE * _HUGE_PAGE
    if hi > lo and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_HUGEPAGE)
        except (OSError, AttributeError):  # no libc symbol: ordinary pages
            pass
    return t.zero_()


class KVCache:
    """Keys and values for ``n_slots`` sequences, preallocated and written by row.

    k, v: (n_layers, n_slots, n_heads, max_len, head_dim), on huge pages where the
    system gives them (``zeros_on_huge_pages``). ``lengths[slot]`` is the number of
    committed rows; rows past it are scratch space (drafts being verified) and are
    overwritten freely. Rollback is setting a length.
    """

    def __init__(self, config: MicroConfig, n_slots: int = 1, max_len: int | None = None,
                 dtype: torch.dtype = torch.float32):
        self.max_len = max_len or config.max_positions
        shape = (config.n_layers, n_slots, config.n_heads, self.max_len, config.head_dim)
        self.k = zeros_on_huge_pages(shape, dtype)
        self.v = zeros_on_huge_pages(shape, dtype)
        self.lengths = [0] * n_slots

    @property
    def n_slots(self) -> int:
        return len(self.lengths)

    def reset(self, slot: int) -> None:
        self.lengths[slot] = 0

    def advance(self, slot: int, n: int) -> None:
        assert self.lengths[slot] + n <= self.max_len
        self.lengths[slot] += n

    def set_length(self, slot: int, n: int) -> None:
        assert 0 <= n <= self.max_len
        self.lengths[slot] = n

    def move_rows(self, slot: int, src: list[int], dst: int) -> None:
        """Copy rows ``src`` (in order) to ``dst, dst+1, ...`` in every layer (tree paths)."""
        if src == list(range(dst, dst + len(src))):
            return
        idx = longs(src)
        for cache in (self.k, self.v):
            cache[:, slot, :, dst:dst + len(src)] = cache[:, slot, :, idx]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: MicroConfig):
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.wqkv = nn.Linear(config.dim, 3 * config.dim, bias=False)  # q, k, v stacked
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: tuple[Tensor, Tensor] | None,
                start: int, mask: Tensor | None) -> Tensor:
        B, T, C = x.shape
        qkv = F.linear(x, self.wqkv.weight).view(B, T, 3, self.n_heads, self.head_dim)
        qkv = qkv.permute(2, 0, 3, 1, 4)
        q, k, v = apply_rope(qkv[:2], cos, sin).unbind(0) + (qkv[2],)  # each (B, H, T, D)
        if kv is not None:  # write rows [start, start+T) of this slot, attend over [0, start+T)
            k_cache, v_cache = kv  # (H, max_len, D) views of one layer, one slot
            k_cache[:, start:start + T] = k[0]
            v_cache[:, start:start + T] = v[0]
            # read back as written: a float16 cache's rows, rounded, in the queries' dtype
            k = k_cache[None, :, :start + T].to(q.dtype)
            v = v_cache[None, :, :start + T].to(q.dtype)
        if mask is None and kv is not None and T == 1:
            y = F.scaled_dot_product_attention(q, k, v)  # one query sees everything before it
        elif mask is None and start == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return F.linear(y.transpose(1, 2).reshape(B, T, C), self.wo.weight)


class FeedForward(nn.Module):
    def __init__(self, config: MicroConfig):
        super().__init__()
        self.ffn_dim = config.ffn_dim
        self.w13 = nn.Linear(config.dim, 2 * config.ffn_dim, bias=False)  # gate, up stacked
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = F.linear(x, self.w13.weight).split(self.ffn_dim, dim=-1)
        return F.linear(F.silu(gate) * up, self.w2.weight)


class Block(nn.Module):
    def __init__(self, config: MicroConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x, cos, sin, kv, start, mask):
        # Sub-modules are called through .forward and linears through F.linear: a 1-token
        # pass is mostly per-call overhead on a CPU, and nn.Module.__call__ is part of it.
        an, fn = self.attention_norm, self.ffn_norm
        x = x + self.attention.forward(F.rms_norm(x, an.weight.shape, an.weight, an.eps),
                                       cos, sin, kv, start, mask)
        return x + self.feed_forward.forward(F.rms_norm(x, fn.weight.shape, fn.weight, fn.eps))


class Micro(nn.Module):
    def __init__(self, config: MicroConfig = MicroConfig()):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        cos, sin = rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.compiled = None  # CompiledPasses once compile() is called
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual outputs
            if name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.n_layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def compile(self, enabled: bool = True, lazy: bool = True,
                gemm: str | None = None, block: bool = True) -> "Micro":
        """Route one-sequence cache passes (``verify_pass``, ``prefill_pass``, ``forward``
        and ``run_layers`` with a cache) through nodraft's one-call pass
        (``nodraft::block``, micro/csrc/block.cpp) where it serves, else through
        ``torch.compile`` graphs (micro/compiled.py); ``enabled=False`` goes back to eager.
        ``lazy``: a graph compiles (and nodraft's library builds) on its first pass;
        otherwise only after ``self.compiled.warm_up`` (until then eager). ``gemm``: the
        matrix product, 'auto' (nodraft's kernel where it loads) or 'torch' (micro/gemm.py;
        default ``NODRAFT_GEMM``, else 'auto'; 'torch' leaves the one-sequence passes to
        the graphs). ``block=False``: the graphs only (what a CPU without nodraft's kernels
        runs; the tests and benchmarks compare the two). Graphs built ahead of time load
        with ``self.compiled.load`` (engine/artifacts.py)."""
        from nodraft.micro.compiled import CompiledPasses

        self.compiled = CompiledPasses(self, lazy, gemm, block) if enabled else None
        return self

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @inference
    def verify_pass(self, ids: Tensor, cache: KVCache, slot: int, start: int,
                    pos: Tensor | None = None, tree_mask: Tensor | None = None
                    ) -> tuple[Tensor, Tensor]:
        """One sequence's block ids (T,) through every layer with its KV rows written at
        [start, start+T): logits (T, V) and the final residual stream (T, dim). Positions
        default to consecutive; ``tree_mask`` (T, T) bool as in ``forward``. Compiled
        when ``compile()`` was called."""
        T = ids.shape[0]
        if pos is None:
            pos = torch.arange(start, start + T)
        compiled = self.compiled  # read once: a failed warm-up may reset it meanwhile
        if compiled is not None:
            mask = None
            if tree_mask is not None:
                mask = additive_mask(tree_mask, self.tok_embeddings.weight.dtype)
            done = compiled.run(self.embed(ids), pos, 0, self.config.n_layers, cache,
                                slot, start, mask, head=True)
            if done is not None:
                return done[1], done[0]
        hidden: list[Tensor] = []
        logits = self(ids[None], pos[None], cache=cache, slot=slot, start=start,
                      tree_mask=tree_mask, hidden=hidden)
        return logits[0], hidden[-1][0]

    @inference
    def verify_chain(self, tokens: list[int], cache: KVCache, slot: int, start: int
                     ) -> tuple[Tensor, Tensor]:
        """``verify_pass`` over a chain given as token ids (a decode step's last token, and
        a chain of drafts behind it): the same logits and residual stream, in one call of
        ``nodraft::chain`` where that serves (``CompiledPasses.chain``), else through
        ``verify_pass``."""
        compiled = self.compiled
        if compiled is not None:
            done = compiled.chain(tokens, cache, slot, start)
            if done is not None:
                return done[1], done[0]
        return self.verify_pass(longs(tokens), cache, slot, start)

    @inference
    def prefill_pass(self, ids: Tensor, cache: KVCache, slot: int, start: int) -> Tensor:
        """Prompt ids (T,) through every layer with their KV rows written at
        [start, start+T), each row seeing the rows before it: the final residual stream
        (T, dim). No logits: a prefill needs none. Compiled (``CompiledPasses.prefill``)
        when ``compile()`` was called; eager otherwise."""
        compiled = self.compiled
        if compiled is not None:
            done = compiled.prefill(self.embed(ids), cache, slot, start=start)
            if done is not None:
                return done
        T = ids.shape[0]
        pos = torch.arange(start, start + T)[None]
        # ``hidden`` given: the eager layers (the compiled block passes are for a few rows)
        return self.run_layers(self.embed(ids)[None], pos, 0, self.config.n_layers,
                               cache=cache, slot=slot, start=start,
                               mask=self.block_mask(T, start, None), hidden=[])[0]

    @inference
    def exit_pass(self, ids: Tensor, cache: KVCache, slot: int, start: int, exit_layer: int
                  ) -> tuple[Tensor, Tensor]:
        """Early exit: ids (T,) through layers [0, exit_layer) with their KV rows written
        at [start, start+T); logits through the final norm and head (T, V) and the layer's
        residual stream (T, dim). Compiled when ``compile()`` was called."""
        return self._layer_range(self.embed(ids), cache, slot, start, 0, exit_layer, True)

    @inference
    def exit_residual(self, ids: Tensor, cache: KVCache, slot: int, start: int,
                      exit_layer: int) -> Tensor:
        """As ``exit_pass`` without the head: the layer-``exit_layer`` residual stream
        (T, dim) (for a drafter with a head of its own)."""
        return self._layer_range(self.embed(ids), cache, slot, start, 0, exit_layer, False)[1]

    @inference
    def verify_from(self, h: Tensor, cache: KVCache, slot: int, start: int, layer: int
                    ) -> tuple[Tensor, Tensor]:
        """A chain block's layer-``layer`` residual stream h (T, dim), its rows below
        ``layer`` already cached at [start, start+T) (early exit's reuse), through layers
        [layer, L) and the head: logits (T, V) and the final residual stream (T, dim), as
        ``verify_pass`` gives them. Compiled when ``compile()`` was called."""
        return self._layer_range(h, cache, slot, start, layer, self.config.n_layers, True)

    def _layer_range(self, h: Tensor, cache: KVCache, slot: int, start: int, lo: int,
                     hi: int, head: bool) -> tuple[Tensor | None, Tensor]:
        """A causal block's residual stream h (T, dim) through layers [lo, hi), their KV
        rows written at [start, start+T): (logits (T, V) with ``head``, else None; the
        block's residual stream after layer hi - 1). Compiled where a graph serves it."""
        T = h.shape[0]
        pos = torch.arange(start, start + T)
        compiled = self.compiled
        if compiled is not None:
            done = compiled.run(h, pos, lo, hi, cache, slot, start, None, head=head)
            if done is not None:
                return done[1], done[0]
        out = self.run_layers(h[None], pos[None], lo, hi, cache=cache, slot=slot, start=start,
                              mask=self.block_mask(T, start, None))[0]
        return (self.head(out) if head else None), out

    # -- the pieces -----------------------------------------------------------------------
    def embed(self, idx: Tensor) -> Tensor:
        """The token embeddings of ``idx`` (..., dim): what ``tok_embeddings`` (a plain
        ``nn.Embedding``) returns, without the module call around it."""
        return torch.embedding(self.tok_embeddings.weight, idx)

    def head(self, h: Tensor) -> Tensor:
        """Final norm and the tied LM head: residual stream (..., dim) -> logits (..., V)."""
        return F.linear(self.norm(h), self.tok_embeddings.weight)

    def block_mask(self, T: int, start: int, tree_mask: Tensor | None) -> Tensor | None:
        """(T, start+T) additive mask (``additive_mask``): each row sees the prefix, then
        the block's rows its mask allows (default causal)."""
        if tree_mask is None:
            if T == 1 or start == 0:
                return None  # handled by SDPA without a mask / with is_causal
            allowed = torch.ones(T, start + T, dtype=torch.bool).tril(start)
        else:
            allowed = torch.cat([torch.ones(T, start, dtype=torch.bool), tree_mask], dim=1)
        return additive_mask(allowed, self.tok_embeddings.weight.dtype)

    def run_layers(self, h: Tensor, pos: Tensor, lo: int, hi: int, *,
                   cache: KVCache | None = None, slot: int = 0, start: int = 0,
                   mask: Tensor | None = None, hidden: list[Tensor] | None = None,
                   keep: list[Tensor] | None = None) -> Tensor:
        """Layers [lo, hi) on residual stream h (B, T, dim) at rotary positions pos (B, T).

        With a cache (B must be 1), keys and values are written to rows [start, start+T)
        of ``slot`` and the block attends to rows [0, start) plus itself under ``mask``,
        a (T, start+T) mask from ``block_mask``. ``hidden`` collects each layer's output;
        ``keep`` (training only: LayerSkip's layer dropout) holds a (B, 1, 1) 0/1 tensor
        per layer, 0 where that sample skips the layer.
        """
        compiled = self.compiled
        if (compiled is not None and cache is not None and keep is None and hidden is None
                and hi > lo and h.shape[0] == 1):
            tt = None if mask is None else mask[:, start:]  # the prefix is always visible
            done = compiled.run(h[0], pos[0], lo, hi, cache, slot, start, tt, head=False)
            if done is not None:
                return done[0][None]
        cos, sin = self.rope_cos[pos][:, None], self.rope_sin[pos][:, None]  # (B, 1, T, D)
        for i in range(lo, hi):
            kv = (cache.k[i, slot], cache.v[i, slot]) if cache is not None else None
            out = self.layers[i].forward(h, cos, sin, kv, start, mask)
            h = out if keep is None else h + keep[i] * (out - h)
            if hidden is not None:
                hidden.append(h)
        return h

    def forward(self, idx: Tensor, pos: Tensor | None = None, *, cache: KVCache | None = None,
                slot: int = 0, start: int | None = None, tree_mask: Tensor | None = None,
                exit_layer: int | None = None, hidden: list[Tensor] | None = None) -> Tensor:
        """Logits (B, T, V) for token ids idx (B, T).

        pos defaults to start + arange(T); start defaults to the slot's committed length.
        exit_layer=k stops after layer k and reads logits through the final norm and head
        (early exit / the logit lens). tree_mask (T, T) bool restricts attention within the
        new block (each node sees its ancestors); the default is causal.
        """
        B, T = idx.shape
        if start is None:
            start = cache.lengths[slot] if cache is not None else 0
        if pos is None:
            pos = torch.arange(start, start + T).expand(B, T)
        mask = self.block_mask(T, start, tree_mask)
        compiled = self.compiled
        if compiled is not None and cache is not None and hidden is None and B == 1:
            tt = None if mask is None else mask[:, start:]
            done = compiled.run(self.embed(idx)[0], pos[0], 0,
                                exit_layer or self.config.n_layers, cache, slot, start,
                                tt, head=exit_layer is None)
            if done is not None:
                h, logits = done
                return (logits if logits is not None else self.head(h))[None]
        h = self.embed(idx)
        if hidden is not None:
            hidden.append(h)
        h = self.run_layers(h, pos, 0, exit_layer or self.config.n_layers, cache=cache,
                            slot=slot, start=start, mask=mask, hidden=hidden)
        return self.head(h)
