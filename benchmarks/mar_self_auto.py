"""`draft="self", num_draft_steps="auto"` in steady state: one pipeline serving many requests
(fresh class labels and seeds), interleaved with plain sampling and a fixed K.

`mmspec bench mar` times a few rounds of a few requests, too few for a per-request choice to
finish its warm-up (one cold request per batch size, then each of K = 0..4 once). Here the three
arms (plain, fixed K, auto) take turns request by request, in alternating order, and the report
gives total-time ratios over the requests after `--skip`, plus the K `auto` ran.

    python benchmarks/mar_self_auto.py --batch 8 --calls 24 [--fixed-k 3] [--num-iter 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch


def main() -> None:
    from mmspec.pipelines.mar_cli import BUNDLED_MAR, load_mar

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(BUNDLED_MAR))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--calls", type=int, default=24)
    p.add_argument("--skip", type=int, default=8, help="requests left out of the totals (auto's warm-up)")
    p.add_argument("--fixed-k", type=int, default=3)
    p.add_argument("--num-iter", type=int, default=64)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    pipe = load_mar(a.model).to(torch.float32)
    pipe.set_progress_bar_config(disable=True)
    n_cls = pipe.transformer.config.class_num
    common = dict(num_iter=a.num_iter, guidance_scale=3.0, temperature=0.7, output_type="latent")
    fixed = f"K={a.fixed_k}"
    arms = {"plain": dict(speculative=False), fixed: dict(draft="self", num_draft_steps=a.fixed_k),
            "auto": dict(draft="self", num_draft_steps="auto")}
    totals, ks, calls = collections.defaultdict(float), collections.Counter(), []
    for c in range(a.calls):
        labels = [(c * a.batch + j) % n_cls for j in range(a.batch)]
        order = list(arms) if c % 2 == 0 else list(arms)[::-1]
        secs, k = {}, None
        for name in order:
            t0 = time.perf_counter()
            out = pipe(labels, generator=torch.Generator().manual_seed(1000 + c), **common, **arms[name])
            secs[name] = time.perf_counter() - t0
            if name == "auto":
                k = out.stats.draft_steps
        calls.append({"seconds": secs, "auto_k": k})
        if c >= a.skip:
            for name, s in secs.items():
                totals[name] += s
            ks[k] += 1
        print(f"call {c}: auto K={k} " + " ".join(f"{n} {s:.2f}s" for n, s in secs.items()), flush=True)
    report = {"batch": a.batch, "num_iter": a.num_iter, "calls": a.calls, "skip": a.skip,
              "totals_s": dict(totals), "auto_vs_plain": totals["plain"] / totals["auto"],
              f"auto_vs_{fixed}": totals[fixed] / totals["auto"], f"{fixed}_vs_plain": totals["plain"] / totals[fixed],
              "auto_k_counted": dict(ks), "per_call": calls}
    print(f"batch {a.batch}, {a.calls - a.skip} counted requests: auto {report['auto_vs_plain']:.3f}x plain, "
          f"{report[f'auto_vs_{fixed}']:.3f}x {fixed}; {fixed} {report[f'{fixed}_vs_plain']:.3f}x plain; auto ran K {dict(ks)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
