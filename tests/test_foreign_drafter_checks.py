"""A drafter written outside mmspec whose Draft is malformed (not a Draft, tokens of another
dtype or row count, parents of another shape, draft_probs of another vocabulary, token ids past
the target's vocabulary) is refused with a ValueError / TypeError naming the drafter and the
field, before the tokens reach the target's embedding lookup (a raw IndexError before); so are
more nodes than its max_draft_nodes, a chain's wrong parents, and draft distributions that are
not distributions, give a drafted token probability 0 or come with a tree (exact sampling then
emitted from another law, silently). A well-formed foreign drafter still decodes exactly like
plain greedy decoding."""

from __future__ import annotations

import pytest
import torch

import mmspec
from mmspec.types import Draft

from conftest import left_padded
from test_core_greedy import LENGTHS, reference


class CustomDrafter:
    """A minimal drafter of its own (the Drafter protocol): drafts `k` copies of the root,
    then `mangle` edits the Draft."""

    vocab_size = 40

    def __init__(self, k=2, mangle=None):
        self.k, self.mangle = k, mangle
        self.max_draft_nodes = k

    def prefill(self, input_ids, attention_mask, target_out, model_inputs, max_new_tokens):
        pass

    def propose(self, roots, sampling, generator):
        B = roots.shape[0]
        draft = Draft(tokens=roots.unsqueeze(1).repeat(1, self.k),
                      parents=torch.arange(-1, self.k - 1).repeat(B, 1))
        return self.mangle(draft) if self.mangle else draft

    def commit(self, info, target_out):
        pass

    def select_rows(self, rows, rows_host):
        pass


def _run(target, drafter, n=6):
    ids, mask = left_padded(LENGTHS)
    return mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=n), ids, mask


def test_a_well_formed_custom_drafter_runs_and_stays_lossless(target):
    assert target.config.vocab_size == CustomDrafter.vocab_size
    out, ids, mask = _run(target, CustomDrafter(k=2), n=10)
    assert torch.equal(out.sequences, reference(target, ids, mask, 10))
    assert out.stats.nodes_per_step[0] == 2


@pytest.mark.parametrize("mangle, error, message", [
    (lambda d: (d.tokens, d.parents), TypeError, r"CustomDrafter.propose must return a mmspec.types.Draft, got tuple"),
    (lambda d: Draft(tokens=d.tokens + 40, parents=d.parents), ValueError,
     r"CustomDrafter.propose drafted token ids outside the target's vocabulary 0\.\.39 \(min \d\d, max \d\d\)"),
    (lambda d: Draft(tokens=d.tokens - 100, parents=d.parents), ValueError, r"outside the target's vocabulary"),
    (lambda d: Draft(tokens=d.tokens.int(), parents=d.parents), ValueError,
     r"Draft.tokens of torch.int32 \(4, 2\); it must be a torch.long tensor \[4 active rows, N\]"),
    (lambda d: Draft(tokens=d.tokens[:2], parents=d.parents[:2]), ValueError, r"Draft.tokens of torch.int64 \(2, 2\)"),
    (lambda d: Draft(tokens=d.tokens, parents=d.parents[:, :1]), ValueError,
     r"Draft.parents \(4, 1\) for tokens \(4, 2\); they must have the same shape"),
    (lambda d: Draft(tokens=d.tokens, parents=d.parents, draft_probs=torch.full((4, 2, 32), 1 / 32)), ValueError,
     r"Draft.draft_probs \(4, 2, 32\); it must be None or \[4, 2, 40\]"),
    (lambda d: Draft(tokens=torch.cat([d.tokens, d.tokens], 1), parents=torch.arange(-1, 3).repeat(4, 1)),
     ValueError, r"CustomDrafter.propose returned 4 draft nodes per row, more than its max_draft_nodes=2"),
    (lambda d: Draft(tokens=d.tokens, parents=torch.full_like(d.parents, -1)), ValueError,
     r"returned is_chain=True with parents that are not a chain's \[-1, 0, 1, ...\]"),
    # draft_probs: rows that are no distributions, or giving the drafted token probability 0, made exact
    # sampling emit from another law without a word (the drafted token was accepted with p / 0 = inf)
    (lambda d: Draft(tokens=d.tokens, parents=d.parents, draft_probs=torch.full((4, 2, 40), 1 / 8)), ValueError,
     r"CustomDrafter.propose's Draft.draft_probs .* rows must each sum to 1"),
    (lambda d: Draft(tokens=d.tokens, parents=d.parents,
                     draft_probs=torch.ones(4, 2, 40).scatter(-1, d.tokens.unsqueeze(-1), 0.0) / 39), ValueError,
     r"CustomDrafter.propose drafted tokens to which its own draft_probs give probability 0"),
    (lambda d: Draft(tokens=d.tokens, parents=torch.full_like(d.parents, -1), is_chain=False,
                     draft_probs=torch.full((4, 2, 40), 1 / 40)), ValueError,
     r"returned draft_probs with a tree: .* draft_probs are for chains only"),
])
def test_malformed_drafts_are_refused_by_name(target, mangle, error, message):
    with pytest.raises(error, match=message):
        _run(target, CustomDrafter(k=2, mangle=mangle))


def test_a_custom_tree_with_parents_after_their_children_is_refused(target):
    def tree(d, parents):
        return Draft(tokens=d.tokens.repeat(1, 2)[:, :3], parents=torch.tensor(parents).repeat(d.tokens.shape[0], 1), is_chain=False)

    ok = CustomDrafter(k=2, mangle=lambda d: tree(d, [-1, -1, 0]))
    ok.max_draft_nodes = 3
    out, ids, mask = _run(target, ok, n=8)
    assert torch.equal(out.sequences, reference(target, ids, mask, 8))
    for parents in ([-1, 0, 3], [-1, 5, 0], [-1, -3, 0]):
        bad = CustomDrafter(k=2, mangle=lambda d, parents=parents: tree(d, parents))
        bad.max_draft_nodes = 3
        with pytest.raises(ValueError, match=r"CustomDrafter.propose returned a tree whose parents\[b, i\] are not "
                                             r"all -1 \(the root\) or a node index < i"):
            _run(target, bad)



def test_only_a_propose_written_outside_mmspec_is_checked(target, monkeypatch):
    """A user subclass of an mmspec drafter that keeps mmspec's `propose` pays no per-step check
    (benchmarks subclass ModelDrafter to count things; their timings stay comparable)."""
    import mmspec.engine as engine
    from mmspec.drafters import ModelDrafter

    calls = []
    check = engine.check_draft
    monkeypatch.setattr(engine, "check_draft", lambda *a: (calls.append(1), check(*a))[1])

    class Counting(ModelDrafter):
        def commit(self, info, target_out):
            super().commit(info, target_out)

    class Overriding(ModelDrafter):
        def propose(self, roots, sampling, generator):
            return super().propose(roots, sampling, generator)

    for cls, checked in ((Counting, False), (Overriding, True)):
        calls.clear()
        out, ids, mask = _run(target, cls(target, 3), n=6)
        assert torch.equal(out.sequences, reference(target, ids, mask, 6))
        assert (len(calls) == len(out.stats.nodes_per_step)) if checked else not calls


def test_an_adaptive_drafter_without_set_draft_length_is_refused_by_name(target):
    """`adaptive = True` on a drafter of its own failed as a raw AttributeError at the first step;
    with `set_draft_length` the loop sets each step's length (0 = a plain step) and stays lossless."""
    flagged = CustomDrafter(k=3)
    flagged.adaptive = True
    with pytest.raises(TypeError, match=r"drafter CustomDrafter says adaptive=True but has no set_draft_length"):
        _run(target, flagged)
    lengths = []
    flagged.set_draft_length = lambda k: (lengths.append(k), setattr(flagged, "k", k))
    out, ids, mask = _run(target, flagged, n=10)
    assert torch.equal(out.sequences, reference(target, ids, mask, 10))
    assert lengths and all(0 <= k <= 3 for k in lengths) and out.stats.nodes_per_step == lengths
