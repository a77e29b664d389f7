"""The CPU attention choice (mmspec/cpu_attention.py), measured two ways.

`--forms`: torch's fused `scaled_dot_product_attention` against the plain matmul form on
synthetic inputs (8 heads of 64, an additive mask), per rows x queries x keys: microseconds per
call, fastest of two runs of 200 calls each.

`--imagegen BATCH`: the bundled testbed image pipeline (exact sampling, maximal-coupled Jacobi
window 16, guidance 3, classes 0..BATCH-1, a fixed seed) the same way.

`--e2e PAIR BATCH K`: `mmspec.speculative_generate` on a `mmspec bench core` pair with the
measured choice against the same code with torch's form forced, interleaved (the order flips
every round), three prompt sets cycled, the first three rounds not timed; prints the median
ratio of times (chosen / torch's) and its range, and the classes decided.

Session 51 (2-core Xeon VM, 2 threads; docs/architecture.md, "Attention on CPU"): plain/fused
time at 34-90 keys 0.4-0.8x at 4-16 rows and 2-9 queries, 1.2-2.7x at one row; end to end
(15 rounds, the first 3 untimed: 12 paired ratios; the printed output was not kept) batch 16 K = 2 0.95x, 81% pair batch 16 K = 3 0.96x, batch 4 K = 2 0.96x, batch 8
K = 2 1.01x, batch 1 K = 3 1.00x; the image pipeline 1.01x at batch 8, 1.00x at batch 1.

    python benchmarks/cpu_attention.py --forms
    python benchmarks/cpu_attention.py --e2e bench 16 2 [--rounds 15]
    python benchmarks/cpu_attention.py --imagegen 8 [--rounds 7]
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from mmspec import cpu_attention as ca
from mmspec.assets_dir import ASSETS

ap = argparse.ArgumentParser()
ap.add_argument("--forms", action="store_true")
ap.add_argument("--e2e", nargs=3, metavar=("PAIR", "BATCH", "K"))
ap.add_argument("--imagegen", type=int, metavar="BATCH", help="the bundled image pipeline, exact Jacobi, BATCH images")
ap.add_argument("--model", default=str(ASSETS / "testbed" / "imagegen"), help="image pipeline folder for --imagegen")
ap.add_argument("--rounds", type=int, default=15)
ap.add_argument("--threads", type=int, default=2)
args = ap.parse_args()
torch.set_num_threads(args.threads)


def per_call_us(fn, n=200):
    for _ in range(10):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


if args.forms:
    for S in (50, 90):
        for B in (1, 4, 8, 16):
            cells = []
            for Q in (1, 2, 3, 5, 9, 32):
                q, k, v = torch.randn(B, 8, Q, 64), torch.randn(B, 8, S, 64), torch.randn(B, 8, S, 64)
                mask = torch.zeros(B, 1, Q, S)
                mask[..., :5] = torch.finfo(torch.float32).min

                def fused():
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

                def plain():
                    return ca.matmul_attention(q, k, v, mask)

                a = min(per_call_us(fused), per_call_us(fused))
                b = min(per_call_us(plain), per_call_us(plain))
                cells.append(f"Q{Q} {a:.0f}/{b:.0f}us={b / a:.2f}")
            print(f"keys {S} rows {B:2d}: " + "  ".join(cells))

if args.e2e:
    import mmspec
    from mmspec.bench.core import _prompts
    from mmspec.bench.draft_length import named_pair
    from mmspec.drafters import ModelDrafter, NullDrafter
    from mmspec.models.hf_target import HFTarget

    pair, B, K = args.e2e[0], int(args.e2e[1]), args.e2e[2]
    pc, target, small = named_pair(pair)
    wrap = HFTarget(target)
    drafter = NullDrafter(pc.vocab_size) if K == "0" else ModelDrafter(small, K if K == "auto" else int(K))
    sets = [_prompts(B, (12, 32), pc.vocab_size, seed=B + 1000 * j) for j in range(3)]
    times = {"torch": [], "chosen": []}
    for r in range(args.rounds):
        for name in (("torch", "chosen") if r % 2 else ("chosen", "torch")):
            with ca.forced("sdpa" if name == "torch" else None):
                t0 = time.perf_counter()
                mmspec.speculative_generate(wrap, drafter, *sets[r % 3], temperature=0, max_new_tokens=48,
                                            pad_token_id=0)
                if r >= 3:
                    times[name].append(time.perf_counter() - t0)
    ratios = [a / b for a, b in zip(times["chosen"], times["torch"])]
    print(f"{pair} batch {B} K={K}: chosen/torch time median {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} rounds)")
    print("  " + ca.describe())
    for c in ca.choices():
        print(f"    rows<={c['rows']} queries<={c['queries']} keys<={c['keys']}: {c['form']} "
              f"(plain/fused {c['matmul_over_sdpa']})")

if args.imagegen:
    from mmspec.drafters import JacobiDrafter
    from mmspec.pipelines import SpeculativeARImagePipeline

    pipe = SpeculativeARImagePipeline.from_pretrained(args.model)
    pipe.set_progress_bar_config(disable=True)
    labels = list(range(args.imagegen))
    times = {"torch": [], "chosen": []}
    for r in range(args.rounds):
        for name in (("torch", "chosen") if r % 2 else ("chosen", "torch")):
            pipe.drafter = JacobiDrafter(window=16, coupling="maximal")
            with ca.forced("sdpa" if name == "torch" else None):
                t0 = time.perf_counter()
                out = pipe(labels, guidance_scale=3.0, generator=torch.Generator().manual_seed(r), output_type="np")
                if r >= 1:
                    times[name].append(time.perf_counter() - t0)
    ratios = [a / b for a, b in zip(times["chosen"], times["torch"])]
    print(f"imagegen batch {args.imagegen}: chosen/torch time median {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} rounds; torch's form "
          f"{statistics.median(times['torch']):.2f} s a call)")
    print("  " + ca.describe())
