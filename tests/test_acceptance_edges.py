"""Hand-made edge cases for every discrete rule, the registry, and the layering of
`mmspec.acceptance`."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import mmspec.acceptance as acceptance
from mmspec.acceptance import (
    CONTINUOUS_RULES,
    RULES,
    ClusterExactAcceptance,
    ContinuousAcceptance,
    ExactAcceptance,
    GreedyAcceptance,
    GroupedAcceptance,
    LanternAcceptance,
    TypicalAcceptance,
    get_rule,
)


def make_rules(V):
    gen = torch.Generator().manual_seed(0)
    cb = torch.randn(V, 3, generator=gen)
    return {
        "exact": ExactAcceptance(),
        "typical": TypicalAcceptance(),
        "lantern": LanternAcceptance(cb, k=min(3, V - 1), delta=0.1),
        "lantern++": LanternAcceptance(cb, k=min(3, V - 1), lam=5.0),
        "gsd": GroupedAcceptance(cb),
        "cluster_exact": ClusterExactAcceptance(torch.arange(V) % 2),
    }


LOSSLESS_OR_RELAXED = list(make_rules(4))


def one_hot_probs(tokens, V, dtype=torch.float64):
    return torch.nn.functional.one_hot(tokens, V).to(dtype)


@pytest.mark.parametrize("name", LOSSLESS_OR_RELAXED)
def test_all_accepted_when_target_is_certain_of_the_drafts(name):
    V, B, K = 8, 3, 4
    rule = make_rules(V)[name]
    drafts = torch.tensor([[1, 2, 3, 4], [0, 0, 0, 0], [7, 6, 5, 4]])
    bonus = torch.tensor([[5], [1], [2]])
    p = one_hot_probs(torch.cat([drafts, bonus], 1), V)
    for q in (None, one_hot_probs(drafts, V)):
        res = rule.verify(drafts, q, p, generator=torch.Generator().manual_seed(1))
        assert res.num_accepted.tolist() == [K] * B
        assert res.next_tokens.tolist() == bonus[:, 0].tolist()


@pytest.mark.parametrize("name", LOSSLESS_OR_RELAXED)
def test_first_rejected_when_target_excludes_the_draft_and_its_neighbours(name):
    V, B, K = 8, 2, 3
    rule = make_rules(V)[name]
    drafts = torch.tensor([[1, 2, 3], [4, 5, 6]])
    # All target mass on token 0 (cluster 0 of cluster_exact, so give odd drafts there).
    p = one_hot_probs(torch.zeros(B, K + 1, dtype=torch.long), V)
    drafts = drafts | 1  # odd ids: never token 0, never in its cluster
    res = rule.verify(drafts, None, p, generator=torch.Generator().manual_seed(2))
    # LANTERN cannot borrow: token 0's mass 1.0 exceeds delta and (lam - 1) * p(x) = 0;
    # GSD's cluster excludes it: |p(0) - p(x)| = 1 >= prob_threshold.
    assert res.num_accepted.tolist() == [0, 0]
    assert res.next_tokens.tolist() == [0, 0]
    assert bool(torch.isfinite(res.accept_probs).all())


@pytest.mark.parametrize("name", LOSSLESS_OR_RELAXED)
def test_rows_with_different_outcomes_and_k1(name):
    V = 8
    rule = make_rules(V)[name]
    drafts = torch.tensor([[3], [5], [3]])
    p = torch.zeros(3, 2, V, dtype=torch.float64)
    p[0, 0, 3] = 1.0  # row 0: certain of its draft
    p[1, 0, 0] = 1.0  # row 1: certain of another (even) token
    p[2, 0, 3] = 1.0
    p[:, 1, 2] = 1.0  # bonus token 2
    res = rule.verify(drafts, None, p, generator=torch.Generator().manual_seed(3))
    assert res.num_accepted.tolist() == [1, 0, 1]
    assert res.next_tokens.tolist() == [2, 0, 2]


@pytest.mark.parametrize("name", LOSSLESS_OR_RELAXED)
def test_vocabulary_of_one(name):
    gen = torch.Generator().manual_seed(0)
    cb = torch.randn(1, 2, generator=gen)
    rule = {
        "exact": ExactAcceptance(),
        "typical": TypicalAcceptance(),
        "lantern": LanternAcceptance(cb, k=0, delta=0.1),
        "lantern++": LanternAcceptance(cb, k=0, lam=5.0),
        "gsd": GroupedAcceptance(cb),
        "cluster_exact": ClusterExactAcceptance(torch.zeros(1, dtype=torch.long)),
    }[name]
    drafts = torch.zeros(4, 2, dtype=torch.long)
    p = torch.ones(4, 3, 1)
    for q in (None, torch.ones(4, 2, 1)):
        res = rule.verify(drafts, q, p)
        assert res.num_accepted.tolist() == [2] * 4 and res.next_tokens.tolist() == [0] * 4
        resid = rule.residual(drafts[:, 0], p[:, 0], None if q is None else q[:, 0])
        assert bool(torch.isfinite(resid).all())


@pytest.mark.parametrize("name", LOSSLESS_OR_RELAXED)
def test_degenerate_distributions_never_give_nan(name):
    V = 6
    rule = make_rules(V)[name]
    gen = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(5, V, generator=gen), -1)
    p[:, :3] = 0.0  # zeros in p
    p = p / p.sum(-1, keepdim=True)
    x = torch.tensor([0, 1, 3, 4, 5])
    for q in (p.clone(), None, torch.nn.functional.one_hot(x, V).float()):  # p == q, one-hot
        a = rule.accept_probability(x, p, q)
        r = rule.residual(x, p, q)
        assert bool(torch.isfinite(a).all()) and bool(((a >= 0) & (a <= 1)).all())
        assert bool(torch.isfinite(r).all()) and torch.allclose(r.sum(-1), torch.ones(5), atol=1e-5)
        d = rule.distortion(x, p, q)
        assert d is None or bool(torch.isfinite(d).all())
    # p == q with sampled drafts: always accepted (typical ignores q, so it is excluded).
    if name != "typical":
        a = rule.accept_probability(x[2:], p[2:], p[2:])
        assert torch.allclose(a, torch.ones(3))


@pytest.mark.parametrize("name", LOSSLESS_OR_RELAXED + ["greedy"])
def test_mismatched_shapes_raise(name):
    rule = make_rules(6).get(name, GreedyAcceptance())
    drafts = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="target_probs"):
        rule.verify(drafts, None, torch.full((2, 3, 6), 1 / 6))
    with pytest.raises(ValueError, match="draft_probs"):
        rule.verify(drafts, torch.full((2, 3, 5), 0.2), torch.full((2, 4, 6), 1 / 6))
    with pytest.raises(ValueError, match="draft_tokens"):
        rule.verify(drafts + 6, None, torch.full((2, 4, 6), 1 / 6))


def test_k_zero_draws_the_bonus():
    for rule in make_rules(6).values():
        p = torch.zeros(3, 1, 6)
        p[:, 0, 4] = 1.0
        res = rule.verify(torch.zeros(3, 0, dtype=torch.long), None, p)
        assert res.num_accepted.tolist() == [0, 0, 0] and res.next_tokens.tolist() == [4, 4, 4]


def test_registry_names_and_get_rule():
    assert {"greedy", "exact", "typical", "lantern", "gsd", "cluster_exact"} <= set(RULES)
    assert "continuous" not in RULES and CONTINUOUS_RULES["continuous"] is ContinuousAcceptance
    cb = torch.randn(10, 2)
    assert isinstance(get_rule("lantern", codebook=cb, k=3, lam=5.0), LanternAcceptance)
    assert isinstance(get_rule("gsd", embeddings=cb), GroupedAcceptance)
    assert isinstance(get_rule("typical"), TypicalAcceptance)
    assert isinstance(get_rule("cluster_exact", labels=torch.arange(10) % 3), ClusterExactAcceptance)
    with pytest.raises(ValueError, match="acceptance"):
        get_rule("nope")
    for name, cls in RULES.items():
        assert getattr(cls, "name", name) == name
        assert cls.__name__ in acceptance.__all__


ALLOWED = {"torch", "math", "dataclasses", "typing", "inspect", "__future__", "mmspec.types", "mmspec.sampling", "mmspec.tree",
           "mmspec.versions"}


def test_acceptance_layering():
    folder = pathlib.Path(acceptance.__file__).parent
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        assert len(path.read_text().splitlines()) <= 400, f"{path.name} is over 400 lines"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level > 0:
                    continue  # relative import inside acceptance/
                names = [node.module]
            else:
                continue
            for n in names:
                assert n in ALLOWED or n.split(".")[0] in {"torch"}, f"{path.name} imports {n}"
                assert n.split(".")[0] != "acceptance", f"{path.name} imports the bare 'acceptance' package"


def test_verify_refuses_what_is_not_a_distribution_and_takes_an_empty_batch():
    """NaN / inf / negative entries (or logits) went through `verify` and came out as NaN
    acceptance probabilities or distortion; an empty batch failed in min() with a bare RuntimeError."""
    from mmspec.sampling import SamplingConfig, process_logits

    V = 6
    x = torch.tensor([[1, 2]])
    p = torch.softmax(torch.randn(1, 3, V), -1)
    q = torch.softmax(torch.randn(1, 2, V), -1)
    for name, rule in make_rules(V).items():
        for bad in (float("nan"), float("inf"), -0.1):
            tp = p.clone()
            tp[0, 1, 3] = bad
            with pytest.raises(ValueError, match="target_probs must hold finite non-negative probabilities"):
                rule.verify(x, q, tp)
            dq = q.clone()
            dq[0, 0, 0] = bad
            with pytest.raises(ValueError, match="draft_probs must hold finite non-negative probabilities"):
                rule.verify(x, dq, p)
        with pytest.raises(ValueError, match="finite non-negative"):
            rule.verify(x, None, torch.randn(1, 3, V))  # logits
        # Rows that are not distributions: an all-zero target row fell back to uniform, target
        # probabilities times 5 made the exact rule keep every draft.
        for bad_p, bad_q in ((p * 5, q), (p * torch.tensor([0.0, 1, 1]).view(1, 3, 1), q), (p, q * 0)):
            with pytest.raises(ValueError, match="rows must each sum to 1"):
                rule.verify(x, bad_q, bad_p)
        with pytest.raises(TypeError, match="generator must be None or a torch.Generator, got int"):
            rule.verify(x, q, p, generator=3)  # an AttributeError deep in the draw before
        out = rule.verify(torch.zeros(0, 2, dtype=torch.long), None, torch.zeros(0, 3, V))
        assert out.num_accepted.shape == (0,), name
    with pytest.raises(ValueError, match="too small to divide logits by"):
        SamplingConfig(temperature=1e-45)
    SamplingConfig(temperature=1e-30)
    # Past float32's range the division made every logit 0 (top_k=1 sampled uniformly) and masked
    # ones NaN; refused by name.
    with pytest.raises(ValueError, match="too large to divide logits by in float32; use at most 1e30"):
        SamplingConfig(temperature=1e39, top_k=1)
    assert process_logits(torch.tensor([[0.0, 2.0, 1.0]]), SamplingConfig(1e30, top_k=1)).tolist() == [[0, 1, 0]]


def test_numpy_scalar_options_are_taken_as_the_numbers_they_hold():
    """`LanternAcceptance(delta=np.float32(0.25))` was refused as "must be in [0, 1], got
    np.float32(0.25)"; NumPy scalars (from configs, sweeps, np.linspace) now mean their value."""
    import numpy as np

    from mmspec.acceptance.continuous_relaxed import RelaxedContinuousAcceptance
    from mmspec.drafters import JacobiDrafter
    from mmspec.sampling import SamplingConfig

    torch.manual_seed(0)
    cb = torch.randn(12, 3)
    pairs = [(LanternAcceptance(cb, k=np.int64(4), delta=np.float32(0.25)), LanternAcceptance(cb, k=4, delta=0.25)),
             (LanternAcceptance(cb, k=np.int32(4), lam=np.float16(2.0)), LanternAcceptance(cb, k=4, lam=2.0)),
             (TypicalAcceptance(np.float32(0.125), np.float64(0.5)), TypicalAcceptance(0.125, 0.5)),
             (GroupedAcceptance(cb, window=np.int16(3), prob_threshold=np.float32(0.5)),
              GroupedAcceptance(cb, window=3, prob_threshold=0.5))]
    p = torch.softmax(torch.randn(6, 4, 12, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(6, 3, 12, dtype=torch.float64), -1)
    drafts = torch.multinomial(q.view(-1, 12), 1).view(6, 3)
    for numpy_rule, python_rule in pairs:
        a = numpy_rule.verify(drafts, q, p, generator=torch.Generator().manual_seed(1))
        b = python_rule.verify(drafts, q, p, generator=torch.Generator().manual_seed(1))
        assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.next_tokens, b.next_tokens)
    assert ContinuousAcceptance(np.int64(8), np.int64(2)).max_tries == 8
    assert RelaxedContinuousAcceptance(np.float32(2.0)).inner_temperature == 2.0
    config = SamplingConfig(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float32(0.5))
    assert config == SamplingConfig(temperature=0.5, top_k=3, top_p=0.5) and type(config.top_k) is int
    assert JacobiDrafter(np.int64(4)).window == 4 and JacobiDrafter("auto", max_window=np.int8(5)).max_window == 5
    # what is no number stays refused: a NumPy bool, a float where an int is needed
    with pytest.raises(ValueError, match="temperature must be"):
        SamplingConfig(temperature=np.bool_(True))
    with pytest.raises(ValueError, match="top_k must be"):
        SamplingConfig(top_k=np.float32(3.0))


def test_float32_rows_cast_to_float64_are_distributions_and_an_empty_vocabulary_is_refused():
    """A float32 process_logits output cast to float64 was refused as 'not summing to 1' at large
    vocabularies (the float64 tolerance was 1e-6; such rows are 1e-6..1e-5 off); an empty
    vocabulary gave next_tokens of shape [B, 0] with no error."""
    from mmspec.acceptance import ExactAcceptance

    V = 152064
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(1, 1, V, generator=gen) * 4, -1).double()
    p = p * (1 + 9e-6)  # the offset the review measured at this vocabulary
    ExactAcceptance().verify(torch.zeros(1, 0, dtype=torch.long), None, p, generator=gen)
    with pytest.raises(ValueError, match="rows must each sum to 1"):
        ExactAcceptance().verify(torch.zeros(1, 0, dtype=torch.long), None, p * 1.01, generator=gen)
    with pytest.raises(ValueError, match=r"empty vocabulary \(V = 0\)"):
        ExactAcceptance().verify(torch.zeros(2, 0, dtype=torch.long), None, torch.zeros(2, 1, 0), generator=gen)
