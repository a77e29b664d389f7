"""`num_draft_tokens="auto"` in steady state: one `auto` drafter serving many requests, each
a fresh batch of prompts, interleaved with mmspec's plain decoding and a fixed K.

`mmspec bench core` times a handful of rounds on one prompt batch per row, so on a VM whose
requests vary by +-15% from one to the next (seen on a 2-core Intel Xeon VM in session 32) a
row's ratio is mostly noise, and its first rounds include the controller's exploration. Here
each call decodes a new batch (prompt lengths 12-32, 48 new tokens, greedy), the three arms run
back to back in alternating order, and the report gives total-time ratios over the calls after
`--skip` (the controller lives on the drafter, so its estimates carry over from call to call),
plus the K histogram of `auto`'s steps.

    python benchmarks/auto_steady.py --pair weak --batch 4 --calls 14 [--fixed-k 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch


def main() -> None:
    import mmspec
    from mmspec.bench.core import _prompts
    from mmspec.bench.draft_length import PAIRS, named_pair
    from mmspec.drafters import ModelDrafter, NullDrafter
    from mmspec.models.hf_target import HFTarget

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default="weak", choices=sorted(PAIRS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--calls", type=int, default=14)
    p.add_argument("--skip", type=int, default=2, help="calls left out of the totals (the controller's warm-up)")
    p.add_argument("--fixed-k", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    pc, target, drafter = named_pair(a.pair)
    wrapped = HFTarget(target)  # built once: the kernel choice and the wrap are paid once
    auto = ModelDrafter(drafter, "auto", max_draft_tokens=8)
    fixed = f"K={a.fixed_k}"
    arms = {"plain": lambda: NullDrafter(pc.vocab_size), fixed: lambda: ModelDrafter(drafter, a.fixed_k),
            "auto": lambda: auto}
    calls, totals, steps = [], collections.defaultdict(float), collections.Counter()
    print(f"pair {a.pair}, batch {a.batch}, kernels {wrapped.kernels}")
    for c in range(a.calls):
        ids, mask = _prompts(a.batch, (12, 32), pc.vocab_size, seed=1000 + c)
        order = list(arms) if c % 2 == 0 else list(arms)[::-1]
        seconds, outs = {}, {}
        for name in order:
            t0 = time.perf_counter()
            outs[name] = mmspec.speculative_generate(wrapped, arms[name](), ids, mask, temperature=0,
                                                     max_new_tokens=a.max_new_tokens, pad_token_id=0)
            seconds[name] = time.perf_counter() - t0
        same = all(torch.equal(o.sequences, outs["plain"].sequences) for o in outs.values())
        hist = collections.Counter(outs["auto"].stats.nodes_per_step)
        if c >= a.skip:
            for k, v in seconds.items():
                totals[k] += v
            steps.update(hist)
        calls.append({"seconds": {k: round(v, 4) for k, v in seconds.items()}, "auto_k": dict(sorted(hist.items())),
                      "identical": same})
        print(f"call {c}: " + "  ".join(f"{k} {v * 1e3:.0f} ms" for k, v in seconds.items())
              + f"  auto/plain {seconds['plain'] / seconds['auto']:.3f}  auto K {dict(sorted(hist.items()))}"
              + ("" if same else "  OUTPUTS DIFFER"))
    summary = {"auto_vs_plain": round(totals["plain"] / totals["auto"], 3),
               f"{fixed}_vs_plain": round(totals["plain"] / totals[fixed], 3),
               f"auto_vs_{fixed}": round(totals[fixed] / totals["auto"], 3),
               "auto_k_steps": dict(sorted(steps.items())), "calls_counted": a.calls - a.skip}
    print(f"calls {a.skip}..{a.calls - 1}: " + "  ".join(f"{k} {v}" for k, v in summary.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "kernels": wrapped.kernels, "summary": summary, "calls": calls}, f, indent=1)


if __name__ == "__main__":
    main()
