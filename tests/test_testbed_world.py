"""The testbed world: deterministic scenes whose captions and answers agree with what was drawn."""

from __future__ import annotations

import re

import numpy as np
import pytest

from mmspec.testbed.language import COLOUR_WORDS, SHAPE_WORDS, build_tokenizer
from mmspec.testbed.world import COLOURS, SHAPES, World, WorldConfig

N = 120


@pytest.fixture(scope="module")
def scenes():
    return World(seed=0, split="validation").sample(N)


def words(text: str) -> set[str]:
    return set(text.split())


def mentions(text: str, phrases) -> bool:
    return any(re.search(rf"\b{re.escape(p)}\b", text) for p in phrases)


def test_same_seed_same_scene_different_seed_different_scene():
    a, b = World(seed=3).sample(4), World(seed=3).sample(4)
    for x, y in zip(a, b):
        assert np.array_equal(np.asarray(x.image), np.asarray(y.image))
        assert x.captions == y.captions and x.qa == y.qa and x.class_label == y.class_label
    c = World(seed=4).sample(4)
    assert any(not np.array_equal(np.asarray(x.image), np.asarray(y.image)) for x, y in zip(a, c))
    # Scene i does not depend on how many scenes were asked for.
    assert np.array_equal(np.asarray(World(seed=3).scene(2).image), np.asarray(a[2].image))


def test_splits_are_disjoint_streams():
    train = World(seed=0, split="train").sample(3)
    val = World(seed=0, split="validation").sample(3)
    assert all(not np.array_equal(np.asarray(t.image), np.asarray(v.image)) for t, v in zip(train, val))


def test_class_label_is_shape_times_colour_of_the_largest_object(scenes):
    labels = set()
    for s in scenes:
        objs = s.attributes["objects"]
        main = objs[s.attributes["main"]]
        assert main["r"] == max(o["r"] for o in objs)
        assert s.class_label == SHAPES.index(main["shape"]) * len(COLOURS) + list(COLOURS).index(main["colour"])
        labels.add(s.class_label)
    assert len(labels) >= 24  # most of the 32 classes appear in 120 scenes


def test_captions_name_every_object_and_no_absent_colour(scenes):
    for s in scenes:
        objs = s.attributes["objects"]
        present = {o["colour"] for o in objs}
        for cap in s.captions:
            for o in objs:
                assert mentions(cap, COLOUR_WORDS[o["colour"]]), (cap, o)
                assert mentions(cap, SHAPE_WORDS[o["shape"]]), (cap, o)
            for colour, syn in COLOUR_WORDS.items():
                if colour not in present:
                    assert not mentions(cap, syn), (cap, colour)


def test_caption_variety(scenes):
    distinct = [len(set(s.captions)) for s in scenes]
    assert np.mean(distinct) >= 3.0
    # Free order: for two-object scenes, both orders of mention occur somewhere.
    first_mentions = set()
    for s in scenes:
        if len(s.attributes["objects"]) == 2:
            for cap in s.captions:
                pos = [min((m.start() for w in COLOUR_WORDS[o["colour"]] for m in re.finditer(rf"\b{w}\b", cap)),
                           default=10**6) for o in s.attributes["objects"]]
                first_mentions.add(int(np.argmin(pos)))
    assert first_mentions == {0, 1}


def _synonym_owner(text: str, table: dict) -> list[str]:
    return [k for k, syn in table.items() if mentions(text, syn)]


def test_answers_agree_with_the_scene(scenes):
    checked = {"count": 0, "exists": 0, "colour": 0, "shape": 0, "position": 0}
    for s in scenes:
        objs = s.attributes["objects"]
        for q, answers in s.qa:
            assert answers and len(set(answers)) == len(answers)
            if q.startswith(("how many", "count")):
                assert answers[0] == str(len(objs))
                checked["count"] += 1
            elif q.startswith(("is there", "does the image", "can you see")):
                colours, shapes = _synonym_owner(q, COLOUR_WORDS), _synonym_owner(q, SHAPE_WORDS)
                truth = any(o["colour"] in colours and o["shape"] in shapes for o in objs)
                assert (answers[0] == "yes") == truth, (q, answers)
                checked["exists"] += 1
            elif "colour" in q or "color" in q:
                (shape,) = _synonym_owner(q, SHAPE_WORDS)
                (obj,) = [o for o in objs if o["shape"] == shape]
                assert answers[0] in COLOUR_WORDS[obj["colour"]]
                checked["colour"] += 1
            elif q.startswith(("what shape", "which shape", "what is the")):
                (colour,) = _synonym_owner(q, COLOUR_WORDS)
                (obj,) = [o for o in objs if o["colour"] == colour]
                assert answers[0] in SHAPE_WORDS[obj["shape"]]
                checked["shape"] += 1
            elif " left " in f" {q} " or " above " in f" {q} ":
                m = re.match(r"is the (\w+) (\w+) .* the (\w+) (\w+) \?", q)
                a = next(o for o in objs if (o["colour"], o["shape"]) == (m[1], m[2]))
                b = next(o for o in objs if (o["colour"], o["shape"]) == (m[3], m[4]))
                if "left or" in q:
                    assert answers[0] == ("left" if a["x"] < b["x"] else "right")
                elif "above or" in q or "higher or" in q:
                    assert answers[0] == ("above" if a["y"] < b["y"] else "below")
                else:
                    assert answers[0] == ("yes" if a["x"] < b["x"] else "no")
                checked["position"] += 1
    assert all(v > 0 for v in checked.values()), checked


def test_tokenizer_covers_every_caption_and_answer(scenes):
    tok = build_tokenizer()
    unk = tok.unk_token_id
    for s in scenes[:40]:
        for text in s.captions + [q for q, _ in s.qa] + [a for _, ans in s.qa for a in ans]:
            ids = tok(text, add_special_tokens=False).input_ids
            assert unk not in ids, text
            assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("<image>") != unk


@pytest.mark.parametrize(
    "kwargs,name",
    [(dict(min_objects=0), "min_objects"), (dict(colours=("red", "mauve")), "colours"),
     (dict(image_size=66), "image_size"), (dict(shapes=("hexagon",)), "shapes"), (dict(max_objects=5), "max_objects")],
)
def test_impossible_settings_raise(kwargs, name):
    with pytest.raises(ValueError, match=name):
        WorldConfig(**kwargs)


def test_main_first_captions_name_the_main_object_then_the_others_left_to_right(scenes):
    """The `main_first` order (a training option of the testbed VLM): read back with the eval's own
    parser, the named (colour, shape) pairs come in exactly that order; the scene is unchanged."""
    from mmspec.testbed.language import sample_captions
    from mmspec.testbed.vlm_eval import caption_pairs

    multi = [s for s in scenes if len(s.attributes["objects"]) > 1]
    assert len(multi) >= 5
    for s in multi:
        objs, main = s.attributes["objects"], s.attributes["main"]
        rest = sorted((o for i, o in enumerate(objs) if i != main), key=lambda o: o["x"])
        want = [(o["colour"], o["shape"]) for o in [objs[main]] + rest]
        for text in sample_captions(s.attributes, 4, np.random.default_rng(s.index), "main_first"):
            assert caption_pairs(text) == want, text
    with pytest.raises(ValueError, match="caption order"):
        sample_captions(multi[0].attributes, 1, np.random.default_rng(0), "sorted")


def test_centred_main_object_stays_within_the_jitter_and_is_drawn_there():
    cfg = WorldConfig(max_objects=1, backgrounds=("plain",), main_position="centre", centre_jitter=0.05)
    scenes = World(seed=3, config=cfg).sample(40)
    xs = np.array([s.attributes["objects"][0]["x"] for s in scenes])
    ys = np.array([s.attributes["objects"][0]["y"] for s in scenes])
    assert np.abs(xs - 0.5).max() <= 0.05 and np.abs(ys - 0.5).max() <= 0.05
    assert xs.std() > 0.01 and ys.std() > 0.01  # jittered, not all at one point
    # the rendered object is where the attributes say: the centre pixel differs from the corner
    for s in scenes[:10]:
        img = np.asarray(s.image).astype(int)
        assert np.abs(img[32, 32] - img[1, 1]).sum() > 60
    # the default placement is unchanged ("anywhere"): centres spread over the image
    anywhere = World(seed=3, config=WorldConfig(max_objects=1)).sample(40)
    assert np.std([s.attributes["objects"][0]["x"] for s in anywhere]) > 0.1


@pytest.mark.parametrize("kwargs", [dict(main_position="middle"), dict(centre_jitter=0.3), dict(centre_jitter=-0.1)])
def test_bad_placement_settings_raise(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        WorldConfig(**kwargs)


@pytest.mark.parametrize("argv,message", [
    (["data", "--out", "OUT", "--n", "-1"], "testbed data: --n must be >= 1"),  # printed "wrote -1 scenes"
    (["data", "--out", "OUT", "--n", "2", "--image-size", "0"], "testbed data: image_size=0: must be >= 32"),  # a traceback
    (["samples", "--out", "OUT", "--n", "0"], "testbed samples: --n must be >= 1"),  # "wrote 0 sample scenes"
    (["train-vq", "--out", "OUT", "--steps", "0"], "testbed train-vq: VQTrainConfig.steps must be >= 1"),  # a traceback
    (["eval-vq", "--n", "0"], "testbed eval-vq: --n must be >= 1"),
    (["eval-judge", "--n", "1"], "testbed eval-judge: --n must be >= 2"),  # "need at least one array to stack"
    (["caption-stats", "--n", "0"], "testbed caption-stats: --n and --captions must be >= 1"),
    (["contact-sheet", "--n", "0", "--out", "OUT"], "testbed contact-sheet: --n must be >= 1"),
], ids=["data", "data-size", "samples", "train-vq", "eval-vq", "eval-judge", "caption-stats", "contact-sheet"])
def test_testbed_commands_refuse_counts_they_cannot_use(argv, message, tmp_path):
    from mmspec.cli import main

    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    with pytest.raises(SystemExit, match=message):
        main(["testbed", *argv])
    assert not (tmp_path / "out").exists()  # refused before writing anything


def test_the_vocabulary_is_the_bundled_models_own():
    """The word ids are part of the bundled VLM: a module constant added to language.py
    (CAPTION_ORDERS, commit f643616) joined the vocabulary and shifted 71 ids, and the bundled sample tokenizer
    (assets/testbed/tokenizer) went stale. build_tokenizer, the VLM bundle's processor and the
    sample tokenizer must hold one vocabulary."""
    import json
    from pathlib import Path

    assets = Path(__file__).resolve().parents[1] / "assets" / "testbed"
    built = json.loads(build_tokenizer().backend_tokenizer.to_str())["model"]["vocab"]
    for path in (assets / "vlm" / "processor" / "tokenizer.json", assets / "tokenizer" / "tokenizer.json"):
        assert json.loads(path.read_text())["model"]["vocab"] == built, path


def test_world_image_size_comes_from_the_config_or_must_agree_with_it():
    """World(config=WorldConfig(image_size=128)) rendered 64 px: the default image_size argument
    replaced the config's value."""
    import pytest

    from mmspec.testbed.world import World, WorldConfig

    assert World(seed=0, config=WorldConfig(image_size=128)).sample(1)[0].image.size == (128, 128)
    assert World(seed=0).sample(1)[0].image.size == (64, 64)
    assert World(seed=0, image_size=96).sample(1)[0].image.size == (96, 96)
    with pytest.raises(ValueError, match="image_size=64 and config.image_size=128 disagree"):
        World(seed=0, image_size=64, config=WorldConfig(image_size=128))


def test_imagegen_codebooks_past_int16_are_refused_before_training():
    import pytest

    from mmspec.testbed.imagegen_train import ImageGenTrainConfig

    with pytest.raises(ValueError, match="vq_codebook_size must be in 2..32767"):
        ImageGenTrainConfig(vq_codebook_size=40000)  # codes were stored as int16 (wrapped around)


def test_world_settings_that_failed_inside_numpy_are_refused_by_name():
    import pytest

    from mmspec.testbed.world import World, WorldConfig

    with pytest.raises(ValueError, match="colours: .* repeats an entry"):
        WorldConfig(colours=("red", "red", "blue"))
    with pytest.raises(ValueError, match="seed must be an int >= 0, got -1"):
        World(seed=-1)
