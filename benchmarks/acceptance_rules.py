"""Acceptance rules side by side on synthetic problems (no model needed).

    python benchmarks/acceptance_rules.py

1. Exact speculative sampling: chi-square of 200k emitted tokens against p, and the measured
   acceptance rate against its theoretical value sum_x min(p(x), q(x)).
2. A flat image-token-like target over a clustered 256-code codebook (32 clusters of 8 nearly
   identical codes), K=4 sampled drafts, 4096 rows: mean accepted drafts and the distortion
   (total variation) that exact, LANTERN, LANTERN++ and GSD trade for it.
3. Continuous (CSpD) acceptance on 4-D Gaussians: KS test per dimension, moments, fallbacks.
"""

import argparse

import torch
from scipy import stats

from mmspec.acceptance import ContinuousAcceptance, ExactAcceptance, GroupedAcceptance, LanternAcceptance


def exact_check(g):
    V, N = 6, 200_000
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    x = torch.multinomial(q, N, replacement=True, generator=g).view(N, 1)
    r = ExactAcceptance().verify(x, q.expand(N, 1, V).contiguous(), p.expand(N, 2, V).contiguous(), generator=g)
    out = torch.where(r.num_accepted == 1, x[:, 0], r.next_tokens)
    counts = torch.bincount(out, minlength=V).double()
    pval = stats.chisquare(counts.numpy(), (p.double() * N).numpy()).pvalue
    print(f"exact, 200k samples: chi-square p = {pval:.3f}; acceptance {r.num_accepted.float().mean():.3f} "
          f"(theory {torch.minimum(p, q).sum():.3f})")


def relaxed_rules(g):
    V, M, K = 256, 4096, 4
    codebook = torch.randn(32, 8, generator=g).repeat_interleave(8, 0) + 0.05 * torch.randn(V, 8, generator=g)
    p = torch.softmax(torch.randn(M, K + 1, V, generator=g) * 0.8, -1)
    q = torch.softmax(torch.randn(M, K, V, generator=g) * 0.8, -1)
    x = torch.multinomial(q.view(-1, V), 1, generator=g).view(M, K)
    rules = {"exact": ExactAcceptance()}
    for delta in (0.0, 0.05, 0.1, 0.2):
        rules[f"LANTERN k=16 delta={delta}"] = LanternAcceptance(codebook, k=16, delta=delta)
    for lam in (2.0, 5.0):
        rules[f"LANTERN++ k=16 lam={lam}"] = LanternAcceptance(codebook, k=16, lam=lam)
    rules["GSD (window 14)"] = GroupedAcceptance(codebook)
    print(f"\n{'rule':<26} {'accepted drafts':>15} {'distortion/row':>15}")
    for name, rule in rules.items():
        r = rule.verify(x, q, p, generator=torch.Generator().manual_seed(1))
        dist = 0.0 if r.distortion is None else float(r.distortion.mean())
        print(f"{name:<26} {float(r.num_accepted.float().mean()):>15.3f} {dist:>15.4f}")


def continuous_check(g):
    N, D = 40_000, 4
    tm, ts = torch.tensor([1.0, -0.5, 0.0, 2.0]), torch.tensor([0.6, 1.0, 0.3, 1.5])
    dm, ds = torch.tensor([0.5, 0.0, 0.2, 1.0]), torch.tensor([0.8, 0.7, 0.5, 1.0])
    x = dm + ds * torch.randn(N, 1, D, generator=g)
    r = ContinuousAcceptance().verify(x, dm.expand(N, 1, D), ds.expand(N, 1, D), tm.expand(N, 2, D),
                                      ts.expand(N, 2, D), generator=g)
    out = torch.where((r.num_accepted == 1).unsqueeze(-1), x[:, 0], r.next_samples)
    print(f"\ncontinuous, 4-D Gaussians, {N} samples: acceptance {r.num_accepted.float().mean():.3f}, "
          f"fallbacks {int(r.fallbacks.sum())}")
    for d in range(D):
        p = stats.kstest(out[:, d].numpy(), "norm", args=(tm[d].item(), ts[d].item())).pvalue
        print(f"  dim {d}: KS p = {p:.3f}; mean {out[:, d].mean():.3f} (target {tm[d]:.2f}), "
              f"std {out[:, d].std():.3f} (target {ts[d]:.2f})")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # no options; --help says what runs
    g = torch.Generator().manual_seed(0)
    exact_check(g)
    relaxed_rules(g)
    continuous_check(g)
