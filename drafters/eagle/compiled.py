"""The EAGLE draft step compiled: the catch-up and the whole tree, rerank included, as one
``torch.compile`` graph per tree shape, built from the target's own layer code."""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from nodraft.micro.compiled import OPTIONS

if TYPE_CHECKING:
    from nodraft.drafters.eagle.drafter import EagleState, LoadedHead


class CompiledDraft:
    """A draft step -- the catch-up and the whole tree, rerank included -- as one
    ``torch.compile`` graph per tree shape (depth, top_k, kept nodes), for targets whose
    passes are compiled (``Micro.compile``). Eager, a step is ~60 small operations;
    inductor fuses the norms, masks, rotations, softmaxes and top-k
    bookkeeping into a few loops around the layer's products (``micro.compiled.attend_layer``,
    the target's own layer code, on (in, out) copies of the head's weights, with the
    target's product, ``micro.gemm``).

    As the target's graphs: the draft KV cache stays outside (the graph reads the committed
    rows as a view and returns the catch-up's new keys and values), the committed length
    and the catch-up's length are dynamic (one graph serves every context; a one-row
    catch-up -- the usual step after a rejection -- gets a graph of its own), and a shape
    compiles at its first step when the target's passes are lazy, else only in
    ``Eagle.warm_up`` (the server's warm-up) and runs eager until then."""

    def __init__(self, loaded: "LoadedHead", compiled):
        self.loaded, self.compiled = loaded, compiled  # compiled: the target's CompiledPasses
        self._product: tuple | None = None  # (mm, weights), at the first graph (``product``)
        self._fns: dict[tuple, object] = {}
        self._ready: set[tuple] = set()
        self._inv_t: dict[tuple, Tensor] = {}  # 1 / temperature as a graph input, by value
        self._zeros: dict[tuple, Tensor] = {}  # a chain's noise for the argmax, by shape
        # graphs built ahead of time: saved beside the target's (an artifact build) and
        # loaded from there, in a folder of this head's own
        from nodraft.micro.compiled import Precompiled

        self.precompiled = Precompiled("EAGLE draft step")
        self.folder = f"eagle-{Path(loaded.path).stem}"
        if compiled.export_to is not None:
            self.precompiled.export_to = compiled.export_to / self.folder
        self._loaded_from = None
        self.load()

    def load(self) -> None:
        """Load this head's graphs saved beside the target's, once the target's artifacts
        are loaded (``CompiledPasses.load``); a no-op until then and after."""
        folder = self.compiled.artifacts
        if folder is None or folder == self._loaded_from:
            return
        self._loaded_from = folder
        if (folder / self.folder).is_dir():
            self._ready.update(self.precompiled.load(folder / self.folder,
                                                     lambda f: self._core(*f[:3]),
                                                     self.compiled.between_loads))

    def product(self) -> tuple:
        """(the product, the layer's (in, out) weights laid out for it), resolved when a
        graph is first built or loaded -- not before: resolving it may build
        ``nodraft::mm`` (seconds), and a request that meets a head before the compiled
        passes are ready must not wait for that."""
        if self._product is None:
            from nodraft.micro import gemm

            kind = self.compiled.gemm_kind or gemm.choose(self.compiled.gemm)
            lay_out = gemm.pack if kind == "nodraft" else (lambda w: w)
            with torch.inference_mode(False), torch.no_grad():  # plain tensors, as load_for's
                wt = {name: lay_out(p.t().contiguous())
                      for name, p in self.loaded.head.layer.named_parameters() if p.dim() == 2}
            self._product = (gemm.matmul(kind), wt)
        return self._product

    def _core(self, depth: int, top_k: int, keep: int):
        from nodraft.micro.compiled import named_code

        mm, wt = self.product()
        return named_code(_make_draft_core(self.loaded, wt, mm, depth, top_k, keep),
                          f"eagle_draft_{depth}_{top_k}_{keep}")

    def _fn(self, depth: int, top_k: int, keep: int):
        key = (depth, top_k, keep)
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = torch.compile(self._core(depth, top_k, keep), fullgraph=True,
                                                options=DRAFT_OPTIONS)
        return fn

    def step(self, h: Tensor, next_tokens: Tensor, st: "EagleState", a: int,
             depth: int, top_k: int, keep: int, inv_t: float, lazy: bool | None = None,
             noise: Tensor | None = None, fuse: Tensor | None = None
             ) -> tuple[Tensor, Tensor, Tensor | None] | None:
        """Rows [a, a + T) of the draft cache from the target's pre-norm hidden rows h
        (T, dim) and the tokens after them, then the tree. Returns (draft token ids, parent
        indices, a chain's scaled draft logits (keep, N) or None for a tree) with the
        catch-up's keys and values written and ``st`` advanced; None when this shape is not
        compiled yet (the caller drafts eager). ``noise`` (>= min(keep, depth), N): a
        chain's Gumbel noise per level, its first rows used (None: zeros, the argmax).
        ``fuse`` (T, fused·dim): a head with fused features, the fused layers' value rows
        of the T rows (``LoadedHead.fuse_rows``); None for one without, and only then."""
        T = h.shape[0]
        # views into a longer tensor carry a storage offset, which dynamo guards on: inputs
        # start at offset 0 always, as the warm-up's do, so no request recompiles the graph
        h = h.clone() if h.storage_offset() else h
        next_tokens = next_tokens.clone() if next_tokens.storage_offset() else next_tokens
        if (fuse is None) != (not self.loaded.fused):
            raise ValueError("a fused term is given exactly for a head with fused features")
        shape = (depth, top_k, keep, T > 1, tuple(st.k.shape), h.dtype)
        fresh = shape not in self._ready
        if fresh and not (self.compiled.lazy if lazy is None else lazy):
            return None
        pos = torch.arange(a, a + T)
        mask = self.compiled.causal(T, h.dtype) if T > 1 else None
        k_past, v_past = st.k[:, :a], st.v[:, :a]
        if fresh:
            for x in (k_past, v_past):
                torch._dynamo.maybe_mark_dynamic(x, 1)
            if T > 1:
                for x, d in ((h, 0), (next_tokens, 0), (pos, 0), (mask, 0), (mask, 1)):
                    torch._dynamo.maybe_mark_dynamic(x, d)
                if fuse is not None:
                    torch._dynamo.maybe_mark_dynamic(fuse, 0)
        scale = self._inv_t.get((inv_t, h.dtype))
        if scale is None:
            scale = torch.tensor(inv_t, dtype=h.dtype)
            if len(self._inv_t) < 64:  # requests' temperatures are few; do not grow unbounded
                self._inv_t[(inv_t, h.dtype)] = scale
        args = (h, next_tokens, pos, k_past, v_past, mask, scale)
        if min(top_k, self.loaded.w_draft_t.shape[1]) == 1:  # a chain: its noise too,
            levels = min(keep, depth)  # one row per level (a view at offset 0 of the caller's)
            if noise is None:
                noise = self._zeros.get((levels, h.dtype))
                if noise is None:
                    noise = self._zeros[(levels, h.dtype)] = torch.zeros(
                        levels, self.loaded.w_draft_t.shape[1], dtype=h.dtype)
            args += (noise[:levels],)
        if fuse is not None:
            args += (fuse,)
        aot = self.precompiled.fns.get(shape)
        if aot is None and fresh and self.precompiled.export_to is not None:  # a build
            aot = self.precompiled.compile(
                f"draft_{depth}_{top_k}_{keep}_{'rows' if T > 1 else 'row'}", shape,
                self._core(depth, top_k, keep), DRAFT_OPTIONS, args)
            if aot is None:  # another process of the build compiles this one
                return None
        if aot is not None:
            got = self.precompiled(shape, args)
            if got is None:  # refused by its guards: eager from now on
                self._ready.discard(shape)
                return None
        else:
            got = self._fn(depth, top_k, keep)(*args)
        tokens, parents, root, k_new, v_new = got[:5]
        if fresh:
            self._ready.add(shape)
        st.k[:, a:a + T] = k_new
        st.v[:, a:a + T] = v_new
        st.rows, st.root = a + T, root
        return tokens, parents, (got[5] if len(got) > 5 else None)


# The target's options, and C++ in place of the Python wrapper around the graph's kernels:
# a draft step is many small kernels, and the wrapper's per-kernel Python was a large share
# of its time (docs/BENCHMARKS.md, "Choosing EAGLE's defaults").
DRAFT_OPTIONS = {**OPTIONS, "cpp_wrapper": True}

# per compiled target (its CompiledPasses), per head file: built once in a process, whichever
# request or drafter state comes (a graph's weights are those of the first load)
_COMPILED_DRAFTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_COMPILED_DRAFTS_LOCK = threading.Lock()


def _make_draft_core(L: "LoadedHead", wt: dict[str, Tensor], mm, depth: int, top_k: int,
                     keep: int):
    """The draft step's function: ``Eagle.propose``'s catch-up, tree and rerank, with the
    same arithmetic (tests compare the two)."""
    from nodraft.micro.compiled import attend_layer, layer_weights

    model = L.model
    norm = model.norm
    cos_t, sin_t = model.rope_cos, model.rope_sin
    w = layer_weights(L.head.layer, wt, "")
    tok_proj, tok_proj_draft = L.tok_proj, L.tok_proj_draft
    w_feat_t, w_draft_t, vocab = L.w_feat_t, L.w_draft_t, L.head.draft_vocab
    w_fuse_t = L.w_fuse_t
    N = w_draft_t.shape[1]
    k1 = min(top_k, N)
    # a chain's node feeds both its draft head and the next level's fc: one product for both
    # (each output column is its own in-order sum: the same numbers as two products)
    w_next = torch.cat([w_draft_t, w_feat_t], dim=1) if k1 == 1 else None
    sizes = [k1] + [k1 * k1] * (depth - 1)  # nodes generated per level
    total = sum(sizes)
    keep = min(keep, total)
    penalty = torch.cat([torch.full((k,), 1e-9 * d, dtype=torch.float64)
                         for d, k in enumerate(sizes)])
    dtype = w_draft_t.dtype
    neg_inf = float("-inf")

    def catch_up(h: Tensor, next_tokens: Tensor, pos: Tensor, k_past: Tensor,
                 v_past: Tensor, mask: Tensor | None, fuse: Tensor | None):
        """Rows (token_{t+1}, f_t) for the T new committed positions, and a fused head's
        term from its layers' value rows ``fuse`` (T, fused·dim)."""
        f = F.rms_norm(h, norm.weight.shape, norm.weight, norm.eps)
        x = tok_proj[next_tokens] + mm(f, w_feat_t)
        if fuse is not None:
            x = x + mm(fuse, w_fuse_t)
        cos, sin = cos_t[pos][:, None, None], sin_t[pos][:, None, None]
        return attend_layer(x, cos, sin, k_past, v_past, mask, w, mm)

    def chain(h: Tensor, next_tokens: Tensor, pos: Tensor, k_past: Tensor, v_past: Tensor,
              mask: Tensor | None, inv_t: Tensor, noise: Tensor, fuse: Tensor | None = None):
        """top_k = 1: each level's one node is the argmax of its draft logits over the
        temperature plus that level's row of ``noise`` (keep, N): zeros for the argmax
        (greedy, seeded), standard Gumbel noise for a draw from q; the kept nodes are the
        chain's first ``keep``, returned with each level's scaled logits (keep, N)."""
        out, k_blk, v_blk = catch_up(h, next_tokens, pos, k_past, v_past, mask, fuse)
        T = h.shape[0]
        root = out[-1:]
        y = mm(root, w_next)  # the root's draft logits and the next level's feature half
        scaled = [y[:, :N] * inv_t]
        idx = (scaled[0] + noise[:1]).argmax(-1)  # (1,)
        tokens = [idx]
        for level in range(2, keep + 1):
            x = tok_proj_draft[idx] + y[:, N:]
            at = pos[-1:] + (level - 1)
            c, s = cos_t[at][:, None, None], sin_t[at][:, None, None]
            # one row that sees every row before it: no mask
            f_feat, k_l, v_l = attend_layer(x, c, s, k_past, v_past, None, w, mm, k_blk, v_blk)
            k_blk, v_blk = torch.cat([k_blk, k_l], dim=1), torch.cat([v_blk, v_l], dim=1)
            y = mm(f_feat, w_next if level < keep else w_draft_t)
            scaled.append(y[:, :N] * inv_t)
            idx = (scaled[-1] + noise[level - 1:level]).argmax(-1)
            tokens.append(idx)
        parents = torch.arange(-1, keep - 1)
        return (vocab[torch.cat(tokens)], parents, root[0], k_blk[:, :T], v_blk[:, :T],
                torch.cat(scaled))

    def core(h: Tensor, next_tokens: Tensor, pos: Tensor, k_past: Tensor, v_past: Tensor,
             mask: Tensor | None, inv_t: Tensor, fuse: Tensor | None = None):
        out, k_blk, v_blk = catch_up(h, next_tokens, pos, k_past, v_past, mask, fuse)
        T = h.shape[0]
        root = out[-1:]
        # level 1: the root's top_k children, the first frontier
        score, idx = (mm(root, w_draft_t) * inv_t).log_softmax(-1)[0].topk(k1)
        tokens, scores, frontiers = [idx], [score], []
        f_idx, f_score, f_feat = idx, score, root.expand(k1, -1)
        f_nodes = torch.arange(k1)
        anc = torch.zeros(k1, 0, dtype=torch.bool)
        eye = torch.eye(k1, dtype=torch.bool)
        done = k1
        for level in range(2, depth + 1):
            x = tok_proj_draft[f_idx] + mm(f_feat, w_feat_t)
            at = pos[-1:] + (level - 1)  # the frontier's position
            c, s = cos_t[at][:, None, None], sin_t[at][:, None, None]
            allowed = torch.cat([torch.ones(k1, T, dtype=torch.bool), anc, eye], dim=1)
            m = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, neg_inf)
            out, k_l, v_l = attend_layer(x, c, s, k_past, v_past, m, w, mm, k_blk, v_blk)
            k_blk, v_blk = torch.cat([k_blk, k_l], dim=1), torch.cat([v_blk, v_l], dim=1)
            c_score, c_idx = (mm(out, w_draft_t) * inv_t).log_softmax(-1).topk(k1, dim=-1)
            cum = (f_score[:, None] + c_score).flatten()
            c_idx = c_idx.flatten()
            tokens.append(c_idx)
            scores.append(cum)
            frontiers.append(f_nodes)
            if level < depth:
                best = cum.topk(k1).indices
                row = best // k1
                f_nodes, f_idx, f_score, f_feat = done + best, c_idx[best], cum[best], out[row]
                anc = torch.cat([anc, eye], dim=1)[row]
            done += k1 * k1
        # rerank: the best ``keep`` nodes, in level order, parents re-indexed
        if keep >= total:
            sel = torch.arange(total)
        else:
            sel = (torch.cat(scores).double() - penalty).topk(keep).indices.sort().values
        kids = [fr.repeat_interleave(k1) for fr in frontiers]
        parents = torch.cat([torch.full((k1,), total, dtype=torch.long), *kids])[sel]
        new_index = torch.full((total + 1,), -1, dtype=torch.long)
        new_index = new_index.index_put((sel,), torch.arange(keep))
        return vocab[torch.cat(tokens)[sel]], new_index[parents], root[0], k_blk[:, :T], v_blk[:, :T]

    return chain if k1 == 1 else core

