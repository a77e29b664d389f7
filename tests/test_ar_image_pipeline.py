"""`SpeculativeARImagePipeline` on tiny random LlamaGen GPTs and a tiny VQ: greedy tokens equal
the plain sampler's for every drafter (with CFG), `speculative=False` reproduces the plain
sampler for a seed, save_pretrained -> from_pretrained gives bit-identical images, the testbed
folder layout loads, drafters swap, bad input is refused by name, a callback stops a run and
gets what was decoded so far."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from mmspec.drafters import JacobiDrafter, ModelDrafter, NullDrafter
from mmspec.models.llamagen_sample import generate_plain
from mmspec.models.llamagen_spec import LlamaGenSpec
from mmspec.models.llamagen_tokenizer import LlamaGenVQ, VQConfig
from mmspec.models.llamagen_vq_model import LlamaGenVQModel
from mmspec.pipelines import SpeculativeARImagePipeline

from _llamagen_helpers import LABELS, noisy_gpt, plain_greedy, tiny_gpt

VQ_CFG = VQConfig(codebook_size=24, codebook_embed_dim=4, ch=32, ch_mult=(1, 1), z_channels=32, num_res_blocks=1,
                  image_size=8)  # 8x8 pixels, 4x4 = 16 tokens (the tiny GPT's block size)


def tiny_vq(dtype=torch.float64) -> LlamaGenVQModel:
    torch.manual_seed(0)
    return LlamaGenVQModel.from_vq(LlamaGenVQ(VQ_CFG).eval()).to(dtype)


def make_pipe(dtype=torch.float64, drafter="model") -> SpeculativeARImagePipeline:
    target = tiny_gpt(0, dtype=dtype)
    d = noisy_gpt(target, 0.3) if drafter == "model" else drafter
    pipe = SpeculativeARImagePipeline(target=target, vq=tiny_vq(dtype), drafter=d)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("drafter", ["model", "jacobi-maximal", "jacobi-none", "plain"])
@pytest.mark.parametrize("cfg", [(1.0, "constant"), (3.0, "constant"), (4.0, "linear")], ids=["nocfg", "cfg", "linear"])
def test_greedy_tokens_equal_plain_sampler(drafter, cfg):
    scale, schedule = cfg
    pipe = make_pipe()
    if drafter.startswith("jacobi"):
        pipe.drafter = JacobiDrafter(6, None if drafter.endswith("none") else "maximal")
    out = pipe(LABELS.tolist(), guidance_scale=scale, cfg_schedule=schedule, temperature=0, output_type="latent",
               speculative=drafter != "plain", generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.tokens, plain_greedy(pipe.target, scale=scale, schedule=schedule))
    assert out.images is None and out.stats.images == 4
    if drafter == "plain":
        assert out.stats.target_forwards_per_image == 16.0  # one forward per image token
    elif drafter == "model":
        assert out.stats.target_forwards_per_image < 16.0


@pytest.mark.parametrize("schedule", ["constant", "linear"])
def test_plain_decoding_reproduces_the_plain_sampler_for_a_seed(schedule):
    pipe = make_pipe()
    out = pipe([2, 0, 2], num_images_per_prompt=2, guidance_scale=2.5, cfg_schedule=schedule, speculative=False,
               generator=torch.Generator().manual_seed(5), output_type="latent")
    ref = generate_plain(pipe.target, torch.tensor([2, 2, 0, 0, 2, 2]), cfg_scale=2.5, cfg_schedule=schedule,
                         generator=torch.Generator().manual_seed(5))
    assert torch.equal(out.tokens, ref)


@pytest.mark.parametrize("drafter", ["model", "jacobi"])
def test_save_load_round_trip_gives_bit_identical_images(tmp_path, drafter):
    pipe = make_pipe(torch.float32)
    if drafter == "jacobi":
        pipe.drafter = JacobiDrafter(5, "gumbel", init="last")
    kw = dict(guidance_scale=3.0, output_type="np")
    first = pipe([1, 4], generator=torch.Generator().manual_seed(3), **kw)
    pipe.save_pretrained(tmp_path / "p")
    index = json.loads((tmp_path / "p" / "model_index.json").read_text())
    assert index["drafter_config"]["kind"] == ("jacobi" if drafter == "jacobi" else "model")
    loaded = SpeculativeARImagePipeline.from_pretrained(tmp_path / "p")
    loaded.set_progress_bar_config(disable=True)
    assert type(loaded.drafter) is type(pipe.drafter)
    if drafter == "jacobi":
        assert (loaded.drafter.window, loaded.drafter.coupling, loaded.drafter.init) == (5, "gumbel", "last")
    second = loaded([1, 4], generator=torch.Generator().manual_seed(3), **kw)
    assert np.array_equal(first.images, second.images) and torch.equal(first.tokens, second.tokens)
    third = pipe([1, 4], generator=torch.Generator().manual_seed(4), **kw)
    assert not torch.equal(first.tokens, third.tokens)  # the seed matters: the comparison can fail


def test_saving_keeps_the_held_drafter_gpt_and_leaves_the_live_pipeline_unchanged(tmp_path):
    pipe = make_pipe(torch.float32)
    gpt = pipe.drafter
    assert pipe.drafter_model is gpt  # a GPT drafter is also the one at hand
    pipe.drafter = JacobiDrafter(3, None)
    live = json.dumps([pipe.config.drafter, pipe.config.drafter_config], sort_keys=True)
    pipe.save_pretrained(tmp_path / "p")
    assert json.dumps([pipe.config.drafter, pipe.config.drafter_config], sort_keys=True) == live  # left as it was
    assert isinstance(pipe.drafter, JacobiDrafter) and pipe.drafter_model is gpt
    index = json.loads((tmp_path / "p" / "model_index.json").read_text())
    assert index["drafter_config"]["kind"] == "jacobi" and index["drafter"][1] == "LlamaGenGPT"
    loaded = SpeculativeARImagePipeline.from_pretrained(tmp_path / "p")
    loaded.set_progress_bar_config(disable=True)
    assert isinstance(loaded.drafter, JacobiDrafter) and loaded.drafter.window == 3
    held = loaded.drafter_model  # the drafter GPT came back with the folder (it was dropped)
    assert all(torch.equal(a, b) for a, b in zip(held.state_dict().values(), gpt.state_dict().values()))
    kw = dict(temperature=0, guidance_scale=2.0, output_type="latent")
    loaded.drafter = held
    pipe.drafter = gpt
    a, b = loaded([0, 3], **kw), pipe([0, 3], **kw)
    assert torch.equal(a.tokens, b.tokens) and "ModelDrafter" in a.stats.drafter
    # saved again with the GPT active, the folder drafts with it
    loaded.save_pretrained(tmp_path / "q")
    again = SpeculativeARImagePipeline.from_pretrained(tmp_path / "q")
    assert type(again.drafter).__name__ == "LlamaGenGPT" and again.drafter_model is again.drafter


def test_testbed_layout_loads(tmp_path):
    target = tiny_gpt(0, dtype=torch.float32)
    target.save_pretrained(tmp_path / "target")
    noisy_gpt(target, 0.3).save_pretrained(tmp_path / "drafter")
    vq = LlamaGenVQ(VQ_CFG).eval()
    vq.save_pretrained(tmp_path / "vq", dtype=torch.float32)  # LlamaGenVQ's own folder format
    pipe = SpeculativeARImagePipeline.from_pretrained(tmp_path)
    pipe.set_progress_bar_config(disable=True)
    out = pipe([0, 1], temperature=0, guidance_scale=2.0, output_type="pt")
    assert torch.equal(out.tokens, generate_plain(target, torch.tensor([0, 1]), cfg_scale=2.0, temperature=0))
    assert out.images.shape == (2, 3, 8, 8) and float(out.images.min()) >= 0 and float(out.images.max()) <= 1
    codes = out.tokens.view(2, 4, 4)
    assert torch.allclose(out.images, (vq.decode(codes) + 1) / 2)
    assert "ModelDrafter" in out.stats.drafter
    # drafter= / drafter_config= replace the folder's (they were dropped); other options are refused
    swapped = SpeculativeARImagePipeline.from_pretrained(tmp_path, drafter=JacobiDrafter(3, None))
    assert isinstance(swapped.drafter, JacobiDrafter) and swapped.drafter.window == 3
    configured = SpeculativeARImagePipeline.from_pretrained(tmp_path, drafter_config={"kind": "jacobi", "window": 2})
    assert configured.drafter.window == 2 and configured.drafter_model is not None
    assert SpeculativeARImagePipeline.from_pretrained(tmp_path, drafter=None).drafter is None
    with pytest.raises(TypeError, match=r"unsupported argument\(s\) \['bogus_option'\]"):
        SpeculativeARImagePipeline.from_pretrained(tmp_path, bogus_option=1)


def test_pil_output_and_relaxed_rules():
    pipe = make_pipe(torch.float32)
    for rule in ("lantern", "gsd"):  # tables (VQ codebook, token embeddings) come from the pipeline
        out = pipe([0, 1], acceptance=rule, generator=torch.Generator().manual_seed(0))
        assert len(out.images) == 2 and out.images[0].size == (8, 8) and not out.stats.lossless
    images, tokens, stats = pipe(3, return_dict=False, generator=torch.Generator().manual_seed(0))
    assert len(images) == 1 and tokens.shape == (1, 16) and stats.images == 1


def test_broken_vq_decoder_is_refused_not_returned_as_an_image():
    """A VQ decoder that turns out NaN would give a broken picture (clamp keeps NaN): refused
    with a ValueError naming the decoder; the tokens are still available as output_type='latent'."""
    pipe = make_pipe(torch.float32)
    with torch.no_grad():
        pipe.vq.vq.decoder.conv_in.weight.fill_(float("nan"))
    for output_type in ("pil", "np", "pt"):
        with pytest.raises(ValueError, match="VQ decoder produced non-finite pixels"):
            pipe([0], output_type=output_type, generator=torch.Generator().manual_seed(0))
    assert pipe([0], output_type="latent", generator=torch.Generator().manual_seed(0)).tokens.shape == (1, 16)


def test_lantern_default_neighbourhood_is_lanterns_fraction_of_the_codebook(monkeypatch):
    # LANTERN's k = 1000 of 16384 codes, kept as a fraction of this codebook; an explicit k wins.
    from mmspec.acceptance.lantern import LanternAcceptance

    seen = []
    init = LanternAcceptance.__init__

    def spy(self, codebook, *args, **kwargs):
        seen.append((codebook.shape[0], kwargs.get("k", args[0] if args else None)))
        init(self, codebook, *args, **kwargs)

    monkeypatch.setattr(LanternAcceptance, "__init__", spy)
    pipe = make_pipe(torch.float32)
    pipe([0], acceptance="lantern", generator=torch.Generator().manual_seed(0))
    pipe([0], acceptance="lantern", acceptance_kwargs={"k": 3}, generator=torch.Generator().manual_seed(0))
    V = seen[0][0]
    assert seen == [(V, max(1, round(V * 1000 / 16384))), (V, 3)], seen


def test_bad_input_is_refused_by_name(tmp_path):
    pipe = make_pipe(torch.float32)
    with pytest.raises(ValueError, match="unknown class id"):
        pipe([0, 7])
    with pytest.raises(ValueError, match="top_k"):
        pipe([0], top_k=25)
    with pytest.raises(ValueError, match="output_type"):
        pipe([0], output_type="jpeg")
    with pytest.raises(ValueError, match=r"tensor of shape \(1, 2\)"):  # was flattened into 2 images
        pipe(torch.tensor([[0, 1]]))
    with pytest.raises(TypeError, match="generator"):  # was an AttributeError in the first draw
        pipe([0], generator=5)
    with pytest.raises(TypeError, match="speculative must be True or False"):  # "no" read as True
        pipe([0], speculative="no")
    with pytest.raises(TypeError, match="return_dict must be True or False"):  # "no" returned the output object
        pipe([0], return_dict="no")
    with pytest.raises(TypeError, match="callback_on_step_end must be None or callable, got int"):
        pipe([0], callback_on_step_end=3)
    with pytest.raises(TypeError, match="drafter must be None, a LlamaGenGPT, a JacobiDrafter or an mmspec Drafter, "
                                        "got str"):  # diffusers' registration failed with AttributeError '__module__'
        pipe.drafter = "jacobi"
    # A drafter the folder cannot hold: it was saved with a warning, and the folder drafted
    # with a JacobiDrafter instead.
    pipe.drafter = NullDrafter(30)
    with pytest.raises(ValueError, match="pipe.drafter is a NullDrafter, which a saved pipeline cannot hold"):
        pipe.save_pretrained(tmp_path / "other")
    pipe.drafter = None
    # Below 1, LlamaGen (cfg_scale > 1.0 only) and diffusers sample unguided; mmspec computed
    # u + s (c - u) (for 0: the unconditional branch alone). Refused under both schedules.
    for schedule in ("constant", "linear"):
        for scale in (0.0, 0.5, -2.0):
            with pytest.raises(ValueError, match=f"guidance_scale={scale}: LlamaGen's sampling"):
                pipe([0], guidance_scale=scale, cfg_schedule=schedule)
    from mmspec.models.llamagen_sample import generate_plain
    with pytest.raises(ValueError, match="cfg_scale=0.5"):
        generate_plain(pipe.target, torch.tensor([0]), cfg_scale=0.5)
    no_null = SpeculativeARImagePipeline(target=tiny_gpt(0, null_class=False, dtype=torch.float32), vq=tiny_vq(torch.float32))
    with pytest.raises(ValueError, match="no unconditional branch"):
        no_null([0], guidance_scale=4.0)
    with pytest.raises(ValueError, match="codebook mismatch"):
        SpeculativeARImagePipeline(target=pipe.target, vq=tiny_vq(torch.float32), drafter=tiny_gpt(1, vocab=30))
    with pytest.raises(ValueError, match="codebook mismatch"):
        SpeculativeARImagePipeline(target=tiny_gpt(0, vocab=30), vq=tiny_vq(torch.float32))
    pipe.drafter = JacobiDrafter(4, vocab_size=30)
    with pytest.raises(ValueError, match="codebook mismatch"):
        pipe([0])
    # A checkpoint of another architecture where the target should be.
    pipe.drafter = None
    pipe.save_pretrained(tmp_path / "p")
    tiny_vq(torch.float32).save_pretrained(tmp_path / "p" / "target")
    with pytest.raises(ValueError, match="another architecture"):
        SpeculativeARImagePipeline.from_pretrained(tmp_path / "p")
    index = json.loads((tmp_path / "p" / "model_index.json").read_text())
    index["_class_name"] = "StableDiffusionPipeline"
    (tmp_path / "p" / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="StableDiffusionPipeline"):
        SpeculativeARImagePipeline.from_pretrained(tmp_path / "p")


def test_callback_stops_and_returns_what_was_decoded():
    pipe = make_pipe()
    seen = []

    def stop_after_three(p, step, done, kwargs):
        seen.append((step, done, kwargs["num_tokens"]))
        if step == 3:
            p._interrupt = True
        return kwargs

    out = pipe(LABELS.tolist(), guidance_scale=3.0, temperature=0, output_type="pil", callback_on_step_end=stop_after_three)
    assert out.interrupted and out.stats.interrupted and [s for s, _, _ in seen] == [1, 2, 3]
    full = plain_greedy(pipe.target, scale=3.0)
    counts = seen[-1][2]
    for b in range(4):  # decoded tokens are a correct prefix, the rest is flagged with -1
        assert torch.equal(out.tokens[b, : counts[b]], full[b, : counts[b]])
        assert bool((out.tokens[b, counts[b]:] == -1).all())
    assert 4 < sum(counts) < 64 and all(img is None for img in out.images)
    # A callback returning {"stop": True} stops too.
    out = pipe([0], temperature=0, guidance_scale=3.0, output_type="latent",
               callback_on_step_end=lambda p, s, d, kw: {"stop": s >= 2})
    assert out.interrupted and out.stats.target_calls == 2
    # What a stopped run reports is what happened (it said lossless=True for LANTERN and 0 row
    # steps / emitted tokens / mean accepted length, with 3 tokens decoded).
    out = pipe([0, 1], temperature=1.0, guidance_scale=3.0, output_type="latent", acceptance="lantern",
               generator=torch.Generator().manual_seed(0), callback_on_step_end=lambda p, s, d, kw: {"stop": s >= 2})
    decoded = int((out.tokens >= 0).sum())
    assert out.interrupted and out.stats.lossless is False and out.stats.row_steps == 4
    assert out.stats.emitted_tokens == decoded - 2  # each row's first token comes from the prefill
    assert out.stats.mean_accepted_length == pytest.approx((decoded - 2) / 4)
    assert out.stats.target_forwards_per_image == pytest.approx(3.0)  # prefill + 2 verify forwards
    # ... and the rest of what ran: it said 0 drafter forwards, 0 drafts, 0 seconds, stock kernels.
    assert out.stats.draft_calls >= 2 and out.stats.drafted_nodes > 0 and out.stats.total_seconds > 0
    assert out.stats.accepted_drafts == out.stats.emitted_tokens - out.stats.row_steps  # drafts + one token a row-step
    assert len(out.stats.nodes_per_step) == 2 and out.stats.kernels.startswith("target ")
    assert out.stats.distortion_total >= 0 and out.stats.new_tokens == (out.tokens >= 0).sum(1).tolist()
    # A stop asked for after the last token loses nothing: the run is complete, not flagged.
    plain = pipe([0, 1], temperature=0, guidance_scale=3.0, output_type="latent", speculative=False)
    out = pipe([0, 1], temperature=0, guidance_scale=3.0, output_type="np", speculative=False,
               callback_on_step_end=lambda p, s, d, kw: {"stop": min(kw["num_tokens"]) == 16})
    assert not out.interrupted and not out.stats.interrupted and torch.equal(out.tokens, plain.tokens)
    assert out.images.shape == (2, 8, 8, 3) and out.stats.target_calls == 15


def test_a_callback_that_edits_the_tokens_is_refused():
    """Edited tokens were not read (the run went on with its own): a diffusers user expects an
    edit to steer the run, so an edit, returned or in place, is refused; returning the dict
    unchanged (diffusers' usual `return callback_kwargs`) or another entry is fine."""
    pipe = make_pipe()

    def returned(p, s, d, kw):
        kw["tokens"] = kw["tokens"].clone()
        kw["tokens"][0, 0] += 1
        return kw

    def in_place(p, s, d, kw):
        kw["tokens"][0, 0] += 1

    def fewer(p, s, d, kw):
        return {**kw, "num_tokens": [0] * len(kw["num_tokens"])}

    for callback in (returned, in_place, fewer):
        with pytest.raises(ValueError, match="callback_on_step_end edited 'tokens' or 'num_tokens'"):
            pipe([0], temperature=0, guidance_scale=3.0, output_type="latent", callback_on_step_end=callback)
    plain = pipe([0, 1], temperature=0, guidance_scale=3.0, output_type="latent")
    for callback in (lambda p, s, d, kw: kw, lambda p, s, d, kw: None, lambda p, s, d, kw: {"note": s}):
        out = pipe([0, 1], temperature=0, guidance_scale=3.0, output_type="latent", callback_on_step_end=callback)
        assert torch.equal(out.tokens, plain.tokens) and not out.interrupted


def test_drafter_object_swap_and_plain_model_drafter():
    """Any mmspec Drafter can be set; an unguided ModelDrafter under CFG is still exact (greedy equal)."""
    pipe = make_pipe()
    pipe.drafter = ModelDrafter(LlamaGenSpec(noisy_gpt(pipe.target, 0.3)), 3)
    out = pipe(LABELS.tolist(), guidance_scale=3.0, temperature=0, output_type="latent")
    assert torch.equal(out.tokens, plain_greedy(pipe.target, scale=3.0))
    assert out.stats.drafter == "ModelDrafter"


def test_linear_kernels_are_a_pipeline_setting():
    """`pipe.prepack` picks the linear kernels of the target and of a GPT drafter: False keeps
    stock kernels, True packs (float32); both give the same greedy tokens; a bad value or
    packing a float64 model is refused by name."""
    from mmspec.bench.imagegen import STOCK, method_spec

    pipe = make_pipe(torch.float32)
    assert pipe.prepack == "auto"
    outs = {}
    for setting in (False, True):
        pipe.prepack = setting
        outs[setting] = pipe(LABELS.tolist(), guidance_scale=3.0, temperature=0, output_type="latent")
    assert outs[False].stats.kernels == "target stock, drafter stock"
    assert outs[True].stats.kernels == "target prepacked, drafter prepacked"
    assert torch.equal(outs[False].tokens, outs[True].tokens)
    pipe.prepack = "fast"
    with pytest.raises(ValueError, match="prepack"):
        pipe([0], output_type="latent")
    pipe64 = make_pipe()
    pipe64.prepack = True
    with pytest.raises(ValueError, match="float32 only"):
        pipe64([0], output_type="latent")
    assert method_spec("exact/jacobi-maximal@8" + STOCK) == method_spec("exact/jacobi-maximal@8")


def test_sampling_settings_are_refused_before_the_progress_bar_starts(capsys):
    """temperature / top_k / top_p / an unknown rule name were checked inside the loop, so a
    user saw a 0% progress bar and then the error; now they fail before any bar is drawn."""
    pipe = make_pipe(torch.float32)
    pipe.set_progress_bar_config(disable=False)
    cases = [(dict(temperature=-1.0), "temperature must be"), (dict(top_k=0), "top_k must be None or an int >= 1"),
             (dict(top_p=1.5), "top_p must be None"), (dict(acceptance="foo"), "acceptance='foo' is not a known rule"),
             (dict(acceptance="continuous"), "verifies continuous tokens"),
             (dict(generator=[torch.Generator()]), "a list of 1 generators"), (dict(generator=3), "generator must be")]
    for kwargs, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            pipe([0], **kwargs)
        assert "it/s" not in capsys.readouterr().err, kwargs  # no bar was drawn
    pipe([0], num_images_per_prompt=1, output_type="latent")  # a valid call does draw it
    assert "it/s" in capsys.readouterr().err


def test_a_folder_with_missing_renamed_or_extra_weights_is_refused_by_key(tmp_path):
    """diffusers' loader only logged "newly initialized" for a missing key (and, without
    accelerate, kept its random values): an edited target or VQ loaded partly random."""
    from safetensors.torch import load_file, save_file

    pipe = make_pipe(torch.float32)
    pipe.save_pretrained(tmp_path / "p")
    edits = {"target": [("drop", "output.weight"), ("rename", "norm.weight"), ("extra", "norm.bias")],
             "vq": [("drop", "vq.decoder.conv_out.weight")]}
    for component, changes in edits.items():
        for how, key in changes:
            folder = tmp_path / f"{component}_{how}"
            shutil.copytree(tmp_path / "p", folder)
            f = folder / component / "diffusion_pytorch_model.safetensors"
            sd = load_file(f)
            if how == "drop":
                sd.pop(key)
            elif how == "rename":
                sd[key + "_old"] = sd.pop(key)
            else:
                sd[key] = torch.zeros(3)
            save_file(sd, f)
            with pytest.raises(ValueError, match="does not match the model .*" + re.escape(key)):
                SpeculativeARImagePipeline.from_pretrained(folder)
    again = SpeculativeARImagePipeline.from_pretrained(tmp_path / "p")  # the unedited folder loads
    assert torch.equal(again.target.output.weight, pipe.target.output.weight)


def test_pipeline_options_are_honoured_or_refused_by_name():
    """Each was accepted and ignored, or failed deep inside with an error naming nothing:
    acceptance_kwargs beside a rule object, unknown drafter_config keys or kinds, a drafter GPT
    whose position table is shorter than the image (its positions clamped), num_images_per_prompt=True,
    guidance_scale=None / "high"."""
    from mmspec.acceptance import ExactAcceptance

    pipe = make_pipe(torch.float32)
    with pytest.raises(ValueError, match="acceptance_kwargs must be a dict and goes with a rule name"):
        pipe([0], acceptance=ExactAcceptance(), acceptance_kwargs={"k": 3})
    with pytest.raises(ValueError, match="acceptance_kwargs must be a dict"):
        pipe([0], acceptance="lantern", acceptance_kwargs=[("k", 3)])
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['windw'\]"):
        SpeculativeARImagePipeline(target=pipe.target, vq=pipe.vq, drafter_config={"kind": "jacobi", "windw": 3})
    with pytest.raises(ValueError, match="drafter_config\\['kind'\\] must be 'model' or 'jacobi'"):
        SpeculativeARImagePipeline(target=pipe.target, vq=pipe.vq, drafter_config={"kind": "jacobbi"})
    with pytest.raises(ValueError, match="drafter/target grid mismatch: the drafter GPT has block_size=4"):
        SpeculativeARImagePipeline(target=pipe.target, vq=pipe.vq, drafter=tiny_gpt(1, block=4, dtype=torch.float32))
    with pytest.raises(ValueError, match="num_images_per_prompt must be an int >= 1, got True"):
        pipe([0], num_images_per_prompt=True)
    for scale in (None, "high"):
        with pytest.raises(ValueError, match="guidance_scale must be a finite number"):
            pipe([0], guidance_scale=scale)


def test_rule_settings_are_checked_with_speculative_off_too():
    """speculative=False replaced the rule with exact sampling before it was built: a greedy rule
    at temperature 1 and bad rule arguments, refused with speculative=True, passed silently (so a
    side-by-side timing failed on one side only)."""
    pipe = make_pipe(torch.float32)
    cases = [(dict(acceptance="greedy"), "decodes greedily"),
             (dict(acceptance="lantern", acceptance_kwargs={"bogus": 1}), "takes no argument"),
             (dict(acceptance="lantern", acceptance_kwargs={"delta": 7.0}), "delta must be"),
             (dict(acceptance="typical", acceptance_kwargs={"epsilon": -1.0}), "epsilon must be")]
    for kwargs, message in cases:
        for speculative in (True, False):
            with pytest.raises((ValueError, TypeError), match=message):
                pipe([0], speculative=speculative, output_type="latent", **kwargs)
    out = pipe([0], acceptance="greedy", temperature=0, speculative=False, output_type="latent")
    assert out.tokens.shape == (1, pipe.num_tokens)


def test_numpy_labels_and_top_k_are_taken_as_numbers():
    import numpy as np

    pipe = make_pipe(torch.float32)
    ref = pipe([3, 1], top_k=5, generator=torch.Generator().manual_seed(0), output_type="latent").tokens
    for labels in (np.array([3, 1]), [np.int64(3), np.int32(1)]):
        out = pipe(labels, top_k=np.int64(5), generator=torch.Generator().manual_seed(0), output_type="latent")
        assert torch.equal(out.tokens, ref)
    ref = pipe([3], num_images_per_prompt=2, guidance_scale=3.0, generator=torch.Generator().manual_seed(0),
               output_type="latent").tokens
    out = pipe([3], num_images_per_prompt=np.int64(2), guidance_scale=np.float32(3.0),
               generator=torch.Generator().manual_seed(0), output_type="latent")  # "must be a finite number" before
    assert torch.equal(out.tokens, ref)


def test_diffusers_offload_and_attention_switches_are_refused_by_name():
    """enable_model_cpu_offload was accepted and did nothing (the loop never calls the models'
    forward, where accelerate hooks in: on a GPU the models would have stayed on the CPU);
    sequential offload died on meta tensors; attention slicing / xformers changed nothing."""
    from mmspec.pipelines import SpeculativeMARPipeline, SpeculativeVLMPipeline
    from mmspec.pipelines.unsupported import RefusesOffload

    pipe = make_pipe(torch.float32)
    for name in ("enable_model_cpu_offload", "enable_sequential_cpu_offload", "enable_group_offload",
                 "enable_attention_slicing", "enable_xformers_memory_efficient_attention"):
        with pytest.raises(ValueError, match=f"SpeculativeARImagePipeline.{name} is not supported"):
            getattr(pipe, name)()
        for cls in (SpeculativeMARPipeline, SpeculativeVLMPipeline):
            assert getattr(cls, name) is getattr(RefusesOffload, name), (cls, name)
    assert pipe([0], output_type="latent").tokens.shape == (1, pipe.num_tokens)  # the pipeline still runs


def test_a_pipeline_built_from_components_drafts_the_same():
    """`type(pipe)(**pipe.components)` dropped drafter_config: a K=2 drafter came back as a
    default chain (other tokens for a seed under exact sampling)."""
    target = tiny_gpt(0, dtype=torch.float32)
    pipe = SpeculativeARImagePipeline(target=target, vq=tiny_vq(torch.float32), drafter=noisy_gpt(target, 0.3),
                                      drafter_config={"num_draft_tokens": 2})
    pipe.set_progress_bar_config(disable=True)
    copy = SpeculativeARImagePipeline(**pipe.components)
    copy.set_progress_bar_config(disable=True)
    assert copy.config.drafter_config == pipe.config.drafter_config
    a = pipe([0, 1], generator=torch.Generator().manual_seed(3), output_type="latent")
    b = copy([0, 1], generator=torch.Generator().manual_seed(3), output_type="latent")
    assert torch.equal(a.tokens, b.tokens) and a.stats.nodes_per_step == b.stats.nodes_per_step


def test_the_held_drafter_gpt_follows_pipe_to():
    pipe = make_pipe(torch.float32)
    gpt = pipe.drafter
    pipe.drafter = JacobiDrafter(4)
    pipe.drafter_model = gpt  # held aside while Jacobi drafts
    pipe.to(torch.bfloat16)
    assert pipe.target.dtype == torch.bfloat16 and gpt.dtype == torch.bfloat16  # it stayed float32
    pipe.drafter = pipe.drafter_model
    assert pipe([0], output_type="latent", generator=torch.Generator().manual_seed(0)).tokens.shape == (1, pipe.num_tokens)


def test_load_options_are_honoured_or_refused_by_name(tmp_path):
    """A saved folder took torch_dtpye= (diffusers logs "will be ignored": float32 loaded) and
    torch_dtype="float16" (float32 loaded); the testbed layout failed on it as a device string."""
    pipe = make_pipe(torch.float32)
    pipe.save_pretrained(tmp_path / "p")
    assert SpeculativeARImagePipeline.from_pretrained(tmp_path / "p", torch_dtype=torch.bfloat16).target.dtype == torch.bfloat16
    with pytest.raises(TypeError, match=r"unsupported argument\(s\) \['torch_dtpye'\]"):
        SpeculativeARImagePipeline.from_pretrained(tmp_path / "p", torch_dtpye=torch.float16)
    bundle = Path(__file__).resolve().parents[1] / "assets" / "testbed" / "imagegen"
    for folder in (tmp_path / "p", bundle):
        with pytest.raises(TypeError, match="torch_dtype must be a torch.dtype"):
            SpeculativeARImagePipeline.from_pretrained(folder, torch_dtype="float16")
