"""An A/A test of `mmspec bench core`'s harness: two copies of mmspec's plain decoding and two of
`auto` beside plain `generate` and fixed K = 1..6, run through the bench's own `_interleaved`
(balanced order) and `_cycling` (three prompt sets), so that the gap between `auto` and plain
decoding in cells where `auto` decodes plainly can be told from the harness's noise: copies of
one method should read 1.0x each other.

    python benchmarks/bench_harness_aa.py --pair weak --batch 16 --rounds 9

Session 53 (the 2-core Xeon VM, the 47% pair at batch 16, 9 rounds, `auto` all-plain): both `auto`
copies 0.934-0.963x the speed of both plain copies, the plain copies 1.007x each other, the `auto`
copies 0.977x (docs/results_adaptive.md, session 53).
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch


def main() -> None:
    import mmspec
    from mmspec.bench.core import _cycling, _interleaved, _prompts
    from mmspec.bench.draft_length import PAIRS, named_pair
    from mmspec.drafters import ModelDrafter, NullDrafter
    from mmspec.models.hf_target import HFTarget
    from mmspec.models.prepack import maybe_packed

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", choices=sorted(PAIRS), default="weak")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    if a.rounds < 2:
        p.error("--rounds must be >= 2")
    torch.set_num_threads(a.threads)
    pc, target, drafter = named_pair(a.pair)
    t, gen = HFTarget(target), maybe_packed(target)
    sets = [_prompts(a.batch, (12, 32), pc.vocab_size, seed=a.batch + 1000 * j) for j in range(3)]
    fns = {"plain": lambda j: gen.generate(input_ids=sets[j][0], attention_mask=sets[j][1], do_sample=False,
                                           max_new_tokens=48, pad_token_id=0)}
    for name in ("mmspec plain", "mmspec plain 2"):
        fns[name] = lambda j: mmspec.speculative_generate(t, NullDrafter(pc.vocab_size), *sets[j], temperature=0,
                                                          max_new_tokens=48, pad_token_id=0)
    drafters = {f"K={k}": ModelDrafter(drafter, k) for k in range(1, 7)}
    drafters["auto"] = ModelDrafter(drafter, "auto", max_draft_tokens=8)
    drafters["auto 2"] = ModelDrafter(drafter, "auto", max_draft_tokens=8)
    for name, d in drafters.items():
        fns[name] = lambda j, d=d: mmspec.speculative_generate(t, d, *sets[j], temperature=0, max_new_tokens=48,
                                                               pad_token_id=0)
    methods = {name: _cycling(fn, 3) for name, fn in fns.items()}
    rounds: dict = {}
    _interleaved(methods, a.rounds, rounds, order="balanced")

    def speed(x: str, y: str) -> str:  # speed of x over y: geometric mean of paired rounds, ~95% interval
        logs = [math.log(ty / tx) for tx, ty in zip(rounds[x], rounds[y])]
        m, se = statistics.mean(logs), statistics.stdev(logs) / math.sqrt(len(logs))
        return f"{math.exp(m):.3f} [{math.exp(m - 1.96 * se):.3f}-{math.exp(m + 1.96 * se):.3f}]"

    for x, y in (("auto", "mmspec plain"), ("auto 2", "mmspec plain"), ("auto", "mmspec plain 2"),
                 ("auto 2", "mmspec plain 2"), ("mmspec plain 2", "mmspec plain"), ("auto 2", "auto"),
                 ("mmspec plain", "plain")):
        print(f"speed {x} / {y}: {speed(x, y)}")
    for name in ("auto", "auto 2"):
        outs = methods[name].outs
        print(f"{name}: drafting steps in the last call of each prompt set",
              [sum(k > 0 for k in outs[j].stats.nodes_per_step) for j in sorted(outs)])


if __name__ == "__main__":
    main()
