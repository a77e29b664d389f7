"""What a speculative step costs outside the target's forward: the loop around a free target.

The target's "forward" returns logits read from a stored table (keyed by position, nudged by the
drafted tokens so that acceptance is partial, ~3 tokens a step), so a step's time is the loop's
own work: the drafter's proposal and commit, processing the target's distributions, the
acceptance rule's verdict, the output bookkeeping. On the testbed image generator (a ~4 ms
verify forward on a 2-core CPU) this work was ~0.9 ms of a Jacobi step in session 53 and is what
compresses the wall-clock speed-up below the forward-count ratio.

    python benchmarks/step_overhead.py --rules exact,lantern,gsd --batch 1,8 --repeats 40

Prints, per rule and batch size, the lower-decile milliseconds per step of a request (64 tokens,
codebook of 512, Jacobi window 16) for speculative decoding and for plain decoding through the
same loop (`NullDrafter`). Timings of this machine and its load; run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import mmspec
from mmspec.drafters import JacobiDrafter, NullDrafter
from mmspec.types import TargetOutput

V, T, WINDOW = 512, 64, 16


class FreeTarget:
    """A Target whose forward is a table lookup (see the module docstring)."""

    def __init__(self, batch: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = V
        self.table = torch.randn(batch, T + WINDOW + 2, V, generator=g) * 2.5
        self.bias = (torch.arange(V) % 7).view(1, 1, V)

    def prefill(self, input_ids, attention_mask, model_inputs, max_new_tokens, max_draft_nodes, features):
        self.pos = torch.zeros(input_ids.shape[0], dtype=torch.long)
        return TargetOutput(logits=self.table[: input_ids.shape[0], :1])

    def verify(self, tokens, parents):
        B, Q = tokens.shape
        idx = (self.pos.unsqueeze(1) + torch.arange(Q)).clamp(max=self.table.shape[1] - 1)
        logits = self.table[:B].gather(1, idx.unsqueeze(-1).expand(B, Q, V)).clone()
        logits[:, 1:] += (tokens[:, :-1, None] % 7 == self.bias) * 2.5  # the drafts move the next position
        return TargetOutput(logits=logits)

    def commit(self, info):
        self.pos = self.pos + info.num_accepted + 1

    def select_rows(self, rows, rows_host):
        self.table, self.pos = self.table[rows], self.pos[rows]


def rule_kwargs(rule: str) -> dict | None:
    codebook = torch.randn(V, 8, generator=torch.Generator().manual_seed(1))
    if rule == "lantern":
        return {"codebook": codebook, "k": 31}  # ~6% of the codes, as the pipeline's default on 512
    if rule == "gsd":
        return {"embeddings": codebook}
    return None


def per_step(rule: str, batch: int, speculative: bool, coupling: str, repeats: int) -> tuple[float, float]:
    """Lower-decile seconds per step over `repeats` requests, and the mean steps of a request."""
    ids = torch.ones(batch, 1, dtype=torch.long)
    kwargs = rule_kwargs(rule)
    times, counts = [], []
    for r in range(repeats + 3):
        drafter = JacobiDrafter(WINDOW, coupling, vocab_size=V) if speculative else NullDrafter(V)
        t0 = time.perf_counter()
        out = mmspec.speculative_generate(FreeTarget(batch), drafter, ids, acceptance=rule, acceptance_kwargs=kwargs,
                                          max_new_tokens=T, generator=torch.Generator().manual_seed(r))
        steps = len(out.stats.nodes_per_step)
        if r >= 3:  # warm-up requests first
            times.append((time.perf_counter() - t0) / steps)
            counts.append(steps)
    times.sort()
    return times[len(times) // 10], sum(counts) / len(counts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rules", default="exact,lantern,gsd")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--coupling", default="gumbel", choices=["gumbel", "maximal", "none"])
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    coupling = None if args.coupling == "none" else args.coupling
    rows = []
    for rule in args.rules.split(","):
        for batch in (int(b) for b in args.batch.split(",")):
            spec, steps = per_step(rule, batch, True, coupling, args.repeats)
            plain, _ = per_step(rule, batch, False, coupling, args.repeats)
            rows.append({"rule": rule, "batch": batch, "speculative_ms": round(spec * 1e3, 3),
                         "plain_ms": round(plain * 1e3, 3), "steps": round(steps, 2)})
            print(f"{rule:8} batch {batch:2}: speculative step {spec * 1e3:.3f} ms ({steps:.1f} steps a request on average), "
                  f"plain step {plain * 1e3:.3f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "coupling": args.coupling, "window": WINDOW, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
