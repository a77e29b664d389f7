"""What `num_draft_tokens="auto"` pays where speculation and plain decoding tie.

On the weak bench pair (47% greedy agreement) at batch 4 fixed K = 1 runs about as fast as plain
decoding, so whichever the controller picks is right, and what `auto` gives up is the probing that
keeps checking. This script times, in one process, interleaved in a fresh random order each round:
mmspec's plain decoding (`NullDrafter`), `auto`, `auto` with its choice pinned to K = 0 (the same
drafter object and loop, never drafting: the cost of the adaptive path itself), and fixed K = 1.
It prints each method's time against mmspec's plain decoding as a geometric mean of paired
per-round ratios with a 90% interval (Student t), and how many steps of each `auto` call drafted.
`--with-others` also interleaves fixed K = 6 and transformers' plain `generate`, as the full bench
does, to see whether what runs in between changes the figures. `--no-shadow` adds `auto` whose
probes from plain decoding draft and verify as before session 53 instead of reading greedy
acceptance off the plain stretch (mmspec/shadow_acceptance.py), and prints the paired ratio of
the two.

    python benchmarks/auto_near_tie.py --pair weak --batch 4 --rounds 12 [--with-others] [--no-shadow] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

import torch


def paired(a: list[float], b: list[float]) -> list[float]:
    """Geometric mean of a / b over paired rounds, with a 90% Student t interval."""
    from scipy import stats

    logs = [math.log(x / y) for x, y in zip(a, b)]
    m = statistics.mean(logs)
    half = stats.t.ppf(0.95, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return [round(math.exp(m), 3), round(math.exp(m - half), 3), round(math.exp(m + half), 3)]


def main() -> None:
    import mmspec
    from mmspec.bench.core import _prompts
    from mmspec.bench.draft_length import PAIRS, named_pair
    from mmspec.drafters import ModelDrafter, NullDrafter
    from mmspec.models.hf_target import HFTarget

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", choices=sorted(PAIRS), default="weak")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=12, help="timed rounds (one untimed warm-up round first)")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--prompts", type=int, default=3, help="prompt sets, used in turn")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--with-others", action="store_true",
                   help="also interleave fixed K = 6 and transformers' plain generate (as the full bench does): "
                        "does what runs in between change the figures?")
    p.add_argument("--no-shadow", action="store_true",
                   help="also interleave `auto` with drafting probes from plain decoding (no shadow probes)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.rounds < 2:
        p.error("--rounds must be >= 2 (the interval needs two paired rounds)")
    torch.set_num_threads(a.threads)
    pc, target, drafter = named_pair(a.pair)
    t_wrap = HFTarget(target)
    sets = [_prompts(a.batch, (12, 32), pc.vocab_size, seed=a.batch + 1000 * j) for j in range(a.prompts)]
    pinned = ModelDrafter(drafter, "auto", max_draft_tokens=8)
    pinned.controller.choose = lambda *args, **kw: 0  # the adaptive path, never drafting
    methods = {"mmspec plain": NullDrafter(pc.vocab_size), "auto": ModelDrafter(drafter, "auto", max_draft_tokens=8),
               "auto pinned to K=0": pinned, "K=1": ModelDrafter(drafter, 1)}
    if a.no_shadow:
        class DraftingProbes(ModelDrafter):
            shadow_probes = False  # the loop then never asks for shadow probes

        methods["auto, no shadow"] = DraftingProbes(drafter, "auto", max_draft_tokens=8)
    if a.with_others:
        methods["K=6"] = ModelDrafter(drafter, 6)
        from mmspec.models.prepack import maybe_packed

        gen_model = maybe_packed(target)  # as the bench runs `generate`: on the wrap's kernel view
        methods["generate"] = "generate"
    seconds = {m: [] for m in methods}
    drafting_steps = {m: [] for m in methods}
    for r in range(a.rounds + 1):
        order = list(methods)
        random.Random(r).shuffle(order)
        for name in order:
            ids, mask = sets[r % a.prompts]
            t0 = time.perf_counter()
            if name == "generate":
                gen_model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=a.new_tokens,
                                   pad_token_id=0)
                steps = 0
            else:
                out = mmspec.speculative_generate(t_wrap, methods[name], ids, mask, temperature=0,
                                                  max_new_tokens=a.new_tokens, pad_token_id=0)
                steps = sum(k > 0 for k in out.stats.nodes_per_step)
            dt = time.perf_counter() - t0
            if r:  # round 0 warms up (and trains `auto`)
                seconds[name].append(dt)
                drafting_steps[name].append(steps)
    report = {"pair": a.pair, "batch": a.batch, "rounds": a.rounds, "threads": a.threads, "new_tokens": a.new_tokens,
              "methods": {}}
    for name in methods:
        ratio = paired(seconds[name], seconds["mmspec plain"])
        report["methods"][name] = {"time_vs_mmspec_plain": ratio, "median_seconds": round(statistics.median(seconds[name]), 4),
                                   "drafting_steps_per_call": drafting_steps[name]}
        print(f"{name:<20} median {statistics.median(seconds[name]):.3f} s  time / mmspec plain {ratio[0]:.3f}x "
              f"[90% CI {ratio[1]:.3f}-{ratio[2]:.3f}]  drafting steps per call {drafting_steps[name]}")
    if a.no_shadow:
        ratio = paired(seconds["auto, no shadow"], seconds["auto"])
        report["shadow_speedup"] = ratio
        print(f"auto (shadow probes) speed / auto with drafting probes {ratio[0]:.3f}x [90% CI {ratio[1]:.3f}-{ratio[2]:.3f}]")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
