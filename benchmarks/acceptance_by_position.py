"""Conditional acceptance per draft position of a bench pair: for each fixed K, over the three
prompt sets of `mmspec bench core`, P(draft i accepted | drafts 1..i-1 accepted) and the mean
tokens per step. Timing-free: what `auto`'s acceptance model (mmspec/adaptive.py: untried
positions borrow the pooled rate of the tried ones, a geometric tail) assumes about the pair.

Session 49 (`python benchmarks/acceptance_by_position.py weak 1`, then `bench 1`): the 47% pair
reads 0.35-0.40 / 0.35-0.36 / 0.08 at positions 1-3 (K = 2: 1.53 tokens a step), the 69% pair
0.69-0.73 / 0.74-0.79 / 0.70-0.73 / 0.84-0.88 (K = 4: 2.94): close to geometric on both, so
judging the next position for free after fully accepted steps (tried that session) added
nothing the drift toward the pooled rate did not already give.

    python benchmarks/acceptance_by_position.py PAIR BATCH      (PAIR: weak, bench or strong)
"""
import sys

import torch

import mmspec
from mmspec.bench.core import _prompts
from mmspec.bench.draft_length import named_pair
from mmspec.drafters import ModelDrafter
from mmspec.models.hf_target import HFTarget
from mmspec.stats import SpecStats

if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
    sys.exit(__doc__)
pair, B = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(2)
pc, target, drafter = named_pair(pair)
t = HFTarget(target)
for K in (1, 2, 3, 4, 6):
    d = ModelDrafter(drafter, K)
    total = SpecStats()  # the three calls' counts summed: SpecStats.acceptance_rate_per_position over all
    for j in range(3):
        ids, mask = _prompts(B, (12, 32), pc.vocab_size, seed=B + 1000 * j)
        s = mmspec.speculative_generate(t, d, ids, mask, temperature=0, max_new_tokens=48, pad_token_id=0).stats
        total.row_steps += s.row_steps
        total.emitted_tokens += s.emitted_tokens
        for name in ("accept_counts", "offer_counts"):  # [i]: row-steps per position
            counts = getattr(s, name) + [0] * (K - len(getattr(s, name)))
            setattr(total, name, [a + b for a, b in zip(getattr(total, name) or [0] * K, counts)])
    rates = [round(r, 3) for r in total.acceptance_rate_per_position]
    print(f"K={K}: conditional acceptance by position {rates}, tokens a step {total.mean_accepted_length:.3f}")
