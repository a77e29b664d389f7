"""Quality checks of a testbed VLM: caption correctness and VQA accuracy against the scene.

- ``caption_pairs(text)``: the (colour, shape) pairs a caption names, read with the grammar's
  synonym tables (``language.COLOUR_WORDS`` / ``SHAPE_WORDS``, multi-word shape names first).
  Every noun phrase of the grammar names exactly one colour and one shape, next to each other
  in either order ("a crimson disc", "a disc in crimson"), so mentions are paired in order.
- ``caption_correct(text, attrs)``: the caption's pairs equal the scene's objects as a
  multiset (every object named with its own colour and shape, nothing extra, nothing missed).
- ``vqa_correct(answer, valid)``: the answer says what one of the scene's valid answers says, up
  to the grammar's synonyms: both are read as multisets of content words in canonical form
  (colours, shapes, numbers, yes / no, left / right / above / below; "rhombus" = "lozenge" =
  "diamond", "higher" = "above", "2" = "two"), the other words ("it", "is", "the", ...)
  ignored. Why: the grammar's own answer lists are not closed under its synonyms ("the lozenge
  is pink" is listed for "what is the colour of the lozenge ?", "the rhombus is pink" is not;
  "disc" is, "a disc" is not), and a model that learned the synonyms was marked wrong for them.
  ``vqa_exact(answer, valid)`` is the phrase-exact check of earlier bundles (reported beside).
- ``visible_objects(attrs, size=64)``: the scene's objects with at least one visible pixel at
  size x size, which ``evaluate`` takes from each scene's image (the world draws later objects
  over earlier ones; 9 of the 200 validation scenes have an object hidden entirely at 64 px, 7
  of them 3-object scenes). ``evaluate`` reports caption correctness
  against all objects (the goal's figure) and, beside it, against the visible ones: no model
  can name an object it is not shown.
- ``visible_pixels(attrs, size=64)``: how many pixels of each object are visible at size x size
  (in the scene's object order). ``evaluate`` splits caption correctness by the scene's least
  visible object, counted at 64 px whatever the size shown (bins ``LEAST_VISIBLE_BINS``): a
  caption names every object, so the scene is as hard as its most hidden object. On the 2000
  validation scenes of seed 0, 194 have an object with fewer than 30 of its pixels visible
  (at 64 px an object covers 80-900), and there a model that names what it sees cannot be right.
- ``caption_error(text, attrs)``: why a caption fails (None when it is right): ``unpaired``
  (the mentions do not pair up), ``count`` (a wrong number of objects), ``shape``, ``colour``,
  ``colour+shape`` (the right number of objects, the named shapes / colours not the scene's as
  multisets) or ``pairing`` (right colours and shapes, paired wrong).
- ``scene_size(processor)``: the side a testbed VLM's processor crops to; its scenes are rendered
  at that size (``World(..., image_size=scene_size(...))``) so the processor does not resample.
- ``question_kind(question)``: which of the grammar's question templates asked it (``colour``,
  ``shape``, ``count``, ``position``, ``exists``; ``other`` for a question of no template).
- ``evaluate(pipe, scenes)``: both rates and their 95% Wilson intervals through a
  ``SpeculativeVLMPipeline`` (plain greedy),
  with captions split by the scene's number of objects and by error kind, answers by question
  kind.

Limits: the caption check reads colour and shape only (sizes, positions, backgrounds in captions
are not checked); the VQA check knows the default grammar's words only.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

from mmspec.testbed import language
from mmspec.testbed.language import COLOUR_WORDS, SHAPE_WORDS

_COLOUR_OF = {w: c for c, words in COLOUR_WORDS.items() for w in words}
_SHAPE_OF = {w: s for s, words in SHAPE_WORDS.items() for w in words}


def _mentions(text: str, extra: tuple = ()) -> list[tuple[str, str]]:
    """(kind, canonical name) in reading order: colours and shapes (multi-word shape names
    first), then the (table, kind) pairs of ``extra``; other words skipped."""
    words = text.lower().split()
    tables = ((_COLOUR_OF, "colour"), (_SHAPE_OF, "shape"), *extra)
    out, i = [], 0
    while i < len(words):
        two = " ".join(words[i:i + 2])
        if two in _SHAPE_OF:
            out.append(("shape", _SHAPE_OF[two]))
            i += 2
            continue
        hit = next(((kind, table[words[i]]) for table, kind in tables if words[i] in table), None)
        if hit:
            out.append(hit)
        i += 1
    return out


def caption_pairs(text: str) -> list[tuple[str, str]] | None:
    """(colour, shape) per noun phrase, or None when the mentions do not pair up."""
    m = _mentions(text or "")
    if len(m) % 2:
        return None
    pairs = []
    for a, b in zip(m[0::2], m[1::2]):
        if {a[0], b[0]} != {"colour", "shape"}:
            return None
        colour, shape = (a[1], b[1]) if a[0] == "colour" else (b[1], a[1])
        pairs.append((colour, shape))
    return pairs


def scene_size(processor) -> int:
    """The side (pixels) a testbed VLM's processor crops to: render its scenes at this size."""
    image_processor = getattr(processor, "image_processor", processor)
    crop = getattr(image_processor, "crop_size", None)
    if isinstance(crop, dict):
        size, width = crop.get("height"), crop.get("width")
    else:  # transformers' SizeDict (a reloaded processor)
        size, width = getattr(crop, "height", None), getattr(crop, "width", None)
    if not isinstance(size, int) or width != size:
        raise ValueError(f"processor crop_size={crop!r}: the testbed VLMs crop square images "
                         "(crop_size={'height': N, 'width': N})")
    return size


def caption_correct(text: str | None, attrs: dict[str, Any]) -> bool:
    pairs = caption_pairs(text or "")
    if pairs is None:
        return False
    return Counter(pairs) == Counter((o["colour"], o["shape"]) for o in attrs["objects"])


def visible_objects(attrs: dict[str, Any], image_size: int = 64) -> list[dict[str, Any]]:
    """The objects of ``attrs`` with >= 1 visible pixel when drawn at ``image_size`` (module docstring)."""
    return [o for o, v in zip(attrs["objects"], visible_pixels(attrs, image_size)) if v > 0]


def visible_pixels(attrs: dict[str, Any], image_size: int = 64) -> list[int]:
    """Visible pixels of each object of ``attrs`` when drawn at ``image_size`` (module docstring)."""
    from mmspec.testbed.vlm_tower import scene_labels
    from mmspec.testbed.world import WorldConfig

    _, cover, _ = scene_labels(attrs, image_size, 1, WorldConfig(image_size=image_size))
    return [int(c.sum()) for c in cover[:len(attrs["objects"])]]


# Bins of the least visible object's visible pixels at 64 px (lower edges; the last is open) and
# their labels, in order: "0", "1-29", "30-59", ..., "250+".
LEAST_VISIBLE_BINS = (0, 1, 30, 60, 100, 150, 250)
LEAST_VISIBLE_LABELS = tuple(
    f"{lo}+" if hi is None else str(lo) if hi - lo == 1 else f"{lo}-{hi - 1}"
    for lo, hi in zip(LEAST_VISIBLE_BINS, LEAST_VISIBLE_BINS[1:] + (None,)))


def least_visible_bin(attrs: dict[str, Any], pixels64: list[int] | None = None) -> str:
    """The ``LEAST_VISIBLE_LABELS`` entry of a scene's least visible object (``pixels64``: its
    ``visible_pixels(attrs, 64)`` when already computed)."""
    least = min(visible_pixels(attrs, 64) if pixels64 is None else pixels64)
    return LEAST_VISIBLE_LABELS[max(k for k, lo in enumerate(LEAST_VISIBLE_BINS) if least >= lo)]


def wilson(k: int, n: int, z: float = 1.959964) -> list[float]:
    """The Wilson score interval [low, high] of a rate k / n (95% for the default z); [0, 1] for n = 0."""
    if n == 0:
        return [0.0, 1.0]
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [centre - half, centre + half]


def caption_error(text: str | None, attrs: dict[str, Any]) -> str | None:
    """The kind of a caption's error (module docstring), None when the caption is right."""
    pairs = caption_pairs(text or "")
    if pairs is None:
        return "unpaired"
    objects = attrs["objects"]
    if Counter(pairs) == Counter((o["colour"], o["shape"]) for o in objects):
        return None
    if len(pairs) != len(objects):
        return "count"
    colours_ok = Counter(c for c, _ in pairs) == Counter(o["colour"] for o in objects)
    shapes_ok = Counter(s for _, s in pairs) == Counter(o["shape"] for o in objects)
    if colours_ok and shapes_ok:
        return "pairing"
    return "shape" if colours_ok else "colour" if shapes_ok else "colour+shape"


def _template_pattern(template: str) -> re.Pattern:
    parts = re.split(r"\{\w+\}", template)
    return re.compile(".+".join(re.escape(p) for p in parts) + r"\Z")


_QUESTION_KINDS = [(kind, [_template_pattern(t) for t in templates]) for kind, templates in (
    ("colour", language.Q_COLOUR), ("shape", language.Q_SHAPE), ("count", language.Q_COUNT),
    ("position", language.Q_HORIZONTAL + language.Q_VERTICAL + language.Q_LEFT_YN),
    ("exists", tuple(t.replace("a {colour}", "{article} {colour}") for t in language.Q_EXISTS)))]


def question_kind(question: str) -> str:
    """The grammar template kind of `question` (module docstring)."""
    q = " ".join(question.lower().split())
    for kind, patterns in _QUESTION_KINDS:
        if any(p.match(q) for p in patterns):
            return kind
    return "other"


_DIRECTION_OF = {"left": "left", "right": "right", "above": "above", "higher": "above", "over": "above",
                 "below": "below", "lower": "below", "under": "below"}
_NUMBER_OF = {**{w: str(i) for i, w in enumerate(language.NUMBER_WORDS)}, **{str(i): str(i) for i in range(10)}}


_ANSWER_WORDS = ((_NUMBER_OF, "number"), (_DIRECTION_OF, "direction"), ({"yes": "yes", "no": "no", "not": "no"}, "polarity"))


def answer_content(text: str | None) -> tuple[str, ...]:
    """The content words of an answer in canonical form, sorted (see ``vqa_correct``)."""
    out = [f"{kind}:{name}" for kind, name in _mentions((text or "").replace(",", " "), _ANSWER_WORDS)]
    if out.count("polarity:no") > 1:  # "no it is not": one negation
        out = [c for c in out if c != "polarity:no"] + ["polarity:no"]
    return tuple(sorted(out))


def vqa_correct(answer: str | None, valid: list[str]) -> bool:
    """True when the answer's content words equal one valid answer's, up to synonyms (module docstring)."""
    content = answer_content(answer)
    return bool(content) and any(content == answer_content(v) for v in valid)


def vqa_exact(answer: str | None, valid: list[str]) -> bool:
    """True when the answer is one of the valid phrasings (case and spacing aside)."""
    norm = lambda s: " ".join((s or "").lower().split())
    return norm(answer) in {norm(v) for v in valid}


def evaluate(pipe, scenes, *, max_new_tokens: int = 48, batch_size: int = 16, progress: bool = True) -> dict:
    """Caption correctness and VQA accuracy (first question of each scene), plain greedy decoding."""
    from tqdm import tqdm

    images = [s.image for s in scenes]
    captions, answers = [], []
    for start in tqdm(range(0, len(scenes), batch_size), desc="evaluate", disable=not progress):
        chunk = scenes[start:start + batch_size]
        imgs = images[start:start + batch_size]
        captions += pipe(imgs, None, max_new_tokens=max_new_tokens, speculative=False).texts
        answers += pipe(imgs, [s.qa[0][0] for s in chunk], max_new_tokens=max_new_tokens, speculative=False).texts
    errors = [caption_error(t, s.attributes) for t, s in zip(captions, scenes)]
    cap_ok = [e is None for e in errors]
    pixels64 = [visible_pixels(s.attributes, 64) for s in scenes]
    shown = [p if s.image.size[0] == 64 else visible_pixels(s.attributes, s.image.size[0])  # at the size shown
             for p, s in zip(pixels64, scenes)]
    cap_visible_ok = [caption_correct(t, {"objects": [o for o, v in zip(s.attributes["objects"], px) if v > 0]})
                      for t, s, px in zip(captions, scenes, shown)]
    vqa_ok = [vqa_correct(a, s.qa[0][1]) for a, s in zip(answers, scenes)]
    vqa_exact_ok = [vqa_exact(a, s.qa[0][1]) for a, s in zip(answers, scenes)]

    def split(keys, oks):
        table: dict[str, list[int]] = {}
        for key, ok in zip(keys, oks):
            row = table.setdefault(str(key), [0, 0])
            row[0] += int(ok)
            row[1] += 1
        return dict(sorted(table.items()))

    n = max(len(scenes), 1)
    by_least = split([least_visible_bin(s.attributes, p) for s, p in zip(scenes, pixels64)], cap_ok)
    return {
        "scenes": len(scenes),
        "caption_correct": sum(cap_ok) / n,
        # 95% Wilson intervals: on the 200 scenes of train-vlm's eval stage they are ~+-6 points wide
        "caption_correct_ci95": wilson(sum(cap_ok), len(scenes)),
        "vqa_accuracy_ci95": wilson(sum(vqa_ok), len(scenes)),
        "caption_correct_visible_objects": sum(cap_visible_ok) / n,
        "vqa_accuracy": sum(vqa_ok) / n,
        "vqa_exact_phrase_accuracy": sum(vqa_exact_ok) / n,
        "caption_by_objects": split([len(s.attributes["objects"]) for s in scenes], cap_ok),  # [right, scenes]
        "caption_errors": dict(sorted(Counter(e for e in errors if e is not None).items())),
        # [right, scenes] by the least visible object's visible pixels at 64 px, in bin order
        "caption_by_least_visible_px64": {b: by_least[b] for b in LEAST_VISIBLE_LABELS if b in by_least},
        "vqa_by_kind": split([question_kind(s.qa[0][0]) for s in scenes], vqa_ok),  # [right, questions]
        "examples": [{"caption": c, "caption_ok": ok, "question": s.qa[0][0], "answer": a, "answer_ok": aok}
                     for c, ok, a, aok, s in list(zip(captions, cap_ok, answers, vqa_ok, scenes))[:8]],
        # Per scene, in order, one character each ("1" = right): two models judged on the same
        # scenes are compared pair by pair (mmspec/testbed/vlm_compare.py).
        "per_scene": {"caption_ok": "".join("1" if x else "0" for x in cap_ok),
                      "vqa_ok": "".join("1" if x else "0" for x in vqa_ok)},
    }
