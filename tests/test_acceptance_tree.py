"""Every discrete rule through the core's tree walk (`mmspec.tree.verify_tree`): a one-branch
tree behaves like the chain, and LANTERN's rejected sibling takes its lent neighbours along."""

from __future__ import annotations

import pytest
import torch

from _acceptance_helpers import P_MIN, chi_square_pvalue
from mmspec.acceptance import (
    ClusterExactAcceptance,
    ExactAcceptance,
    GreedyAcceptance,
    GroupedAcceptance,
    LanternAcceptance,
    TypicalAcceptance,
)
from mmspec.tree import chain_parents, verify_tree

V, K, N = 12, 3, 30_000


def _codebook():
    gen = torch.Generator().manual_seed(7)
    centers = torch.randn(4, 3, generator=gen)
    return centers[torch.arange(V) % 4] + 0.1 * torch.randn(V, 3, generator=gen)


RULES = {
    "exact": lambda: ExactAcceptance(),
    "greedy": lambda: GreedyAcceptance(),
    "typical": lambda: TypicalAcceptance(epsilon=0.15, alpha=1.5),  # rejects the third draft
    "lantern": lambda: LanternAcceptance(_codebook(), k=4, delta=0.2),
    "lantern++": lambda: LanternAcceptance(_codebook(), k=4, lam=3.0),
    "gsd": lambda: GroupedAcceptance(_codebook(), window=6, prob_threshold=0.2, distance_threshold=0.5),
    "cluster_exact": lambda: ClusterExactAcceptance(torch.arange(V) % 4),
}


def _problem():
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(1.5 * torch.randn(K + 1, V, generator=gen, dtype=torch.float64), -1)
    x = torch.tensor([int(p[0].argmax()), int(p[1].argsort()[-2]), int(p[2].argsort()[-3])])
    return p, x


def _expected_joint(rule, p, x):
    """Exact distribution over (num_accepted, next token), as a flat [(K+1) * V] vector."""
    out = torch.zeros(K + 1, V, dtype=torch.float64)
    reach = 1.0
    for i in range(K):
        a = float(rule.accept_probability(x[i : i + 1], p[i : i + 1], None))
        resid = rule.residual(x[i : i + 1], p[i : i + 1], None)[0]
        if isinstance(rule, GreedyAcceptance):
            resid = torch.nn.functional.one_hot(resid.argmax(), V).double()
        out[i] = reach * (1 - a) * resid
        reach *= a
    last = p[K] if not isinstance(rule, GreedyAcceptance) else torch.nn.functional.one_hot(p[K].argmax(), V).double()
    out[K] = reach * last
    return out.flatten()


@pytest.mark.parametrize("name", list(RULES))
def test_one_branch_tree_matches_chain(name):
    rule = RULES[name]()
    p, x = _problem()
    tokens = x.expand(N, K)
    target = p.expand(N, K + 1, V)
    # Same per-candidate acceptance probabilities along the path.
    chain = rule.verify(tokens, None, target, generator=torch.Generator().manual_seed(13))
    walked = torch.stack([rule.accept_probability(x[i : i + 1], p[i : i + 1], None)[0] for i in range(K)])
    assert torch.allclose(chain.accept_probs[0], walked)
    tree = verify_tree(rule, tokens, chain_parents(N, K), target, generator=torch.Generator().manual_seed(12))
    # The accepted path of a one-branch tree is the chain prefix.
    width = torch.arange(K + 1)
    assert bool((tree.path[:, : K + 1] == torch.minimum(width, tree.num_accepted.unsqueeze(1)).expand(N, K + 1)).all())
    expected = _expected_joint(rule, p, x)
    for res in (chain, tree):
        joint = res.num_accepted * V + res.next_tokens
        assert chi_square_pvalue(joint, expected) > P_MIN
    if chain.distortion is not None:
        assert tree.distortion is not None
        assert abs(float(chain.distortion.mean()) - float(tree.distortion.mean())) < 0.05 * max(1.0, float(chain.distortion.mean()))


def test_lantern_rejected_sibling_removes_its_lent_neighbours():
    cb = torch.tensor([[0.0, 1.0], [0.05, 1.0], [1.0, 0.0], [1.0, 0.05], [-1.0, 0.0], [-1.0, -0.05]])
    p = torch.tensor([0.2, 0.25, 0.2, 0.15, 0.1, 0.1], dtype=torch.float64)
    rule = LanternAcceptance(cb, k=1, delta=0.3)  # token 0 borrows token 1's mass
    n = 20_000
    tokens = torch.tensor([0, 1]).expand(n, 2)  # two children of the root: 0 first, then 1
    parents = torch.full((n, 2), -1)
    target = torch.cat([p.view(1, 1, 6).expand(n, 1, 6), torch.full((n, 2, 6), 1 / 6, dtype=torch.float64)], 1)
    res = verify_tree(rule, tokens, parents, target, generator=torch.Generator().manual_seed(0))
    took_first = (res.num_accepted == 1) & (res.path[:, 1] == 1)
    took_second = (res.num_accepted == 1) & (res.path[:, 1] == 2)
    assert abs(took_first.double().mean().item() - 0.45) < 0.02  # p~(0) = 0.2 + 0.25
    assert int(took_second.sum()) == 0  # token 1 lent its mass to 0 and was zeroed with it
    # Exact sampling, for contrast, does try token 1 after rejecting 0.
    res_exact = verify_tree(ExactAcceptance(), tokens, parents, target, generator=torch.Generator().manual_seed(0))
    assert int(((res_exact.num_accepted == 1) & (res_exact.path[:, 1] == 2)).sum()) > 0
    # Rows that accepted nothing draw from p with tokens 0 and 1 removed.
    rest = res.next_tokens[res.num_accepted == 0]
    assert chi_square_pvalue(rest, torch.tensor([0, 0, 0.2, 0.15, 0.1, 0.1]) / 0.55) > P_MIN


@pytest.mark.parametrize("name", sorted(RULES))
def test_verify_tree_refuses_what_a_chain_verify_refuses(name):
    """verify_tree checked shapes only: a NaN row, logits, all-zero or scaled rows came back as a
    verdict (NaN or negative distortion), an out-of-vocabulary id as a raw index error, and a
    parent after its child was silently an unreachable node."""
    rule = RULES[name]()
    B, M = 2, 3
    parents = torch.tensor([[-1, -1, 0]] * B)
    tokens = torch.tensor([[1, 2, 3]] * B)
    good = torch.softmax(torch.randn(B, M + 1, V, generator=torch.Generator().manual_seed(0)), -1).double()
    verify_tree(rule, tokens, parents, good, generator=torch.Generator().manual_seed(0))  # well formed: runs
    # a float32 distribution cast to float64 is still one (rows ~1e-6 off 1 at large V)
    verify_tree(rule, tokens, parents, good.float().double() * (1 + 5e-6), generator=torch.Generator().manual_seed(0))
    nan = good.clone()
    nan[0, 0, 0] = float("nan")
    for probs, message in [(nan, "finite non-negative probabilities"), (good.log(), "finite non-negative"),
                           (torch.zeros_like(good), "rows must each sum to 1"), (good * 10, "rows must each sum to 1")]:
        with pytest.raises(ValueError, match=message):
            verify_tree(rule, tokens, parents, probs)
    for toks, pars, message in [(torch.tensor([[1, V, 3]] * B), parents, r"draft_tokens must lie in \[0, V=12\)"),
                                (torch.tensor([[1, -2, 3]] * B), parents, r"draft_tokens must lie in \[0, V=12\)"),
                                (tokens, torch.tensor([[-1, 2, 0]] * B), "parents precede their children"),
                                (tokens, torch.tensor([[-5, -1, 0]] * B), "parents precede their children"),
                                (tokens.float(), parents, "integer token ids"),
                                (tokens, parents.float(), "parents must be an integer tensor")]:
        with pytest.raises(ValueError, match=message):
            verify_tree(rule, toks, pars, good)
    with pytest.raises(TypeError, match="generator"):
        verify_tree(rule, tokens, parents, good, generator=0)
    empty = verify_tree(rule, tokens[:0], parents[:0], good[:0])  # no rows: an empty verdict, as for chains
    assert empty.num_accepted.shape == (0,)
