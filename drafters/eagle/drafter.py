"""``eagle``: the EAGLE head (Li et al., 2024) drafting EAGLE-2's dynamic tree.

Per sequence the head keeps its own KV cache, one row per committed position: row t holds
``(token_{t+1}, f_t)``. After the prefill ``ctx.last_hidden`` holds the prompt's features
f_0 .. f_{n-1}; after each step, those of [previous current token, *accepted] -- exactly
the rows the step committed -- so the drafter appends them in one causal forward (the
*catch-up*) and the last row's output, f^_n, predicts the token after the current one.
Tree rows go to scratch rows past the committed length and are overwritten next step
(rollback = not advancing the length), as micro's KVCache.

The dynamic tree (EAGLE-2): ``depth`` levels, ``top_k`` children per expanded node, at most
``total_tokens - 1`` nodes (``total_tokens`` counts the current token, as EAGLE-2 does). A
node's score is the sum of the draft log-probabilities along its path::

    level 1: the root's top_k tokens (from the catch-up's last row)
    level l = 2 .. depth: ONE forward of the layer over the top_k best nodes of level l-1
             (the frontier; rows at position n + l - 2, a tree mask over the draft cache:
             each row sees the committed rows, its ancestors' rows and itself), then
             top_k children per frontier node, scored parent + log q(child)
    rerank:  the best total_tokens - 1 of all nodes generated (a child never outscores its
             parent, and ties go to the shallower node, so the set contains every ancestor
             of its members), in level order -- parents before children, siblings best
             first.

So a step costs ``depth`` forwards of the layer whatever ``top_k`` is (draft cost:
``depth * head.forward_cost``). Under sampling:

- **unseeded, a chain** (``top_k`` 1, the default): each level's token is drawn from the
  head's q at the request's temperature (Gumbel-max: the argmax of the scaled logits plus
  standard Gumbel noise from the request's generator, inside the compiled step), and q
  travels with the draft, so verification's min(1, p/q) rule accepts it with
  sum min(p, q) -- more often than the argmax's p(argmax q) (docs/LOG.md, 2026-12-04);
- **seeded, or a tree**: the same deterministic top-k tree (scored at the request's
  temperature) with ``q = None``: the sibling rule (``engine.verify``) accepts child x with
  the target's p(x), zeroes it and renormalises on rejection; seeded, the race decides. A
  seeded draw coupled with the race's noise would be kept more often still, but that noise
  is hashed outside the compiled step.

Lossless either way: the rejection rule is for any q the token was drawn from, the sibling
rule for any deterministic tree.

The draft vocabulary (EAGLE-3's idea): the head reads only the N most frequent tokens of the
train split (``draft_vocab`` in the weights), mapped back to target ids; tokens outside it
are never drafted. With the target's passes compiled, a draft step is one compiled graph
(``compiled.CompiledDraft``). The default tree shape, and the measurements behind it and
behind N, are in docs/BENCHMARKS.md ("EAGLE").
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from nodraft.drafters.base import (Draft, DraftContext, DrafterBase, DrafterEnv, SpeculationError,
                                  loaded_weights)
from nodraft.drafters.eagle.compiled import _COMPILED_DRAFTS, _COMPILED_DRAFTS_LOCK, CompiledDraft
from nodraft.drafters.eagle.head import (EagleHead, cached_values, features, forward_cost,
                                         load_head_state, weights_path)
from nodraft.micro.compiled import MIN_CONTEXT
from nodraft.micro.model import Micro
from nodraft.micro.ops import additive_mask


# -- the drafter ------------------------------------------------------------------------------
@dataclass
class LoadedHead:
    """A head ready to draft for one target: weights in the target's dtype, and the tables
    built from the target's frozen embedding."""

    model: Micro
    path: Path
    head: EagleHead
    tok_proj: Tensor  # (V, dim) embed(token) @ W_fc_tok^T + bias, for every target id
    tok_proj_draft: Tensor  # (N, dim) the same rows for the draft vocabulary
    w_feat_t: Tensor  # (dim, dim) fc's feature half, transposed
    w_draft_t: Tensor  # (dim, N) the draft head (target embedding rows of the draft vocab)^T
    cost_per_forward: float
    fused: tuple[int, ...] = ()  # the target layers whose value rows the head reads
    w_fuse_t: Tensor | None = None  # (fused·dim, dim) their product, transposed

    def fuse_rows(self, ctx: DraftContext, a: int, n: int) -> Tensor | None:
        """The fused layers' value rows of committed positions [a, n) ((n - a,
        fused·dim): ``head.cached_values``), or None for a head without fused features."""
        if not self.fused:
            return None
        # in the head's dtype: a float16 KV cache's rows are half precision
        return cached_values(ctx.cache, ctx.slot, self.fused, a, n).to(self.w_fuse_t.dtype)

    def fuse_term(self, ctx: DraftContext, a: int, n: int) -> Tensor | None:
        """fuse(value rows of committed positions [a, n)): (n - a, dim), or None for a head
        without fused features."""
        rows = self.fuse_rows(ctx, a, n)
        return None if rows is None else rows @ self.w_fuse_t


def load_for(env: DrafterEnv) -> LoadedHead:
    """The head for env's model, loaded once per model and weights file and shared by every
    request and server state (``drafters.base.loaded_weights``). Its tensors are plain ones
    (not inference tensors) whatever mode the caller is in: the compiled draft step closes
    over them, and a saved graph's guards compare their dispatch keys, so a head loaded
    inside inference mode in one process (a request's) and outside it in another (an
    artifact build's) would refuse the saved graph."""
    path = weights_path(env.checkpoint_dir, env.model_name)
    dtype = env.model.tok_embeddings.weight.dtype
    return loaded_weights(env.model, path, f"eagle {dtype}", lambda: _load(env, path))


def _load(env: DrafterEnv, path: Path) -> LoadedHead:
    with torch.inference_mode(False):
        model = env.model
        config, state = load_head_state(env.checkpoint_dir, env.model_name)
        c = model.config
        if (config.dim, config.n_heads, config.ffn_dim) != (c.dim, c.n_heads, c.ffn_dim) \
                or int(state["draft_vocab"].max()) >= c.vocab_size:
            raise SpeculationError(
                f"the EAGLE head for {env.model_name!r} was trained for another model shape; "
                f"retrain it with `nodraft train eagle --model {env.model_name}`",
                "speculation.method")
        dtype = model.tok_embeddings.weight.dtype
        head = EagleHead.from_state(c, state).to(dtype)
        d = c.dim
        with torch.no_grad():
            w_tok, w_feat = head.fc.weight[:, :d], head.fc.weight[:, d:]
            tok_proj = (model.tok_embeddings.weight @ w_tok.T + head.fc.bias).contiguous()
            fused = head.fused
            return LoadedHead(model, path, head, tok_proj,
                              tok_proj[head.draft_vocab].contiguous(), w_feat.T.contiguous(),
                              head.draft_weight(model).T.contiguous(),
                              forward_cost(c, int(head.draft_vocab.numel()), len(fused)),
                              fused, head.fuse.weight.T.contiguous() if fused else None)


@dataclass
class EagleState:
    """One sequence's draft KV cache and the features not yet in it."""

    k: Tensor | None  # (H, capacity, D); None until the first draft (``Eagle._cache``)
    v: Tensor | None
    rows: int = 0  # committed rows: row t holds (token_{t+1}, f_t)
    pending: list[Tensor] = field(default_factory=list)  # pre-norm hidden rows from [rows, ...)
    pending_rows: int = 0
    root: Tensor | None = None  # f^_rows: the last committed row's output


class Eagle(DrafterBase):
    name = "eagle"

    @dataclass(frozen=True)
    class Params:
        # chosen on the workload suite (docs/BENCHMARKS.md, "Medusa's, EAGLE's and early
        # exit's settings on the workload suite"): one draft token beat chains of 2, 3 and 6
        # in 20 of 30 rows (16 of the 20 sampled)
        depth: int = 1  # tree levels = forwards of the EAGLE layer per step
        top_k: int = 1  # children per expanded node, and nodes expanded per level
        total_tokens: int = 2  # the current token + at most total_tokens - 1 draft nodes

        def __post_init__(self):
            if not 1 <= self.depth <= 12:
                raise ValueError("depth must be in 1..12")
            if not 1 <= self.top_k <= 16:
                raise ValueError("top_k must be in 1..16")
            if not 2 <= self.total_tokens <= 65:
                raise ValueError("total_tokens must be in 2..65 (64 draft nodes at most)")

    @staticmethod
    def check(params: Params, env: DrafterEnv) -> None:
        """Before the request is queued: the model has a trained head."""
        path = weights_path(env.checkpoint_dir, env.model_name)
        if not path.exists():
            raise SpeculationError(
                f"no EAGLE head for model {env.model_name!r}; train one with "
                f"`nodraft train eagle --model {env.model_name}`", "speculation.method")

    def __init__(self, params: Params, env: DrafterEnv):
        self.params = params
        self.loaded = load_for(env)
        self.layer = self.loaded.head.layer
        self.draft_vocab = self.loaded.head.draft_vocab
        self._penalties: dict[tuple, Tensor] = {}

    # -- the draft KV cache -------------------------------------------------------------
    def _kv(self, max_len: int, make=torch.empty) -> tuple[Tensor, Tensor]:
        """A draft KV cache (keys, values) for a target cache of ``max_len`` rows."""
        c = self.loaded.model.config
        cap = max_len + self.params.depth * self.params.top_k
        shape = (c.n_heads, cap, c.head_dim)
        dtype = self.loaded.w_draft_t.dtype
        return make(shape, dtype=dtype), make(shape, dtype=dtype)

    def _new_state(self, max_len: int) -> EagleState:
        return EagleState(*self._kv(max_len, torch.zeros))

    def _state(self, ctx: DraftContext) -> EagleState:
        """The sequence's state; its draft KV cache is made at the first draft (``_cache``):
        ``observe`` runs every step, also for a sequence that ``auto`` never drafts with
        EAGLE, and only queues features."""
        st = ctx.state.get("eagle")
        if st is None:
            st = ctx.state["eagle"] = EagleState(None, None)
        return st

    def _cache(self, ctx: DraftContext, st: EagleState) -> None:
        """The draft KV cache, made once per sequence, unfilled: a row is read only after
        the catch-up or a tree level has written it."""
        if st.k is None:
            st.k, st.v = self._kv(ctx.cache.max_len)

    def _ingest(self, ctx: DraftContext, st: EagleState) -> None:
        """Queue the features ``ctx.last_hidden`` holds that the cache lacks (it covers the
        last len(last_hidden) committed positions)."""
        n, h = ctx.n_cached, ctx.last_hidden
        have = st.rows + st.pending_rows
        if h is None or have >= n or n - h.shape[0] > have:
            return
        st.pending.append(h[have - (n - h.shape[0]):])
        st.pending_rows = n - st.rows

    def _take_pending(self, ctx: DraftContext, st: EagleState) -> Tensor:
        """The target's pre-norm hidden rows for positions [st.rows, n), from the queue
        (or recomputed when a step went unseen)."""
        n = ctx.n_cached
        if st.rows + st.pending_rows == n and st.pending:
            h = st.pending[0] if len(st.pending) == 1 else torch.cat(st.pending)
        else:  # features missed (a step this drafter did not see): recompute them
            hidden: list[Tensor] = []
            ctx.model(torch.tensor([ctx.tokens[:n]]), hidden=hidden)
            h = hidden[-1][0, st.rows:n]
        st.pending, st.pending_rows = [], 0
        return h

    def _catch_up(self, ctx: DraftContext, st: EagleState, h: Tensor, n: int | None = None
                  ) -> None:
        """Append rows [st.rows, n) (default: every committed row) to the draft cache in one
        causal forward from their hidden rows h; keep the last row's output (the root's
        feature)."""
        n = ctx.n_cached if n is None else n
        m = ctx.model
        a, T = st.rows, n - st.rows
        L = self.loaded
        x = L.tok_proj[torch.tensor(ctx.tokens[a + 1:n + 1])] + features(m, h) @ L.w_feat_t
        fuse = L.fuse_term(ctx, a, n)
        if fuse is not None:
            x = x + fuse
        if T == 1:  # one row: its position's rotation broadcasts
            cos, sin = m.rope_cos[a], m.rope_sin[a]
        else:
            pos = torch.arange(a, n)
            cos, sin = m.rope_cos[pos][None, None], m.rope_sin[pos][None, None]
        mask = None if T == 1 or a == 0 else additive_mask(
            torch.ones(T, n, dtype=torch.bool).tril(a), x.dtype)
        out = self.layer.forward(x[None], cos, sin, (st.k, st.v), a, mask)
        st.rows, st.root = n, out[0, -1]

    def _compiled_draft(self, model: Micro) -> "CompiledDraft | None":
        """The compiled draft step when the target's passes are compiled."""
        compiled = model.compiled
        if compiled is None:
            return None
        with _COMPILED_DRAFTS_LOCK:  # the engine's thread and the warm-up's: one object
            drafts = _COMPILED_DRAFTS.setdefault(compiled, {})
            cd = drafts.get(self.loaded.path)
            if cd is None:
                cd = drafts[self.loaded.path] = CompiledDraft(self.loaded, compiled)
            cd.load()  # the target's artifacts may have been loaded since
        return cd

    @torch.inference_mode()  # inputs as propose makes them (dynamo guards dispatch keys)
    def warm_up(self, cache, compile: bool = True) -> float:
        """Compile this drafter's draft step (its tree shape, one-row and several-row
        catch-ups) on a scratch draft cache as long as ``cache``'s rows; the server calls it
        after the target's warm-up. ``compile=False``: only run the shapes compiled or
        loaded already (``CompiledDraft.load``). Returns the seconds it took (0 without
        compiled passes)."""
        cd = self._compiled_draft(self.loaded.model)
        if cd is None:
            return 0.0
        t0 = time.perf_counter()
        p, c = self.params, self.loaded.model.config
        st = self._new_state(cache.max_len)
        dtype = self.loaded.w_draft_t.dtype
        start = 8
        fused = len(self.loaded.fused)
        for T in (1, 3):
            fuse = torch.zeros(T, fused * c.dim, dtype=dtype) if fused else None
            cd.step(torch.zeros(T, c.dim, dtype=dtype), torch.zeros(T, dtype=torch.long), st,
                    start, p.depth, p.top_k, p.total_tokens - 1, 1.0, lazy=compile,
                    fuse=fuse)
        return time.perf_counter() - t0

    # -- propose / observe --------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        p, L, m = self.params, self.loaded, ctx.model
        n = ctx.n_cached
        if n == 0 or budget < 1:
            return Draft.empty()  # a one-token prompt: no feature yet for the current token
        st = self._state(ctx)
        self._cache(ctx, st)
        self._ingest(ctx, st)
        depth = min(p.depth, budget)
        inv_t = 1.0 / ctx.temperature if ctx.temperature >= 0.05 else 1.0
        N = L.w_draft_t.shape[1]
        # unseeded sampling, a chain: each level's token drawn from q (Gumbel-max over this
        # noise), q sent for the rejection rule (seeded: the argmax chain, q = None)
        noise = None
        if ctx.temperature >= 0.05 and ctx.draw is None and min(p.top_k, N) == 1:
            noise = torch.empty(p.depth, N, dtype=L.w_draft_t.dtype).exponential_(
                generator=ctx.generator).log_().neg_()
        if st.rows < n:
            h = self._take_pending(ctx, st)
            cd = self._compiled_draft(m)
            if cd is not None and n - 1 >= MIN_CONTEXT:  # one graph for the request's tree shape
                if st.rows < MIN_CONTEXT:  # after the prefill: the prompt's rows eager first
                    split = n - 1 - st.rows
                    self._catch_up(ctx, st, h[:split], n - 1)
                    h = h[split:]
                a = st.rows
                done = cd.step(h, torch.tensor(ctx.tokens[a + 1:n + 1]), st, a, p.depth,
                               p.top_k, p.total_tokens - 1, inv_t, noise=noise,
                               fuse=L.fuse_rows(ctx, a, n))
                if done is not None:  # near the end of a request: its first ``budget`` nodes
                    tokens, parents, scaled = done
                    q = None if noise is None else self._q(scaled.softmax(-1))
                    return self._draft(tokens, parents, p.depth * L.cost_per_forward,
                                       q).prefix(budget)
            self._catch_up(ctx, st, h)

        def log_q(feats: Tensor) -> Tensor:  # draft log-probabilities over the draft vocab
            logits = feats @ L.w_draft_t
            return (logits if inv_t == 1.0 else logits * inv_t).log_softmax(-1)

        q_rows: list[Tensor] = []

        def children(lq: Tensor, level: int) -> tuple[Tensor, Tensor]:
            """(scores, indices) of a node's children: its top_k, or, drawing from q, the
            one the level's noise picks (the compiled chain's argmax)."""
            if noise is None:
                return lq.topk(min(p.top_k, N), dim=-1)
            q_rows.append(lq.reshape(1, N))
            i = (lq + noise[level - 1]).argmax(-1, keepdim=True)
            return lq.gather(-1, i), i

        # level 1: the root's top_k children; they are the first frontier
        score, idx = children(log_q(st.root), 1)
        tokens, scores, frontiers = [idx], [score], []
        f_idx, f_score, f_feat = idx, score, st.root.expand(idx.numel(), -1)
        f_nodes = torch.arange(idx.numel())  # the frontier's global node indices
        anc = torch.zeros(idx.numel(), 0, dtype=torch.bool)  # ancestors' scratch rows
        total, used = idx.numel(), 0
        for level in range(2, depth + 1):  # ONE forward over the frontier per level
            kf = f_idx.numel()
            x = L.tok_proj_draft[f_idx] + f_feat @ L.w_feat_t  # (kf, dim)
            at = n + level - 2  # the frontier's position (depth level - 1)
            eye = torch.eye(kf, dtype=torch.bool)
            mask = additive_mask(torch.cat([torch.ones(kf, n, dtype=torch.bool), anc, eye],
                                           dim=1), x.dtype)
            out = self.layer.forward(x[None], m.rope_cos[at], m.rope_sin[at], (st.k, st.v),
                                     n + used, mask)[0]
            c_score, c_idx = children(log_q(out), level)
            cum = (f_score[:, None] + c_score).flatten()  # (kf * k,) path log-probabilities
            c_idx = c_idx.flatten()
            tokens.append(c_idx)
            scores.append(cum)
            frontiers.append(f_nodes)
            if level < depth:  # the next frontier: this level's best top_k
                best = cum.topk(min(p.top_k, cum.numel())).indices
                row = best // c_score.shape[1]
                f_nodes, f_idx, f_score, f_feat = total + best, c_idx[best], cum[best], out[row]
                anc = torch.cat([anc, eye], dim=1)[row]
            total += cum.numel()
            used += kf
        draft = self._rerank(tokens, scores, frontiers, min(p.total_tokens - 1, budget),
                             depth * L.cost_per_forward)
        if noise is None:
            return draft
        # a chain keeps its first nodes: their q rows are the first rows drawn
        return dataclasses.replace(draft, probs=self._q(torch.cat(q_rows)[:len(draft)].exp()))

    def _q(self, rows: Tensor) -> Tensor:
        """(k, V) draft distributions from (k, N) ones over the draft vocabulary."""
        q = torch.zeros(rows.shape[0], self.loaded.model.config.vocab_size, dtype=rows.dtype)
        return q.index_copy_(1, self.draft_vocab, rows)

    def _rerank(self, tokens: list[Tensor], scores: list[Tensor], frontiers: list[Tensor],
                keep: int, cost: float) -> Draft:
        """The best ``keep`` nodes of all levels, in level order, parents re-indexed."""
        sizes = tuple(s.numel() for s in scores)
        penalty = self._penalties.get(sizes)
        if penalty is None:  # ties go to the shallower node: 1e-9 per level, in float64
            penalty = self._penalties[sizes] = torch.cat(
                [torch.full((k,), 1e-9 * d, dtype=torch.float64) for d, k in enumerate(sizes)])
        total = penalty.numel()
        if keep >= total:  # every node
            keep, sel = total, torch.arange(total)
        else:
            sel = (torch.cat(scores).double() - penalty).topk(keep).indices.sort().values
        kids = [f.repeat_interleave(s // f.numel()) for f, s in zip(frontiers, sizes[1:])]
        parents = torch.cat([torch.full((sizes[0],), -1), *kids])[sel]
        new_index = torch.full((total + 1,), -1)  # new_index[-1] = -1 for the root's children
        new_index[sel] = torch.arange(keep)
        parents = new_index[parents]
        return self._draft(self.draft_vocab[torch.cat(tokens)[sel]], parents, cost)

    @staticmethod
    def _draft(tokens: Tensor, parents: Tensor, cost: float, q: Tensor | None = None) -> Draft:
        chain = bool((parents == torch.arange(-1, parents.numel() - 1)).all())
        return Draft(tokens, None if chain else parents, q, cost=cost)

    def observe(self, ctx: DraftContext, accepted: list[int]) -> None:
        if ctx.n_cached:
            self._ingest(ctx, self._state(ctx))

