"""Compiled cache passes: one sequence's block through micro's layers as one ``torch.compile``
graph -- or, where nodraft's kernels load, as one call of ``nodraft::block`` (a batch's:
``nodraft::packed_block``; csrc/block.cpp, ``CompiledPasses.block_serves``), which leaves
the graphs to EAGLE's draft steps, ``--gemm torch`` and CPUs without AVX-512 or AVX2.

On a CPU a 1-token pass of eager micro is mostly per-operation cost: ~200 small kernels
and views around a few matrix products. Inductor fuses the norms, rotary embeddings,
softmax and SwiGLU into a few C++ loops around the products (the measured passes:
docs/ARCHITECTURE.md, "Compiled passes"; docs/BENCHMARKS.md, "What a pass costs").

What makes it work (docs/ARCHITECTURE.md, "Compiled passes"):

- **The KV cache stays outside the graph.** The graph reads the slot's committed rows
  ``[0, start)`` as a view and returns the block's new keys and values; two copies write
  them after the call. A cache mutated inside the graph is copied whole by inductor's
  functionalisation.
- **Weights laid out (in, out).** The graphs multiply by contiguous (in, out) copies of
  the weights (``transposed_weights``), which MKL multiplies a few rows by faster than
  the (out, in) originals ``F.linear`` reads transposed.
- **Products by nodraft::mm** (micro/gemm.py) where it builds: a few-row AVX-512 or AVX2
  kernel, cheaper than MKL's at 2-9 rows, and batch-invariant, over weights laid out for
  it (``gemm.pack``: 16-column blocks, each contiguous); otherwise ``torch.mm``.
- **Attention is split at the cache boundary.** Scores against the cached rows and against
  the block itself (under the block's mask: causal for chains, the tree for trees) are
  soft-maxed together, then each part weights its own values. No concatenation of the
  cache with the block: its cost does not grow with the context.
  The block's part (scores and weighting) is written as broadcast products summed, which
  inductor fuses into its loops, rather than two ``bmm`` calls a layer.
- **Shapes.** A family (layer range, head or not, one row or several, cache shape) is
  compiled once, at its first pass, with the context length -- and for several rows the
  block length -- marked dynamic, so one graph serves every context and every chain or
  tree. Every other size (heads, widths, the cache's strides) stays a constant the
  generated loops are vectorised over. ``warm_up`` compiles the families up front. The
  marking (``maybe_mark_dynamic``, not free) happens only at that first pass.
- **Built once, loaded after.** With ``export_to`` set, a family is compiled with
  ``torch.compile``'s AOT precompilation and saved (``Precompiled``); ``load`` reads saved
  families into another process, where they run at once, untraced. The server does this
  (engine/artifacts.py): a process of its own builds every family once per machine, and
  every engine loads them at start.

- **Packed passes.** Several sequences' blocks in one pass (continuous batching) have two
  families of their own per cache shape (``packed``): every block one row, or some
  drafted; every size symbolic, duck sizing off (docs/ARCHITECTURE.md, "Compiled packed
  passes").

The numbers differ from eager micro in the last bits (fused reductions), as eager
already differs between a 1-row and a k-row pass. A prompt's first 256 rows are
prefilled by a graph of their own (``prefill``: no cached prefix, SDPA's causal attention,
no head), its rows past rows already cached (a prefix read from the prefix cache, a later
chunk) by the full pass's graph without a head, alone or in a packed pass; a pass whose
family is not compiled yet (or whose cached prefix is under two rows) runs eager. Speculative and
plain greedy decoding stay token-for-token equal all the same:
tests/server/test_server_compiled.py runs every drafter on both checkpoints with the
compiled passes a server loads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import time
import types
from pathlib import Path
from typing import Callable

import torch
import torch.fx.experimental._config as shape_config  # loaded with torch: no dynamo import
import torch.nn.functional as F
from torch import Tensor

from nodraft.micro import gemm
from nodraft.micro.ops import additive_mask, apply_rope, cat_ints, inference, longs



def configure_dynamo() -> None:
    """Dynamo's settings for these graphs, once something compiles or loads them (not at
    import: an eager process -- ``--compile false``, the drafters that import this module
    for its constants -- never imports dynamo). Graphs per code object: early exit's layer
    ranges and the cache shapes of several engines share one; the default limit of 8 would
    silently fall back to eager."""
    import torch._dynamo.config as config

    config.cache_size_limit = max(config.cache_size_limit, 64)
    config.accumulated_cache_size_limit = max(config.accumulated_cache_size_limit, 512)


# size_asserts off: inductor checks the size and strides of every extern kernel's output
# (the products and the bmms: up to 25 calls a pass) with a Python-level call after it, a
# debugging aid; our kernels' outputs are fixed by their schemas, and 1- and 2-row passes
# measured faster without it (docs/ARCHITECTURE.md, "Compiled passes"). ``cpp_wrapper``
# showed no clear gain for these passes and compiles longer (EAGLE's draft step uses it).
#
# freezing off: frozen parameters become constants of the generated code, so a saved graph
# would carry its model's weights and be valid for that checkpoint only; as graph inputs
# the (in, out) copies (``transposed_weights``) are read the same way, no slower
# (docs/ARCHITECTURE.md, "Compiled passes").
OPTIONS = {"freezing": False, "size_asserts": False}

log = logging.getLogger("nodraft.compiled")

CAUSAL_KEPT = 64  # causal masks kept up to this block length
MIN_CONTEXT = 2  # shorter cached prefixes (sizes 0 and 1 are specialised): eager
PREFILL = "prefill"  # the first element of the prefill graph's family
PACKED = "packed"  # the first element of the packed passes' families
# a packed pass whose drafted blocks, padded, exceed this many rows runs eager: the padded
# attention over their slots grows past the eager pass's, which groups blocks by width
# (docs/ARCHITECTURE.md, "Compiled packed passes")
PACKED_DRAFTED_ROWS = 64


class CompiledPasses:
    """Compiled versions of ``Micro.run_layers`` (+ the head) for one sequence with a KV
    cache. Build with ``Micro.compile()``; the model's cache passes route here.

    A *family* is a layer range, head or not, one row or several, and the cache's shape
    (its strides are constants of the graph). ``lazy`` compiles a family on its first
    pass (benchmarks, tests); otherwise only families compiled by ``warm_up`` run compiled
    and the rest run eager (the server: no request waits on a compiler).
    """

    def __init__(self, model, lazy: bool = True, gemm: str | None = None, block: bool = True):
        configure_dynamo()
        self.model = model
        # called before each saved graph is loaded, here and by the drafters' graphs that
        # load beside these (an engine's: wait for a gap between requests); None: at once
        self.between_loads: Callable[[], None] | None = None
        self.lazy = lazy
        self.gemm = gemm  # micro.gemm.choose's argument; resolved at the first graph
        self.gemm_kind: str | None = None  # 'nodraft' or 'torch', once resolved
        self._fns: dict[tuple, object] = {}
        self._ready: set[tuple] = set()
        self._causal: dict[int, Tensor] = {}
        self._slots: dict[tuple[int, int, int], tuple] = {}  # a slot's K/V views per range
        self._wt: dict[str, Tensor] | None = None  # transposed_weights, built at first compile
        self._wt_mm: dict[str, Tensor] | None = None  # the same as the product reads them
        # whether nodraft::block runs run()'s passes (None: not decided; ``block=False``:
        # never, the graphs only)
        self._block: bool | None = None if block else False
        self._block_args: dict[tuple[int, int, bool], tuple[list, list]] = {}
        self._chain_args: tuple | None = None  # nodraft::chain's weights (``chain``)
        self.compile_seconds = 0.0
        self.precompiled = Precompiled()  # graphs built ahead of time (``load``, ``export_to``)
        self.artifacts: Path | None = None  # the folder they were loaded from (drafters' too)

    def _weights(self) -> dict[str, Tensor]:
        if self._wt is None:
            # in inference mode whoever asks first: a saved graph's guards compare its
            # tensors' dispatch keys, and the graphs are built and run in that mode
            with torch.inference_mode():
                self._wt = transposed_weights(self.model)
            self.gemm_kind = gemm.choose(self.gemm)
        return self._wt

    def built_weights(self) -> dict[str, Tensor] | None:
        """``transposed_weights`` once a graph has been compiled or loaded here; None
        before (nothing builds them here: their first build resolves the product)."""
        return self._wt

    def _product_weights(self) -> dict[str, Tensor]:
        """``transposed_weights`` laid out for the product in use (``gemm.pack``)."""
        if self._wt_mm is None:
            wt = self._weights()
            with torch.inference_mode():
                self._wt_mm = ({k: gemm.pack(w) for k, w in wt.items()}
                               if self.gemm_kind == "nodraft" else wt)
        return self._wt_mm

    def _core(self, lo: int, hi: int, head: bool, rows: bool = True):
        wt = self._weights()  # resolves the product first: what follows depends on it
        if not rows and self.gemm_kind == "nodraft" and gemm.unit() == "AVX2":
            return _make_core(self.model, lo, hi, head, wt, torch.mm)  # MKL's matrix-vector
        return _make_core(self.model, lo, hi, head, self._product_weights(),
                          gemm.matmul(self.gemm_kind))

    def _prefill_core(self):
        # torch.mm whatever the product: a prompt is many rows, which MKL is built for
        # (nodraft::mm's tiles are for the few rows of a decode step)
        return _make_prefill_core(self.model, self._weights(), torch.mm)

    def _packed_core(self, mixed: bool):
        # torch.mm whatever the product: a batch's rows are many, and on hot weights MKL
        # multiplied 8 rows and more faster than nodraft::mm (docs/ARCHITECTURE.md). The
        # one-row blocks' attention: nodraft::attend where nodraft's kernels serve
        wt = self._weights()
        return _make_packed_core(self.model, wt, torch.mm, mixed,
                                 gemm.attention(self.gemm_kind, self.model.config.head_dim,
                                                self.model.tok_embeddings.weight.dtype))

    def _family_fn(self, family: tuple):
        """A saved family's function, rebuilt for this model (``load``)."""
        if family[0] == PREFILL:
            return self._prefill_core()
        if family[0] == PACKED:
            return self._packed_core(family[1])
        return self._core(family[0], family[1], family[2], family[3])

    def load(self, folder: Path) -> int:
        """Load the families saved in ``folder`` (``export_to`` of an artifact build for
        this model, cache shape and product): they run at once, none compiles. Returns how
        many were loaded."""
        families = self.precompiled.load(folder, self._family_fn, self.between_loads)
        self._ready.update(families)
        self.artifacts = Path(folder)
        return len(families)

    @property
    def export_to(self) -> Path | None:
        return self.precompiled.export_to

    @export_to.setter
    def export_to(self, folder: Path | None) -> None:
        """Where a family compiled from now on is saved too (an artifact build)."""
        self.precompiled.export_to = None if folder is None else Path(folder)

    def block_serves(self, compile: bool | None = None) -> bool:
        """Whether ``nodraft::block`` (csrc/block.cpp) runs this model's one-sequence passes
        (``run``, ``prefill``) and ``nodraft::packed_block`` its batches (``packed_block``,
        through ``forward_packed``): nodraft's product chosen (``gemm``) and its library loaded,
        float32 weights, heads of an even width up to 128. Decided at the first call that
        finds the library loaded, or, where compiling is allowed (``compile``, else
        ``lazy``), loads it; until then False. A server's engine asks from its warm-up
        thread (``Engine._load_all``), never from a request's pass, which runs eager until
        it is decided."""
        if self._block is None:
            if not (gemm.loaded() or (self.lazy if compile is None else compile)):
                return False
            c = self.model.config
            serves = (gemm.choose(self.gemm) == "nodraft"
                      and self.model.tok_embeddings.weight.dtype == torch.float32
                      and c.head_dim % 2 == 0 and 2 <= c.head_dim <= 128)
            if serves:
                self._product_weights()  # before another thread can see it decided
            self._block = serves
        return self._block

    @inference
    def packed_block(self, segments: list, cache) -> list[tuple[Tensor | None, Tensor]] | None:
        """ONE pass over several sequences' blocks (``micro.packed.Segment``s, any sizes,
        prompts' chunks among them) through ``nodraft::packed_block``: per segment,
        (logits (T, V) or None, final hidden (T, dim)), every block's keys and values
        written to its rows. None where the operator does not serve (``block_serves``:
        decided, never built here) or the cache is not the float32, contiguous one it
        reads."""
        if not (self._block and _block_reads(cache)):
            return None
        L = self.model.config.n_layers
        norms, mats = self._block_weights(0, L, True)
        dtype = self.model.tok_embeddings.weight.dtype
        ids = cat_ints([s.ids for s in segments])
        pos = cat_ints([s.pos for s in segments])
        masks = [None if s.mask is None else additive_mask(s.mask, dtype) for s in segments]
        h, logits = torch.ops.nodraft.packed_block.default(
            self.model.embed(ids), pos, self.model.rope_cos, self.model.rope_sin, norms, mats,
            cache.k, cache.v, [len(s) for s in segments], [s.slot for s in segments],
            [s.start for s in segments], masks, [int(s.logits) for s in segments], 0,
            self.model.config.norm_eps)
        out, o, r = [], 0, 0
        for s in segments:
            T = len(s)
            lg = None
            if s.logits:
                lg, r = logits[r:r + T], r + T
            out.append((lg, h[o:o + T]))
            o += T
        return out

    @inference
    def head_rows(self, h: Tensor) -> Tensor | None:
        """The final norm and head over rows h (T, dim) by ``nodraft::head``, from the head
        matrix every pass of ``nodraft::block`` reads -- the same bits as a pass's head
        gives those rows; None until those passes are decided to serve (which lays their
        weights out first; never decided here)."""
        if not (self._block and h.dtype == torch.float32):
            return None
        return torch.ops.nodraft.head.default(h, self.model.norm.weight.detach(),
                                              self._product_weights()["head"],
                                              self.model.config.norm_eps)

    def _block_weights(self, lo: int, hi: int, head: bool) -> tuple[list, list]:
        """``nodraft::block``'s norms and matrices for layers [lo, hi) (and the head)."""
        args = self._block_args.get((lo, hi, head))
        if args is None:
            wt, m = self._product_weights(), self.model
            norms, mats = [], []
            for i in range(lo, hi):
                layer = m.layers[i]
                norms += [layer.attention_norm.weight.detach(), layer.ffn_norm.weight.detach()]
                mats += [wt[f"{i}.{n}.weight"] for n in ("attention.wqkv", "attention.wo",
                                                         "feed_forward.w13", "feed_forward.w2")]
            if head:
                norms.append(m.norm.weight.detach())
                mats.append(wt["head"])
            args = self._block_args[(lo, hi, head)] = (norms, mats)
        return args

    @inference
    def chain(self, tokens: list[int], cache, slot: int, start: int
              ) -> tuple[Tensor, Tensor] | None:
        """A chain of ``tokens`` at consecutive positions from ``start``, causal, through
        every layer and the head by ``nodraft::chain`` (their embeddings looked up in the
        call): the final residual stream (T, dim) and logits (T, V), the same bits as
        ``run`` gives over their embeddings; keys and values written to rows [start,
        start + T). None where ``nodraft::block`` does not serve (``block_serves``, decided
        as ``run`` decides it) or the cache is not one it reads: the caller runs ``run``."""
        if not (self.block_serves() and _block_reads(cache)):
            return None
        args = self._chain_args
        if args is None:  # once: a decode step calls this for every token
            m = self.model
            norms, mats = self._block_weights(0, m.config.n_layers, True)
            args = self._chain_args = (m.tok_embeddings.weight, m.rope_cos, m.rope_sin, norms,
                                       mats)
        return torch.ops.nodraft.chain.default(tokens, *args, cache.k, cache.v, slot, start,
                                               self.model.config.norm_eps)

    def _run_block(self, h: Tensor, pos: Tensor, lo: int, hi: int, cache, slot: int,
                   start: int, mask: Tensor | None, head: bool) -> tuple[Tensor, Tensor | None]:
        args = self._block_weights(lo, hi, head)
        out, logits = torch.ops.nodraft.block.default(
            h, pos, self.model.rope_cos, self.model.rope_sin, args[0], args[1], cache.k, cache.v,
            slot, start, lo, mask, self.model.config.norm_eps)
        return out, (logits if head else None)

    def causal(self, T: int, dtype: torch.dtype) -> Tensor:
        """The additive causal mask (T, T); kept for blocks of drafts' sizes, made for
        longer ones (a prompt's chunk)."""
        m = self._causal.get((T, dtype))
        if m is None:
            m = additive_mask(torch.ones(T, T, dtype=torch.bool).tril(), dtype)
            if T <= CAUSAL_KEPT:
                self._causal[(T, dtype)] = m
        return m

    @inference
    def run(self, h: Tensor, pos: Tensor, lo: int, hi: int, cache, slot: int, start: int,
            mask: Tensor | None, head: bool, compile: bool | None = None
            ) -> tuple[Tensor, Tensor | None] | None:
        """Layers [lo, hi) over one sequence's block h (T, dim) at positions pos (T,);
        keys and values go to rows [start, start+T) of ``slot``; the block sees rows
        [0, start) and itself under ``mask``, an additive (T, T) mask (None: causal).
        Returns the block's final residual stream (T, dim) and, with ``head``, logits;
        None when this family is not compiled (the caller runs eager). ``compile``: whether
        a family not compiled yet compiles now (None: ``lazy``) -- the warm-up passes True
        for its own calls only, so a request served meanwhile on another thread never
        compiles."""
        if self.block_serves(compile) and _block_reads(cache):
            return self._run_block(h, pos, lo, hi, cache, slot, start, mask, head)
        T = h.shape[0]
        if start < MIN_CONTEXT or not _graphs_read(cache, h.dtype):
            return None
        # dynamo guards on storage offsets: a view into a longer tensor (early exit's mask is
        # a slice of the block's) would compile the graph again; inputs start at offset 0
        h, pos = _offset0(h), _offset0(pos)
        if mask is not None:
            mask = _offset0(mask)
        family = (lo, hi, head, T > 1, tuple(cache.k.shape), h.dtype)
        if family not in self._ready and not (self.lazy if compile is None else compile):
            return None  # before the views are built (``_call`` would say the same)
        if mask is None and T > 1:
            mask = self.causal(T, h.dtype)
        views = self._slots.get((lo, hi, slot))
        if views is None or views[0] is not cache.k or views[1] is not cache.v:
            views = self._slots[(lo, hi, slot)] = (cache.k, cache.v, cache.k[lo:hi, slot],
                                                   cache.v[lo:hi, slot])
        k_slot, v_slot = views[2], views[3]  # (layers, H, max_len, D)
        k_past, v_past = k_slot[:, :, :start], v_slot[:, :, :start]
        # the context (and block) length symbolic
        dynamic = [(k_past, 2), (v_past, 2)]
        if T > 1:
            dynamic += [(h, 0), (pos, 0), (mask, 0), (mask, 1)]
        got = self._call(family,
                         f"passes_{lo}_{hi}{'_head' if head else ''}_{'rows' if T > 1 else 'row'}",
                         lambda: self._core(lo, hi, head, T > 1),
                         (h, pos, k_past, v_past, mask if T > 1 else None), dynamic, compile,
                         key=(lo, hi, head, T > 1))
        if got is None:
            return None
        out, logits, k_new, v_new = got
        k_slot[:, :, start:start + T] = k_new
        v_slot[:, :, start:start + T] = v_new
        return out, logits

    @inference
    def prefill(self, h: Tensor, cache, slot: int, compile: bool | None = None,
                start: int = 0) -> Tensor | None:
        """A prompt's rows h (T, dim) through every layer into ``slot`` at rows
        [start, start + T), each row seeing the rows before it. Returns the final residual
        stream (T, dim), or None when the graph is not compiled (the caller runs eager).
        ``start`` 0 (an empty slot): the prefill graph; a lone row runs as two (a scratch
        row after it, which no row before it sees, and whose cache row is past the
        committed length): the graph's block length is symbolic from 2 up. ``start`` > 0
        (rows [0, start) cached: a prompt past its cached prefix, a long prompt's next
        chunk): the full pass's graph, without the head (``run``). ``compile`` as in
        ``run``."""
        T = h.shape[0]
        if start > 0 or self.block_serves(compile):
            got = self.run(h, torch.arange(start, start + T), 0, self.model.config.n_layers,
                           cache, slot, start, None, False, compile)
            return None if got is None else got[0]
        if not _graphs_read(cache, h.dtype):
            return None
        if T == 1:
            h = torch.cat([h, h])
        h = _offset0(h)
        got = self._call((PREFILL, tuple(cache.k.shape), h.dtype), PREFILL,
                         self._prefill_core, (h,), [(h, 0)], compile)
        if got is None:
            return None
        out, k_new, v_new = got
        rows = k_new.shape[2]
        cache.k[:, slot, :, :rows] = k_new
        cache.v[:, slot, :, :rows] = v_new
        return out[:T]

    def _call(self, family: tuple, stem: str, make: Callable[[], Callable], args: tuple,
              dynamic: list[tuple[Tensor, int]], compile: bool | None,
              key: tuple | None = None):
        """Run ``family``'s graph on ``args``: loaded, built (an artifact build: compiled
        and saved as ``stem``) or compiled now (``compile``, as in ``run``) with the
        dimensions in ``dynamic`` symbolic; None when it is not compiled, another build
        process compiles it, or its guards refuse these inputs (the caller runs eager).
        ``make()`` builds the graph's function; compiled in this process, one compiled
        function serves every family with the same ``key`` (default: the family)."""
        fresh = family not in self._ready
        if fresh and not (self.lazy if compile is None else compile):
            return None
        if fresh:  # compiled once with these dimensions symbolic
            t0 = time.perf_counter()
            for x, d in dynamic:
                torch._dynamo.maybe_mark_dynamic(x, d)
        aot = self.precompiled.fns.get(family)
        if aot is None and fresh and self.export_to is not None:  # an artifact build
            aot = self.precompiled.compile(stem, family, make(), OPTIONS, args)
            if aot is None:  # another process of the build compiles this one
                return None
        if aot is not None:
            got = self.precompiled(family, args)
            if got is None:  # refused by its guards: eager from now on
                self._ready.discard(family)
                return None
        else:
            fn = self._fns.get(key or family)
            if fn is None:
                fn = self._fns[key or family] = torch.compile(make(), fullgraph=True,
                                                              options=OPTIONS)
            got = fn(*args)
        if fresh:
            self._ready.add(family)
            self.compile_seconds += time.perf_counter() - t0
        return got

    @inference
    def packed(self, segments: list, cache, compile: bool | None = None
               ) -> list[tuple[Tensor, Tensor]] | None:
        """ONE pass over several sequences' blocks (``micro.packed.Segment``s, each of its
        own slot, each with logits, at most ``NARROW`` rows): per segment, (logits (T, V),
        final hidden (T, dim)), with every block's keys and values written to its rows.
        None when the family is not compiled, or the drafted blocks padded to the longest
        exceed ``PACKED_DRAFTED_ROWS`` rows (the caller runs eager).

        Two families per cache shape: every block one row (no sequence drafts), or some
        drafted (``mixed``). The rows go through the products packed. Attention takes the
        one-row blocks as the slot range [lo, hi) of the cache, read in place up to the
        longest committed length (a view, no copy), each slot's own length masking the
        rest (slots of the range without a block attend to a zero row, discarded); the
        drafted blocks, apart, padded to the longest, over their slots' rows gathered --
        so a few drafting sequences never pad the others to their length. Every size is
        symbolic (rows, slots, block and context lengths), no group smaller than two (a
        size of one would be specialised): one graph serves every batch of its kind,
        compiled once with duck sizing off, so that no size is assumed equal to another."""
        if len(segments) < 2:
            return None
        drafted = [i for i, s in enumerate(segments) if len(s) > 1]
        if drafted and (max(2, len(drafted)) * max(len(segments[i]) for i in drafted)
                        > PACKED_DRAFTED_ROWS):
            return None
        dtype = self.model.tok_embeddings.weight.dtype
        if not _graphs_read(cache, dtype):
            return None
        family = (PACKED, bool(drafted), tuple(cache.k.shape), dtype)
        if family not in self._ready and not (self.lazy if compile is None else compile):
            return None
        offsets, N = [], 0
        for s in segments:
            offsets.append(N)
            N += len(s)
        ones = [i for i, s in enumerate(segments) if len(s) == 1]
        S = cache.n_slots
        lo = min((segments[i].slot for i in ones), default=0)
        hi = max((segments[i].slot + 1 for i in ones), default=0)
        if hi - lo < 2:  # (one block or none: a padded range of two)
            lo, hi = (lo, lo + 2) if lo + 2 <= S else (S - 2, S)
        B1 = hi - lo
        src1, starts1, dest = [N] * B1, [0] * B1, [0] * N  # N: the zero row after the rows
        for i in ones:
            s = segments[i]
            src1[s.slot - lo], starts1[s.slot - lo] = offsets[i], s.start
            dest[offsets[i]] = s.slot - lo
        ctx1 = max(max(starts1), MIN_CONTEXT)
        k1, v1 = cache.k[:, lo:hi, :, :ctx1], cache.v[:, lo:hi, :, :ctx1]
        ids = cat_ints([s.ids for s in segments])
        pos = cat_ints([s.pos for s in segments])
        src1_t, starts1_t = longs(src1), longs(starts1)
        args = [ids, pos, src1_t, starts1_t, k1, v1]
        dynamic = [(ids, 0), (pos, 0), (src1_t, 0), (starts1_t, 0),
                   (k1, 1), (k1, 3), (v1, 1), (v1, 3)]
        if drafted:
            Tq = max(len(segments[i]) for i in drafted)
            B2 = max(2, len(drafted))
            slots2 = [segments[i].slot for i in drafted]
            slots2 += slots2[:1] * (B2 - len(drafted))  # padding: reads, masked, discarded
            src2, starts2 = [N] * (B2 * Tq), [0] * B2
            allowed = torch.eye(Tq, dtype=torch.bool).repeat(B2, 1, 1)
            for b, i in enumerate(drafted):
                s, o, T = segments[i], offsets[i], len(segments[i])
                starts2[b] = s.start
                src2[b * Tq: b * Tq + T] = range(o, o + T)
                dest[o:o + T] = range(B1 + b * Tq, B1 + b * Tq + T)
                allowed[b, :T, :T] = (s.mask if s.mask is not None
                                      else torch.ones(T, T, dtype=torch.bool).tril())
            ctx2 = max(max(starts2), MIN_CONTEXT)
            # every slot's rows up to ctx2, a view: the graph gathers the blocks' slots
            # (gathered here, the 5-d view's copies took 5-8 ms each, keys and values)
            k2, v2 = cache.k[:, :, :, :ctx2], cache.v[:, :, :, :ctx2]
            src2_t, starts2_t = longs(src2), longs(starts2)
            idx_t = longs(slots2)
            mask2 = additive_mask(allowed, dtype)
            args += [src2_t, starts2_t, idx_t, k2, v2, mask2]
            dynamic += [(src2_t, 0), (starts2_t, 0), (idx_t, 0), (k2, 3), (v2, 3),
                        (mask2, 0), (mask2, 1), (mask2, 2)]
        dest_t = longs(dest)
        args.append(dest_t)
        dynamic.append((dest_t, 0))
        # duck sizing off while the family is traced (a loaded or compiled one runs as is)
        tracing = (shape_config.patch(use_duck_shape=False) if family not in self._ready
                   else contextlib.nullcontext())
        with tracing:
            got = self._call(family, "packed_mixed" if drafted else "packed_row",
                             lambda: self._packed_core(bool(drafted)), tuple(args), dynamic,
                             compile, key=family[:2])
        if got is None:
            return None
        h, logits, k_new, v_new = got
        _write_rows(cache, segments, k_new, v_new)
        return [(logits[o:o + len(s)], h[o:o + len(s)]) for s, o in zip(segments, offsets)]

    @torch.inference_mode()
    def warm_up(self, cache, slot: int, early_exit: bool = True, compile: bool = True) -> float:
        """Compile every family a request can reach on ``cache`` (whose ``slot`` must be
        free: its rows past the committed length are written): full passes of one row and
        of several, with ``early_exit`` each exit's draft and verification ranges, the
        prefill and the packed passes. Where ``nodraft::block`` serves (``block_serves``)
        none of these is a graph: the passes run once each through it.
        ``compile=False``: only run the families already compiled or loaded once each.
        Returns the seconds it took."""
        t0 = time.perf_counter()
        L, dim = self.model.config.n_layers, self.model.config.dim
        dtype = self.model.tok_embeddings.weight.dtype
        # the last two: a prompt's rows past a cached prefix (``prefill`` with a start)
        ranges = [(0, L, True, 1), (0, L, True, 3), (0, L, False, 1), (0, L, False, 3)]
        if early_exit:
            for E in range(1, L):  # drafting, the last draft token's rows, verification
                ranges += [(0, E, True, 1), (0, E, False, 1), (E, L, True, 3)]
        start = MIN_CONTEXT + 6
        # inputs made in inference mode, as the engine's passes make them: dynamo guards on
        # a tensor's dispatch keys, and a graph compiled for a normal tensor would compile
        # again (on the engine's thread, seconds) at the first real pass
        for lo, hi, head, T in ranges:
            self.run(torch.zeros(T, dim, dtype=dtype), torch.arange(start, start + T),
                     lo, hi, cache, slot, start, None, head, compile=compile)
        self.prefill(torch.zeros(5, dim, dtype=dtype), cache, slot, compile=compile)
        if not self.block_serves(compile):  # else nodraft::packed_block runs every batch
            for batch in _warm_up_batches(cache):
                self.packed(batch, cache, compile=compile)
        return time.perf_counter() - t0


def _write_rows(cache, segments: list, k_new: Tensor, v_new: Tensor) -> None:
    """Every block's keys and values (layers, N, H, D), packed in ``segments``' order, into
    its slot's rows [start, start + T) of ``cache``: ``nodraft::put_rows`` where nodraft's
    kernels are loaded, else advanced indexing into slot and row."""
    slots = [s.slot for s in segments for _ in range(len(s))]
    rows = [r for s in segments for r in range(s.start, s.start + len(s))]
    slot_t, row_t = longs(slots), longs(rows)
    if gemm.unit() is not None and cache.k.is_contiguous() and cache.v.is_contiguous():
        torch.ops.nodraft.put_rows.default(cache.k, slot_t, row_t, k_new)
        torch.ops.nodraft.put_rows.default(cache.v, slot_t, row_t, v_new)
        return
    cache.k[:, slot_t, :, row_t] = k_new.transpose(0, 1)
    cache.v[:, slot_t, :, row_t] = v_new.transpose(0, 1)


def _warm_up_batches(cache) -> list[list]:
    """Batches for ``packed``'s families (one row each; some drafted) in the free slots of
    ``cache`` (the first needs two free, the second three), their sizes apart where the
    cache allows (rows, slots, block and context lengths)."""
    from nodraft.micro.packed import Segment  # packed imports this module's users

    def seg(slot: int, start: int, T: int) -> Segment:
        return Segment(slot, start, torch.zeros(T, dtype=torch.long),
                       torch.arange(start, start + T))

    free = [s for s, n in enumerate(cache.lengths) if n == 0]
    S, c = cache.n_slots, MIN_CONTEXT
    out = []
    if len(free) >= 2:
        # a slot range short of the whole cache: one as long as the cache would be
        # contiguous across slots and layers, and the graph would take the layers' stride
        # as a product of the slot count -- true at that count only
        slots = (free[:1] + free[2:3] if len(free) >= 3 and free[2] - free[0] + 1 < S
                 else free[:2])
        out.append([seg(slots[0], c + 7, 1), seg(slots[1], c + 6, 1)])
    if len(free) >= 3:  # one row (a padded range of two) and two drafted blocks
        out.append([seg(free[0], c + 7, 1), seg(free[1], c + 11, 3), seg(free[2], c + 9, 2)])
    return out


class Precompiled:
    """Graphs compiled ahead of time and saved, one file per family: ``torch.compile``'s
    AOT precompilation (``aot_compile`` then ``save_compiled_function``; loaded with
    ``torch.compiler.load_compiled_function``), which keeps dynamo's guards and the
    generated code but not the tracing, so a loaded graph runs at once -- no dynamo, no
    inductor. A file holds no weights: every tensor and module the graph's function closes
    over is external data, matched by its place in the closure (``closure_data``), and
    supplied again at load from the function rebuilt for the model at hand.

    ``export_to``: where compiling a family also saves it (the artifact build); ``load``
    reads every family saved in a folder. Families are named by their owner; ``families``
    maps a file's stem to its family tuple."""

    # a build's worker (engine.artifacts): claim(stem) says whether this process compiles
    # that family (else another does, and ``compile`` returns None); None: every family
    claim: Callable[[str], bool] | None = None

    def __init__(self, what: str = "pass"):
        configure_dynamo()
        self.what = what  # for the log: what a graph computes
        self.export_to: Path | None = None
        self.fns: dict[tuple, object] = {}
        self._trusted: set[tuple] = set()

    def __call__(self, family: tuple, args: tuple):
        """Run a family's graph; None if its guards refuse these inputs (another thread
        count, another kind of tensor): the family is then dropped -- the caller runs it
        eager from now on -- and the log says why. Guards are checked at a family's first
        call in this process and skipped after: a loaded graph checks them in Python, a
        cost a small pass notices (docs/ARCHITECTURE.md), and what they protect is the
        family itself -- its shapes, dtype and mode are its key, and the engine calls it
        only with inputs of that kind (at offset 0, as its first call was)."""
        fn = self.fns[family]
        try:
            out = fn(*args)
        except RuntimeError as e:
            if "GuardManager check failed" not in str(e):
                raise
            del self.fns[family]
            log.warning("nodraft: a precompiled %s (%s) does not fit its inputs and runs "
                        "eager from now on: %s", self.what, family[:4], guard_reason(e))
            return None
        if family not in self._trusted:
            fn.disable_guard_check()
            self._trusted.add(family)
        return out

    def compile(self, stem: str, family: tuple, fn, options: dict, inputs: tuple):
        """Compile ``fn`` for ``inputs`` (dynamic dimensions marked) and, with
        ``export_to``, save it as ``stem``; returns the compiled function, or None where
        ``claim`` gives the family to another process."""
        # the family in the name too: two of one kind (another cache shape) never collide
        stem = f"{stem}-{hashlib.sha256(repr(family).encode()).hexdigest()[:8]}"
        if Precompiled.claim is not None and not Precompiled.claim(stem):
            return None
        t0 = time.perf_counter()
        # what dynamo learnt from earlier compiles of the same code in this process (sizes
        # it saw change, made dynamic by itself) must not shape a saved graph: a graph
        # traced after a lazy compile's recompiles was saved needing the process's globals
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            aot = torch.compile(fn, fullgraph=True,
                                options={**options, "guard_filter_fn": saved_guards}
                                ).aot_compile((inputs, {}))
        log.info("nodraft: compiled %s (%.1f s)", stem, time.perf_counter() - t0)
        if self.export_to is not None:
            self.export_to.mkdir(parents=True, exist_ok=True)
            aot.save_compiled_function(str(self.export_to / f"{stem}.pt2"),
                                       external_data=closure_data(fn))
            (self.export_to / f"{stem}.json").write_text(json.dumps(_jsonable(family)))
        self.fns[family] = aot
        return aot

    def load(self, folder: Path, make_fn, before_each: Callable[[], None] | None = None
             ) -> list[tuple]:
        """Load every family saved in ``folder``; ``make_fn(family)`` rebuilds its function
        (for its closure's tensors); ``before_each()`` is called before each file. Returns
        the families loaded."""
        loaded = []
        for meta in sorted(Path(folder).glob("*.json")):
            if before_each is not None:
                before_each()
            family = _from_json(json.loads(meta.read_text()))
            # under inference mode, as the graphs run and were compiled: a tensor guard's
            # dispatch keys are taken relative to the mode it is built in
            with open(meta.with_suffix(".pt2"), "rb") as f, torch.inference_mode():
                fn = make_fn(family)
                self.fns[family] = torch.compiler.load_compiled_function(
                    f, external_data=closure_data(fn))
            loaded.append(family)
        return loaded


def saved_guards(entries) -> list[bool]:
    """Which of dynamo's guards a saved graph keeps (``guard_filter_fn``): those on its plain
    tensors -- shape, strides, dtype, device of its inputs and of the weight copies it
    closes over -- and its symbolic shapes, which its first call in a process checks
    (``Precompiled.__call__``). The rest protect what the artifact store's key already pins:
    the code and checkpoint the graph was built from (module, parameter, closure and constant
    guards) and the process's global state (grad mode, deterministic algorithms, the default
    device), which the engine does not change. Global guards cannot be saved at all
    (``aot_compile`` drops them itself). Fewer guards also load faster
    (docs/BENCHMARKS.md, "First start")."""
    return [e.guard_type in ("TENSOR_MATCH", "SHAPE_ENV") and not e.is_global
            and not isinstance(e.value, torch.nn.Parameter) for e in entries]


def guard_reason(e: Exception) -> str:
    """The failed guard of a precompiled graph's error, in a line."""
    text = str(e)
    i = text.find("verbose_code_parts=")
    return (text[i:].split("\n")[0] if i >= 0 else text.splitlines()[-1])[:300]


def closure_data(fn) -> dict[str, object]:
    """Everything but plain numbers and strings that ``fn`` closes over (tensors, modules,
    functions; inside lists, tuples and dicts too), keyed by
    its place in the closure: the same keys for the same function built for another model
    object."""
    out: dict[str, object] = {}

    def walk(key: str, x) -> None:
        if isinstance(x, (list, tuple)):
            for i, y in enumerate(x):
                walk(f"{key}.{i}", y)
        elif isinstance(x, dict):
            for k, y in x.items():
                walk(f"{key}.{k}", y)
        elif not isinstance(x, (int, float, bool, str, type(None))):
            out[key] = x  # tensors, modules, the product function: the caller's own

    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        walk(name, cell.cell_contents)
    return out


def _jsonable(family: tuple) -> list:
    return [["dtype", str(x).removeprefix("torch.")] if isinstance(x, torch.dtype)
            else list(x) if isinstance(x, tuple) else x for x in family]


def _from_json(items: list) -> tuple:
    return tuple(getattr(torch, x[1]) if isinstance(x, list) and x[:1] == ["dtype"]
                 else tuple(x) if isinstance(x, list) else x for x in items)


def _block_reads(cache) -> bool:
    """Whether ``cache`` is what nodraft::block reads: float32 keys and values, or float16
    ones whose heads are whole vectors of 8, contiguous."""
    return ((cache.k.dtype == torch.float32
             or (cache.k.dtype == torch.float16 and cache.k.shape[-1] % 8 == 0))
            and cache.k.is_contiguous() and cache.v.is_contiguous())


def _graphs_read(cache, dtype: torch.dtype) -> bool:
    """Whether the graphs can take ``cache``: keys and values in the model's own dtype (a
    float16 cache of a float32 model is read by nodraft::block, or else eagerly)."""
    return cache.k.dtype == dtype


def _offset0(x: Tensor) -> Tensor:
    """``x``, copied if it is a view that starts past its storage's first element."""
    return x.clone() if x.storage_offset() else x


def transposed_weights(model) -> dict[str, Tensor]:
    """Every matrix of micro's passes as a contiguous (in, out) copy, by parameter name
    (7 MB for micro, taken when the first graph is built; the eager passes keep the
    originals).

    ``F.linear`` reads an (out, in) weight transposed; MKL multiplies a few rows by an
    (in, out) matrix faster, and every compiled pass size measured faster on the copies
    (``benchmarks/passes.py``; docs/ARCHITECTURE.md, "Compiled passes"). One set of copies
    for every graph: mixing layouts by row count lost, as a decode alternates the sizes
    and one set of weights falls out of the cache while the other is read."""
    with torch.no_grad():
        out = {"head": model.tok_embeddings.weight.t().contiguous()}
        for name, p in model.layers.named_parameters():
            if p.dim() == 2:
                out[name] = p.t().contiguous()
    return out


def layer_weights(layer, wt: dict[str, Tensor], prefix: str) -> tuple:
    """One micro ``Block``'s weights as ``attend_layer`` reads them: its two norms, then its
    (in, out) matrices (wqkv, wo, w13, w2) from ``wt`` under ``prefix`` (e.g. ``"2."``)."""
    names = ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")
    return (layer.attention_norm, layer.ffn_norm) + tuple(wt[f"{prefix}{n}.weight"] for n in names)


def attend_layer(h: Tensor, cos: Tensor, sin: Tensor, k_past: Tensor, v_past: Tensor,
                 mask: Tensor | None, w: tuple, mm, k_prev: Tensor | None = None,
                 v_prev: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """One decoder layer over a block h (T, dim) at rotations cos, sin (T, 1, 1, D): the
    block sees the cached rows k_past, v_past (H, n, D) whole, and under the additive
    ``mask`` (T, T' + T) the rows of ``k_prev``/``v_prev`` (H, T', D; earlier blocks of the
    same graph, e.g. a draft tree's levels) and itself. ``mask`` None: one row, no
    ``k_prev``. Returns the block's residual stream and its keys and values (H, T, D)."""
    H, D = k_past.shape[0], k_past.shape[-1]
    scale = 1.0 / math.sqrt(D)
    q, k, v = _project(h, cos, sin, w, mm, H, D)
    kb = k if k_prev is None else torch.cat([k_prev, k], dim=1)
    vb = v if v_prev is None else torch.cat([v_prev, v], dim=1)
    s_past = torch.matmul(q, k_past.transpose(-1, -2)) * scale  # (H, T, n)
    if mask is None:  # one row
        s_self = torch.matmul(q, kb.transpose(-1, -2)) * scale
    else:  # (H, T, T' + T) as a broadcast product: a fused loop, not a bmm call
        s_self = (q[:, :, None, :] * kb[:, None, :, :]).sum(-1) * scale + mask
    p = torch.cat([s_past, s_self], dim=-1).softmax(-1)
    n = s_past.shape[-1]
    y = torch.matmul(p[..., :n], v_past)  # (H, T, D)
    if mask is None:
        y = y + torch.matmul(p[..., n:], vb)
    else:
        y = y + (p[..., n:, None] * vb[:, None, :, :]).sum(-2)
    return _mix(h, y, w, mm), k, v


def prefill_layer(h: Tensor, cos: Tensor, sin: Tensor, w: tuple, mm, H: int, D: int
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """One decoder layer over a prompt's first rows h (T, dim), nothing cached before them:
    causal attention within the block (SDPA's, which scales with T where the broadcast
    products of ``attend_layer`` grow as T squared). Returns as ``attend_layer``."""
    q, k, v = _project(h, cos, sin, w, mm, H, D)
    y = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
    return _mix(h, y, w, mm), k, v


def _project(h: Tensor, cos: Tensor, sin: Tensor, w: tuple, mm, H: int, D: int
             ) -> tuple[Tensor, Tensor, Tensor]:
    """A layer's queries, keys (both rotated) and values, each (H, T, D)."""
    an, wqkv = w[0], w[2]
    x = F.rms_norm(h, an.weight.shape, an.weight, an.eps)
    qkv = mm(x, wqkv).view(h.shape[0], 3, H, D)
    qk = apply_rope(qkv[:, :2], cos, sin)
    return qk[:, 0].transpose(0, 1), qk[:, 1].transpose(0, 1), qkv[:, 2].transpose(0, 1)


def _mix(h: Tensor, y: Tensor, w: tuple, mm) -> Tensor:
    """The rest of a layer after attention's output y (H, T, D): the output projection,
    the residual, the SwiGLU feed-forward and its residual."""
    fn, wo, w13, w2 = w[1], w[3], w[4], w[5]
    T, HD = h.shape[0], wo.shape[-2]  # in-features: (in, out), or packed (blocks, in, 16)
    h = h + mm(y.transpose(0, 1).reshape(T, HD), wo)
    gate, up = mm(F.rms_norm(h, fn.weight.shape, fn.weight, fn.eps), w13).split(w2.shape[-2],
                                                                               dim=-1)
    return h + mm(F.silu(gate) * up, w2)


def named_code(fn, name: str):
    """``fn`` as a function with a code object of its own, named ``name``: dynamo keeps its
    graphs (and checks their guards, in turn, on every call) per code object, so each
    family gets a short list of its own."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__,
                              fn.__closure__)


def _make_core(model, lo: int, hi: int, head: bool, wt: dict[str, Tensor], mm):
    """The graph's function; its products are ``mm(x, w)`` (micro.gemm) over ``wt``
    (``transposed_weights``)."""
    cos_t, sin_t = model.rope_cos, model.rope_sin
    weights = [layer_weights(model.layers[i], wt, f"{i}.") for i in range(lo, hi)]
    head_wt = wt["head"]
    norm = model.norm

    def core(h: Tensor, pos: Tensor, k_past: Tensor, v_past: Tensor, mask: Tensor | None):
        # h (T, dim); pos (T,); k_past, v_past (layers, H, n, D); mask (T, T) additive
        cos, sin = cos_t[pos][:, None, None], sin_t[pos][:, None, None]  # (T, 1, 1, D)
        ks, vs = [], []
        for j, w in enumerate(weights):
            h, k, v = attend_layer(h, cos, sin, k_past[j], v_past[j], mask, w, mm)
            ks.append(k)
            vs.append(v)
        logits = None
        if head:
            logits = mm(F.rms_norm(h, norm.weight.shape, norm.weight, norm.eps), head_wt)
        return h, logits, torch.stack(ks), torch.stack(vs)

    return named_code(core, f"micro_layers_{lo}_{hi}{'_head' if head else ''}")


def _make_prefill_core(model, wt: dict[str, Tensor], mm):
    """The prefill graph's function: a prompt's first rows h (T, dim) at positions [0, T)
    through every layer; returns their final residual stream and keys and values
    (layers, H, T, D). No head: a prefill needs no logits."""
    cos_t, sin_t = model.rope_cos, model.rope_sin
    c = model.config
    weights = [layer_weights(model.layers[i], wt, f"{i}.") for i in range(c.n_layers)]
    H, D = c.n_heads, c.head_dim

    def prefill(h: Tensor):
        T = h.shape[0]
        cos, sin = cos_t[:T][:, None, None], sin_t[:T][:, None, None]  # (T, 1, 1, D)
        ks, vs = [], []
        for w in weights:
            h, k, v = prefill_layer(h, cos, sin, w, mm, H, D)
            ks.append(k)
            vs.append(v)
        return h, torch.stack(ks), torch.stack(vs)

    return named_code(prefill, "micro_prefill")


def _past_mask(starts: Tensor, ctx, dtype) -> Tensor:
    """(B, 1, 1, ctx) additive: each slot's rows past its committed length ``starts`` out."""
    return torch.zeros(starts.shape[0], ctx, dtype=dtype).masked_fill(
        torch.arange(ctx)[None, :] >= starts[:, None], float("-inf"))[:, None, None, :]


def _make_packed_core(model, wt: dict[str, Tensor], mm, mixed: bool, attend=None):
    """A packed pass's function (``CompiledPasses.packed``). ids, pos (N,): every block's
    rows, packed. The one-row blocks: ``src1`` (B1,) the row of each slot of their range (N:
    the zero row), ``starts1`` (B1,) each slot's committed length, k1, v1 (layers, B1, H,
    ctx1, D) the range's cache rows. With ``mixed``, the drafted blocks: ``src2``
    (B2 * Tq,) the row of each padded place, ``starts2`` (B2,), ``idx2`` (B2,) their slots,
    k2, v2 (layers, slots, H, ctx2, D) every slot's rows, ``mask2`` (B2, Tq, Tq) additive,
    the attention within each block.
    ``dest`` (N,): each row's place among the groups' outputs (B1, then B2 * Tq). Returns
    the final residual stream (N, dim), logits (N, V), and the rows' keys and values
    (layers, N, H, D).
    ``attend``: ``nodraft::attend`` (micro.gemm.attention) for the one-row blocks, each
    slot reading its own committed rows only; None: that attention as tensor operations,
    every slot scored up to the longest length under a mask."""
    cos_t, sin_t = model.rope_cos, model.rope_sin
    c = model.config
    H, D = c.n_heads, c.head_dim
    scale = 1.0 / math.sqrt(D)
    weights = [layer_weights(model.layers[i], wt, f"{i}.") for i in range(c.n_layers)]
    emb, head_wt, norm = model.tok_embeddings.weight, wt["head"], model.norm

    def packed(ids: Tensor, pos: Tensor, src1: Tensor, starts1: Tensor, k1: Tensor,
               v1: Tensor, *rest: Tensor):
        N, B1, ctx1 = ids.shape[0], starts1.shape[0], k1.shape[3]
        dest = rest[-1]
        h = emb[ids]
        cos, sin = cos_t[pos][:, None, None], sin_t[pos][:, None, None]  # (N, 1, 1, D)
        padded = attend is None or mixed  # blocks gathered from the rows with a zero row
        if attend is None:
            past1 = _past_mask(starts1, ctx1, h.dtype)
        if mixed:
            src2, starts2, idx2, k2, v2, mask2 = rest[:6]
            B2, ctx2, Tq = starts2.shape[0], k2.shape[3], mask2.shape[1]
            past2 = _past_mask(starts2, ctx2, h.dtype)
        zero = h.new_zeros(1, H, D)
        ks, vs = [], []
        for j, w in enumerate(weights):
            an, wqkv = w[0], w[2]
            x = F.rms_norm(h, an.weight.shape, an.weight, an.eps)
            qkv = mm(x, wqkv).view(N, 3, H, D)
            qk = apply_rope(qkv[:, :2], cos, sin)
            if padded:  # (N + 1, H, D): the zero row last
                q0 = torch.cat([qk[:, 0], zero])
                k0 = torch.cat([qk[:, 1], zero])
                v0 = torch.cat([qkv[:, 2], zero])
            # the one-row blocks, (B1, H, D) (no comprehensions here: a saved graph's
            # code must not hold a nested function, whose globals a load does not supply)
            if attend is not None:
                y = attend(qk[:, 0], qk[:, 1], qkv[:, 2], k1[j], v1[j], src1, starts1, scale)
            else:
                qp, kb, vb = q0[src1][:, :, None], k0[src1][:, :, None], v0[src1][:, :, None]
                s_past = torch.matmul(qp, k1[j].transpose(-1, -2)) * scale + past1
                s_self = (qp * kb).sum(-1, keepdim=True) * scale
                p = torch.cat([s_past, s_self], dim=-1).softmax(-1)
                y = (torch.matmul(p[..., :ctx1], v1[j]) + p[..., ctx1:] * vb)[:, :, 0]
            if mixed:  # the drafted blocks, (B2, H, Tq, D); their own rows by bmm too
                qp = q0[src2].view(B2, Tq, H, D).transpose(1, 2)
                kb = k0[src2].view(B2, Tq, H, D).transpose(1, 2)
                vb = v0[src2].view(B2, Tq, H, D).transpose(1, 2)
                s_past = torch.matmul(qp, k2[j][idx2].transpose(-1, -2)) * scale + past2
                s_self = torch.matmul(qp, kb.transpose(-1, -2)) * scale + mask2[:, None]
                p = torch.cat([s_past, s_self], dim=-1).softmax(-1)
                y2 = torch.matmul(p[..., :ctx2], v2[j][idx2]) + torch.matmul(p[..., ctx2:], vb)
                y = torch.cat([y, y2.transpose(1, 2).reshape(B2 * Tq, H, D)])
            h = _mix(h, y[dest].transpose(0, 1), w, mm)
            ks.append(qk[:, 1])
            vs.append(qkv[:, 2])
        logits = mm(F.rms_norm(h, norm.weight.shape, norm.weight, norm.eps), head_wt)
        return h, logits, torch.stack(ks), torch.stack(vs)

    return named_code(packed, f"micro_packed_{'mixed' if mixed else 'row'}")
