"""Trace `auto` on one bench cell: per request the K it drafted, then its cost estimates per shape
(with the readings behind each), per-position acceptance and the rates it ranks K by.

Session 46 on the 2-core Xeon VM (`python benchmarks/trace_auto_estimates.py bench 1 8`): after K = 4
took over, its 1-row verify of 5 tokens fell from 32.6 to 25.9 ms over four requests (the VM sped up)
while the shapes of K = 2 and 3, last read in the slower phase, kept 37.6 and 39.1 ms; the ranking
put K = 3 at 0.62 of K = 4. Estimates of shapes read at different times carry the machine's phase
of that time (docs/adaptive.md).

    python benchmarks/trace_auto_estimates.py PAIR BATCH CALLS      (PAIR: weak, bench or strong)
"""
import math, sys, torch, mmspec
from mmspec.bench.core import _prompts
from mmspec.bench.draft_length import named_pair
from mmspec.drafters import ModelDrafter
from mmspec.models.hf_target import HFTarget
torch.set_num_threads(2)
if len(sys.argv) != 4 or sys.argv[1] in ("-h", "--help"):
    sys.exit(__doc__)
pair, B, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
pc, target, drafter = named_pair(pair)
w = HFTarget(target)
auto = ModelDrafter(drafter, "auto", max_draft_tokens=8)
c = auto.controller
for i in range(calls):
    ids, mask = _prompts(B, (12, 32), pc.vocab_size, seed=B + 1000 * (i % 3))
    out = mmspec.speculative_generate(w, auto, ids, mask, temperature=0, max_new_tokens=48, pad_token_id=0)
    ks = out.stats.nodes_per_step
    ms = 1e3 * math.exp(c.log_phase)  # the estimates are kept in the units of phase 0: ms now
    v = {q: (round(c.verify.estimate((B, q), B * q) * ms, 1), c.verify.counts.get((B, q), 0)) for q in range(1, 8)}
    d = {k: (round((c.draft.estimate((B, k), B * k) or 0) * ms, 1), c.draft.counts.get((B, k), 0)) for k in range(1, 7)}
    rates = c._rates(B, None)
    best = max(r for r in rates.values() if r)
    print(i, "K", ks, f"\n   speed phase {math.exp(-c.log_phase):.3f}", "\n   verify", v, "\n   draft", d, "\n   acc", [round(a, 2) for a in c.acceptance()[:6]],
          "\n   rel rate", {k: round(r / best, 3) for k, r in rates.items() if r and k <= 6}, flush=True)
