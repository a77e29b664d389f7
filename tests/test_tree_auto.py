"""Trees whose size is chosen by measurement (`TreeConfig(num_nodes="auto")`):
lossless whatever node count each request runs (greedy equals `generate` over requests that
run 24, 16, ..., 2 nodes and plain decoding; exact sampling over requests matches the
enumerated joint; a node count changing every step keeps EAGLE / ViSpec / model trees greedy
exact on LLaVA), the controller is the per-request `WindowBandit` and lives on the drafter, and
fixed-shape drafters refuse it by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mmspec
from mmspec.adaptive_window import WindowBandit
from mmspec.drafters import ModelDrafter

from conftest import left_padded
from test_vlm_llava import llava  # noqa: F401  (a fixture)
from test_core_sampling import SAMPLES, V, chi_square_p, joint_23, pair  # noqa: F401  (pair: a fixture)


def test_tree_config_auto():
    t = mmspec.TreeConfig(depth=3, top_k=2, num_nodes="auto")
    assert t.adaptive and t.num_nodes == 10  # at most the 2 + 2 * 4 candidates a depth-3 top-2 tree holds
    with pytest.raises(ValueError, match="exceeds the top_k \\+ \\(depth-1\\)\\*top_k\\^2=10 candidates"):
        mmspec.TreeConfig(depth=3, top_k=2, num_nodes=11)  # before: accepted, and 10 nodes verified
    assert mmspec.TreeConfig(num_nodes="auto").num_nodes == 24
    assert mmspec.TreeConfig(**dataclasses.asdict(t)) == t  # a saved config round-trips
    assert not mmspec.TreeConfig(depth=3, top_k=2, num_nodes=6).adaptive
    with pytest.raises(TypeError, match="adaptive must be a bool"):
        mmspec.TreeConfig(adaptive="yes")
    with pytest.raises(TypeError, match="num_nodes must be an int"):
        mmspec.TreeConfig(num_nodes="many")


def test_auto_tree_greedy_equals_generate_over_requests(target, good_drafter):
    ids, mask = left_padded([9, 5, 7, 3])
    ref = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=0,
                          eos_token_id=2)
    drafter = ModelDrafter(good_drafter, tree=mmspec.TreeConfig(depth=4, top_k=3, num_nodes="auto"))
    assert drafter.adaptive and isinstance(drafter.controller, WindowBandit)
    for _ in range(8):  # the cold request, then a warm-up pass: 24, 16, 8, 4, 2, 0 nodes
        out = mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=24,
                                          eos_token_id=2, pad_token_id=0)
        assert torch.equal(out.sequences, ref)
    arms = {a for _, a in drafter.controller.requests}
    assert arms >= {0, 2, 4, 8, 16, 24}


def test_auto_tree_exact_sampling_matches_enumerated_joint(pair):
    target, draft_model = pair
    prompt = torch.tensor([[1, 5, 3, 6]])
    sampling = mmspec.SamplingConfig(1.0)
    drafter = ModelDrafter(draft_model, tree=mmspec.TreeConfig(depth=2, top_k=2, num_nodes=6, adaptive=True))
    g = torch.Generator().manual_seed(2024)
    counts = torch.zeros(V, V)
    per_call = SAMPLES // 6
    for _ in range(6):  # windows 6, 6 (the cold one), 4, 2, 0, ...: all in one pooled sample
        out = mmspec.speculative_generate(target, drafter, prompt.expand(per_call, -1), acceptance="exact",
                                          temperature=1.0, max_new_tokens=3, generator=g)
        new = out.sequences[:, 4:]
        counts.index_put_((new[:, 1], new[:, 2]), torch.ones(per_call), accumulate=True)
    assert {a for _, a in drafter.controller.requests} >= {0, 2, 4, 6}
    n = per_call * 6
    assert chi_square_p(counts, joint_23(target, prompt, sampling), n) > 1e-4
    assert chi_square_p(counts, joint_23(draft_model, prompt, sampling), n) < 1e-4  # power


def test_a_fixed_shape_drafter_refuses_an_adaptive_tree():
    tree = mmspec.TreeConfig(depth=2, top_k=2, num_nodes="auto")
    with pytest.raises(ValueError, match="static=True / compile= needs a fixed draft length or a fixed tree"):
        ModelDrafter(torch.nn.Linear(2, 2), tree=tree, static=True)


@pytest.mark.parametrize("kind", ["model", "eagle", "vispec"])
def test_tree_size_changing_every_step_stays_greedy_exact(llava, kind):
    """A tree whose node count changes from step to step (0 = plain, the catch-up deferred; a
    scripted controller, so every transition is exercised): greedy output equals plain greedy
    decoding row by row on LLaVA (batch of 4, different prompt lengths and images, EOS)."""
    from test_drafters_eagle import KINDS, ScriptedK, greedy_rows_equal_plain

    model, _ = llava
    tree = mmspec.TreeConfig(depth=3, top_k=2, num_nodes=6, adaptive=True)
    if kind == "model":
        from test_vlm_llava import _text_only

        drafter = ModelDrafter(_text_only(model), tree=tree)
    else:
        from _eagle_helpers import llava_test_head

        drafter = KINDS[kind][1](model, llava_test_head(model, kind), tree=tree)
    assert drafter.adaptive and isinstance(drafter.controller, WindowBandit)
    script = [0, 0, 4, 0, 2, 6, 0, 1, 6]
    drafter.controller = ScriptedK(script)
    out = greedy_rows_equal_plain(model, drafter)
    ks = out.stats.nodes_per_step
    assert ks[: len(script)] == script[: len(ks)] and len(ks) > 4
    assert 0 < out.stats.accepted_drafts < out.stats.drafted_nodes  # drafts kept and drafts rejected


def test_the_tree_bandit_scores_tokens_that_reached_the_output(target, good_drafter):
    """It counted the rule's accepted drafts + 1 per row, drafts past max_new_tokens included: on
    3-token answers a wide tree was credited 22 tokens where the steps emitted 8."""
    ids, mask = left_padded([5, 3, 7, 4])
    d = ModelDrafter(good_drafter, tree=mmspec.TreeConfig(depth=5, top_k=2, num_nodes="auto"))
    for _ in range(3):
        out = mmspec.speculative_generate(target, d, ids, mask, temperature=0, max_new_tokens=3)
        s = out.stats
        assert d.controller._tokens == s.emitted_tokens  # the request's score counts what was emitted
    assert s.verified_accepted > s.accepted_drafts  # drafts were accepted past the end: the counts could differ
