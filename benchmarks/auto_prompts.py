"""`num_draft_tokens="auto"` against every fixed K at batch 1, over several prompts.

`mmspec bench core` measures batch 1 on one prompt. With greedy decoding the tokens a drafter
gets accepted are a fixed property of that prompt, so the best fixed K "in hindsight" profits
from where that one prompt's accepted runs happen to end (for a 48-token request, K = 4 and
K = 5 may need the same number of steps, and then the shorter chain wins by its cheaper steps),
which no rule choosing K from past steps can know. This script runs each method on several
prompts (interleaved rounds, median per prompt) and compares `auto` with the best fixed K per
prompt and over the whole set, which is what a workload sees.

    python benchmarks/auto_prompts.py [--pair bench] [--prompts 8] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    import mmspec
    from mmspec.bench.draft_length import PAIRS, _prompts, named_pair
    from mmspec.drafters import ModelDrafter
    from mmspec.models.hf_target import HFTarget

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default="bench", choices=sorted(PAIRS))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--fixed-k", default="3,4,5,6")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    pc, target, drafter = named_pair(a.pair)
    wrapped = HFTarget(target)
    prompts = [_prompts(1, (12, 32), pc.vocab_size, seed=s) for s in range(1, a.prompts + 1)]
    methods = {f"K={k}": ModelDrafter(drafter, int(k)) for k in a.fixed_k.split(",")}
    methods["auto"] = ModelDrafter(drafter, "auto", max_draft_tokens=6)
    plain_ref = {}

    def run(name, i):
        ids, mask = prompts[i]
        t0 = time.perf_counter()
        out = mmspec.speculative_generate(wrapped, methods[name], ids, mask, temperature=0,
                                          max_new_tokens=a.max_new_tokens, pad_token_id=0)
        seconds = time.perf_counter() - t0
        ref = plain_ref.setdefault(i, target.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                                      max_new_tokens=a.max_new_tokens, pad_token_id=0))
        if not torch.equal(out.sequences, ref):
            raise SystemExit(f"{name} on prompt {i + 1} differs from plain greedy decoding")
        return seconds

    for name in methods:  # warm-up (also the controller's first request)
        run(name, 0)
    times = {name: [[] for _ in prompts] for name in methods}
    for r in range(a.rounds):
        for i in range(len(prompts)):
            order = list(methods) if (r + i) % 2 == 0 else list(reversed(methods))
            for name in order:
                times[name][i].append(run(name, i))
    med = {name: [sorted(v)[len(v) // 2] for v in per] for name, per in times.items()}
    fixed = [n for n in methods if n != "auto"]
    rows = []
    for i in range(len(prompts)):
        best = min(fixed, key=lambda n: med[n][i])
        rows.append({"prompt": i + 1, "seconds": {n: round(med[n][i], 4) for n in methods}, "best_fixed": best,
                     "auto_vs_best_fixed": round(med[best][i] / med["auto"][i], 3)})
        print(f"prompt {i + 1}: " + "  ".join(f"{n} {med[n][i] * 1e3:6.1f} ms" for n in methods)
              + f"  | best {best}, auto/best {rows[-1]['auto_vs_best_fixed']:.3f}")
    total = {n: sum(v) for n, v in med.items()}
    best = min(fixed, key=total.get)
    summary = {"best_fixed": best, "auto_vs_best_fixed": round(total[best] / total["auto"], 3),
               "per_prompt_range": [min(r["auto_vs_best_fixed"] for r in rows), max(r["auto_vs_best_fixed"] for r in rows)],
               "seconds": {n: round(v, 4) for n, v in total.items()}}
    print(f"all {len(prompts)} prompts: " + "  ".join(f"{n} {v * 1e3:.0f} ms" for n, v in total.items())
          + f"  | best fixed {best}, auto/best {summary['auto_vs_best_fixed']:.3f}; every output identical to plain greedy")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": vars(a), "rows": rows, "summary": summary}, f, indent=2)


if __name__ == "__main__":
    main()
