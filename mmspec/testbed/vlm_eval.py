"""Quality checks of a testbed VLM: caption correctness and VQA accuracy against the scene.

- ``caption_pairs(text)``: the (colour, shape) pairs a caption names, read with the grammar's
  synonym tables (``language.COLOUR_WORDS`` / ``SHAPE_WORDS``, multi-word shape names first).
  Every noun phrase of the grammar names exactly one colour and one shape, next to each other
  in either order ("a crimson disc", "a disc in crimson"), so mentions are paired in order.
- ``caption_correct(text, attrs)``: the caption's pairs equal the scene's objects as a
  multiset (every object named with its own colour and shape, nothing extra, nothing missed).
- ``vqa_correct(answer, valid)``: the answer is one of the scene's valid phrasings.
- ``evaluate(pipe, scenes)``: both rates through a ``SpeculativeVLMPipeline`` (plain greedy).

Limits: the check reads colour and shape only (sizes, positions, backgrounds in captions are
not checked); an answer phrased validly but not in the scene's list counts as wrong.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from mmspec.testbed.language import COLOUR_WORDS, SHAPE_WORDS

_COLOUR_OF = {w: c for c, words in COLOUR_WORDS.items() for w in words}
_SHAPE_OF = {w: s for s, words in SHAPE_WORDS.items() for w in words}


def _mentions(text: str) -> list[tuple[str, str]]:
    """("colour" | "shape", canonical name) in reading order."""
    words = text.lower().split()
    out, i = [], 0
    while i < len(words):
        two = " ".join(words[i:i + 2])
        if two in _SHAPE_OF:
            out.append(("shape", _SHAPE_OF[two]))
            i += 2
            continue
        if words[i] in _COLOUR_OF:
            out.append(("colour", _COLOUR_OF[words[i]]))
        elif words[i] in _SHAPE_OF:
            out.append(("shape", _SHAPE_OF[words[i]]))
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


def caption_correct(text: str | None, attrs: dict[str, Any]) -> bool:
    pairs = caption_pairs(text or "")
    if pairs is None:
        return False
    return Counter(pairs) == Counter((o["colour"], o["shape"]) for o in attrs["objects"])


def vqa_correct(answer: str | None, valid: list[str]) -> bool:
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
    cap_ok = [caption_correct(t, s.attributes) for t, s in zip(captions, scenes)]
    vqa_ok = [vqa_correct(a, s.qa[0][1]) for a, s in zip(answers, scenes)]
    return {
        "scenes": len(scenes),
        "caption_correct": sum(cap_ok) / max(len(scenes), 1),
        "vqa_accuracy": sum(vqa_ok) / max(len(scenes), 1),
        "examples": [{"caption": c, "caption_ok": ok, "question": s.qa[0][0], "answer": a, "answer_ok": aok}
                     for c, ok, a, aok, s in list(zip(captions, cap_ok, answers, vqa_ok, scenes))[:8]],
    }
