"""Peak memory of a run whose EOS comes after a few tokens, with a huge `max_new_tokens` cap:
mmspec (cache grows in chunks) against plain transformers `generate`, each in a fresh
process (peak RSS, Linux `ru_maxrss`), on the bench pair's target.

    python benchmarks/memory.py [--max-new-tokens 300000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import resource, sys, json, torch
torch.set_num_threads(1)
from mmspec.bench.pair import PairConfig, build_pair
target, drafter = build_pair(PairConfig())
ids = torch.randint(3, 2000, (1, 16), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    first = target.generate(input_ids=ids, do_sample=False, max_new_tokens=4, min_new_tokens=4, pad_token_id=0)
eos = int(first[0, -1])  # greedy decoding emits this as its 4th token: the run ends there
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
N = int(sys.argv[2])
if sys.argv[1] == "plain":
    with torch.no_grad():
        out = target.generate(input_ids=ids, do_sample=False, max_new_tokens=N, eos_token_id=eos, pad_token_id=0)
    n = out.shape[1] - ids.shape[1]
else:
    import mmspec, mmspec.models
    from mmspec.drafters import ModelDrafter
    pre = "auto" if sys.argv[1] == "mmspec" else False
    out = mmspec.speculative_generate(mmspec.models.HFTarget(target, prepack=pre), ModelDrafter(drafter, 4, prepack=pre),
                                      ids, temperature=0, max_new_tokens=N, eos_token_id=eos)
    n = out.stats.new_tokens[0]
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"new_tokens": n, "peak_mib": peak / 1024, "extra_mib": (peak - base) / 1024}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=300_000)
    args = ap.parse_args()
    res = {}
    for method in ("plain", "mmspec", "mmspec-stock-kernels"):
        out = subprocess.run([sys.executable, "-c", CHILD, method, str(args.max_new_tokens)],
                             capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        res[method] = json.loads(out)
        print(method, res[method])
    for m in ("mmspec", "mmspec-stock-kernels"):
        why = " (the prepacked kernels keep a packed copy of the linear weights)" if m == "mmspec" else ""
        print(f"peak RSS {m} / plain generate: {res[m]['peak_mib'] / res['plain']['peak_mib']:.2f}x; "
              f"memory added by the run: {res[m]['extra_mib']:.1f} MiB vs {res['plain']['extra_mib']:.1f} MiB{why}")


if __name__ == "__main__":
    main()
