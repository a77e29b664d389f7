"""Sampled captions on the testbed VLM: exact against drafter-invariant verification, chains and trees.

`mmspec bench vlm --temperature T --acceptance invariant` times rows whose answers are identical to
plain sampling's. Exact speculative sampling draws other answers than plain sampling for the same
seed (same distribution), so it cannot join that table; this script compares the two rules on
their own terms: tokens per target forward (bonus included) and generated tokens per second of
whole requests (prefill included) against plain sampling with the same rule, ViSpec's chain
(K = 5) and its 20-node tree, batch 1, one caption per scene, interleaved rounds.

Session 34 (2-core Intel Xeon VM, pinned to core 0, 48 scenes, T = 0.7, 3 rounds, two runs):
chain exact 2.84 tokens per forward, 1.22x / 1.20x its plain sampling; invariant 3.03, 1.24x /
1.38x; tree exact 2.48, 0.67x / 0.66x; tree invariant 3.64, 1.04x / 0.96x. A top-k tree holds the drafter's likeliest tokens, which the
verifier's sample is often not; under "invariant" the tree ranks the drafter's Gumbel-perturbed
scores with the verifier's own noise (drafters/tree_grow.py), so it holds the verifier's likely
pick. On this CPU a 20-node verify costs ~1.7x a chain's, so the tree still does not pay.

    taskset -c 0 python benchmarks/sampled_rules_vlm.py [--scenes 48] [--temperature 0.7] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    from mmspec.bench.vlm import DEFAULT_MODEL, load_pipeline, tree_variant
    from mmspec.testbed.vlm_eval import scene_size
    from mmspec.testbed.world import World

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--scenes", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    pipe = load_pipeline(a.model)
    tree = tree_variant(pipe, "vispec", (6, 4, 20))
    images = [s.image for s in World(seed=0, split="validation", image_size=scene_size(pipe.processor)).sample(a.scenes)]

    def run(drafter, rule, speculative):
        if speculative:
            pipe.load_drafter(drafter)
        forwards = tokens = 0
        t0 = time.perf_counter()
        for i, image in enumerate(images):
            out = pipe([image], None, max_new_tokens=40, temperature=a.temperature, acceptance=rule,
                       speculative=speculative, generator=torch.Generator().manual_seed(i))
            forwards += out.stats.row_steps
            tokens += sum(out.stats.new_tokens) - 1  # the prefill's token needs no step
        return tokens / (time.perf_counter() - t0), tokens / max(forwards, 1)

    configs = [(d, rule, d != "plain") for rule in ("exact", "invariant") for d in ("plain", "vispec", tree)]
    for c in configs:  # warm-up
        run(*c)
    results = {c: [] for c in configs}
    for r in range(a.rounds):
        for c in configs if r % 2 == 0 else configs[::-1]:
            results[c].append(run(*c))
    rate = {c: statistics.median(x[0] for x in v) for c, v in results.items()}
    for c, v in results.items():
        print(f"{c[0]:<12} {c[1]:<10} tokens/forward {v[0][1]:.2f}  tokens/s {rate[c]:.0f}  "
              f"vs plain sampling with the same rule {rate[c] / rate[('plain', c[1], False)]:.2f}x")


if __name__ == "__main__":
    main()
