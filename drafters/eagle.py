"""``eagle``: the EAGLE head (Li et al., 2024) drafting EAGLE-2's dynamic tree.

The head
--------
One decoder layer that predicts the target's next *feature* from the features it has seen::

    x_t     = fc(concat(embed(token_{t+1}), f_t))        # 2·dim -> dim, with bias
    f^_{t+1} = Block(x_0 .. x_t)                          # micro's decoder layer, causal
    q(token_{t+2}) = softmax(f^_{t+1} · E_draft^T)        # the target's frozen tied head

``f_t`` is the target's final-normed hidden state at position t (``model.norm`` of the
final layer's residual stream, the tensor the target's LM head reads; the drafter applies
the norm itself to ``ctx.last_hidden``, which is taken before it), ``embed`` is the
target's frozen embedding, and ``E_draft`` the rows of the target's tied embedding for the
draft vocabulary (below). The layer keeps its own KV cache per sequence, one row per
committed position: row t holds ``(token_{t+1}, f_t)``. Rows are never recomputed. After
the prefill ``ctx.last_hidden`` holds f_0 .. f_{n-1} for the prompt's first n tokens
(rows 0 .. n-1); after each step it holds the features of [previous current token,
*accepted] -- exactly the rows the step committed -- so the drafter appends them (one
causal forward, the *catch-up*) and the output of the last row, f^_n, predicts the token
after the current one. Tree rows go to scratch rows past the committed length and are
simply overwritten next step (rollback = not advancing the length), as micro's KVCache.

The dynamic tree (EAGLE-2)
--------------------------
``depth`` levels, ``top_k`` children per expanded node, at most ``total_tokens - 1`` nodes
(``total_tokens`` counts the current token, as EAGLE-2 does). A node's score is the sum of
the draft log-probabilities along its path (an estimate of the log-probability that the
target accepts the whole path)::

    level 1: the root's top_k tokens (from the catch-up's last row)
    level l = 2 .. depth: ONE forward of the layer over the top_k best nodes of level l-1
             (the frontier; rows at position n + l - 2, a tree mask over the draft cache:
             each row sees the committed rows, its ancestors' rows and itself), then
             top_k children per frontier node, scored parent + log q(child)
    rerank:  the best total_tokens - 1 of all nodes generated (a child never outscores its
             parent, and ties go to the shallower node, so the set contains every ancestor
             of its members), in level order -- parents before children, siblings best
             first.

So a step costs ``depth`` forwards of the layer whatever ``top_k`` is. ``depth`` is also the
tree's maximum depth (EAGLE-2's code counts one level more). Under sampling the tree is the
same deterministic top-k tree (scored at the request's temperature) and travels with
``q = None``: verification's sibling rule (``engine.verify``) accepts child x with the
target's p(x), zeroes it and renormalises on rejection -- lossless for any deterministic
tree. (verify uses a draft distribution q only where a node has a single child, so a q per
node would not be used where it matters; q = None is correct everywhere.)

The reduced draft vocabulary (EAGLE-3's idea)
----------------------------------------------
On micro the 4096-way head is 0.36 of a target pass, more than twice the draft layer
(0.16). The head reads only the N most frequent tokens of the train split (``draft_vocab``
in the weights; N = 1024 by default: 82% of the train split's tokens, 90% of the target's
greedy tokens on held-out text), mapped back to target ids; tokens outside it are never
drafted. Measured with the committed micro head (``time_draft_step``: CPU time of one draft
step after one committed row, 1 thread, the 2-core development machine under load, which
inflates every figure; a 1-token target pass took 2.0 ms on the same clock):

    tree (depth/top_k/total)    N = 256   512    1024   4096 (full head)
    4/4/12                      2.08 ms   2.12   2.11   3.64
    2/2/4                       1.17      1.00   1.08   1.38
    1/1/2                       0.66      0.59   0.59   0.70

so N = 1024 makes the default-sized trees' draft 20-40% cheaper than the full head, and
smaller N buys nothing more (the layer's own forwards dominate). It costs some accuracy:
held-out top-1 at depth 1..5 with the same weights is 0.55/0.53/0.52/0.52/0.51 reading all
4096 tokens, 0.53/0.51/0.50/0.50/0.49 with N = 1024 and 0.51/0.49/0.48/0.48/0.47 with 512.

Draft cost model (FLOPs, in target-pass units, per verification pass)
---------------------------------------------------------------------
A 1-token pass of micro on a CPU is bound by reading its weights, and a target pass reads
every weight once whatever its length (L layers + the V-way head); so does each batched
forward of the EAGLE layer. Per forward: the layer, the feature half of fc (the token half
is a (V, dim) table, ``embed @ W_tok^T + b``, precomputed once), and the N-way head::

    cost = depth * (layer + dim^2 + N * dim) / (L * layer + V * dim)

with layer = 4·dim² + 3·dim·ffn_dim. For micro (dim 160, ffn 384, L = 4, V = 4096),
N = 1024: 0.264 per forward, 1.59 per step at the default depth 6 (the full head: 0.54
per forward). The table above agrees: one forward (1/1/2) took 0.3 of a target pass.

The compiled draft step
-----------------------
With the target's passes compiled (``Micro.compile``), a draft step -- the catch-up, every
level of the tree or chain, the top-k and rerank bookkeeping -- is one ``torch.compile``
graph (``CompiledDraft``), built from the same layer code as the target's graphs
(``micro.compiled.attend_layer``) and multiplying with ``nodraft::mm`` (micro/gemm.py). Eager,
the default tree's step took 1.47 ms of CPU time against 0.73 ms for the 8-row pass that
verifies it: ~60 small operations at 5-20 us each. Compiled (one thread, 100 committed rows,
``CompiledDraft.step`` timed alone): 3/3/8 445 us, a chain of 6 (6/1/7) 370 us, one level
(1/1/2) 142 us, so ~46 us a further level -- about the FLOPs model's 0.26 of a 366 us
1-row target pass. Three things made the graph that cheap:

- ``cpp_wrapper``: C++, not Python, calls the graph's ~90 kernels (6/1/7: 588 -> 437 us;
  3/3/8: 442 -> 355 us, same process);
- a chain (top_k = 1) takes each level's argmax -- no log-softmax, no top-k, no rerank
  (437 -> 384 us);
- a chain node's draft head and the next level's fc read the same feature: one product
  over the two matrices side by side (384 -> 370 us).

Fusing the attention over the committed rows into the loops, as the block's own part is,
gained nothing (379 against 373 us). A step whose catch-up has one row (after a rejection
at the first draft) and one with several have a graph each; the committed length is
dynamic. The server compiles the default shape at start-up (``Eagle.warm_up``, called by
``Engine.warm_up``); other shapes draft eager there, or compile at first use when the
passes are lazy (benchmarks, tests). Near the end of a request the draft is the compiled
tree's first ``budget`` nodes.

Measured speed (``benchmarks/eagle_sweep.py``)
----------------------------------------------
micro, 128 greedy tokens, measured speed-up over ``none`` (runs alternated, median of
5-7), 2 threads, compiled, the self-distilled head (below):

    depth/top_k/total    fresh prompt              repeating prompt
    3/1/4                1.12x (3.05 tokens/pass)  1.14x (3.28)
    4/1/5                1.19x (3.46)              1.14x (4.00)
    5/1/6                1.04x, 1.12x (3.88)       1.19x, 1.03x (4.27)
    6/1/7                1.34x, 1.29x (5.33)       1.18x, 1.18x (4.74)
    7/1/8                1.15x, 1.05x (5.33)       1.12x, 1.09x (5.12)
    8/1/9                1.17x (5.33)              1.19x (5.33)
    10/1/11              0.99x (5.33)              1.19x (6.10)
    3/3/8                0.79x (3.12)              0.83x (3.37)
    5/2/8                0.74x (3.88)              0.92x (4.41)
    6/2/10               0.94x (4.92)              0.90x (4.92)

Hence the defaults 6/1/7: best on the fresh prompt, level with the best on the repeating
one. Chains beat trees now that the head's top-1 is right ~85% of the time on the target's
own text: a tree's extra nodes rarely hold the accepted token and cost a wider graph and
more verification rows. Mind the spread: on the fresh prompt micro's greedy output falls
into a loop (``getattr(obj, '_is_instance', None) is not ...``), the head misses at about
the same place each time round, and a chain of 6 happens to fit the loop (5.33 tokens per
pass against 3.88 for a chain of 5); the earlier head (natural text only) gave 1.24x fresh
and 1.27x repeating at 6/1/7 in the same session. micro-layerskip's fresh output is not a
loop and its head is right less often there (17-23% acceptance): 4/1/5 0.67x, 6/1/7 0.48x,
3/3/8 0.60x; repeating 0.76x, 0.67x, 0.72x. EAGLE pays on this CPU only where the target's
text is predictable from its own features.

Files
-----
``<checkpoint_dir>/<model_name>-eagle.safetensors``: ``fc.weight`` (dim, 2·dim),
``fc.bias``, ``layer.*`` (a micro ``Block``), ``draft_vocab`` (N,) int64 target ids, most
frequent first; metadata ``config`` = the target's MicroConfig as JSON. Beside it,
``<model_name>-eagle.json``: the training record (command, minutes, steps, losses, held-out
top-1 accuracy by position, draft-step timings). Loaded once per model into
``env.shared["eagle_head"]``, cast to the target's dtype.

Training: ``nodraft train eagle --model micro --minutes 20`` (``drafters.eagle_train``).
The committed heads were trained in two stages, each record nesting the first's (``init``):
on the train split (``--minutes 40`` for micro, ``--minutes 15`` for micro-layerskip), then
on from those weights with half of every batch the target's own greedy continuations of
train-split prompts (``--init <model> --self-distill 0.5 --lr 3e-3``, 25 and 20 minutes;
``--threads 1`` throughout). Self-distillation moved the top-1 on the target's greedy
continuations of held-out prompts (the path drafted at run time; ``evaluate_head`` with
``greedy_rows``) from 0.84/0.83/0.82/0.82/0.82 to 0.85/0.84/0.84/0.83/0.83 at depths 1-5 for
micro and from 0.77/0.76/0.76/0.76/0.75 to 0.79/0.79/0.79/0.78/0.78 for micro-layerskip,
and cost at most 0.5 points on held-out text (0.57 -> 0.57 and 0.55 -> 0.55 at depth 1).
"""

from __future__ import annotations

import json
import math
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nodraft.drafters.base import Draft, DraftContext
from nodraft.drafters.registry import DrafterEnv, SpeculationError
from nodraft.micro.compiled import MIN_CONTEXT, OPTIONS
from nodraft.micro.model import Block, Micro, MicroConfig, additive_mask, apply_rope


def layer_macs(c: MicroConfig) -> int:
    return 4 * c.dim * c.dim + 3 * c.dim * c.ffn_dim


def forward_cost(c: MicroConfig, draft_vocab: int) -> float:
    """One forward of the EAGLE layer + fc's feature half + the N-way head, in passes."""
    return ((layer_macs(c) + c.dim * c.dim + draft_vocab * c.dim)
            / (c.n_layers * layer_macs(c) + c.vocab_size * c.dim))


# -- the head ---------------------------------------------------------------------------------
class EagleHead(nn.Module):
    """fc over [token embedding, feature], one micro decoder layer; the draft vocabulary.

    The embedding and the LM head are the target's (frozen, not stored here)."""

    def __init__(self, config: MicroConfig, draft_vocab: Tensor):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.dim, config.dim, bias=True)
        self.layer = Block(config)
        self.register_buffer("draft_vocab", draft_vocab.to(torch.long).clone())
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2) if name.endswith(("wo.weight", "w2.weight")) else 0.02
                nn.init.normal_(p, std=std)
        nn.init.zeros_(self.fc.bias)

    @classmethod
    def from_state(cls, config: MicroConfig, state: dict[str, Tensor]) -> "EagleHead":
        head = cls(config, state["draft_vocab"])
        head.load_state_dict(state)
        return head.eval().requires_grad_(False)

    def inputs(self, model: Micro, tokens: Tensor, feats: Tensor) -> Tensor:
        """fc(concat(embed(tokens), feats)): (..., dim)."""
        return self.fc(torch.cat([model.embed(tokens), feats], dim=-1))

    def draft_weight(self, model: Micro) -> Tensor:
        """The draft head: the target's tied embedding rows of the draft vocabulary (N, dim)."""
        return model.tok_embeddings.weight[self.draft_vocab]


def features(model: Micro, hidden: Tensor) -> Tensor:
    """EAGLE's feature: the final-normed hidden state (what the LM head reads)."""
    return model.norm(hidden)


def _layer_over_steps(block: Block, x: Tensor, cos: Tensor, sin: Tensor,
                      past: list[tuple[Tensor, Tensor]], mask: Tensor) -> tuple[Tensor, tuple]:
    """micro's Block on x (B, T, dim) whose queries also see the keys and values of earlier
    unrolled steps (``past``, each (B, H, T, D)); mask (T, (len(past)+1)·T) bool. Used to
    train and evaluate the head as it drafts (predicted features fed back); the drafter
    itself runs ``Block.forward`` with its KV cache (tests check the two agree)."""
    att, an, fn = block.attention, block.attention_norm, block.ffn_norm
    B, T, C = x.shape
    h = F.rms_norm(x, an.weight.shape, an.weight, an.eps)
    qkv = F.linear(h, att.wqkv.weight).view(B, T, 3, att.n_heads, att.head_dim)
    qkv = qkv.permute(2, 0, 3, 1, 4)
    q, k = apply_rope(qkv[:2], cos, sin).unbind(0)  # (B, H, T, D)
    v = qkv[2]
    keys = torch.cat([pk for pk, _ in past] + [k], dim=2)
    values = torch.cat([pv for _, pv in past] + [v], dim=2)
    y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    x = x + F.linear(y.transpose(1, 2).reshape(B, T, C), att.wo.weight)
    x = x + block.feed_forward.forward(F.rms_norm(x, fn.weight.shape, fn.weight, fn.eps))
    return x, (k, v)


def unroll_mask(T: int, step: int) -> Tensor:
    """(T, step·T) bool for unrolled step ``step`` (1-based): row p sees step 1's rows at
    positions <= p - step + 1 (real features) and, of each later step i, only its row at
    p - step + i -- the chain of its own predictions, as a tree node at depth step - 1 sees
    the committed rows and its ancestors."""
    p = torch.arange(T)[:, None]
    q = torch.arange(T)[None, :]
    parts = [q <= p - step + 1] + [q == p - step + i for i in range(2, step + 1)]
    return torch.cat(parts, dim=1)


def unroll(head: EagleHead, model: Micro, next_tokens: Tensor, feats: Tensor, steps: int,
           noise: float = 0.0) -> list[Tensor]:
    """Predicted features of ``steps`` unrolled draft steps, as at run time.

    next_tokens (B, T): token_{t+1} for rows t = 0..T-1; feats (B, T, dim): f_t.
    Step 1 reads the real features (plus uniform noise of width ``noise``); step j > 1 reads
    step j-1's prediction for its row (row p: step j-1's output of row p-1). Returns one
    (B, T, dim) tensor per step: out[j-1][:, p] predicts f_{p+1} after j-1 drafted tokens
    (rows p < j-1 have no valid input and are to be ignored)."""
    B, T, _ = feats.shape
    pos = torch.arange(T)
    cos, sin = model.rope_cos[pos][None, None], model.rope_sin[pos][None, None]
    past: list[tuple[Tensor, Tensor]] = []
    outs: list[Tensor] = []
    f_in = feats
    if noise:
        f_in = f_in + (torch.rand_like(f_in) - 0.5) * noise
    for j in range(1, steps + 1):
        if j > 1:
            f_in = torch.cat([feats[:, :1], outs[-1][:, :-1]], dim=1)
        x = head.inputs(model, next_tokens, f_in)
        mask = unroll_mask(T, j)
        out, kv = _layer_over_steps(head.layer, x, cos, sin, past, mask)
        past.append(kv)
        outs.append(out)
    return outs


@torch.no_grad()
def target_features(model: Micro, ids: Tensor) -> tuple[Tensor, Tensor]:
    """(features f (B, T, dim), the final layer's residual stream h (B, T, dim)) of ids."""
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    h = model.run_layers(model.embed(ids), pos, 0, model.config.n_layers)
    return features(model, h), h


@torch.no_grad()
def greedy_continue(model, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
    """The target's greedy continuation of each row of ``prompts`` (B, P) by ``n_new``
    tokens: (B, P + n_new). Batched, with a key/value cache of its own (micro's KVCache
    holds one row per slot); the same layers and arithmetic as ``Micro.forward``. For
    self-distillation (``drafters.eagle_train``) and evaluation on the target's own text."""
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

    ``rows`` (W, seq_len + 1) replaces the windows, e.g. ``greedy_rows``: the target's own
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
        f, h = target_features(model, x)
        greedy = model.head(h).argmax(-1)  # (B, T+1): the target's token after position t
        outs = unroll(head, model, x[:, 1:], f[:, :-1], depth)
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


# -- files ------------------------------------------------------------------------------------
def weights_path(directory: Path, model_name: str) -> Path:
    return Path(directory) / f"{model_name}-eagle.safetensors"


def save_head(head: EagleHead, model_name: str, directory: Path, record: dict) -> Path:
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
    path = weights_path(directory, model_name)
    save_file(state, path, metadata={"config": json.dumps(head.config.to_dict())})
    path.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    return path


def load_head_state(directory: Path, model_name: str) -> tuple[MicroConfig, dict[str, Tensor]]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = weights_path(directory, model_name)
    if not path.exists():
        raise SpeculationError(
            f"no EAGLE head for model {model_name!r} (looked for {path}); train one with "
            f"`nodraft train eagle --model {model_name}`", "speculation.method")
    with safe_open(str(path), "pt") as f:
        config = MicroConfig(**json.loads(f.metadata()["config"]))
    return config, load_file(str(path))


def write_untrained(model: Micro, model_name: str, directory: Path) -> Path:
    """Random, non-zero weights and a record, for tiny test models: real trees, real
    drafting, nothing learnt. The draft vocabulary is a random 3/4 of the target's, so the
    mapping back to target ids is exercised."""
    c = model.config
    gen = torch.Generator().manual_seed(c.dim * 7919 + c.vocab_size)
    vocab = torch.randperm(c.vocab_size, generator=gen)[:max(2, 3 * c.vocab_size // 4)]
    head = EagleHead(c, vocab)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() >= 2 else 0.1))
            if "norm" in name:
                p.add_(1.0)
    return save_head(head, model_name, directory, {"name": f"{model_name}-eagle",
                                                    "untrained": True})


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


def load_for(env: DrafterEnv) -> LoadedHead:
    """The head for env's model, loaded once and kept in ``env.shared``."""
    path = weights_path(env.checkpoint_dir, env.model_name)
    cached = env.shared.get("eagle_head")
    if cached is not None and cached.model is env.model and cached.path == path:
        return cached
    model = env.model
    config, state = load_head_state(env.checkpoint_dir, env.model_name)
    c = model.config
    if (config.dim, config.n_heads, config.ffn_dim) != (c.dim, c.n_heads, c.ffn_dim) \
            or int(state["draft_vocab"].max()) >= c.vocab_size:
        raise SpeculationError(
            f"the EAGLE head for {env.model_name!r} was trained for another model shape; "
            f"retrain it with `nodraft train eagle --model {env.model_name}`", "speculation.method")
    dtype = model.tok_embeddings.weight.dtype
    head = EagleHead.from_state(c, state).to(dtype)
    d = c.dim
    with torch.no_grad():
        w_tok, w_feat = head.fc.weight[:, :d], head.fc.weight[:, d:]
        tok_proj = (model.tok_embeddings.weight @ w_tok.T + head.fc.bias).contiguous()
        loaded = LoadedHead(model, path, head, tok_proj, tok_proj[head.draft_vocab].contiguous(),
                            w_feat.T.contiguous(), head.draft_weight(model).T.contiguous(),
                            forward_cost(c, int(head.draft_vocab.numel())))
    env.shared["eagle_head"] = loaded
    return loaded


@dataclass
class EagleState:
    """One sequence's draft KV cache and the features not yet in it."""

    k: Tensor  # (H, capacity, D)
    v: Tensor
    rows: int = 0  # committed rows: row t holds (token_{t+1}, f_t)
    pending: list[Tensor] = field(default_factory=list)  # pre-norm hidden rows from [rows, ...)
    pending_rows: int = 0
    root: Tensor | None = None  # f^_rows: the last committed row's output


class Eagle:
    name = "eagle"

    @dataclass(frozen=True)
    class Params:
        # chosen by measurement (``benchmarks/eagle_sweep.py``, see the module docstring):
        # with the compiled draft step a top-1 chain of 6 beat every tree on micro
        depth: int = 6  # tree levels = forwards of the EAGLE layer per step
        top_k: int = 1  # children per expanded node, and nodes expanded per level
        total_tokens: int = 7  # the current token + at most total_tokens - 1 draft nodes

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
    def _new_state(self, max_len: int) -> EagleState:
        c = self.loaded.model.config
        cap = max_len + self.params.depth * self.params.top_k
        k = torch.zeros(c.n_heads, cap, c.head_dim, dtype=self.loaded.w_draft_t.dtype)
        return EagleState(k, torch.zeros_like(k))

    def _state(self, ctx: DraftContext) -> EagleState:
        st = ctx.state.get("eagle")
        if st is None:
            st = ctx.state["eagle"] = self._new_state(ctx.cache.max_len)
        return st

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
        for T in (1, 3):
            cd.step(torch.zeros(T, c.dim, dtype=dtype), torch.zeros(T, dtype=torch.long), st,
                    start, p.depth, p.top_k, p.total_tokens - 1, 1.0, lazy=compile)
        return time.perf_counter() - t0

    # -- propose / observe --------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        p, L, m = self.params, self.loaded, ctx.model
        n = ctx.n_cached
        if n == 0 or budget < 1:
            return Draft.empty()  # a one-token prompt: no feature yet for the current token
        st = self._state(ctx)
        self._ingest(ctx, st)
        depth = min(p.depth, budget)
        inv_t = 1.0 / ctx.temperature if ctx.temperature >= 0.05 else 1.0
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
                               p.top_k, p.total_tokens - 1, inv_t)
                if done is not None:  # near the end of a request: its first ``budget`` nodes
                    return self._draft(*done, p.depth * L.cost_per_forward).prefix(budget)
            self._catch_up(ctx, st, h)

        def log_q(feats: Tensor) -> Tensor:  # draft log-probabilities over the draft vocab
            logits = feats @ L.w_draft_t
            return (logits if inv_t == 1.0 else logits * inv_t).log_softmax(-1)

        # level 1: the root's top_k children; they are the first frontier
        score, idx = log_q(st.root).topk(min(p.top_k, L.w_draft_t.shape[1]))
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
            c_score, c_idx = log_q(out).topk(min(p.top_k, L.w_draft_t.shape[1]), dim=-1)
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
        return self._rerank(tokens, scores, frontiers, min(p.total_tokens - 1, budget),
                            depth * L.cost_per_forward)

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
    def _draft(tokens: Tensor, parents: Tensor, cost: float) -> Draft:
        chain = bool((parents == torch.arange(-1, parents.numel() - 1)).all())
        return Draft(tokens, None if chain else parents, None, cost=cost)

    def observe(self, ctx: DraftContext, accepted: list[int]) -> None:
        if ctx.n_cached:
            self._ingest(ctx, self._state(ctx))


# -- the compiled draft step -------------------------------------------------------------------
class CompiledDraft:
    """A draft step -- the catch-up and the whole tree, rerank included -- as one
    ``torch.compile`` graph per tree shape (depth, top_k, kept nodes), for targets whose
    passes are compiled (``Micro.compile``). Eager, a step of the old default 3/3/8 tree is ~60
    small operations and took 1.47 ms of CPU time against 0.73 ms for the 8-row pass
    that verifies it; inductor fuses the norms, masks, rotations, softmaxes and top-k
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
        from nodraft.micro import gemm

        self.loaded, self.compiled = loaded, compiled  # compiled: the target's CompiledPasses
        self.mm = gemm.matmul(gemm.choose(compiled.gemm))
        with torch.no_grad():
            self.wt = {name: p.t().contiguous()
                       for name, p in loaded.head.layer.named_parameters() if p.dim() == 2}
        self._fns: dict[tuple, object] = {}
        self._ready: set[tuple] = set()
        self._inv_t: dict[tuple, Tensor] = {}  # 1 / temperature as a graph input, by value
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

    def _core(self, depth: int, top_k: int, keep: int):
        from nodraft.micro.compiled import named_code

        return named_code(_make_draft_core(self.loaded, self.wt, self.mm, depth, top_k, keep),
                          f"eagle_draft_{depth}_{top_k}_{keep}")

    def _fn(self, depth: int, top_k: int, keep: int):
        key = (depth, top_k, keep)
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = torch.compile(self._core(depth, top_k, keep), fullgraph=True,
                                                options=DRAFT_OPTIONS)
        return fn

    def step(self, h: Tensor, next_tokens: Tensor, st: "EagleState", a: int,
             depth: int, top_k: int, keep: int, inv_t: float, lazy: bool | None = None
             ) -> tuple[Tensor, Tensor] | None:
        """Rows [a, a + T) of the draft cache from the target's pre-norm hidden rows h
        (T, dim) and the tokens after them, then the tree. Returns (draft token ids, parent
        indices) with the catch-up's keys and values written and ``st`` advanced; None when
        this shape is not compiled yet (the caller drafts eager)."""
        T = h.shape[0]
        # views into a longer tensor carry a storage offset, which dynamo guards on: inputs
        # start at offset 0 always, as the warm-up's do, so no request recompiles the graph
        h = h.clone() if h.storage_offset() else h
        next_tokens = next_tokens.clone() if next_tokens.storage_offset() else next_tokens
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
        scale = self._inv_t.get((inv_t, h.dtype))
        if scale is None:
            scale = torch.tensor(inv_t, dtype=h.dtype)
            if len(self._inv_t) < 64:  # requests' temperatures are few; do not grow unbounded
                self._inv_t[(inv_t, h.dtype)] = scale
        args = (h, next_tokens, pos, k_past, v_past, mask, scale)
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
            tokens, parents, root, k_new, v_new = got
        else:
            tokens, parents, root, k_new, v_new = self._fn(depth, top_k, keep)(*args)
        if fresh:
            self._ready.add(shape)
        st.k[:, a:a + T] = k_new
        st.v[:, a:a + T] = v_new
        st.rows, st.root = a + T, root
        return tokens, parents


# The target's options, and C++ in place of the Python wrapper around the graph's kernels:
# a draft step is many small kernels (a 6-level chain: ~90), and the wrapper's per-kernel
# Python was a quarter of its time (one thread, 100 committed rows, the same process: a
# 6-level chain 588 -> 437 us, the 3/3/8 tree 442 -> 355 us). For the target's passes it
# made no clear difference (micro.compiled.OPTIONS).
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
                 v_past: Tensor, mask: Tensor | None):
        """Rows (token_{t+1}, f_t) for the T new committed positions."""
        f = F.rms_norm(h, norm.weight.shape, norm.weight, norm.eps)
        x = tok_proj[next_tokens] + mm(f, w_feat_t)
        cos, sin = cos_t[pos][:, None, None], sin_t[pos][:, None, None]
        return attend_layer(x, cos, sin, k_past, v_past, mask, w, mm)

    def chain(h: Tensor, next_tokens: Tensor, pos: Tensor, k_past: Tensor, v_past: Tensor,
              mask: Tensor | None, inv_t: Tensor):
        """top_k = 1: each level's one node is its parent's argmax (the temperature does
        not move an argmax), and the kept nodes are the chain's first ``keep``."""
        out, k_blk, v_blk = catch_up(h, next_tokens, pos, k_past, v_past, mask)
        T = h.shape[0]
        root = out[-1:]
        y = mm(root, w_next)  # the root's draft logits and the next level's feature half
        idx = y[:, :N].argmax(-1)  # (1,)
        tokens = [idx]
        for level in range(2, keep + 1):
            x = tok_proj_draft[idx] + y[:, N:]
            at = pos[-1:] + (level - 1)
            c, s = cos_t[at][:, None, None], sin_t[at][:, None, None]
            # one row that sees every row before it: no mask
            f_feat, k_l, v_l = attend_layer(x, c, s, k_past, v_past, None, w, mm, k_blk, v_blk)
            k_blk, v_blk = torch.cat([k_blk, k_l], dim=1), torch.cat([v_blk, v_l], dim=1)
            y = mm(f_feat, w_next if level < keep else w_draft_t)
            idx = y[:, :N].argmax(-1)
            tokens.append(idx)
        parents = torch.arange(-1, keep - 1)
        return vocab[torch.cat(tokens)], parents, root[0], k_blk[:, :T], v_blk[:, :T]

    def core(h: Tensor, next_tokens: Tensor, pos: Tensor, k_past: Tensor, v_past: Tensor,
             mask: Tensor | None, inv_t: Tensor):
        out, k_blk, v_blk = catch_up(h, next_tokens, pos, k_past, v_past, mask)
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
