"""`SpeculativeVLMPipeline` on a tiny LLaVA with a real processor and tokenizer built locally:
speculative answers (text, EAGLE and ViSpec drafters, chains and trees) equal plain decoding and
the model's own `generate`; save / load round trips (a saved pipeline, a transformers checkpoint
folder + drafter); drafters switch by name; bad input raises ValueError naming it; a missing or
corrupt image file is reported in its item while the rest of the batch is answered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mmspec
from mmspec.drafters import EagleHead, EagleHeadConfig, ViSpecHead
from mmspec.pipelines import DrafterComponent, SpeculativeVLMPipeline

from _vlm_helpers import random_images, tiny_llava_parts

BUNDLE = Path(__file__).resolve().parents[1] / "assets" / "testbed" / "vlm"

PROMPTS = ["what colour is the circle ?", None, "describe the image", "what shape is left ?"]


@pytest.fixture(scope="module")
def parts():
    return tiny_llava_parts()


def drafters(model):
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    lm = LlamaForCausalLM(model.config.text_config).double().eval()
    lm.model.load_state_dict(model.model.language_model.state_dict())
    lm.lm_head.load_state_dict(model.lm_head.state_dict())
    tree = mmspec.TreeConfig(depth=3, top_k=2, num_nodes=6)
    return {
        "text": DrafterComponent.from_lm(lm, 3),
        "eagle": DrafterComponent.from_head(EagleHead(EagleHeadConfig.for_target(model)).double(), tree=tree),
        "vispec": DrafterComponent.from_head(ViSpecHead(EagleHeadConfig.for_target(model, kind="vispec")).double(), 2),
    }


@torch.no_grad()
def generate_reference(model, processor, images, prompts, pipe, n):
    """The model's own greedy `generate`, item by item, on the processor's outputs."""
    out = []
    for img, p in zip(images, prompts):
        enc = processor(images=[img], text=[pipe._prompt(p, 1)], return_tensors="pt")
        seq = model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                             pixel_values=enc["pixel_values"].to(model.dtype), do_sample=False, max_new_tokens=n,
                             eos_token_id=2, pad_token_id=0)
        out.append(seq[0, enc["input_ids"].shape[1]:])
    return out


def test_pipeline_answers_equal_generate_for_every_drafter_and_round_trip(parts, tmp_path):
    model, processor = parts
    pipe = SpeculativeVLMPipeline(model, processor)
    for name, comp in drafters(model).items():
        pipe.add_drafter(name, comp)
    images = random_images(4, seed=3)
    refs = generate_reference(model, processor, images, PROMPTS, pipe, 10)
    plain = pipe(images, PROMPTS, max_new_tokens=10, speculative=False)
    assert plain.stats.accepted_drafts == 0 and plain.stats.draft_calls == 0
    for name in ("text", "eagle", "vispec"):
        pipe.load_drafter(name)
        for bs in (None, 3):
            out = pipe(images, PROMPTS, max_new_tokens=10, batch_size=bs)
            assert all(torch.equal(a, r) for a, r in zip(out.sequences, refs)), (name, bs)
            assert out.texts == plain.texts and out.errors == [None] * 4
    assert plain.texts[1] == pipe(images[1], max_new_tokens=10).texts[0]  # prompts=None captions
    pipe.save_pretrained(tmp_path / "pipe")
    again = SpeculativeVLMPipeline.from_pretrained(tmp_path / "pipe", dtype=torch.float64)
    assert sorted(again.drafters) == ["eagle", "text", "vispec"]
    assert again.drafter is again.drafters["vispec"]  # the active drafter is the default
    assert again(images, PROMPTS, max_new_tokens=10).texts == plain.texts
    again.load_drafter("text")
    assert again(images, PROMPTS, max_new_tokens=10).texts == plain.texts
    # A transformers checkpoint folder (model + processor) with a saved drafter folder.
    model.save_pretrained(tmp_path / "ckpt")
    processor.save_pretrained(tmp_path / "ckpt")
    third = SpeculativeVLMPipeline.from_pretrained(tmp_path / "ckpt", drafter=tmp_path / "pipe" / "drafters" / "eagle",
                                                   dtype=torch.float64)
    assert third(images, PROMPTS, max_new_tokens=10).texts == plain.texts


def test_sampling_runs_and_is_reproducible(parts):
    model, processor = parts
    pipe = SpeculativeVLMPipeline(model, processor, drafters(model)["eagle"])
    images = random_images(2, seed=4)
    a = pipe(images, max_new_tokens=8, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(0))
    b = pipe(images, max_new_tokens=8, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(0))
    assert a.texts == b.texts and all(t is not None for t in a.texts)


def test_a_progress_bar_counts_items_across_batches(parts, capsys):
    """Work over several batches shows a bar (diffusers' progress_bar, silenced by
    set_progress_bar_config); one batch does not, and the answers are those of one batch."""
    model, processor = parts
    pipe = SpeculativeVLMPipeline(model, processor, drafters(model)["eagle"])
    images = random_images(3, seed=6)
    capsys.readouterr()
    whole = pipe(images, max_new_tokens=4)
    assert "3/3" not in capsys.readouterr().err
    chunked = pipe(images, max_new_tokens=4, batch_size=1)
    assert "3/3" in capsys.readouterr().err
    assert chunked.texts == whole.texts
    # image items, a text-only one and a missing file: two batches of the four items that load
    mixed = pipe([None, *images, "/nonexistent/scene.png"], ["what colour is the circle ?", None, None, None, None],
                 max_new_tokens=4)
    assert "4/4" in capsys.readouterr().err
    # stats.new_tokens is per item in the caller's order, 0 for the item that failed (it was in
    # batch order, image items first, and the failed item was missing from it)
    assert mixed.stats.new_tokens == [len(s) for s in mixed.sequences[:4]] + [0]
    assert mixed.texts[1:4] == whole.texts and mixed.errors[4] is not None
    pipe.set_progress_bar_config(disable=True)
    pipe(images, max_new_tokens=4, batch_size=1)
    assert "3/3" not in capsys.readouterr().err


def test_bad_input_is_refused_by_name(parts, tmp_path):
    model, processor = parts
    pipe = SpeculativeVLMPipeline(model, processor, drafters(model)["eagle"])
    img = random_images(2, seed=5)
    with pytest.raises(ValueError, match="placeholder.*but no image"):
        pipe([None], ["<image> describe the image"])
    with pytest.raises(ValueError, match=r"more images \(2\) than image placeholders \(1\)"):
        pipe([img], ["<image> describe the image"])
    with pytest.raises(ValueError, match="2 prompts for 1 images"):
        pipe(img[:1], ["a", "b"])
    with pytest.raises(TypeError, match="speculative must be True or False"):  # "no" read as True
        pipe(img[:1], speculative="no")
    with pytest.raises(ValueError, match="batch_size must be None or an int >= 1, got True"):  # read as 1
        pipe(img[:1], batch_size=True)
    for images in (None, [None], [img[0], None], [[]], [()]):  # captioned "an image" from the caption prompt alone
        with pytest.raises(ValueError, match="has neither an image nor a prompt"):
            pipe(images)
    assert pipe([None], ["what colour is the circle ?"], max_new_tokens=2).errors == [None]  # text-only: fine
    with pytest.raises(ValueError, match="list of images holds None"):  # the message listed None as allowed
        pipe([[None]], ["what colour is the circle ?"])
    # a name where a component belongs (diffusers failed with AttributeError '__module__')
    with pytest.raises(TypeError, match=r"got str; to switch to a saved drafter by name call pipe.load_drafter\('eagle'\)"):
        pipe.drafter = "eagle"
    with pytest.raises(TypeError, match="load_drafter takes a saved drafter's name or a folder, got int"):
        pipe.load_drafter(3)  # failed in os.fspath ("expected str, bytes or os.PathLike object")
    for empty in ("", "  "):  # answered a question nobody asked (`mmspec vqa --question ""`)
        with pytest.raises(ValueError, match="is empty; pass a question, or None to caption"):
            pipe(img[:1], [empty])
    # A drafter's name is its folder under drafters/ when saved: '../x' was saved beside drafters/,
    # '' into drafters/ itself; a crafted model_index.json entry is refused the same way.
    for bad in ("../x", "", "a/b", ".hidden"):
        with pytest.raises(ValueError, match="drafter name"):
            pipe.add_drafter(bad, pipe.drafter)
    pipe.save_pretrained(tmp_path / "saved")
    index = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    index["drafters"].append("../../outside")
    (tmp_path / "saved" / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="drafters entry '../../outside'"):
        SpeculativeVLMPipeline.from_pretrained(tmp_path / "saved")
    pipe.add_drafter("eagle+tree", pipe.drafter)  # names bench vlm gives its variants stay valid
    pipe.drafter.save_pretrained(tmp_path / ".hidden drafter")
    pipe.load_drafter(str(tmp_path / ".hidden drafter"))  # registered under a valid version of its folder's name
    assert pipe.drafter is pipe.drafters["hidden drafter"]
    wide = EagleHead(EagleHeadConfig.for_target(model, hidden_size=64, intermediate_size=64))
    with pytest.raises(ValueError, match="hidden size 64"):
        pipe.add_drafter("wide", DrafterComponent.from_head(wide.double()))
    other_vocab = EagleHead(EagleHeadConfig.for_target(model, vocab_size=99))
    with pytest.raises(ValueError, match="vocabulary 99"):
        pipe.add_drafter("v", DrafterComponent.from_head(other_vocab.double()))
    other_image = ViSpecHead(EagleHeadConfig.for_target(model, kind="vispec", image_token_id=7))
    with pytest.raises(ValueError, match="image token 7"):
        pipe.add_drafter("i", DrafterComponent.from_head(other_image.double()))
    from conftest import tiny_llama

    with pytest.raises(ValueError, match="supports model types.*'llama'"):
        SpeculativeVLMPipeline(tiny_llama(), processor)
    with pytest.raises(ValueError, match="no drafter 'nope'"):
        pipe.load_drafter("nope")


def test_missing_and_corrupt_files_are_reported_per_item(parts, tmp_path):
    model, processor = parts
    pipe = SpeculativeVLMPipeline(model, processor, drafters(model)["text"])
    good = random_images(2, seed=6)
    good[0].save(tmp_path / "good.png")
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG not really")
    items = [tmp_path / "good.png", tmp_path / "missing.png", tmp_path / "corrupt.png", good[1]]
    out = pipe(items, max_new_tokens=6)
    assert out.texts[0] is not None and out.texts[3] is not None
    assert out.texts[1] is None and "missing.png" in out.errors[1] and "not found" in out.errors[1]
    assert out.texts[2] is None and "corrupt.png" in out.errors[2]
    assert out.errors[0] is None and out.errors[3] is None
    alone = pipe([tmp_path / "good.png", good[1]], max_new_tokens=6)
    assert alone.texts == [out.texts[0], out.texts[3]]
    from PIL import Image  # an empty image failed inside the image processor

    for size in ((0, 0), (5, 0)):
        with pytest.raises(ValueError, match=rf"an image of {size[0]}x{size[1]} pixels has no content"):
            pipe([Image.new("RGB", size)], max_new_tokens=2)


def test_a_tied_text_drafter_saves_and_loads(tmp_path):
    from conftest import tiny_llama

    lm = tiny_llama(vocab=26)
    lm.config.tie_word_embeddings = True
    lm.tie_weights()
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    comp = DrafterComponent.from_lm(lm, 3)
    comp.save_pretrained(tmp_path / "d")
    again = DrafterComponent.from_pretrained(str(tmp_path / "d"), low_cpu_mem_usage=False, torch_dtype=torch.float64)
    for (k, a), (k2, b) in zip(comp.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    torch.testing.assert_close(again.lm.lm_head.weight, lm.lm_head.weight)


def test_processor_outputs_go_straight_into_speculative_generate(parts):
    """`speculative_generate(model, drafter, **processor_outputs)` picks the adapter by itself."""
    from mmspec.drafters import EagleHeadDrafter

    model, processor = parts
    processor.tokenizer.padding_side = "left"
    images = random_images(3, seed=8)
    prompts = ["user : <image> describe the image assistant :", "user : <image> what colour ? assistant :",
               "user : <image> what shape is left of the red circle ? assistant :"]
    enc = processor(images=images, text=prompts, return_tensors="pt", padding=True)
    enc["pixel_values"] = enc["pixel_values"].double()
    assert bool((enc["attention_mask"] == 0).any())  # different prompt lengths, left-padded
    torch.manual_seed(2)
    drafter = EagleHeadDrafter(model, EagleHead(EagleHeadConfig.for_target(model)).double(), 3)
    out = mmspec.speculative_generate(model, drafter, **enc, temperature=0, max_new_tokens=8, eos_token_id=2)
    L = enc["input_ids"].shape[1]
    for b in range(3):
        one = processor(images=images[b:b + 1], text=prompts[b:b + 1], return_tensors="pt")
        ref = model.generate(input_ids=one["input_ids"], attention_mask=one["attention_mask"],
                             pixel_values=one["pixel_values"].double(), do_sample=False, max_new_tokens=8,
                             eos_token_id=2, pad_token_id=0)[0, one["input_ids"].shape[1]:]
        assert torch.equal(out.sequences[b, L:L + len(ref)], ref)


def test_auto_draft_length_drafters_save_load_and_answer_like_plain(parts, tmp_path):
    """Drafters saved with num_draft_tokens='auto' (the loop picks K per step, 0 included)
    round-trip and answer exactly like plain decoding, for the heads and the text drafter."""
    model, processor = parts
    base = drafters(model)
    pipe = SpeculativeVLMPipeline(model, processor)
    for name in ("text", "vispec"):
        comp = base[name]
        kwargs = {k: v for k, v in comp.config.items() if not k.startswith("_")}
        kwargs.update(num_draft_tokens="auto", max_draft_tokens=4)
        auto = DrafterComponent(**kwargs)
        auto.load_state_dict(comp.state_dict())
        torch.nn.Module.to(auto, torch.float64)
        pipe.add_drafter(f"{name}-auto", auto)
    images = random_images(4, seed=5)
    plain = pipe(images, PROMPTS, max_new_tokens=12, speculative=False)
    for name in ("text-auto", "vispec-auto"):
        pipe.load_drafter(name)
        assert pipe._check_drafter(pipe.drafter).adaptive
        for _ in range(2):  # the second call reuses the built drafter and what its controller learned
            out = pipe(images, PROMPTS, max_new_tokens=12, batch_size=3)
            assert out.texts == plain.texts
    pipe.save_pretrained(tmp_path / "pipe")
    again = SpeculativeVLMPipeline.from_pretrained(tmp_path / "pipe", dtype=torch.float64)
    again.load_drafter("vispec-auto")
    assert again.drafter.config.num_draft_tokens == "auto" and again.drafter.config.max_draft_tokens == 4
    assert again(images, PROMPTS, max_new_tokens=12).texts == plain.texts
    with pytest.raises(ValueError, match="max_draft_tokens=4 only applies"):
        DrafterComponent(kind="eagle", head_config=base["eagle"].config.head_config, num_draft_tokens=3,
                         max_draft_tokens=4)
    with pytest.raises(ValueError, match="'auto' is for chains"):
        DrafterComponent(kind="eagle", head_config=base["eagle"].config.head_config, num_draft_tokens="auto",
                         tree_depth=3, tree_top_k=2, tree_num_nodes=6)


def test_auto_tree_size_drafters_save_load_and_answer_like_plain(parts, tmp_path):
    """tree_num_nodes='auto' (TreeConfig(num_nodes='auto'): the tree's size chosen per request,
    0 = plain): saved as "auto", rebuilt adaptive, answers equal plain decoding; a tree of another
    largest size or 'auto' without a tree is refused by name."""
    model, processor = parts
    head = EagleHead(EagleHeadConfig.for_target(model)).double()
    comp = DrafterComponent.from_head(head, tree=mmspec.TreeConfig(depth=3, top_k=2, num_nodes="auto"))
    assert comp.config.tree_num_nodes == "auto" and comp.tree.adaptive and comp.tree.num_nodes == 10
    pipe = SpeculativeVLMPipeline(model, processor)
    pipe.add_drafter("eagle-tree-auto", comp)
    images = random_images(4, seed=6)
    plain = pipe(images, PROMPTS, max_new_tokens=12, speculative=False)
    for _ in range(3):  # requests move the bandit between sizes
        assert pipe(images, PROMPTS, max_new_tokens=12, batch_size=2).texts == plain.texts
    assert pipe._check_drafter(pipe.drafter).tree.adaptive
    pipe.save_pretrained(tmp_path / "pipe")
    again = SpeculativeVLMPipeline.from_pretrained(tmp_path / "pipe", dtype=torch.float64)
    again.load_drafter("eagle-tree-auto")
    assert again.drafter.config.tree_num_nodes == "auto" and again.drafter.tree.adaptive
    assert again(images, PROMPTS, max_new_tokens=12).texts == plain.texts
    with pytest.raises(ValueError, match="another largest"):
        DrafterComponent.from_head(head, tree=mmspec.TreeConfig(depth=3, top_k=2, num_nodes=8, adaptive=True))
    with pytest.raises(ValueError, match="needs tree_depth"):
        DrafterComponent(kind="eagle", head_config=comp.config.head_config, tree_num_nodes="auto")
    with pytest.raises(ValueError, match="exceeds"):
        DrafterComponent(kind="eagle", head_config=comp.config.head_config, tree_depth=2, tree_top_k=2,
                         tree_num_nodes=9)
    for fields in (dict(tree_top_k=3), dict(tree_num_nodes=8)):  # a chain drafter ignored them
        with pytest.raises(ValueError, match="tree_depth is 0"):
            DrafterComponent(kind="eagle", head_config=comp.config.head_config, **fields)
    for name in ("text", "eagle", "vispec"):  # the bundled drafters (chains, tree fields 0) still load
        bundled = DrafterComponent.from_pretrained(BUNDLE / "drafters" / name)
        assert bundled.tree is None and bundled.config.tree_top_k == bundled.config.tree_num_nodes == 0


def test_load_and_save_options_are_honoured_or_refused(parts, tmp_path):
    """from_pretrained / save_pretrained swallowed every extra keyword: torch_dtype=float16 loaded
    float32, a misspelt dtype passed, push_to_hub=True pushed nothing. torch_dtype is now
    honoured as dtype; the rest is refused by name."""
    model, processor = parts
    pipe = SpeculativeVLMPipeline(model, processor, drafters(model)["text"])
    pipe.save_pretrained(tmp_path / "p")
    half = SpeculativeVLMPipeline.from_pretrained(tmp_path / "p", torch_dtype=torch.float32)
    assert half.target.dtype == torch.float32
    with pytest.raises(TypeError, match=r"unsupported argument\(s\) \['dtpye'\]"):
        SpeculativeVLMPipeline.from_pretrained(tmp_path / "p", dtpye=torch.float16)
    for bad in ("float16", {"target": torch.float16}):  # loaded float32
        with pytest.raises(TypeError, match="must be a torch.dtype"):
            SpeculativeVLMPipeline.from_pretrained(tmp_path / "p", torch_dtype=bad)
    with pytest.raises(ValueError, match="disagree"):
        SpeculativeVLMPipeline.from_pretrained(tmp_path / "p", dtype=torch.float64, torch_dtype=torch.float32)
    with pytest.raises(ValueError, match="push_to_hub=True is not supported"):
        pipe.save_pretrained(tmp_path / "q", push_to_hub=True)
    with pytest.raises(ValueError, match="safe_serialization=False is not supported"):
        pipe.save_pretrained(tmp_path / "q", safe_serialization=False)
    with pytest.raises(TypeError, match=r"unsupported argument\(s\) \['variant'\]"):
        pipe.save_pretrained(tmp_path / "q", variant="fp16")
    assert not (tmp_path / "q").exists()  # refused before writing


def test_an_image_file_reads_as_the_same_image_passed_as_pil(parts, tmp_path):
    """A path was opened with convert("RGB"): alpha dropped (the processor composites a PIL image's
    alpha onto white) and EXIF orientation ignored (a phone photo read sideways), so a file and the
    same picture as a PIL image answered differently."""
    import numpy as np
    from PIL import Image

    model, processor = parts
    pipe = SpeculativeVLMPipeline(model, processor, drafters(model)["text"])
    pipe.set_progress_bar_config(disable=True)
    base = np.array(random_images(1, seed=11, size=(24, 20))[0])
    alpha = np.random.default_rng(0).integers(0, 256, base.shape[:2], dtype=np.uint8)
    Image.fromarray(np.dstack([base, alpha]), "RGBA").save(tmp_path / "a.png")
    loaded = np.array(pipe._load_image(tmp_path / "a.png")).astype(float)
    expected = base * (alpha[..., None] / 255.0) + 255.0 * (1 - alpha[..., None] / 255.0)  # over white
    assert np.abs(loaded - expected).max() <= 1.0
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 clockwise to display"
    Image.fromarray(base).transpose(Image.Transpose.ROTATE_90).save(tmp_path / "r.png", exif=exif)
    assert np.array_equal(np.array(pipe._load_image(tmp_path / "r.png")), base)  # as displayed
    rgba = Image.open(tmp_path / "a.png")
    got = pipe([tmp_path / "a.png", rgba, tmp_path / "r.png", Image.fromarray(base)], max_new_tokens=8).texts
    assert got[0] == got[1] and got[2] == got[3]


def test_an_unregistered_active_drafter_does_not_overwrite_one_named_default(parts, tmp_path):
    """save_pretrained stored an active drafter that was never registered as "default", over a
    registered drafter of that name (lost on reload)."""
    model, processor = parts
    comps = drafters(model)
    pipe = SpeculativeVLMPipeline(model, processor)
    pipe.add_drafter("default", comps["text"], active=False)
    pipe.drafter = comps["eagle"]
    pipe.save_pretrained(tmp_path / "p")
    again = SpeculativeVLMPipeline.from_pretrained(tmp_path / "p")
    assert {n: c.config.kind for n, c in again.drafters.items()} == {"default": "text", "default_1": "eagle"}
    assert again.drafter.config.kind == "eagle"


def test_options_are_checked_without_work_and_built_drafters_follow_their_components(parts, tmp_path):
    """Options were checked only inside each batch: with no item to run (an empty list, every
    file missing) bad values passed silently. The built-drafter cache was keyed by address without
    holding the component: a freed component left its built drafter (and weights) behind, and a new
    one allocated at that address would have run it."""
    import gc
    import weakref

    model, processor = parts
    d = drafters(model)
    pipe = SpeculativeVLMPipeline(model, processor, d["eagle"])
    cases = [(dict(max_new_tokens=-5), "max_new_tokens must be an int >= 0"), (dict(temperature=float("nan")), "temperature"),
             (dict(acceptance="bogus"), "not a known rule"), (dict(top_k=0), "top_k must be"),
             (dict(generator=3), "generator must be"), (dict(acceptance="greedy", temperature=1.0), "decodes greedily")]
    for items in ([], [str(tmp_path / "missing.png")]):
        for kwargs, message in cases:
            with pytest.raises((ValueError, TypeError), match=message):
                pipe(items, **kwargs)
    text = d["text"]
    pipe.drafter = text
    pipe(random_images(1, seed=2), max_new_tokens=4)
    gone = weakref.ref(text)
    pipe.drafter = d["vispec"]
    del text, d
    gc.collect()
    assert gone() is None  # the pipeline kept neither the component nor its built drafter
    assert all(entry[0] is pipe.drafter for entry in pipe._built.values())


def test_folders_with_a_missing_tensor_are_refused_by_key(parts, tmp_path):
    """A saved drafter or target with a tensor missing loaded with that part random (a ViSpec
    head without fc drafted nothing the target accepted; a target layer changed the captions)."""
    from safetensors.torch import load_file, save_file

    model, processor = parts
    pipe = SpeculativeVLMPipeline(model, processor, drafters(model)["vispec"])
    pipe.save_pretrained(tmp_path / "p")
    SpeculativeVLMPipeline.from_pretrained(tmp_path / "p")  # as saved: loads
    drafter_file = next((tmp_path / "p" / "drafters").glob("*/diffusion_pytorch_model.safetensors"))
    weights = load_file(drafter_file)
    save_file({k: v for k, v in weights.items() if not k.endswith("fc.weight")}, drafter_file)
    with pytest.raises(ValueError, match=r"DrafterComponent: the checkpoint .*missing keys \['head.fc.weight'"):
        SpeculativeVLMPipeline.from_pretrained(tmp_path / "p")
    save_file(weights, drafter_file)
    target_file = next((tmp_path / "p" / "target").glob("*.safetensors"))
    weights = load_file(target_file)
    dropped = next(k for k in weights if "layers.0.mlp" in k)
    save_file({k: v for k, v in weights.items() if k != dropped}, target_file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="the target in .* does not match its config .*missing keys"):
        SpeculativeVLMPipeline.from_pretrained(tmp_path / "p")


def test_a_pipeline_built_from_components_answers_the_same(parts):
    """`type(pipe)(**pipe.components)` lost the drafter (no _optional_components) and the caption
    prompt (captions changed)."""
    model, processor = parts
    pipe = SpeculativeVLMPipeline(model, processor, drafters(model)["eagle"], caption_prompt="describe the image")
    copy = SpeculativeVLMPipeline(**pipe.components)
    assert copy.drafter is pipe.drafter and copy.config.caption_prompt == "describe the image"
    images = random_images(2, seed=5)
    a, b = pipe(images, max_new_tokens=6), copy(images, max_new_tokens=6)
    assert a.texts == b.texts and a.stats.drafted_nodes == b.stats.drafted_nodes > 0


@torch.no_grad()
def test_the_rule_is_built_once_per_call_whatever_the_batches(parts, monkeypatch):
    """The pipeline built its rule at the top of a call (to refuse bad options before any work)
    and again inside every batch; it now builds it once and passes the object on."""
    import mmspec.acceptance as acceptance

    model, processor = parts
    pipe = SpeculativeVLMPipeline(model, processor, drafters(model)["text"])
    images = random_images(3, seed=6)
    whole = pipe(images, max_new_tokens=4, temperature=0)
    built = []
    real = acceptance.get_rule
    monkeypatch.setattr(acceptance, "get_rule", lambda rule, **kw: built.append(rule) or real(rule, **kw))
    chunked = pipe(images, max_new_tokens=4, temperature=0, acceptance="exact", batch_size=1)
    assert built[0] == "exact" and len(built) == 4  # the name once, then the built object per batch
    assert all(not isinstance(b, str) for b in built[1:]) and len({id(b) for b in built[1:]}) == 1
    assert chunked.texts == whole.texts
