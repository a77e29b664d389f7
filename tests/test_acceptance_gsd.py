"""GroupedAcceptance (GSD) and ClusterExactAcceptance (static clusters)."""

from __future__ import annotations

import pytest
import torch

from _acceptance_helpers import P_MIN, chi_square_pvalue, dist, one_step, random_dist
from mmspec.acceptance import ClusterExactAcceptance, ExactAcceptance, GroupedAcceptance


def clustered_embeddings(V, D=4, groups=8, spread=0.2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(groups, D, generator=gen)
    return centers[torch.arange(V) % groups] + spread * torch.randn(V, D, generator=gen)


def reference_cluster(x, p, emb, window, pt, dt):
    """Straight transcription of the rule, one candidate at a time (for checking)."""
    V = p.shape[0]
    order = sorted(range(V), key=lambda i: (float(p[i]), i))
    r = order.index(int(x))
    lo = r - window // 2
    group = set()
    for pos in range(lo, lo + window):
        if 0 <= pos < V:
            w = order[pos]
            if abs(float(p[w] - p[x])) < pt and float(((emb[w] - emb[x]) ** 2).sum()) < dt:
                group.add(w)
    group.add(int(x))
    return group


def test_cluster_matches_reference_transcription():
    gen = torch.Generator().manual_seed(0)
    V, M = 40, 60
    emb = clustered_embeddings(V, seed=1)
    rule = GroupedAcceptance(emb, window=14, prob_threshold=0.15, distance_threshold=0.5)
    p = torch.softmax(torch.randn(M, V, generator=gen, dtype=torch.float64), -1)
    p[:5, :20] = 0.0  # ties at zero probability
    p = p / p.sum(-1, keepdim=True)
    x = torch.randint(0, V, (M,), generator=gen)
    tokens, member = rule.cluster(x, p)
    sizes = []
    for m in range(M):
        got = set(tokens[m][member[m]].tolist())
        assert got == reference_cluster(x[m], p[m], rule.embeddings, 14, 0.15, 0.5)
        sizes.append(len(got))
    assert max(sizes) > 1  # the test problem does form clusters
    q = torch.softmax(torch.randn(M, V, generator=gen, dtype=torch.float64), -1)
    for m in range(M):
        g = sorted(reference_cluster(x[m], p[m], rule.embeddings, 14, 0.15, 0.5))
        want = min(1.0, float(p[m, g].sum() / q[m, g].sum()))
        assert abs(float(rule.accept_probability(x[m : m + 1], p[m : m + 1], q[m : m + 1])) - want) < 1e-12


def test_gsd_accepts_at_least_as_often_as_exact():
    gen = torch.Generator().manual_seed(1)
    V, M = 64, 2000
    rule = GroupedAcceptance(clustered_embeddings(V, seed=2))
    p = torch.softmax(0.3 * torch.randn(M, V, generator=gen), -1)
    q = torch.softmax(0.3 * torch.randn(M, V, generator=gen), -1)
    x = torch.multinomial(q, 1, generator=gen).squeeze(-1)
    # One-hot drafts: sum_G p >= p(x), so never less than exact, candidate by candidate.
    a_gsd = rule.accept_probability(x, p, None)
    a_exact = ExactAcceptance().accept_probability(x, p, None)
    assert bool((a_gsd >= a_exact - 1e-6).all()) and a_gsd.mean() > a_exact.mean()
    # Sampled drafts: a cluster whose q outweighs its p can lower one candidate's ratio, so
    # this holds on average on look-alike problems, not candidate by candidate.
    a_gsd = rule.accept_probability(x, p, q)
    a_exact = ExactAcceptance().accept_probability(x, p, q)
    assert a_gsd.mean() > a_exact.mean() + 0.02
    # Measured on chains (K=4): accepted-prefix lengths.
    K = 4
    pk = p[: 400 * (K + 1)].view(400, K + 1, V)
    xk = torch.randint(0, V, (400, K), generator=gen)
    n_gsd = rule.verify(xk, None, pk, generator=torch.Generator().manual_seed(5)).num_accepted
    n_exact = ExactAcceptance().verify(xk, None, pk, generator=torch.Generator().manual_seed(5)).num_accepted
    assert bool((n_gsd >= n_exact).all())  # same uniforms and alpha_gsd >= alpha_exact: never fewer
    assert n_gsd.float().mean() > n_exact.float().mean()


def test_window_one_is_exact():
    gen = torch.Generator().manual_seed(2)
    V = 6
    p, q = random_dist(V, gen), random_dist(V, gen)
    rule = GroupedAcceptance(clustered_embeddings(V, seed=3), window=1)
    x, res, first = one_step(rule, p, q, 200_000, gen)
    exact = ExactAcceptance().accept_probability(x, p.expand(x.numel(), V), q.expand(x.numel(), V))
    assert torch.allclose(res.accept_probs[:, 0], exact)
    assert chi_square_pvalue(first, p) > P_MIN


def test_gsd_one_hot_distortion_is_the_step_tvd():
    gen = torch.Generator().manual_seed(3)
    V = 6
    emb = torch.zeros(V, 2)  # all tokens look alike: clusters limited by probability only
    rule = GroupedAcceptance(emb, window=6, prob_threshold=0.2)
    p = dist([0.3, 0.25, 0.2, 0.15, 0.07, 0.03])
    x = torch.full((100_000,), 2)
    _, res, first = one_step(rule, p, None, 100_000, gen, x=x)
    alpha = float(rule.accept_probability(x[:1], p.unsqueeze(0), None))
    out = p.clone() * (1 - alpha) / (1 - p[2])
    out[2] = alpha
    assert abs(alpha - min(1.0, float(p.sum()))) < 1e-12  # |p(w) - 0.2| < 0.2 for every w: cluster = all
    assert chi_square_pvalue(first, out) > P_MIN
    assert abs(float(res.distortion[0]) - 0.5 * float((out - p).abs().sum())) < 1e-12


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(window=0), "window"),
        (dict(prob_threshold=-1.0), "prob_threshold"),
        (dict(distance_threshold=-0.5), "distance_threshold"),
        # NaN compared False everywhere: every cluster came out empty, exact sampling in disguise
        (dict(prob_threshold=float("nan")), "prob_threshold"),
        (dict(distance_threshold=float("nan")), "distance_threshold"),
    ],
)
def test_gsd_invalid_arguments(kwargs, word):
    with pytest.raises(ValueError, match=word):
        GroupedAcceptance(torch.zeros(6, 2), **kwargs)
    with pytest.raises(ValueError, match="embeddings"):
        GroupedAcceptance(torch.zeros(6))
    with pytest.raises(ValueError, match="embeddings hold NaN"):
        GroupedAcceptance(torch.tensor([[0.0, 1.0], [float("nan"), 0.0]]))
    GroupedAcceptance(torch.zeros(6, 2), distance_threshold=float("inf"))  # no distance test: meaningful


# -- cluster-exact ------------------------------------------------------------------------

LABELS = torch.tensor([0, 0, 1, 1, 1, 2])


def cluster_of(tokens):
    return LABELS[tokens]


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_q", "one_hot_q"])
def test_cluster_exact_cluster_marginals_match_target(sampled):
    gen = torch.Generator().manual_seed(4)
    p = dist([0.05, 0.25, 0.1, 0.1, 0.2, 0.3])
    q = dist([0.3, 0.1, 0.05, 0.05, 0.1, 0.4]) if sampled else None
    rule = ClusterExactAcceptance(LABELS)
    _, res, first = one_step(rule, p, q, 200_000, gen)
    P = rule.cluster_mass(p.unsqueeze(0))[0]
    assert chi_square_pvalue(cluster_of(first), P) > P_MIN
    # The token level is not exact (that is the relaxation): within-cluster choice follows q.
    assert chi_square_pvalue(first, p) < P_MIN


def analytic_output(rule, p, q):
    """Exact distribution of the step's emitted token, summing over all drafts x ~ q."""
    V = p.shape[0]
    xs = torch.arange(V)
    P, Q = p.expand(V, V), q.expand(V, V)
    alpha = rule.accept_probability(xs, P, Q)
    resid = rule.residual(xs, P, Q)
    return (q * alpha) + (q * (1 - alpha)) @ resid


def test_cluster_exact_analytic_cluster_marginals_and_distortion():
    gen = torch.Generator().manual_seed(5)
    rule = ClusterExactAcceptance(LABELS)
    for _ in range(20):
        p, q = random_dist(6, gen, zeros=1), random_dist(6, gen)
        out = analytic_output(rule, p, q)
        assert torch.allclose(rule.cluster_mass(out.unsqueeze(0)), rule.cluster_mass(p.unsqueeze(0)), atol=1e-12)
        tvd = 0.5 * (out - p).abs().sum()
        d = rule.distortion(torch.tensor([0]), p.unsqueeze(0), q.unsqueeze(0))
        assert abs(float(d) - float(tvd)) < 1e-12
    # One-hot draft: distortion P(c(x)) - p(x).
    p = dist([0.05, 0.25, 0.1, 0.1, 0.2, 0.3])
    d = rule.distortion(torch.tensor([1, 2, 5]), p.expand(3, 6), None)
    assert torch.allclose(d, torch.tensor([0.05, 0.3, 0.0], dtype=torch.float64))


def test_cluster_exact_with_singleton_clusters_is_exact():
    gen = torch.Generator().manual_seed(6)
    p, q = random_dist(6, gen), random_dist(6, gen)
    rule = ClusterExactAcceptance(torch.arange(6))
    x, res, first = one_step(rule, p, q, 100_000, gen)
    exact = ExactAcceptance().accept_probability(x, p.expand(x.numel(), 6), q.expand(x.numel(), 6))
    assert torch.allclose(res.accept_probs[:, 0], exact)
    assert chi_square_pvalue(first, p) > P_MIN
    assert float(res.distortion.abs().max()) < 1e-12


def test_cluster_exact_invalid_labels():
    with pytest.raises(ValueError, match="labels"):
        ClusterExactAcceptance(torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="labels"):
        ClusterExactAcceptance(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="labels"):
        ClusterExactAcceptance(torch.tensor([0, -1]))
    rule = ClusterExactAcceptance(LABELS)
    with pytest.raises(ValueError, match="labels"):
        rule.accept_probability(torch.tensor([0]), torch.full((1, 5), 0.2), None)


def test_cluster_exact_ratio_of_denormal_masses_and_names_of_any_size():
    """A floor under Q(c) before dividing skewed denormal cluster masses (1e-39 / 1e-40 gave an
    acceptance of 0.085, not 1); a cluster id like 2**40 made a [M, 2**40] mass table on the
    first call. Ids are names: renumbering them changes nothing."""
    labels = torch.tensor([0, 0, 1, 1])
    rule = ClusterExactAcceptance(labels)
    x = torch.tensor([0, 0])
    p = torch.tensor([[0.5e-39, 0.5e-39, 0.5, 0.5], [1.5e-39, 1.5e-39, 0.5, 0.5]], dtype=torch.float32)
    q = torch.tensor([[0.5e-40, 0.5e-40, 0.5, 0.5], [3e-39, 3e-39, 0.5, 0.5]], dtype=torch.float32)
    alpha = rule.accept_probability(x, p, q)
    assert alpha[0] == 1.0 and abs(float(alpha[1]) - 0.5) < 1e-3  # P/Q: 1e-39/1e-40 -> 1, 3e-39/6e-39
    named = ClusterExactAcceptance(torch.tensor([7, 7, 2 ** 40, 2 ** 40]))
    assert named.num_clusters == 2
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(3, 4, 4, generator=gen), -1)
    drafts = torch.softmax(torch.randn(3, 3, 4, generator=gen), -1)
    tokens = torch.multinomial(drafts.reshape(-1, 4), 1, generator=gen).view(3, 3)
    for a, b in [(rule.accept_probability(tokens[:, 0], probs[:, 0], drafts[:, 0]),
                  named.accept_probability(tokens[:, 0], probs[:, 0], drafts[:, 0])),
                 (rule.residual(tokens[:, 0], probs[:, 0], drafts[:, 0]),
                  named.residual(tokens[:, 0], probs[:, 0], drafts[:, 0])),
                 (rule.distortion(tokens[:, 0], probs[:, 0], drafts[:, 0]),
                  named.distortion(tokens[:, 0], probs[:, 0], drafts[:, 0]))]:
        assert torch.equal(a, b)
    out = named.verify(tokens, drafts, probs, generator=torch.Generator().manual_seed(1))
    ref = rule.verify(tokens, drafts, probs, generator=torch.Generator().manual_seed(1))
    assert torch.equal(out.num_accepted, ref.num_accepted) and torch.equal(out.next_tokens, ref.next_tokens)


@pytest.mark.parametrize("window", [1, 2, 5, 14, 40])
def test_float32_window_by_integer_key_matches_reference_transcription(window):
    """float32 probabilities take the sort-free path (two top-k over an exact integer key) and the
    distance table: same clusters as the transcription, including ties at zero probability, -0.0,
    windows cut at both ends of the ranking and windows wider than the vocabulary."""
    gen = torch.Generator().manual_seed(3)
    V, M = 30, 80
    emb = clustered_embeddings(V, seed=4)
    rule = GroupedAcceptance(emb, window=window, prob_threshold=0.3, distance_threshold=0.5)
    p = torch.softmax(2 * torch.randn(M, V, generator=gen), -1)
    p[:20, :12] = 0.0
    p[20:25, :3] = -0.0  # a masked entry may carry the sign bit
    p[25:30] = 1.0 / V  # all tied
    p[30:35] = 0.0
    p[30:35, 7] = 1.0  # one-hot: x at the top, everything else tied at 0
    x = torch.randint(0, V, (M,), generator=gen)
    x[:10] = torch.arange(10)  # drafts inside the zero block (bottom of the ranking)
    tokens, member = rule.cluster(x, p)
    assert p.dtype == torch.float32
    sizes = []
    for m in range(M):
        got = set(tokens[m][member[m]].tolist())
        assert got == reference_cluster(x[m], p[m].double(), rule.embeddings, window, 0.3, 0.5), m
        sizes.append(len(got))
    assert window == 1 or max(sizes) > 1


def test_distance_table_follows_in_place_edits_of_the_embeddings():
    emb = clustered_embeddings(16, seed=5)
    p = torch.full((1, 16), 1.0 / 16)
    x = torch.tensor([3])
    before = GroupedAcceptance(emb, window=40, distance_threshold=0.5).cluster(x, p)[1].sum()
    with torch.no_grad():
        emb.mul_(100.0)  # every pair now far apart: the draft's cluster is itself alone
    tokens, member = GroupedAcceptance(emb, window=40, distance_threshold=0.5).cluster(x, p)
    assert before > 1 and tokens[member].tolist() == [3]
