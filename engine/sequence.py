"""One sequence's speculative decoding: token ids in, token ids out.

    first = sample(target(prompt)[-1])         # the prefill: ONE pass, the first token
    loop:
        draft  = drafter.propose(ctx, budget)  # propose
        logits = target([current, *draft])     # verify: ONE target pass, tree mask if any
        path, bonus = accept(logits, draft)    # accept: greedy or lossless sampling
        cache.length = n + 1 + len(path)       # rollback: the rest of the rows are scratch
        drafter.observe(ctx, accepted)         # observe
        emit(accepted + [bonus])

The prefill caches the whole prompt and the first token comes from the head over its last
row: plain decoding makes exactly one target pass per token, the prefill included, and
the first token waits for no second pass. Drafting starts at the second step. ``step``
prefills in one pass (chunks of ``PREFILL_CHUNK`` for a long prompt); a packed pass takes a
prompt in chunks beside the other sequences' steps (``prefill_segment``, ``prefill_done``).
``prefill`` caches all but the prompt's last token instead, which the first ``step`` then
verifies with a draft: for callers that time decoding apart from the prefill.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
from torch import Tensor

from nodraft.drafters.base import NOT_LOOKED, Draft, DraftContext, Drafter, close_drafter, hook
from nodraft.drafters.none import NoDraft
from nodraft.micro.model import KVCache, Micro
from nodraft.micro.ops import inference, longs
from nodraft.micro.packed import Segment, head_rows
from nodraft.engine.stats import SpecStats
from nodraft.engine.sampling import PositionNoise, derive_seed
from nodraft.engine.verify import SamplingParams, accept, race_rows

PREFILL_CHUNK = 256


class StepResult(msgspec.Struct, array_like=True, gc=False):
    """One step's outcome for one sequence, as the engine reports it (``Event.step``).
    Plain data, a msgspec Struct: it crosses to the API process as an array, and neither
    process's garbage collector tracks the thousands a second a batch makes."""

    tokens: list[int]  # emitted this step, in order (after stops)
    n_accepted: int  # how many of ``tokens`` were accepted draft tokens (the rest: bonus)
    draft: list[int]  # the draft's tokens (tree nodes in node order)
    rejected: list[int]  # draft tokens on the first rejected branch (for display)
    method: str  # the drafter that proposed (``auto`` reports the one it chose)
    cost: float = 0.0  # the draft's cost, in target-pass units
    finish_reason: str | None = None
    accepted: int = 0  # draft tokens verification accepted (``n_accepted``: those emitted)
    drafter_errors: int = 0  # the sequence's contained drafter errors so far
    # with ``Sequence.logprobs`` set: per emitted token, (its logprob, the top
    # ``logprobs`` (id, logprob) pairs, most likely first) under the target's raw
    # distribution (log-softmax of its logits: no temperature, no top-k/top-p)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # with ``Sequence.prompt_logprobs``, on the first step only: the same for prompt tokens
    # 1.. (the first prompt token has none), from the prefill's hidden states
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # the pass's measured-cost figures (``engine.stats``): plain decoding's seconds for the
    # tokens it produced, the pass's seconds by its rows, the drafter's wall time
    plain_seconds: float = 0.0
    verify_seconds: float = 0.0
    draft_seconds: float = 0.0
    # on the first step only: how many prompt tokens came from the prefix cache
    cached_tokens: int | None = None


@dataclass
class Sequence:
    model: Micro
    cache: KVCache
    slot: int
    prompt: list[int]
    drafter: Drafter
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: frozenset[int] = frozenset()  # end-of-text and the like: not emitted
    method: str = "none"
    max_draft: int = 64
    logprobs: int | None = None  # None: none; k >= 0: each token's logprob and the top k
    prompt_logprobs: bool = False  # the prompt's too (needs ``logprobs``), on the first step
    # what a lone pass costs here by its rows (``drafters.costs.PassCost``); None: the
    # measured-cost figures stay 0 (the engine sets it)
    pass_cost: Any = None
    # the model's kept prompt blocks (``engine.prefix_cache``): the prefill starts after the
    # longest kept prefix of the prompt, and keeps the prompt's blocks once it is done
    prefix_cache: Any = None

    def __post_init__(self):
        assert 1 <= len(self.prompt) < self.cache.max_len, "prompt must fit the context"
        self.tokens = list(self.prompt)
        self.generated = 0
        self.finish_reason: str | None = None
        self.stats = SpecStats(self.method)
        self.stats_by_method: dict[str, SpecStats] = {}
        sp = self.sampling
        self.generator = torch.Generator()  # the drafters' own randomness; the unseeded rule's
        self.generator.manual_seed(derive_seed(sp.seed, "draft") if sp.seed is not None
                                   else int(torch.randint(0, 2**62, (1,))))
        # seeded sampling: the drafter-invariant rule (engine.sampling)
        vocab = self.model.config.vocab_size
        self.noise = (PositionNoise(sp.seed, vocab)
                      if sp.seed is not None and not sp.greedy else None)
        # unseeded sampling races too, over noise of its own, wherever a step's draft is
        # point masses or nothing (``race_noise``)
        self._unseeded_noise = (PositionNoise(int(torch.randint(0, 2**62, (1,))), vocab)
                                if sp.seed is None and not sp.greedy else None)
        self.ctx = DraftContext(self.tokens, len(self.prompt), self.model, self.cache, self.slot,
                                temperature=sp.temperature, generator=self.generator,
                                draw=self._draw if self.noise is not None else None)
        self.prefilled = False
        self._states: list[Tensor] = []  # prefill chunks' hidden states (packed prefill)
        self._prefill_begun = False
        self.cached_tokens = 0  # prompt tokens the prefix cache supplied
        self._timed = self.method != "none"  # plain decoding's drafter costs nothing
        self._never_drafts = isinstance(self.drafter, NoDraft)
        self._draft_s = 0.0  # the drafter's wall time since the last pass
        self._reused = 0.0  # early exit's last pass: the share of layers it reused
        self.asked = False  # the last ``propose`` asked the drafter
        self._idle_draft: Draft | None = None  # what a step the drafter is not asked sends
        # steps the drafter declined in advance (its ``resting``), and whether it is told of
        # this step (``observe``): not while it rests so
        self._quiet = 0
        self._silent = False
        # the owner closes the drafter itself once the last outputs are out (``close``);
        # else ``finish`` does
        self.defer_close = False
        self._closed = False

    def _draw(self, logits: Tensor, pos: int) -> int:
        return race_rows(logits[None], self.sampling, self.noise, [pos])[0]

    def race_noise(self, draft: Draft) -> PositionNoise | None:
        """The race noise that verifies ``draft``, or None where the rejection rule does.

        Seeded: always the seed's. Unseeded: the request's own noise when the draft carries
        no distribution (point masses, or no draft) -- a race over fresh noise is plain
        sampling, and it keeps a point-mass draft token x with probability p(x), as the
        rejection rule does, in fewer operations; a draft sent with its q keeps the rejection
        rule, whose min(1, p/q) keeps more than a race coupling of q and p would."""
        if self.noise is not None or draft.probs is not None:
            return self.noise
        return self._unseeded_noise

    def _accept(self, logits: Tensor, draft: Draft, targets: list[int] | None = None
                ) -> tuple[list[int], int]:
        return accept(logits, draft, self.sampling, self.generator, self.race_noise(draft),
                      len(self.tokens), targets)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    # -- prefill --------------------------------------------------------------------------
    @inference
    def prefill(self) -> None:
        """Cache every prompt token but the last, which the first ``step`` then verifies
        with a draft (``step`` alone prefills the whole prompt and takes the first token
        from it): for callers that time decoding apart from the prefill."""
        self._prefill_rows(len(self.prompt) - 1)
        # after prefill: every prompt token's but the last (EAGLE builds its cache from them)
        self.ctx.last_hidden = torch.cat(self._states) if self._states else None
        self._states = []
        self.prefilled = True
        if self.prefix_cache is not None and self.ctx.last_hidden is not None:
            self.prefix_cache.store(self.prompt, len(self.prompt) - 1, self.cache, self.slot,
                                    self.ctx.last_hidden)

    def _begin_prefill(self) -> None:
        """At the prompt's first prefill rows: an empty slot (it may hold a previous
        sequence's length) and no hidden states kept -- then the longest prefix of the
        prompt the prefix cache holds, copied in, with its hidden states."""
        if not self._prefill_begun:
            self.cache.reset(self.slot)
            self._states, self._prefill_begun = [], True
            if self.prefix_cache is not None:
                hidden = self.prefix_cache.load(self.prompt, self.cache, self.slot)
                if hidden is not None:
                    self._states.append(hidden)
                    self.cached_tokens = hidden.shape[0]

    def _prefill_rows(self, end: int) -> None:
        """Cache the prompt's rows from where the slot stands (an empty slot at first) up to
        ``end``, in passes of at most ``PREFILL_CHUNK`` rows, keeping their final hidden
        states in ``_states``."""
        self._begin_prefill()
        for s in range(self.cache.lengths[self.slot], end, PREFILL_CHUNK):
            chunk = longs(self.prompt[s:min(s + PREFILL_CHUNK, end)])
            self._states.append(self.model.prefill_pass(chunk, self.cache, self.slot, s))
            self.cache.advance(self.slot, chunk.shape[0])

    # -- one step -------------------------------------------------------------------------
    def budget(self) -> int:
        """Draft tokens this step may carry: leave room for the bonus token, within
        max_tokens and the context."""
        if self._never_drafts or self._quiet:  # plain decoding, or a resting drafter's
            return 0
        room = min(self.max_tokens - self.generated, self.cache.max_len - len(self.tokens))
        return max(0, min(self.max_draft, room - 1))

    def propose(self, limit: int | None = None) -> Draft:
        """The drafter's draft for this step, within ``budget()`` and ``limit`` (the
        scheduler's share under batching; 0 = do not draft this step)."""
        if self._quiet:  # declined in advance (``resting``): neither asked nor told
            self._quiet -= 1
            self.asked, self._silent = False, True
            return self._idle()
        self._silent = False
        budget = self.budget() if limit is None else min(limit, self.budget())
        self.asked = budget > 0  # whether the drafter is asked this step (and looks)
        if budget == 0:  # not consulted
            return self._idle()
        t0 = time.perf_counter()
        try:
            draft = self.drafter.propose(self.ctx, budget)
        except Exception:  # a drafter that raises is contained: plain decoding this step
            self._drafter_error(self.method)
            return Draft.empty()
        finally:
            if self._timed:
                self._draft_s += time.perf_counter() - t0
        if draft is NOT_LOOKED:  # the drafter chose not to look: as if not consulted
            self.asked = False
            try:  # and maybe not at the next ones either
                self._quiet = max(0, int(hook(self.drafter, "resting", 0) or 0))
            except (TypeError, ValueError):  # a plugin's nonsense: contained, as a raise is
                self._quiet = 0
                self._drafter_error(self.method)
            self._silent = self._quiet > 0
            return self._idle()
        if len(draft) > budget:
            draft = draft.prefix(budget)
        room = self.cache.max_len - len(self.tokens) - len(draft)  # rows left for aux
        if draft.n_aux and (draft.n_aux > room or draft.reuse is not None):
            draft = dataclasses.replace(draft, aux=None)
        return draft

    def _idle(self) -> Draft:
        """The empty draft of a step the drafter was not consulted at: a drafter may name
        who that pass belongs to (``idle_method``)."""
        if self._idle_draft is None:  # a frozen Draft: one per sequence serves every step
            self._idle_draft = dataclasses.replace(
                Draft.empty(), method=hook(self.drafter, "idle_method"))
        return self._idle_draft

    def block(self, draft: Draft) -> tuple[Tensor, Tensor, Tensor | None]:
        """The verification block [current, *draft, *aux]: ids (T,), positions (T,), and
        its (T, T) attention mask (None = causal)."""
        n = self.cache.lengths[self.slot]
        assert n == len(self.tokens) - 1
        k, m = len(draft), draft.n_aux
        ids = [self.tokens[-1], *draft.token_list]
        if draft.parents is None:
            depth = torch.arange(k + 1)
            mask = None if not m else torch.ones(k + 1, k + 1, dtype=torch.bool).tril()
        else:
            depth = longs([0, *draft.depths()])
            mask = tree_attention_mask(draft.parents)
        if not m:
            return longs(ids), n + depth, mask
        full = torch.zeros(1 + k + m, 1 + k + m, dtype=torch.bool)
        full[:k + 1, :k + 1] = mask
        aux = draft.aux
        full[k + 1:, 0] = aux.mask[:, 0]
        full[k + 1:, k + 1:] = aux.mask[:, 1:]
        ids += aux.tokens.tolist()
        pos = torch.cat([n + depth, n + aux.pos])
        return longs(ids), pos, full

    @inference
    def verify(self, draft: Draft) -> tuple[Tensor, Tensor]:
        """ONE target pass over [current, *draft] (and any aux rows): logits (1+k, V) and
        final hidden (1+k, dim) of the current token and the draft nodes."""
        n = self.cache.lengths[self.slot]
        k = len(draft)
        m = self.model
        if draft.reuse is not None and k:  # early exit: layers < E cached for all but the last
            E = draft.reuse.layer
            h_last = m.exit_residual(draft.tokens[-1:], self.cache, self.slot, n + k, E)
            h = torch.cat([draft.reuse.hidden, h_last])  # (1+k, dim)
            self.ctx.aux_logits = None
            self._reused = E / m.config.n_layers  # for its price: layers below E were reused
            return m.verify_from(h, self.cache, self.slot, n, E)
        if draft.parents is None and not draft.n_aux:  # a chain: positions and mask implied
            self.ctx.aux_logits = None
            return m.verify_chain([self.tokens[-1], *draft.token_list], self.cache, self.slot,
                                  n)
        ids, pos, tree_mask = self.block(draft)
        logits, hidden = m.verify_pass(ids, self.cache, self.slot, n, pos, tree_mask)
        return self.split(logits, hidden, k)

    def split(self, logits: Tensor, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """Keep the aux rows' logits for the drafter; return the verified rows'."""
        if logits.shape[0] == k + 1 and hidden.shape[0] == k + 1:  # no aux rows: as they are
            self.ctx.aux_logits = None
            return logits, hidden
        self.ctx.aux_logits = logits[k + 1:] if logits.shape[0] > k + 1 else None
        return logits[:k + 1], hidden[:k + 1]

    def commit(self, draft: Draft, path: list[int], bonus: int, hidden: Tensor,
               logits: Tensor | None = None, features: Tensor | None = None) -> StepResult:
        """Roll the cache back to the accepted path, record the figures, apply stops.
        ``logits``: the verified rows' (needed for ``logprobs``); ``features``: the final
        hidden rows of every position this step commits, for the drafters
        (``ctx.last_hidden``; default: the verified rows on the accepted path)."""
        n = self.cache.lengths[self.slot]
        prompt_lp = None
        if self.prompt_logprobs and len(self.tokens) == len(self.prompt):  # the first step
            prompt_lp = self._prompt_logprobs()
        if draft.parents is not None and path:  # move the accepted path's rows into place
            self.cache.move_rows(self.slot, [n + 1 + i for i in path], n + 1)
        self.cache.set_length(self.slot, n + 1 + len(path))
        dtok = list(draft.token_list)
        accepted = [dtok[i] for i in path]
        method = draft.method or self.method
        plain_s = verify_s = 0.0
        if self.pass_cost is not None:
            plain_s = (len(accepted) + 1) * self.pass_cost(1)
            verify_s = self.pass_cost(1 + len(draft) + draft.n_aux)
            if self._reused:  # early exit's own pass: its rows below the exit were reused
                verify_s = (1 - self._reused) * verify_s + self._reused * self.pass_cost(1)
        self._reused = 0.0
        draft_s, self._draft_s = self._draft_s, 0.0
        for s in (self.stats, self._method_stats(method)):
            s.record(len(draft), len(accepted), draft.cost, plain_s, verify_s, draft_s)
        if features is not None:
            self.ctx.last_hidden = features
        elif not path:
            self.ctx.last_hidden = hidden if hidden.shape[0] == 1 else hidden[:1]
        elif draft.parents is None:  # a chain's accepted path: its first rows, in order
            self.ctx.last_hidden = hidden[:1 + len(path)]
        else:
            self.ctx.last_hidden = hidden[[0, *(i + 1 for i in path)]]
        emitted = accepted + [bonus]
        finish = None
        hit = next((i for i, t in enumerate(emitted) if t in self.stop_ids), None)
        if hit is not None:
            emitted = emitted[:hit]
            finish = "stop"
        self.tokens.extend(accepted + [bonus])
        self.generated += len(emitted)
        if finish is None and self.generated >= self.max_tokens:
            finish = "length"
        if finish is None and len(self.tokens) >= self.cache.max_len:
            finish = "length"  # the context is full
        if not self._silent:
            t0 = time.perf_counter()
            try:
                self.drafter.observe(self.ctx, accepted)
            except Exception:
                self._drafter_error(method)
            if self._timed:  # the drafter's bookkeeping is its cost too: the next pass's
                self._draft_s += time.perf_counter() - t0
        if finish is not None:
            self.finish(finish)
        rejected = _rejected_branch(draft, path) if len(draft) else []
        lps = None
        if self.logprobs is not None and logits is not None:
            rows = [0, *(i + 1 for i in path)][:len(emitted)]
            lps = token_logprobs(logits[rows], emitted, self.logprobs)
        return StepResult(emitted, min(len(accepted), len(emitted)), dtok, rejected, method,
                          draft.cost, finish, len(accepted), self.stats.drafter_errors, lps,
                          prompt_lp, plain_s, verify_s, draft_s)

    def _prompt_logprobs(self) -> list[tuple[float, list[tuple[int, float]]]]:
        """Prompt tokens 1.. scored by the prefill's final hidden states (row i predicts
        prompt token i + 1); read before the first commit replaces them."""
        h = self.ctx.last_hidden
        if h is None or len(self.prompt) < 2:
            return []
        with torch.inference_mode():
            return token_logprobs(self.model.head(h[:len(self.prompt) - 1]), self.prompt[1:],
                                  self.logprobs or 0)

    def finish(self, reason: str) -> None:
        """End the sequence (a stop, a limit, or ``"cancelled"``); the drafter hears of it
        now, or, with ``defer_close``, when the owner calls ``close``."""
        if self.finish_reason is None:
            self.finish_reason = reason
            if not self.defer_close:
                self.close()

    def close(self) -> None:
        """The drafter's close hook (suffix decoding's store takes the response), once,
        after ``finish``. With ``defer_close`` the owner calls it after the request's last
        outputs are out: what the hook does is for later requests, not for this one."""
        if self._closed or self.finish_reason is None:
            return
        self._closed = True
        try:
            close_drafter(self.drafter, self.ctx)
        except Exception:
            self._drafter_error(self.method)

    def step(self) -> StepResult:
        if not self.prefilled:
            return self._prefill_step()
        t_step = time.perf_counter()
        draft = self.propose()
        t0 = time.perf_counter()
        logits, hidden = self.verify(draft)
        passed = time.perf_counter() - t0
        # only a model-free chain's pass teaches the table: the passes it times and prices
        # (``PassCost``)
        if (self.pass_cost is not None and not self._reused and draft.parents is None
                and not draft.n_aux and not draft.cost):
            self.pass_cost.observe(1 + len(draft), passed)
        path, bonus = self._accept(logits, draft)
        result = self.commit(draft, path, bonus, hidden, logits)
        self.ctx.step_seconds = time.perf_counter() - t_step
        self.ctx.pass_seconds = passed
        return result

    @inference
    def _prefill_step(self) -> StepResult:
        """The first step: the prompt's rows not yet cached through every layer, then its
        first token (``_first_token``)."""
        self._prefill_rows(len(self.prompt))
        return self._first_token()

    def _first_token(self) -> StepResult:
        """Every prompt row is cached: the head over the last one gives the first token,
        accepted as a step with no draft. The drafters see every prompt token's features."""
        hidden, self._states = torch.cat(self._states), []
        if self.prefix_cache is not None:
            self.prefix_cache.store(self.prompt, len(self.prompt), self.cache, self.slot, hidden)
        # the last prompt token's row is written; ``commit`` commits it as a step's would be
        self.cache.set_length(self.slot, len(self.prompt) - 1)
        self.ctx.last_hidden = hidden  # what the prompt's logprobs are scored from
        self.prefilled = True
        with torch.inference_mode():
            logits = head_rows(self.model, hidden[-1:])
        draft = dataclasses.replace(Draft.empty(), method=hook(self.drafter, "idle_method"))
        path, bonus = self._accept(logits, draft)
        result = self.commit(draft, path, bonus, hidden[-1:], logits, features=hidden)
        result.cached_tokens = self.cached_tokens
        return result

    # -- the same, as segments of a packed pass shared with other sequences ---------------
    def prefill_segment(self, budget: int) -> Segment:
        """The next chunk of the prompt (at most ``budget`` rows, at least one) for a
        packed pass, while the sequence is not ``prefilled``."""
        self._begin_prefill()
        n = self.cache.lengths[self.slot]
        end = min(len(self.prompt), n + max(1, budget))
        return Segment(self.slot, n, longs(self.prompt[n:end]), torch.arange(n, end),
                       logits=False)

    def prefill_done(self, segment: Segment, hidden: Tensor) -> StepResult | None:
        """A chunk's pass is done; after the prompt's last chunk, the first token
        (``_first_token``), else None."""
        self.cache.advance(self.slot, len(segment))
        self._states.append(hidden)
        if self.cache.lengths[self.slot] < len(self.prompt):
            return None
        return self._first_token()

    def verify_segment(self, draft: Draft) -> Segment:
        """The verification block as a segment. Early exit's KV reuse does not apply in a
        packed pass: the block runs through every layer, rewriting the rows below the exit
        that the draft wrote (the same values, so the output is unchanged)."""
        n = self.cache.lengths[self.slot]
        if not len(draft) and not draft.n_aux:  # the current token alone: most of a batch
            return Segment(self.slot, n, [self.tokens[-1]], [n])
        ids, pos, mask = self.block(draft)
        return Segment(self.slot, n, ids, pos, mask)

    def finish_step(self, draft: Draft, logits: Tensor, hidden: Tensor,
                    targets: list[int] | None = None) -> StepResult:
        """Accept and commit after a packed pass computed the segment's logits;
        ``targets``: its rows' own tokens (``verify.accept``), if the pass took them."""
        logits, hidden = self.split(logits, hidden, len(draft))
        path, bonus = self._accept(logits, draft, targets)
        # a share of a packed pass: no step or pass of its own
        self.ctx.step_seconds = self.ctx.pass_seconds = None
        return self.commit(draft, path, bonus, hidden, logits)

    def _drafter_error(self, method: str) -> None:
        self.stats.drafter_errors += 1
        self._method_stats(method).drafter_errors += 1

    def _method_stats(self, method: str) -> SpecStats:
        if method not in self.stats_by_method:
            self.stats_by_method[method] = SpecStats(method)
        return self.stats_by_method[method]


def token_logprobs(logits: Tensor, tokens: list[int], top: int
                   ) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per row of ``logits`` (m, V): the logprob of ``tokens[row]`` and the ``top`` most
    likely (id, logprob) pairs, under log-softmax (float32)."""
    if not tokens:
        return []
    lp = logits.float().log_softmax(-1)
    chosen = lp[torch.arange(len(tokens)), longs(tokens)].tolist()
    if top <= 0:
        return [(c, []) for c in chosen]
    vals, ids = lp.topk(min(top, lp.shape[-1]), dim=-1)
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), vals.tolist())]


def tree_attention_mask(parents: Tensor) -> Tensor:
    """(1+n, 1+n) bool: row 0 is the current token; node i sees the current token, its
    ancestors and itself."""
    n = parents.numel()
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True
    mask[0, 0] = True
    par = parents.tolist()
    for i in range(n):
        mask[i + 1, i + 1] = True
        p = par[i]
        if p >= 0:
            mask[i + 1] |= mask[p + 1]
    return mask


def _rejected_branch(draft: Draft, path: list[int]) -> list[int]:
    """The draft tokens after the accepted path on the first branch not taken (a chain's
    rejected tail; for a tree, the first child of the last accepted node's branch)."""
    tokens = draft.token_list
    if draft.parents is None:
        return tokens[len(path):]
    parents = draft.parents.tolist()
    last = path[-1] if path else -1
    out, node = [], next((i for i, p in enumerate(parents) if p == last), None)
    while node is not None:
        out.append(tokens[node])
        node = next((i for i, p in enumerate(parents) if p == node), None)
    return out
