"""Shared helpers for the acceptance-rule tests: batched one-step sampling and chi-square.

Statistical tests draw one speculative step for N independent rows that share the same
target / draft distributions, so a whole sample is one vectorised `verify` call.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy import stats

# A fixed seed makes every statistical test deterministic; with p-value threshold 1e-3 a
# correct implementation fails with probability 1e-3 per (seed, test) and a wrong one of the
# size we care about (TVD >= ~0.01 at N = 2e5) fails almost surely.
P_MIN = 1e-3


def dist(values, dtype=torch.float64) -> torch.Tensor:
    t = torch.tensor(values, dtype=dtype)
    return t / t.sum()


def random_dist(V: int, gen: torch.Generator, *, zeros: int = 0, temp: float = 1.0) -> torch.Tensor:
    logits = torch.randn(V, generator=gen, dtype=torch.float64) / temp
    if zeros:
        logits[torch.randperm(V, generator=gen)[:zeros]] = float("-inf")
    return logits.softmax(-1)


def one_step(rule, p: torch.Tensor, q: torch.Tensor | None, n: int, gen: torch.Generator, *, bonus=None, x=None):
    """Run one K=1 chain step for n rows sharing p [V] (and q [V] or None).

    Drafts are x ~ q (or the given tokens [n] / uniform when q is None). Returns
    (x [n], result, emitted first token [n])."""
    V = p.shape[-1]
    if x is None:
        src = q if q is not None else torch.full((V,), 1.0 / V, dtype=p.dtype)
        x = torch.multinomial(src.expand(n, V), 1, replacement=True, generator=gen)
    else:
        x = x.reshape(n, 1)
    bonus = p if bonus is None else bonus
    target = torch.stack([p, bonus]).unsqueeze(0).expand(n, 2, V)
    draft = None if q is None else q.view(1, 1, V).expand(n, 1, V)
    res = rule.verify(x, draft, target, generator=gen)
    first = torch.where(res.num_accepted >= 1, x[:, 0], res.next_tokens)
    return x[:, 0], res, first


def chi_square_pvalue(tokens: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Goodness of fit of integer samples against probs [V]; bins whose expected count is
    below `min_expected` are pooled into one (and any sample in a zero-probability bin
    fails the test outright)."""
    probs = probs.double().cpu().numpy()
    n = tokens.numel()
    counts = np.bincount(tokens.cpu().numpy(), minlength=probs.shape[0]).astype(np.float64)
    if (counts[probs == 0] > 0).any():
        return 0.0
    expected = probs * n
    big = expected >= min_expected
    obs = list(counts[big])
    exp = list(expected[big])
    if (~big).any() and expected[~big].sum() > 0:
        obs.append(counts[~big].sum())
        exp.append(expected[~big].sum())
    if len(obs) < 2:
        return 1.0
    exp = np.array(exp) * (sum(obs) / sum(exp))
    return float(stats.chisquare(obs, exp).pvalue)


def binomial_tolerance(prob: float, n: int, z: float = 5.0) -> float:
    """z-sigma tolerance of an empirical frequency of n Bernoulli(prob) trials."""
    return z * max(prob * (1 - prob), 1.0 / n) ** 0.5 / n**0.5
