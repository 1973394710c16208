"""The packed pass's attention for one-row blocks, and the alternatives to it, in one run.

    python benchmarks/packed_attention.py [--slots 32] [--min-context 13] [--max-context 181]
                                          [--threads 1] [--repeats 30] [--out FILE.json]

Under load most sequences carry one row (their current token), and ``forward_packed``
attends for all of them in one SDPA call: a batch over their slots, keys read up to the
longest context, a boolean mask hiding each slot's rows past its own. Measured here per
layer, over ``--slots`` caches of micro's shape with contexts drawn between the two bounds
(every layer's cache distinct, so keys and values come from memory as in a pass):

- ``padded``: that call (what the engine does);
- ``buckets-N``: slots sorted by context and split in N groups, each padded to its own
  longest (its slots' rows gathered);
- ``compiled``: scores and weighted values as element-wise products and sums, compiled by
  inductor (dynamic shapes), padded as the first;
- ``graph``: what the compiled packed pass did before ``nodraft::attend`` (and does where
  nodraft's kernels do not load): batched products against every slot's rows up to the
  longest context, an additive mask, the softmax, compiled by inductor (dynamic shapes);
- ``kernel``: ``nodraft::attend`` (micro/csrc/attend.cpp), each slot reading its own rows
  only (where nodraft's kernels load); ``kernel, 4 KiB pages``: the same over a copy of
  the caches on ordinary pages (every other variant reads caches allocated as the
  engine's, ``micro.model.zeros_on_huge_pages``);
- ``per-sequence``: one unpadded SDPA call per slot.

Every variant is checked against ``padded``. The variants alternate, pass after pass
(``--repeats`` passes of the 4 layers each); the median per layer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from nodraft.micro import gemm
from nodraft.micro.model import MicroConfig, zeros_on_huge_pages


def variants(q, ks, vs, ctxs):
    """name -> function(layer) giving (B, H, 1, D)."""
    B, H, _, D = q.shape
    cmax = max(ctxs)
    lens = torch.tensor(ctxs)
    mask = (torch.arange(cmax)[None, :] < lens[:, None])[:, None, None, :]  # (B, 1, 1, cmax)
    additive = torch.zeros(B, 1, cmax).masked_fill(~mask[:, :, 0], float("-inf"))
    scale = D ** -0.5

    def padded(l):
        return F.scaled_dot_product_attention(q, ks[l][:, :, :cmax], vs[l][:, :, :cmax],
                                              attn_mask=mask)

    def bucketed(n):
        order = sorted(range(B), key=lambda b: ctxs[b])
        groups = []
        for g in (order[i * B // n:(i + 1) * B // n] for i in range(n)):
            c = max(ctxs[b] for b in g)
            m = (torch.arange(c)[None, :] < torch.tensor([ctxs[b] for b in g])[:, None])
            groups.append((torch.tensor(g), c, m[:, None, None, :]))

        def f(l):
            out = torch.empty(B, H, 1, D)
            for idx, c, m in groups:
                k = ks[l][:, :, :c].index_select(0, idx)
                v = vs[l][:, :, :c].index_select(0, idx)
                out[idx] = F.scaled_dot_product_attention(q[idx], k, v, attn_mask=m)
            return out
        return f

    def products(qq, k, v, am):
        p = ((qq * k).sum(-1) * scale + am).softmax(-1)  # (B, H, ctx)
        return (p[..., None] * v).sum(-2)

    compiled_products = torch.compile(products, dynamic=True)

    def compiled(l):
        return compiled_products(q, ks[l][:, :, :cmax], vs[l][:, :, :cmax], additive)[:, :, None]

    def per_sequence(l):
        out = torch.empty(B, H, 1, D)
        for b, c in enumerate(ctxs):
            out[b] = F.scaled_dot_product_attention(q[b], ks[l][b, :, :c], vs[l][b, :, :c])
        return out

    def masked(qq, k, v, am):  # the packed graph's own form (micro/compiled.py)
        p = (torch.matmul(qq, k.transpose(-1, -2)) * scale + am[:, None]).softmax(-1)
        return torch.matmul(p, v)

    compiled_masked = torch.compile(masked, dynamic=True)

    def graph(l):
        return compiled_masked(q, ks[l][:, :, :cmax], vs[l][:, :, :cmax], additive)

    out = {"padded": padded, "buckets-2": bucketed(2), "buckets-4": bucketed(4),
           "compiled": compiled, "graph": graph, "per-sequence": per_sequence}
    if gemm.load():
        # the kernel's own row is the query's last cached one: a slot of length c attends
        # over c - 1 rows, then that row as its own
        q3, src, starts = q[:, :, 0], torch.arange(B), lens - 1
        last = torch.arange(B)

        def kernel(l):
            k_self, v_self = ks[l][last, :, starts], vs[l][last, :, starts]
            return torch.ops.nodraft.attend.default(q3, k_self, v_self, ks[l], vs[l], src,
                                                    starts, scale)[:, :, None]

        out["kernel"] = kernel
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--min-context", type=int, default=13)
    p.add_argument("--max-context", type=int, default=181)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    c = MicroConfig()
    H, D, L = c.n_heads, c.head_dim, c.n_layers
    shape = (args.slots, H, c.max_positions, D)
    # allocated as the engine's cache is (huge pages where the system gives them); a copy
    # on ordinary pages for the kernel's second row
    ks = [zeros_on_huge_pages(shape, torch.float32).normal_() for _ in range(L)]
    vs = [zeros_on_huge_pages(shape, torch.float32).normal_() for _ in range(L)]
    small = ([x.clone() for x in ks], [x.clone() for x in vs])
    ctxs = torch.randint(args.min_context, args.max_context + 1, (args.slots,)).tolist()
    q = torch.randn(args.slots, H, 1, D)
    with torch.inference_mode():
        fns = variants(q, ks, vs, ctxs)
        if "kernel" in fns:
            fns["kernel, 4 KiB pages"] = variants(q, *small, ctxs)["kernel"]
        want = fns["padded"](0)
        times = {name: [] for name in fns}
        for name, f in fns.items():
            torch.testing.assert_close(f(0), want, rtol=1e-4, atol=1e-4)
        for _ in range(args.repeats):
            for name, f in fns.items():
                t0 = time.perf_counter()
                for layer in range(L):
                    f(layer)
                times[name].append((time.perf_counter() - t0) / L)
        rows = [{"variant": name, "us_per_layer": 1e6 * statistics.median(t),
                 "spread_us": [1e6 * min(t), 1e6 * max(t)]} for name, t in times.items()]
    base = rows[0]["us_per_layer"]
    for r in rows:
        r["x_padded"] = r["us_per_layer"] / base
    result = {"command": "python benchmarks/packed_attention.py " + " ".join(argv or sys.argv[1:]),
              "slots": args.slots, "contexts": ctxs, "threads": args.threads, "rows": rows}
    print(f"Command: `{result['command']}` ({args.slots} slots, contexts "
          f"{min(ctxs)}-{max(ctxs)}: {sum(ctxs)} rows, {args.slots * max(ctxs)} padded)\n")
    print("| variant | us per layer (min-max) | x padded |\n|---|---|---|")
    for r in rows:
        lo, hi = r["spread_us"]
        print(f"| {r['variant']} | {r['us_per_layer']:.0f} ({lo:.0f}-{hi:.0f}) | "
              f"{r['x_padded']:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
