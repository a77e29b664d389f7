"""Options that were accepted and then ignored, or reported as something that did not happen
(session 59's parameter audit): each is now honoured or refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mmspec
from mmspec.drafters import GuidedModelDrafter
from mmspec.models.llamagen_spec import LlamaGenSpec, llamagen_target, null_class_uncond
from mmspec.pipelines import DrafterComponent, SpeculativeVLMPipeline

from _llamagen_helpers import NUM_CLASSES, noisy_gpt, tiny_gpt
from _vlm_helpers import random_images, tiny_llava_parts
from test_ar_image_pipeline import make_pipe

TREE = mmspec.TreeConfig(depth=2, top_k=2, num_nodes=4)


def test_a_draft_length_beside_a_tree_is_refused_not_dropped():
    gpt = tiny_gpt(0)
    with pytest.raises(ValueError, match="num_draft_tokens=7 has no effect with tree="):
        GuidedModelDrafter(LlamaGenSpec(gpt), 3.0, 7, TREE, make_uncond=null_class_uncond(NUM_CLASSES))
    d = GuidedModelDrafter(LlamaGenSpec(gpt), 3.0, tree=TREE, make_uncond=null_class_uncond(NUM_CLASSES))
    assert d.tree == TREE
    assert GuidedModelDrafter(LlamaGenSpec(gpt), 3.0, make_uncond=null_class_uncond(NUM_CLASSES)).num_draft_tokens == 4
    # The image pipeline: a tree with a non-default K is refused; the stats name the tree alone.
    pipe = make_pipe()
    pipe.config.drafter_config["tree"] = {"depth": 2, "top_k": 2, "num_nodes": 4}
    out = pipe([0], guidance_scale=3.0, temperature=0, output_type="latent")
    assert out.stats.drafter.startswith("GuidedModelDrafter(tree=") and "K=" not in out.stats.drafter
    pipe.config.drafter_config["num_draft_tokens"] = 9
    with pytest.raises(ValueError, match=r"num_draft_tokens'\]=9 has no effect beside a 'tree'"):
        pipe([0], guidance_scale=3.0, temperature=0, output_type="latent")
    # A saved VLM drafter component: K beside a tree, an LM config on a head drafter.
    with pytest.raises(ValueError, match="num_draft_tokens=7 has no effect on a tree drafter"):
        DrafterComponent(kind="eagle", head_config={"hidden_size": 8}, num_draft_tokens=7, tree_depth=2,
                         tree_top_k=2, tree_num_nodes=4)
    with pytest.raises(ValueError, match="lm_config describes a text drafter's LM"):
        DrafterComponent(kind="eagle", head_config={"hidden_size": 8}, lm_config={"model_type": "llama"})


def test_a_stopped_image_run_reports_the_rule_that_ran():
    """At temperature 0 "typical" runs its greedy, lossless form: a run stopped by the callback
    said lossless=False (the class's flag) where the complete run said True."""
    pipe = make_pipe()
    full = pipe([0, 1], acceptance="typical", temperature=0, guidance_scale=3.0, output_type="latent")
    stopped = pipe([0, 1], acceptance="typical", temperature=0, guidance_scale=3.0, output_type="latent",
                   callback_on_step_end=lambda p, s, d, kw: {"stop": s >= 2})
    assert full.stats.lossless is True and stopped.interrupted and stopped.stats.lossless is True
    # Sampling with a lossy rule still says so when stopped.
    lossy = pipe([0, 1], acceptance="typical", temperature=1.0, guidance_scale=3.0, output_type="latent",
                 generator=torch.Generator().manual_seed(0), callback_on_step_end=lambda p, s, d, kw: {"stop": s >= 2})
    assert lossy.interrupted and lossy.stats.lossless is False


def test_vlm_plain_decoding_is_lossless_whatever_the_rule():
    model, processor = tiny_llava_parts()
    pipe = SpeculativeVLMPipeline(model, processor)
    images = random_images(2, seed=4)
    runs = [pipe(images, max_new_tokens=6, temperature=1.0, speculative=False, acceptance=rule,
                 generator=torch.Generator().manual_seed(0)) for rule in ("exact", "typical")]
    assert runs[0].texts == runs[1].texts  # plain sampling either way
    assert runs[1].stats.lossless is True  # it said False: the rule's flag, for a run that drafted nothing
    assert pipe(images, max_new_tokens=4, speculative=False, batch_size=np.int64(1)).texts  # a NumPy int is an int


def test_guided_target_options_are_checked_when_built():
    gpt = tiny_gpt(0)
    target = llamagen_target(gpt, 1.0, num_tokens=16)  # unguided: the bare spec target to guide here
    make = null_class_uncond(NUM_CLASSES)
    with pytest.raises(ValueError, match="uncond_attention_mask goes with uncond_input_ids"):
        mmspec.GuidedTarget(target, 3.0, make_uncond=make, uncond_attention_mask=torch.zeros(1, 1, dtype=torch.long))
    for bad in (-1, 10**6, None, 2.7):
        with pytest.raises(ValueError, match="pad_token_id must be a token id"):
            mmspec.GuidedTarget(target, 3.0, make_uncond=make, pad_token_id=bad)
    g = mmspec.GuidedTarget(target, np.float32(2.0), make_uncond=make, pad_token_id=np.int64(0))
    assert g.pad_token_id == 0 and float(g.schedule(0)) == 2.0
    d = GuidedModelDrafter(LlamaGenSpec(noisy_gpt(gpt, 0.3)), np.float32(2.0), 2, make_uncond=make)
    assert d is not None


def test_spec_runner_takes_static_and_compile_as_spec_target_does():
    from mmspec.spec import SpecRunner

    spec = LlamaGenSpec(tiny_gpt(0))
    with pytest.raises(TypeError, match="static must be a bool"):
        SpecRunner(spec, static="no")  # it ran the static path
    runner = SpecRunner(spec, compile={"backend": "eager"})
    assert runner.static and runner.compile == {"backend": "eager"}
    with pytest.raises(ValueError, match="needs static shapes"):
        SpecRunner(spec, static=False, compile={"backend": "eager"})


def test_folders_saved_with_a_draft_length_beside_a_tree_still_load(tmp_path):
    """Before session 59 a draft length beside a tree was saved (and never used): such folders
    load with the default in its place and a warning, where refusing them broke the folder."""
    import json

    from mmspec.drafters import EagleHead, EagleHeadConfig
    from mmspec.pipelines import SpeculativeARImagePipeline

    from test_ar_image_pipeline import tiny_vq

    with pytest.warns(UserWarning, match="num_draft_tokens=6 has no effect beside a 'tree'"):
        pipe = SpeculativeARImagePipeline(target=tiny_gpt(0), vq=tiny_vq(), drafter=noisy_gpt(tiny_gpt(0), 0.3),
                                          drafter_config={"tree": {"depth": 2, "top_k": 2, "num_nodes": 4},
                                                          "num_draft_tokens": 6})
    assert pipe.config.drafter_config["num_draft_tokens"] == 4
    pipe.set_progress_bar_config(disable=True)
    assert pipe([0], guidance_scale=3.0, temperature=0, output_type="latent").stats.drafter.startswith("GuidedModelDrafter(tree=")
    model, _ = tiny_llava_parts()
    comp = DrafterComponent.from_head(EagleHead(EagleHeadConfig.for_target(model)).double(), tree=TREE)
    comp.save_pretrained(tmp_path / "d")
    cfg = tmp_path / "d" / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "num_draft_tokens": 5}))  # as saved before
    with pytest.warns(UserWarning, match="num_draft_tokens=5 beside a tree"):
        again = DrafterComponent.from_pretrained(tmp_path / "d")
    assert again.config.num_draft_tokens == 4 and again.tree == TREE


def test_a_guided_target_passes_its_inner_targets_stop_request_through():
    target = llamagen_target(tiny_gpt(0), 1.0, num_tokens=16)

    class Stopping:
        def __init__(self, inner):
            self.inner, self.steps = inner, 0

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def commit(self, info):
            self.inner.commit(info)
            self.steps += 1

        @property
        def stop_requested(self):
            return self.steps >= 2

    guided = mmspec.GuidedTarget(Stopping(target), 3.0, make_uncond=null_class_uncond(NUM_CLASSES))
    out = mmspec.speculative_generate(guided, mmspec.drafters.NullDrafter(guided.vocab_size), torch.tensor([[0]]),
                                      max_new_tokens=10)
    assert out.stats.target_calls == 2 and out.stats.new_tokens == [3]  # it ran to max_new_tokens
