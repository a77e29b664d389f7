"""Captions, question/answer pairs and the word-level tokenizer of the testbed world.

What: a small grammar that turns scene attributes (see ``world.py``) into text with real
linguistic variety -- colour/shape/size synonyms, free order of objects, several templates,
optional background / position / occlusion details -- and questions (colour, shape, count,
relative position, yes/no) with several valid phrasings of each answer. Every string the
grammar can emit is built from the module-level constants below, so the tokenizer's
vocabulary is read off those constants and is closed by construction.

Why: speculative decoding of a captioner is only an honest test if the target's next-token
distribution is genuinely multimodal (several valid captions per image), as with real VLMs.

Limits: English only, lowercase, no punctuation except "," ":" "?"; all objects of a scene
are mentioned in every caption (variety comes from wording and order, never from omission),
which makes captions checkable against the scene.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

COLOUR_WORDS: dict[str, tuple[str, ...]] = {
    "red": ("red", "crimson", "scarlet"),
    "orange": ("orange", "amber", "tangerine"),
    "yellow": ("yellow", "golden", "lemon"),
    "green": ("green", "emerald", "grassy"),
    "cyan": ("cyan", "turquoise", "aqua"),
    "blue": ("blue", "azure", "cobalt"),
    "purple": ("purple", "violet", "lilac"),
    "pink": ("pink", "rose", "salmon"),
}
SHAPE_WORDS: dict[str, tuple[str, ...]] = {
    "circle": ("circle", "disc", "dot", "round shape"),
    "square": ("square", "box", "block", "tile"),
    "triangle": ("triangle", "wedge", "triangular shape"),
    "diamond": ("diamond", "rhombus", "lozenge"),
}
SIZE_WORDS: dict[str, tuple[str, ...]] = {
    "large": ("large", "big", "huge"),
    "medium": ("medium", "midsized"),
    "small": ("small", "little", "tiny"),
}
BACKGROUND_PHRASES: dict[str, tuple[str, ...]] = {
    "plain": ("on a plain background", "against a plain backdrop", "on a flat background"),
    "gradient": ("on a gradient background", "against a shaded backdrop",
                 "on a smoothly shaded background"),
    "stripes": ("on a striped background", "against stripes", "on a background of stripes"),
    "checker": ("on a checkered background", "on a checkerboard", "against a checked pattern"),
    "noise": ("on a mottled background", "against a noisy backdrop", "on a blotchy background"),
}
NUMBER_WORDS: tuple[str, ...] = ("zero", "one", "two", "three")
PREFIXES: tuple[str, ...] = ("", "a picture of ", "an image of ", "a photo of ", "there is ",
                             "this shows ", "we see ")
PLURAL_PREFIXES: tuple[str, ...] = ("{n} shapes : ", "{n} objects : ", "a scene with {n} shapes : ")
JOINERS: tuple[str, ...] = (" and ", " , ", " with ", " next to ", " plus ")
NP_TEMPLATES: tuple[str, ...] = ("{det} {size}{colour} {shape}", "{det} {size}{shape} in {colour}",
                                 "{det} {size}{shape} coloured {colour}")
LEFT_RIGHT: tuple[str, ...] = ("to the left of", "left of", "on the left of")
RIGHT_LEFT: tuple[str, ...] = ("to the right of", "right of", "on the right of")
ABOVE: tuple[str, ...] = ("above", "over", "higher than")
BELOW: tuple[str, ...] = ("below", "under", "lower than")
OCCLUSION: tuple[str, ...] = ("partly hidden behind", "partly covered by", "behind")
ARTICLES: tuple[str, ...] = ("a", "an", "one", "the", "is", "it", "there", "are")

Q_COLOUR: tuple[str, ...] = ("what colour is the {shape} ?", "what color is the {shape} ?",
                             "which colour is the {shape} ?", "what is the colour of the {shape} ?")
A_COLOUR: tuple[str, ...] = ("{c}", "it is {c}", "the {shape} is {c}")
Q_SHAPE: tuple[str, ...] = ("what shape is the {colour} object ?", "which shape is {colour} ?",
                            "what is the {colour} thing ?")
A_SHAPE: tuple[str, ...] = ("{s}", "a {s}", "it is a {s}")
Q_COUNT: tuple[str, ...] = ("how many shapes are there ?", "how many objects are in the image ?",
                            "how many objects can you see ?", "count the shapes .")
A_COUNT: tuple[str, ...] = ("{d}", "{w}", "there are {w}")
Q_HORIZONTAL: tuple[str, ...] = ("is the {a} to the left or to the right of the {b} ?",
                                 "is the {a} left or right of the {b} ?")
A_LEFT: tuple[str, ...] = ("left", "to the left", "on the left", "it is to the left")
A_RIGHT: tuple[str, ...] = ("right", "to the right", "on the right", "it is to the right")
Q_VERTICAL: tuple[str, ...] = ("is the {a} above or below the {b} ?",
                               "is the {a} higher or lower than the {b} ?")
A_ABOVE: tuple[str, ...] = ("above", "higher", "it is above")
A_BELOW: tuple[str, ...] = ("below", "lower", "it is below")
Q_EXISTS: tuple[str, ...] = ("is there a {colour} {shape} ?", "does the image contain a {colour} {shape} ?",
                             "can you see a {colour} {shape} ?")
A_YES: tuple[str, ...] = ("yes", "yes there is", "yes , there is one")
A_NO: tuple[str, ...] = ("no", "no there is not", "no , there is none")
Q_LEFT_YN: tuple[str, ...] = ("is the {a} to the left of the {b} ?", "is the {a} left of the {b} ?")
A_YES_REL: tuple[str, ...] = ("yes", "yes it is", "yes , it is")
A_NO_REL: tuple[str, ...] = ("no", "no it is not", "no , it is not")

SPECIAL_TOKENS: dict[str, str] = {"pad_token": "<pad>", "bos_token": "<bos>",
                                  "eos_token": "<eos>", "unk_token": "<unk>"}
IMAGE_TOKEN = "<image>"
# Horizontal/vertical offsets (unit coordinates) below which relative position is not asked.
_POSITION_MARGIN = 0.15


def _choice(rng: np.random.Generator, options: tuple[str, ...] | list[str]) -> str:
    return options[int(rng.integers(len(options)))]


def _article(next_word: str) -> str:
    return "an" if next_word[:1] in "aeiou" else "a"


def noun_phrase(obj: dict[str, Any], rng: np.random.Generator) -> str:
    """'a big crimson disc', 'one tile in azure', ... -- always names colour and shape."""
    size = _choice(rng, SIZE_WORDS[obj["size"]]) + " " if rng.random() < 0.4 else ""
    colour = _choice(rng, COLOUR_WORDS[obj["colour"]])
    shape = _choice(rng, SHAPE_WORDS[obj["shape"]])
    text = _choice(rng, NP_TEMPLATES).format(det="{det}", size=size, colour=colour, shape=shape)
    det = "one" if rng.random() < 0.15 else _article(text.split()[1])
    return text.format(det=det)


def _relation(a: dict[str, Any], b: dict[str, Any], rng: np.random.Generator) -> str | None:
    """A spatial relation 'a REL b' that clearly holds, or None."""
    dx, dy = a["x"] - b["x"], a["y"] - b["y"]
    if abs(dx) > _POSITION_MARGIN and abs(dx) > abs(dy):
        return _choice(rng, LEFT_RIGHT if dx < 0 else RIGHT_LEFT)
    if abs(dy) > _POSITION_MARGIN and abs(dy) > abs(dx):
        return _choice(rng, ABOVE if dy < 0 else BELOW)
    return None


CAPTION_ORDERS = ("random", "main_first")


def object_order(attrs: dict[str, Any], order: str, rng: np.random.Generator) -> list[int]:
    """The order in which a caption names the objects: ``random`` (a uniform permutation), or
    ``main_first`` (the main, largest object, then the others from left to right: an order a
    reader can see in the image, so the next object to name is never a matter of chance)."""
    objects = attrs["objects"]
    if order == "random":
        return [int(i) for i in rng.permutation(len(objects))]
    if order == "main_first":
        rest = sorted((i for i in range(len(objects)) if i != attrs["main"]), key=lambda i: objects[i]["x"])
        return [int(attrs["main"])] + rest
    raise ValueError(f"caption order {order!r}: choose from {CAPTION_ORDERS}")


def caption(attrs: dict[str, Any], rng: np.random.Generator, order: str = "random") -> str:
    """One caption of the scene, sampled from the grammar (objects named in ``order``)."""
    objects = attrs["objects"]
    order = object_order(attrs, order, rng)
    nps = [noun_phrase(objects[i], rng) for i in order]
    style = rng.random()
    if len(objects) == 1:
        text = _choice(rng, PREFIXES) + nps[0]
    elif style < 0.25:
        n = _choice(rng, (NUMBER_WORDS[len(objects)], str(len(objects))))
        text = _choice(rng, PLURAL_PREFIXES).format(n=n) + " , ".join(nps[:-1]) + " and " + nps[-1]
    elif style < 0.55:
        # a relation between the first two mentioned objects, if one clearly holds
        a, b = objects[order[0]], objects[order[1]]
        # b is drawn after a and overlaps it (same test as world._overlap)
        occluded = order[1] > order[0] and (
            np.hypot(a["x"] - b["x"], a["y"] - b["y"]) < 0.9 * (a["r"] + b["r"]))
        rel = _choice(rng, OCCLUSION) if occluded and rng.random() < 0.5 else _relation(a, b, rng)
        head = f"{nps[0]} {rel} {nps[1]}" if rel else f"{nps[0]} and {nps[1]}"
        text = _choice(rng, PREFIXES) + head + "".join(" and " + p for p in nps[2:])
    else:
        text = _choice(rng, PREFIXES) + nps[0]
        for p in nps[1:]:
            text += _choice(rng, JOINERS) + p
    if rng.random() < 0.5:
        text += " " + _choice(rng, BACKGROUND_PHRASES[attrs["background"]["kind"]])
    return " ".join(text.split())


def sample_captions(attrs: dict[str, Any], n: int, rng: np.random.Generator, order: str = "random") -> list[str]:
    return [caption(attrs, rng, order) for _ in range(n)]


def _name(obj: dict[str, Any]) -> str:
    return f"{obj['colour']} {obj['shape']}"


def sample_questions(attrs: dict[str, Any], config: Any, n: int,
                     rng: np.random.Generator) -> list[tuple[str, list[str]]]:
    """``n`` (question, [valid answers]) pairs; kinds are sampled among those that apply."""
    objects = attrs["objects"]
    makers = [_q_colour, _q_shape, _q_count, _q_position, _q_exists, _q_exists]
    out: list[tuple[str, list[str]]] = []
    for _ in range(4 * n):
        if len(out) == n:
            break
        qa = makers[int(rng.integers(len(makers)))](objects, config, rng)
        if qa is not None and qa[0] not in [q for q, _ in out]:
            out.append(qa)
    return out


def _q_colour(objects, config, rng):
    shapes = [o["shape"] for o in objects]
    unique = [o for o in objects if shapes.count(o["shape"]) == 1]
    if not unique:
        return None
    obj = unique[int(rng.integers(len(unique)))]
    shape = _choice(rng, SHAPE_WORDS[obj["shape"]])
    answers = list(COLOUR_WORDS[obj["colour"]])
    answers += [t.format(c=obj["colour"], shape=shape) for t in A_COLOUR[1:]]
    return _choice(rng, Q_COLOUR).format(shape=shape), answers


def _q_shape(objects, config, rng):
    colours = [o["colour"] for o in objects]
    unique = [o for o in objects if colours.count(o["colour"]) == 1]
    if not unique:
        return None
    obj = unique[int(rng.integers(len(unique)))]
    colour = _choice(rng, COLOUR_WORDS[obj["colour"]])
    words = SHAPE_WORDS[obj["shape"]]
    answers = list(words) + [t.format(s=words[0]) for t in A_SHAPE[1:]]
    return _choice(rng, Q_SHAPE).format(colour=colour), answers


def _q_count(objects, config, rng):
    n = len(objects)
    word = NUMBER_WORDS[n]
    answers = [str(n), word, ("there is one" if n == 1 else f"there are {word}")]
    return _choice(rng, Q_COUNT), answers


def _pair(objects, rng):
    names = [_name(o) for o in objects]
    if len(objects) < 2 or len(set(names)) < len(names):
        return None
    i, j = (int(k) for k in rng.choice(len(objects), size=2, replace=False))
    return objects[i], objects[j]


def _q_position(objects, config, rng):
    pair = _pair(objects, rng)
    if pair is None:
        return None
    a, b = pair
    dx, dy = a["x"] - b["x"], a["y"] - b["y"]
    fmt = {"a": _name(a), "b": _name(b)}
    if abs(dx) > _POSITION_MARGIN and abs(dx) > abs(dy):
        if rng.random() < 0.5:
            return _choice(rng, Q_LEFT_YN).format(**fmt), list(A_YES_REL if dx < 0 else A_NO_REL)
        return _choice(rng, Q_HORIZONTAL).format(**fmt), list(A_LEFT if dx < 0 else A_RIGHT)
    if abs(dy) > _POSITION_MARGIN and abs(dy) > abs(dx):
        return _choice(rng, Q_VERTICAL).format(**fmt), list(A_ABOVE if dy < 0 else A_BELOW)
    return None


def _q_exists(objects, config, rng):
    present = {(o["colour"], o["shape"]) for o in objects}
    if rng.random() < 0.5:
        colour, shape = sorted(present)[int(rng.integers(len(present)))]
    else:
        absent = [(c, s) for c in config.colours for s in config.shapes if (c, s) not in present]
        # tiny configs can have every colour x shape present: then ask about a present one
        pool = absent or sorted(present)
        colour, shape = pool[int(rng.integers(len(pool)))]
    question = _choice(rng, Q_EXISTS).format(colour=_choice(rng, COLOUR_WORDS[colour]),
                                             shape=_choice(rng, SHAPE_WORDS[shape]))
    question = re.sub(r"\ba ([aeiou])", r"an \1", question)
    return question, list(A_YES if (colour, shape) in present else A_NO)


# ----------------------------------------------------------------------------- tokenizer

def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _strings(k) + _strings(v)]
    if isinstance(value, (tuple, list)):
        return [s for v in value for s in _strings(v)]
    return []


def vocabulary() -> list[str]:
    """Every word the grammar can emit, read off the module constants (sorted). The word ids are
    part of the bundled VLM (its processor holds this vocabulary; a test keeps them equal): a new
    upper-case constant here changes them (CAPTION_ORDERS' two words joined in commit f643616)."""
    pieces: set[str] = {str(d) for d in range(10)}
    for name, value in globals().items():
        if name.isupper() and name not in ("SPECIAL_TOKENS", "IMAGE_TOKEN"):
            for s in _strings(value):
                pieces.update(re.findall(r"\w+|[^\w\s]+", re.sub(r"\{\w+\}", " ", s.lower())))
    return sorted(pieces)


def build_tokenizer():
    """Word-level ``PreTrainedTokenizerFast`` with <pad> <bos> <eos> <unk> and <image>.

    Ids: 0 <pad>, 1 <bos>, 2 <eos>, 3 <unk>, 4 <image>, then the sorted vocabulary.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = list(SPECIAL_TOKENS.values()) + [IMAGE_TOKEN]
    vocab = {tok: i for i, tok in enumerate(specials + vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    bos, eos = SPECIAL_TOKENS["bos_token"], SPECIAL_TOKENS["eos_token"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=[(bos, vocab[bos]), (eos, vocab[eos])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=128,
                                   additional_special_tokens=[IMAGE_TOKEN], **SPECIAL_TOKENS)
    return fast
