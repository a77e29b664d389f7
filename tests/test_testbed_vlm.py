"""The testbed VLM: `mmspec testbed train-vlm` end to end on a tiny config (the saved folder loads
as a SpeculativeVLMPipeline with a real LlavaProcessor, weights stored fp16, greedy speculative
answers of every drafter equal plain), the caption / VQA checks (every grammar caption passes, a
planted colour swap fails), and the bundled assets/testbed/vlm folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mmspec.testbed.vlm_eval import (caption_correct, caption_error, caption_pairs, question_kind, vqa_correct,
                                     vqa_exact)
from mmspec.testbed.world import World

BUNDLED = Path(__file__).resolve().parents[1] / "assets" / "testbed" / "vlm"
TINY = ["--n-train", "32", "--n-val", "4", "--tower-steps", "2", "--tower-layers", "1", "--lm-steps", "3",
        "--lm-layers", "1", "--lm-batch", "8", "--tune-steps", "2", "--drafter-images", "4", "--drafter-steps", "2", "--drafter-warmup", "0", "--drafter-batch", "4",
        "--accept-scenes", "2", "--max-new-tokens", "6", "--answer-tokens", "6", "--no-progress"]


def test_every_grammar_caption_is_correct_and_a_swapped_colour_is_not():
    scenes = World(seed=0, split="validation").sample(60)
    assert all(caption_correct(c, s.attributes) for s in scenes for c in s.captions)
    swapped = 0
    for s in scenes:
        objs = s.attributes["objects"]
        if len(objs) < 2 or objs[0]["colour"] == objs[1]["colour"] or objs[0]["shape"] == objs[1]["shape"]:
            continue
        a, b = objs[0], objs[1]
        wrong = f"a {a['colour']} {b['shape']} and a {b['colour']} {a['shape']}" + "".join(
            f" and a {o['colour']} {o['shape']}" for o in objs[2:])
        assert not caption_correct(wrong, s.attributes), wrong
        missing = " and ".join(f"a {o['colour']} {o['shape']}" for o in objs[1:])
        assert not caption_correct(missing, s.attributes), missing
        swapped += 1
    assert swapped >= 10  # the planted errors were actually exercised
    assert caption_pairs("a disc in crimson next to a round shape coloured azure") == [("red", "circle"),
                                                                                      ("blue", "circle")]


def test_caption_errors_are_classified_by_kind():
    attrs = {"objects": [{"colour": "red", "shape": "circle"}, {"colour": "blue", "shape": "square"}]}
    assert caption_error("a red circle and a blue square", attrs) is None
    assert caption_error("a blue square next to a disc in crimson", attrs) is None
    assert caption_error("a red circle", attrs) == "count"
    assert caption_error("a red circle and a blue square and a red square", attrs) == "count"
    assert caption_error("a red square and a blue circle", attrs) == "pairing"
    assert caption_error("a red circle and a blue circle", attrs) == "shape"
    assert caption_error("a red circle and a red square", attrs) == "colour"
    assert caption_error("a green circle and a blue triangle", attrs) == "colour+shape"
    assert caption_error("a red circle and blue", attrs) == "unpaired"


def test_every_world_question_has_its_template_kind():
    from collections import Counter

    scenes = World(seed=0, split="validation").sample(200)
    kinds = Counter(question_kind(q) for s in scenes for q, _ in s.qa)
    assert set(kinds) == {"colour", "shape", "count", "position", "exists"}, kinds
    assert question_kind("what colour is the disc ?") == "colour"
    assert question_kind("is there an orange square ?") == "exists"
    assert question_kind("is the red disc above or below the blue square ?") == "position"
    assert question_kind("what is the meaning of life ?") == "other"


def test_vqa_check_takes_any_valid_phrasing_only():
    s = World(seed=0, split="validation").scene(3)
    q, valid = s.qa[0]
    assert all(vqa_correct(v.upper() + "  ", valid) and vqa_exact(v.upper() + "  ", valid) for v in valid)
    assert not vqa_correct("elephant", valid) and not vqa_exact("purple elephant", valid)
    assert not vqa_correct(None, valid) and not vqa_correct("", valid)


def test_vqa_check_takes_the_grammars_synonyms_but_not_other_content():
    pink = ["pink", "rose", "salmon", "it is pink", "the lozenge is pink"]
    assert vqa_correct("the rhombus is pink", pink) and not vqa_exact("the rhombus is pink", pink)
    assert vqa_correct("it is salmon", pink)
    for wrong in ("the rhombus is red", "the circle is pink", "pink pink", "yes", "it is"):
        assert not vqa_correct(wrong, pink), wrong
    circle = ["circle", "disc", "dot", "round shape", "a circle", "it is a circle"]
    assert vqa_correct("a disc", circle) and vqa_correct("it is a round shape", circle)
    assert not vqa_correct("a box", circle) and not vqa_correct("a round shape and a box", circle)
    assert vqa_correct("2", ["2", "two", "there are two"]) and not vqa_correct("three", ["2", "two"])
    assert vqa_correct("higher", ["above", "it is above"]) and not vqa_correct("it is below", ["above"])
    assert vqa_correct("no , it is not", ["no"]) and not vqa_correct("yes , it is", ["no", "no it is not"])
    # on the world's questions: every listed answer passes its own list; the same answer with
    # another colour / shape / number / polarity swapped in fails it
    swap = {"pink": "red", "red": "pink", "circle": "square", "square": "circle", "disc": "box", "yes": "no",
            "no": "yes", "two": "three", "three": "two", "above": "below", "below": "above", "left": "right",
            "right": "left"}
    tried = 0
    for scene in World(seed=0, split="validation").sample(200):
        for _, valid in scene.qa:
            assert all(vqa_correct(v, valid) for v in valid), valid
            for v in valid:
                words = v.split()
                changed = " ".join(swap.get(w, w) for w in words)
                if changed != v and "not" not in words:
                    assert not vqa_correct(changed, valid), (changed, valid)
                    tried += 1
    assert tried >= 100


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from mmspec.cli import main

    d = tmp_path_factory.mktemp("vlm")
    assert main(["testbed", "train-vlm", "--out", str(d / "vlm"), *TINY]) == 0
    return d / "vlm"


def test_train_vlm_tiny_folder_loads_and_speculative_equals_plain(tiny_run):
    from safetensors import safe_open
    from transformers import AutoProcessor, LlavaProcessor

    from mmspec.pipelines import SpeculativeVLMPipeline

    metrics = json.loads((tiny_run / "metrics.json").read_text())
    log = json.loads((tiny_run / "train_log.json").read_text())
    assert {"data", "tower", "lm", "tune", "text", "eagle", "vispec", "flash", "eval"} <= set(metrics)
    assert len(log["lm"]) >= 1 and all(torch.isfinite(torch.tensor(r["loss"])) for r in log["lm"])
    assert metrics["eval"]["default_drafter"] in ("text", "eagle", "vispec", "flash")
    with safe_open(str(next((tiny_run / "target").glob("*.safetensors"))), "pt") as f:
        assert all(f.get_slice(k).get_dtype() == "F16" for k in f.keys())
    assert isinstance(AutoProcessor.from_pretrained(tiny_run / "processor"), LlavaProcessor)
    pipe = SpeculativeVLMPipeline.from_pretrained(tiny_run)
    assert pipe.target.dtype == torch.float32  # fp16 storage, float32 compute on CPU
    assert set(pipe.drafters) == {"text", "eagle", "vispec", "flash"}
    assert pipe.drafter is pipe.drafters[metrics["eval"]["default_drafter"]]
    scenes = World(seed=5, split="test").sample(3)
    images, prompts = [s.image for s in scenes], [None, scenes[1].qa[0][0], None]
    plain = pipe(images, prompts, max_new_tokens=8, speculative=False)
    assert any(len(x) > 1 for x in plain.sequences)
    for name in sorted(pipe.drafters):
        pipe.load_drafter(name)
        out = pipe(images, prompts, max_new_tokens=8)
        assert [x.tolist() for x in out.sequences] == [x.tolist() for x in plain.sequences], name


def test_train_vlm_refuses_too_few_visual_tokens(tmp_path):
    from mmspec.cli import main

    with pytest.raises(SystemExit, match="visual tokens"):
        main(["testbed", "train-vlm", "--out", str(tmp_path / "x"), "--patch-size", "20", "--no-progress"])


@pytest.mark.parametrize("argv,message", [
    (["--tower-lr", "-1"], "tower_lr must be a finite number > 0"),
    (["--lm-lr", "0"], "lm_lr must be a finite number > 0"),
    (["--drafter-lr", "nan"], "drafter_lr must be a finite number > 0"),
    (["--lm-dim", "7"], "lm_dim=7 is not divisible by lm_heads=4"),
    (["--tower-dim", "0"], "tower_dim must be >= 1"),
    (["--num-draft-tokens", "0"], "num_draft_tokens must be >= 1"),
    (["--caption-fraction", "2"], "caption_fraction=2.0 must be in"),
])
def test_train_vlm_refuses_before_rendering_what_a_later_stage_could_not_use(argv, message, tmp_path):
    """These rendered 108000 scenes (minutes) and trained the tower before failing, or trained
    with a negative learning rate; now they are refused before anything runs or is written."""
    from mmspec.cli import main

    with pytest.raises(SystemExit, match=message):
        main(["testbed", "train-vlm", "--out", str(tmp_path / "x"), "--no-progress", *argv])
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(not (BUNDLED / "model_index.json").is_file(), reason="no bundled VLM in this checkout")
def test_bundled_vlm_has_a_real_processor_and_its_drafters():
    from transformers import LlavaProcessor

    from mmspec.pipelines import SpeculativeVLMPipeline

    pipe = SpeculativeVLMPipeline.from_pretrained(BUNDLED)
    assert isinstance(pipe.processor, LlavaProcessor)
    assert type(pipe.processor.image_processor).__name__.startswith("CLIPImageProcessor")
    scene = World(seed=0, split="validation").scene(0)
    enc = pipe.processor(images=[scene.image], text=[pipe._prompt(None, 1)], return_tensors="pt")
    image_id = pipe.processor.tokenizer.convert_tokens_to_ids(pipe.processor.image_token)
    assert int((enc["input_ids"] == image_id).sum()) >= 32
    metrics = json.loads((BUNDLED / "metrics.json").read_text())
    assert set(pipe.drafters) == {"text", "eagle", "vispec", "flash"}
    assert pipe.drafter is pipe.drafters[metrics["eval"]["default_drafter"]]
    plain = pipe([scene.image], None, max_new_tokens=24, speculative=False)
    spec = pipe([scene.image], None, max_new_tokens=24)
    assert spec.sequences[0].tolist() == plain.sequences[0].tolist()
    # Every bundled drafter answers like plain decoding, and the trained FLASH head drafts tokens
    # the target keeps (2.68 per target forward in the eval stage; an untrained head gives ~1.0).
    images = [s.image for s in World(seed=0, split="validation").sample(4)]
    plain = pipe(images, None, max_new_tokens=24, speculative=False)
    for name in sorted(pipe.drafters):
        pipe.load_drafter(name)
        out = pipe(images, None, max_new_tokens=24)
        assert out.texts == plain.texts, name
        if name == "flash":
            assert out.stats.mean_accepted_length > 1.8, out.stats.mean_accepted_length


@pytest.mark.skipif(not (BUNDLED / "model_index.json").is_file(), reason="no bundled VLM in this checkout")
def test_bundled_vlm_was_trained_with_the_default_recipe():
    """The bundle's recorded settings are `train-vlm`'s defaults (threads and the progress bar
    aside), so `mmspec testbed train-vlm --out DIR` is its recipe."""
    import dataclasses

    from mmspec.testbed.vlm_train import VLMTrainConfig

    recorded = json.loads((BUNDLED / "metrics.json").read_text())["config"]
    defaults = dataclasses.asdict(VLMTrainConfig())
    differ = {k: (recorded.get(k), v) for k, v in defaults.items()
              if k not in ("threads", "progress") and recorded.get(k) != v}
    assert not differ, differ


def test_tower_labels_match_the_rendered_scene():
    """Object coverage read off the geometry: a patch fully covered by the main object (drawn last)
    shows exactly its colour in the rendered image, the main object's coverage adds up to its area,
    and every visible object's class is its colour x shape."""
    import math

    import numpy as np

    from mmspec.testbed.vlm_tower import scene_labels
    from mmspec.testbed.world import COLOURS

    world = World(seed=0, split="train")
    areas = {"circle": math.pi, "square": 1.7 ** 2, "triangle": 3 * math.sqrt(3) / 4, "diamond": 1.6}
    perimeters = {"circle": 2 * math.pi, "square": 4 * 1.7, "triangle": 3 * math.sqrt(3), "diamond": 4 * math.hypot(1, 0.8)}
    full_patches = 0
    for i in range(24):
        s = world.scene(i)
        objs = s.attributes["objects"]
        patches, cover, classes = scene_labels(s.attributes, 64, 8, world.config)
        assert cover.shape == (3, 64) and patches.shape == (64,)
        assert (cover.sum(0) <= 1 + 1e-6).all()
        assert list(classes[len(objs):]) == [-100] * (3 - len(objs))
        for k, o in enumerate(objs):
            if cover[k].sum() > 0:
                assert classes[k] == world.config.class_label(o["shape"], o["colour"])
        main = objs[-1]
        r = main["r"] * 64  # pixels; rasterised outlines add about half a pixel all along the perimeter
        expect = areas[main["shape"]] * r * r + 0.5 * perimeters[main["shape"]] * r
        assert abs(cover[len(objs) - 1].sum() * 64 - expect) < 2 * r
        img = np.asarray(s.image, dtype=np.int64).reshape(8, 8, 8, 8, 3).transpose(0, 2, 1, 3, 4).reshape(64, 64, 3)
        for j in np.flatnonzero(cover[len(objs) - 1] == 1.0):
            exact = (abs(img[j] - np.array(COLOURS[main["colour"]])) <= 2).all(-1)
            assert exact.sum() >= 56  # all but anti-aliased outline pixels
            assert patches[j] == classes[len(objs) - 1]
            full_patches += 1
    assert full_patches > 20


def test_shape_word_ids_are_the_grammar_shape_words():
    from mmspec.testbed.language import SHAPE_WORDS
    from mmspec.testbed.vlm_train import VLMTrainConfig, build_processor, shape_word_ids

    tok = build_processor(VLMTrainConfig()).tokenizer
    words = {tok.convert_ids_to_tokens(i) for i in shape_word_ids(tok)}
    assert words == {w.split()[0] for ws in SHAPE_WORDS.values() for w in ws}
    assert not words & {"shape", "red", "a", "the"}


def test_train_vlm_regenerates_shared_drafter_data_for_other_settings(tiny_run):
    from mmspec.cli import main

    shared = tiny_run.with_name(tiny_run.name + "_work") / "drafter_data.pt"
    assert len(torch.load(shared, weights_only=False)["examples"]) == 4
    assert main(["testbed", "train-vlm", "--out", str(tiny_run), *TINY, "--drafter-images", "6",
                 "--stages", "text"]) == 0
    saved = torch.load(shared, weights_only=False)
    assert saved["key"]["num_images"] == 6 and len(saved["examples"]) == 6
    assert saved["key"]["image_size"] == 64  # the world's scenes, at the bundle-like 64 px


def test_train_vlm_reuses_shared_drafter_data_of_the_same_target(tiny_run, monkeypatch):
    """The data key holds the target's fingerprint since session 56; train-vlm's check of its shared
    answers must compute it too, or every drafter regenerates them."""
    import mmspec.pipelines.train_drafter as td
    from mmspec.cli import main

    def refuse(*args, **kwargs):
        raise AssertionError("the shared answers were regenerated although they fit")

    monkeypatch.setattr(td, "regenerate", refuse)
    assert main(["testbed", "train-vlm", "--out", str(tiny_run), *TINY, "--drafter-images", "6",
                 "--stages", "eagle"]) == 0


def test_drafter_data_rendered_at_another_size_are_not_reused(tmp_path):
    """`data.pt` of world scenes rendered at 64 px is refused for a 128-px pipeline (resume)."""
    from mmspec.pipelines.train_config import TrainDrafterConfig
    from mmspec.pipelines.train_drafter import data_key, load_data

    config = TrainDrafterConfig(pipeline="-", drafter="eagle", out=str(tmp_path))
    torch.save({"key": data_key(config, 64), "examples": [{"ids": [1]}]}, tmp_path / "data.pt")
    assert load_data(tmp_path / "data.pt", config, 64) == [{"ids": [1]}]
    with pytest.raises(ValueError, match="image_size"):
        load_data(tmp_path / "data.pt", config, 128)


@pytest.mark.parametrize("strategy,tokens", [("full", 65), ("default", 64)])
def test_train_vlm_full_strategy_keeps_cls_as_a_visual_token(tmp_path, strategy, tokens):
    """`--vision-feature-select-strategy full` (the default): the processor and the model count 65
    visual tokens (64 patches + CLS), the tower stage trains the object-set / count heads on the
    CLS token (its gradient reaches the CLS position's output), and speculative answers still
    equal plain; `default` (LLaVA's own, CLS dropped) gives 64 and the same guarantees."""
    from mmspec.cli import main
    from mmspec.pipelines import SpeculativeVLMPipeline
    from mmspec.testbed.vlm_tower import TowerHeads
    from mmspec.testbed.vlm_train import VLMTrainConfig

    assert VLMTrainConfig().vision_feature_select_strategy == "full" and VLMTrainConfig().lm_exists_fraction == 0.8
    assert VLMTrainConfig(vision_feature_select_strategy=strategy).num_visual_tokens == tokens
    with pytest.raises(ValueError, match="vision_feature_select_strategy"):
        VLMTrainConfig(vision_feature_select_strategy="cls")
    heads = TowerHeads(8, 4)
    feats, cls = torch.randn(2, 5, 8, requires_grad=True), torch.randn(2, 8, requires_grad=True)
    _, _, present, count = heads(feats, torch.rand(2, 3, 5), cls)
    (present.sum() + count.sum()).backward()
    assert cls.grad.abs().sum() > 0 and feats.grad is None  # present / count read CLS only
    assert main(["testbed", "train-vlm", "--out", str(tmp_path / "vlm"), *TINY,
                 "--vision-feature-select-strategy", strategy, "--stages", "data,tower,lm,eagle,vispec,eval"]) == 0
    pipe = SpeculativeVLMPipeline.from_pretrained(tmp_path / "vlm")
    assert pipe.target.config.vision_feature_select_strategy == strategy
    scenes = World(seed=5, split="test").sample(2)
    text = pipe.processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {
        "type": "text", "text": "what is in the image ?"}]}], add_generation_prompt=True)
    ids = pipe.processor(images=[scenes[0].image], text=[text], return_tensors="pt")["input_ids"][0]
    assert int((ids == pipe.target.config.image_token_id).sum()) == tokens
    images, prompts = [s.image for s in scenes], [None, scenes[1].qa[0][0]]
    plain = pipe(images, prompts, max_new_tokens=8, speculative=False)
    for name in sorted(pipe.drafters):
        pipe.load_drafter(name)
        out = pipe(images, prompts, max_new_tokens=8)
        assert [x.tolist() for x in out.sequences] == [x.tolist() for x in plain.sequences], name


def test_visible_objects_drop_only_an_object_drawn_over_entirely():
    from mmspec.testbed.vlm_eval import visible_objects

    big = {"colour": "red", "shape": "square", "x": 0.5, "y": 0.5, "r": 0.3}
    small = {"colour": "blue", "shape": "circle", "x": 0.5, "y": 0.5, "r": 0.05}
    beside = {"colour": "green", "shape": "circle", "x": 0.1, "y": 0.1, "r": 0.05}
    # drawn in list order: the small circle first, then the square over it
    assert visible_objects({"objects": [small, beside, big]}) == [beside, big]
    assert visible_objects({"objects": [big, small, beside]}) == [big, small, beside]
    scenes = World(seed=0, split="validation").sample(200)
    hidden = [s for s in scenes if len(visible_objects(s.attributes)) < len(s.attributes["objects"])]
    assert 0 < len(hidden) < 20  # the docstring's count (9): rare, but there
    assert all(not caption_correct(c, {"objects": visible_objects(s.attributes)}) for s in hidden for c in s.captions)


def test_scenes_render_at_the_processor_crop_everywhere_the_testbed_vlm_reads_them(tmp_path):
    """A testbed VLM with a 128-px processor (`--image-size 128 --patch-size 16`): the data stage
    stores the processor's pixels of the world's scenes rendered at 128 (not 64-px renders
    resampled), the world's scenes at 128 carry the same attributes, captions and questions as at
    64, `scene_size` reads the crop (and refuses a non-square one), and the drafters' training
    data are rendered at the pipeline's size."""
    from types import SimpleNamespace

    from mmspec.cli import main
    from mmspec.pipelines import SpeculativeVLMPipeline
    from mmspec.pipelines.train_drafter import data_items, world_image_size
    from mmspec.pipelines.train_config import TrainDrafterConfig
    from mmspec.testbed.vlm_eval import scene_size

    small, big = World(seed=0, split="train").scene(3), World(seed=0, split="train", image_size=128).scene(3)
    assert big.image.size == (128, 128) and small.image.size == (64, 64)
    assert big.attributes == small.attributes and big.captions == small.captions and big.qa == small.qa
    work = tmp_path / "work"
    assert main(["testbed", "train-vlm", "--out", str(tmp_path / "vlm"), "--work", str(work), *TINY,
                 "--image-size", "128", "--patch-size", "16", "--stages", "data,tower,lm,eval"]) == 0
    pipe = SpeculativeVLMPipeline.from_pretrained(tmp_path / "vlm")
    assert scene_size(pipe.processor) == 128 == world_image_size(pipe)
    data = torch.load(work / "data_train.pt", weights_only=False)
    world = World(seed=0, split="train", image_size=128)
    want = pipe.processor.image_processor([world.scene(i).image for i in range(3)], return_tensors="pt")["pixel_values"]
    assert torch.equal(data["pixels"][:3], want.half())
    resampled = pipe.processor.image_processor([World(seed=0, split="train").scene(i).image for i in range(3)],
                                               return_tensors="pt")["pixel_values"]
    assert not torch.equal(data["pixels"][:3], resampled.half())
    config = TrainDrafterConfig(pipeline="-", drafter="eagle", out=str(tmp_path / "d"), num_images=2)
    assert [img.size for img, _ in data_items(config, world_image_size(pipe))] == [(128, 128)] * 2
    with pytest.raises(ValueError, match="crop_size"):
        scene_size(SimpleNamespace(crop_size={"height": 64, "width": 48}))
    assert world_image_size(SimpleNamespace(processor=SimpleNamespace())) == 64  # no square crop: the world's default


def test_caption_check_against_visible_objects_uses_the_size_the_scene_was_shown_at():
    """Whether a small object peeks out from under a later one depends on the rendering size
    (validation scene 50: three objects visible at 64 px, two at 128 px). `evaluate` checks the
    visible-objects caption figure at each scene's own image size."""
    from types import SimpleNamespace

    import numpy as np

    from mmspec.testbed.language import noun_phrase
    from mmspec.testbed.vlm_eval import evaluate, visible_objects

    big = World(seed=0, split="validation", image_size=128).scene(50)
    at64, at128 = visible_objects(big.attributes, 64), visible_objects(big.attributes, 128)
    assert len(at64) == 3 and len(at128) == 2
    rng = np.random.default_rng(0)
    text = "a photo of " + " and ".join(noun_phrase(o, rng) for o in at128)

    def pipe(images, prompts, **kw):  # a stand-in model that names what is visible at 128 px
        return SimpleNamespace(texts=[text if prompts is None else "yes"] * len(images))

    assert evaluate(pipe, [big], progress=False)["caption_correct_visible_objects"] == 1.0
    small = World(seed=0, split="validation").scene(50)
    assert evaluate(pipe, [small], progress=False)["caption_correct_visible_objects"] == 0.0


def test_visible_pixels_and_the_split_by_the_least_visible_object():
    """Pixel counts against an independent disc count; a stand-in model that names exactly the
    visible objects is wrong in the "0" bin only, and the bins hold every scene once."""
    from types import SimpleNamespace

    import numpy as np

    from mmspec.testbed.language import noun_phrase
    from mmspec.testbed.vlm_eval import evaluate, least_visible_bin, visible_objects, visible_pixels

    disc = {"colour": "red", "shape": "circle", "x": 0.25, "y": 0.25, "r": 0.1}
    yy, xx = np.mgrid[0:64, 0:64] + 0.5
    # PIL fills an ellipse's bounding box inclusively: about half a pixel more radius than r
    expected = int(((xx - 16) ** 2 + (yy - 16) ** 2 <= 6.9 ** 2).sum())  # ~150 px
    assert abs(visible_pixels({"objects": [disc]})[0] - expected) <= 0.05 * expected
    cover = {"colour": "blue", "shape": "square", "x": 0.25, "y": 0.25, "r": 0.3}
    assert visible_pixels({"objects": [disc, cover]})[0] == 0
    assert least_visible_bin({"objects": [disc, cover]}) == "0"
    assert least_visible_bin({"objects": [disc]}) == "100-149"
    assert least_visible_bin({"objects": [dict(disc, r=0.04)]}) == "1-29"
    assert least_visible_bin({"objects": [cover]}) == "250+"

    scenes = World(seed=0, split="validation").sample(200)
    rng = np.random.default_rng(0)
    texts = {id(s.image): "a photo of " + " and ".join(noun_phrase(o, rng) for o in visible_objects(s.attributes))
             for s in scenes}

    def pipe(images, prompts, **kw):
        return SimpleNamespace(texts=[texts[id(i)] if prompts is None else "yes" for i in images])

    r = evaluate(pipe, scenes, progress=False)
    bins = r["caption_by_least_visible_px64"]
    assert sum(n for _, n in bins.values()) == 200 and list(bins)[0] == "0" and list(bins)[-1] == "250+"
    assert bins["0"][0] == 0 < bins["0"][1]
    assert all(right == n for b, (right, n) in bins.items() if b != "0")
    from mmspec.testbed.vlm_eval import wilson

    right = sum(r for r, _ in bins.values())
    assert r["caption_correct"] == right / 200 and r["caption_correct_ci95"] == wilson(right, 200)
    low, high = r["caption_correct_ci95"]
    assert low < right / 200 < high and high - low > 0.05  # 200 scenes: several points either way
    yes = sum(vqa_correct("yes", s.qa[0][1]) for s in scenes)  # the stand-in answers "yes" to every question
    assert r["vqa_accuracy"] == yes / 200 and r["vqa_accuracy_ci95"] == wilson(yes, 200)


def test_data_stage_renders_the_same_tensors_with_any_number_of_processes():
    """`render` splits the scenes into ranges of 1024 over `--threads` forked processes writing
    into one shared pixel tensor; each scene draws from its own index's stream, so 1 and 2
    processes give equal tensors, captions and Q/A (3 ranges here, the last one short)."""
    from mmspec.testbed.vlm_data import render
    from mmspec.testbed.vlm_train import VLMTrainConfig, build_processor

    cfg = VLMTrainConfig(image_size=32, patch_size=4, threads=2, progress=False)
    proc = build_processor(cfg)
    one, two = render(cfg, "train", 2100, proc, workers=1), render(cfg, "train", 2100, proc, workers=2)
    assert one["pixels"].shape == (2100, 3, 32, 32) and one["patches"].shape == (2100, 64) and one["pixels"].abs().sum() > 0
    for key in one:
        assert (torch.equal(one[key], two[key]) if torch.is_tensor(one[key]) else one[key] == two[key]), key
    last = render(cfg, "train", 2100, proc, workers=1)  # a scene's pixels do not depend on its range either
    assert torch.equal(render(cfg, "train", 3, proc, workers=1)["pixels"], last["pixels"][:3])
