"""`SpeculativeVLMPipeline`: captions and answers about images with speculative decoding.

diffusers conventions (components registered and swappable, `save_pretrained` /
`from_pretrained`, one `__call__`, an output dataclass):

    pipe = SpeculativeVLMPipeline.from_pretrained("saved_pipeline")               # target + processor + drafters
    pipe = SpeculativeVLMPipeline.from_pretrained("llava_checkpoint", drafter="my_eagle_head")
    out = pipe(["a.png", "b.png"], ["what colour is the circle?", None], max_new_tokens=64)
    out.texts, out.sequences, out.stats, out.errors

Components: `target` (a transformers LLaVA-1.5 / LLaVA-NeXT / Qwen2-VL / Qwen2.5-VL model), its
`processor` (chat template, image preprocessing, tokenizer; each call pads on the left), and the active
`drafter` (a `DrafterComponent`: text LM, EAGLE head or ViSpec head). A saved pipeline keeps
every drafter added to it under `drafters/<name>/`; `pipe.load_drafter(name_or_dir)` switches.

`images`: one entry per item, an image (PIL, path), a list of images (several in one prompt),
or None / [] for a text-only item. Prompts go through the processor's chat template (the item's
images, then the text); `None` captions with `caption_prompt`; a prompt that already contains
the image placeholder is used verbatim.
`speculative=False` decodes plainly through the same loop and target code (a drafter that
drafts nothing), so both paths are compared like for like. Greedy (`temperature=0`) output is
identical either way; `acceptance="exact"` keeps sampled output distributed like the target, and
`acceptance="invariant"` also keeps it identical to plain sampling for a seed (with every drafter).
`batch_size` splits the items into batches (image items and text-only items never share one);
once there is more than one batch a progress bar counts the items done
(`pipe.set_progress_bar_config(disable=True)` silences it).

Stopping and settings: a row ends at the target's `generation_config.eos_token_id` (every id
of a list; the tokenizer's EOS where it has none) or after `max_new_tokens`; sampling comes from
the call's `temperature` / `top_k` / `top_p` (default greedy), not from the generation config.
Settings there that the loop cannot apply (`repetition_penalty`, `no_repeat_ngram_size`,
`suppress_tokens`, minimum lengths, ...) are named in a warning: reset them on
`pipe.target.generation_config` to decode as plain `model.generate` would without them.

Errors: bad input (an image placeholder without an image, more images than placeholders, a
drafter built for another target, an unsupported model type) raises ValueError naming it;
an image file that is missing or cannot be decoded is reported in that item's `errors` entry
(its text is None) while the rest of the batch is answered.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from diffusers import DiffusionPipeline

from mmspec.devices import check_dtype
from mmspec.acceptance import get_rule
from mmspec.engine import resolve_rule, speculative_generate
from mmspec.sampling import SamplingConfig, check_generator, plain_number
from mmspec.models.eval_mode import eval_modes
from mmspec.models.hf_target import HFTarget
from mmspec.stats import SpecStats

from .unsupported import RefusesOffload
from .vlm_drafter import DrafterComponent, PlainDecoding

SUPPORTED_MODEL_TYPES = ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl")
DEFAULT_CAPTION_PROMPT = "Describe the image."
INDEX = "model_index.json"


@dataclass
class VLMPipelineOutput:
    texts: list[str | None]  # one per item; None where the item failed (see errors)
    sequences: list[torch.Tensor | None]  # generated token ids per item (EOS included when reached)
    stats: SpecStats  # summed over the batch chunks
    errors: list[str | None] = field(default_factory=list)  # per item: what went wrong, naming the file


def check_target(model) -> None:
    model_type = str(getattr(getattr(model, "config", None), "model_type", ""))
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"SpeculativeVLMPipeline supports model types {SUPPORTED_MODEL_TYPES}; "
                         f"{type(model).__name__} is {model_type!r}")


def check_drafter_name(name, where: str = "drafter name") -> None:
    """A drafter's name becomes a folder under drafters/ when the pipeline is saved: one path
    component (no '/' or '\\', not starting with '.', so neither '.' nor '..'), 1-100 printable
    characters."""
    if (not isinstance(name, str) or not 1 <= len(name) <= 100 or not name.isprintable() or name.startswith(".")
            or "/" in name or "\\" in name):
        raise ValueError(f"{where} {name!r}: a drafter's name is its folder under drafters/ when the pipeline is "
                         "saved: one folder name (no '/' or '\\', not starting with '.'), 1-100 characters")


def merge_stats(parts: list[SpecStats]) -> SpecStats:
    out = SpecStats()
    for s in parts:
        for f in fields(SpecStats):
            a, b = getattr(out, f.name), getattr(s, f.name)
            if isinstance(a, bool):
                setattr(out, f.name, a and b)
            elif isinstance(a, list):
                if f.name in ("accept_counts", "offer_counts"):
                    n = max(len(a), len(b))
                    setattr(out, f.name, [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)])
                else:
                    setattr(out, f.name, a + b)
            elif isinstance(a, (int, float)) and isinstance(b, (int, float)):
                setattr(out, f.name, a + b)
            elif isinstance(a, str):
                setattr(out, f.name, a or b)
            elif b is not None:
                setattr(out, f.name, b if a is None else a + b)
    return out


def _as_displayed_rgb(im):
    """An opened image file as a viewer shows it, in RGB: EXIF orientation applied (a phone photo
    was read sideways) and transparency composited onto white, as transformers' image processors
    treat a PIL image with alpha (the file path and the same image passed as PIL answered differently)."""
    from PIL import Image, ImageOps

    im = ImageOps.exif_transpose(im)
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        rgba = im.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return im.convert("RGB")


# generation_config settings that change what transformers' generate emits and that the speculative
# loop has no counterpart for, each with generate's own test of whether it acts (5.x
# `_get_logits_processor`); the last five are sampling warpers, which act only when sampling.
# Sampling settings themselves come from the pipeline call's own arguments.
_ACTIVE = {
    "repetition_penalty": lambda v: v is not None and v != 1.0, "guidance_scale": lambda v: v is not None and v != 1,
    "no_repeat_ngram_size": lambda v: bool(v) and v > 0, "min_length": lambda v: bool(v) and v > 0,
    "min_new_tokens": lambda v: bool(v) and v > 0, "num_beams": lambda v: bool(v) and v > 1,
    "bad_words_ids": bool, "suppress_tokens": bool, "begin_suppress_tokens": bool, "sequence_bias": bool,
    "stop_strings": bool, "forced_bos_token_id": lambda v: v is not None, "forced_eos_token_id": lambda v: v is not None,
    "exponential_decay_length_penalty": lambda v: v is not None, "watermarking_config": lambda v: v is not None,
    "top_h": lambda v: v is not None, "min_p": lambda v: bool(v) and v > 0,
    "typical_p": lambda v: v is not None and v < 1.0, "epsilon_cutoff": lambda v: v is not None and 0.0 < v < 1.0,
    "eta_cutoff": lambda v: v is not None and 0.0 < v < 1.0,
}
_SAMPLING_ONLY = ("top_h", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")


def unapplied_generation_settings(config, sampling: bool) -> list[str]:
    """'name=value' for each setting of `config` (a GenerationConfig) that would act in
    transformers' generate and that the speculative loop cannot apply (sampling warpers only
    when `sampling`), and the decoding mode when it is neither greedy search nor sampling
    (contrastive search, DoLa, beams, assisted decoding)."""
    found = [f"{name}={getattr(config, name, None)!r}" for name, active in _ACTIVE.items()
             if (sampling or name not in _SAMPLING_ONLY) and active(getattr(config, name, None))]
    try:
        mode = config.get_generation_mode()
    except Exception:  # (a config generate itself would refuse: its settings are named above, or not used)
        mode = None
    name = str(getattr(mode, "value", mode or ""))
    if name and name not in ("greedy_search", "sample") and not any(f.startswith("num_beams=") for f in found):
        found.append(f"generation mode {name!r}")
    return found


class SpeculativeVLMPipeline(RefusesOffload, DiffusionPipeline):
    _optional_components = ["drafter"]  # (without it `components` left the drafter out)

    @property
    def components(self) -> dict:
        """diffusers' components plus the caption prompt, so that `type(pipe)(**pipe.components)`
        answers as this pipeline does. Named drafters (`pipe.drafters`) are not carried."""
        return {**super().components, "caption_prompt": self.config.caption_prompt}

    def __init__(self, target, processor, drafter: DrafterComponent | None = None,
                 caption_prompt: str = DEFAULT_CAPTION_PROMPT):
        super().__init__()
        self.register_modules(target=target, processor=processor, drafter=drafter)  # checked in __setattr__
        self.register_to_config(caption_prompt=caption_prompt)
        self.drafters: dict[str, DrafterComponent] = {}
        self._spec_target = HFTarget(target)
        # id(component) -> (component, built drafter); the entry holds the component, so a freed
        # component's address cannot be taken by a new one that would get the old drafter.
        self._built: dict[int, tuple[Any, Any]] = {}
        if drafter is not None:
            self._check_drafter(drafter)

    # ---- drafters ---------------------------------------------------------------------------------
    def __setattr__(self, name, value):
        # diffusers' registration fails on a string with AttributeError '__module__' (or, on a
        # loaded pipeline, keeps it until the call): say what fits, and how to switch by name
        if name == "drafter" and value is not None:
            self._check_drafter_type(value)
        if name == "target":
            check_target(value)  # (its train / eval mode is the caller's: a call runs it in eval mode, then puts it back)
        super().__setattr__(name, value)
        if name == "drafter":
            self._prune_built()
        elif name == "target" and "_built" in self.__dict__:  # `pipe.target = model`: decode with that model
            self._spec_target = HFTarget(value)
            self._built = {}
        elif name == "processor":  # at __init__ and on `pipe.processor = other` (each call pads on the left)
            self.image_token = getattr(value, "image_token", None) or getattr(value.tokenizer, "image_token", None)

    @staticmethod
    def _check_drafter_type(drafter) -> None:
        if not isinstance(drafter, DrafterComponent):
            hint = (f"; to switch to a saved drafter by name call pipe.load_drafter({drafter!r})"
                    if isinstance(drafter, str) else "")
            raise TypeError(f"drafter must be a DrafterComponent, got {type(drafter).__name__}{hint}")

    def _check_drafter(self, drafter) -> Any:
        self._check_drafter_type(drafter)
        key = id(drafter)
        entry = self._built.get(key)
        if entry is None or entry[0] is not drafter:
            self._prune_built()
            # (ModelMixin.to warns about fp32 modules; none here)
            torch.nn.Module.to(drafter, device=self.target.device, dtype=self.target.dtype)
            entry = self._built[key] = (drafter, drafter.build(self._spec_target))  # ValueError if built for another target
        return entry[1]

    def _prune_built(self) -> None:
        """Drop the built drafters of components the pipeline no longer holds (each kept its weights)."""
        built = self.__dict__.get("_built")
        if built:
            held = [self.__dict__.get("drafter"), *self.__dict__.get("drafters", {}).values()]
            self._built = {k: e for k, e in built.items() if any(e[0] is h for h in held)}

    def to(self, *args, **kwargs):
        """diffusers' `to` (moves the registered target and drafter), then the target's wrap and
        the built drafters are made again for where the target now is (on CPU the wrap may hold
        prepacked copies of its weights, which stay behind); other saved drafters follow the
        target when they are next used."""
        out = super().to(*args, **kwargs)
        self._spec_target = HFTarget(self.target)
        self._built = {}
        return out

    def add_drafter(self, name: str, drafter: DrafterComponent, *, active: bool = True) -> None:
        """Register `drafter` under `name` (a folder name under drafters/ when saved; a drafter of
        that name is replaced) and, with `active`, make it the one used."""
        check_drafter_name(name)
        self._check_drafter(drafter)
        self.drafters[name] = drafter
        if active:
            self.drafter = drafter

    def load_drafter(self, name_or_dir) -> DrafterComponent:
        """Make a drafter active: one saved with this pipeline (by name) or a saved drafter folder."""
        if isinstance(name_or_dir, str) and name_or_dir in self.drafters:
            self.drafter = self.drafters[name_or_dir]
            return self.drafter
        if not isinstance(name_or_dir, (str, Path)):  # os.fspath's bare "expected str, bytes or os.PathLike"
            raise TypeError(f"load_drafter takes a saved drafter's name or a folder, got {type(name_or_dir).__name__}"
                            + ("; add a built component with pipe.add_drafter(name, component)"
                               if isinstance(name_or_dir, DrafterComponent) else ""))
        path = Path(name_or_dir)
        if not (path / DrafterComponent.config_name).is_file():
            known = sorted(self.drafters) or "none"
            raise ValueError(f"no drafter {str(name_or_dir)!r}: not one saved with this pipeline ({known}) and not a "
                             "folder holding a saved DrafterComponent")
        drafter = DrafterComponent.from_pretrained(str(path), low_cpu_mem_usage=False, torch_dtype=self.target.dtype)
        name = path.resolve().name.lstrip(".")[:100] or "drafter"  # registered under its folder's name
        self.add_drafter(name, drafter)
        return drafter

    # ---- save / load ----------------------------------------------------------------------------------
    def save_pretrained(self, directory, *, safe_serialization: bool = True, push_to_hub: bool = False, **kwargs) -> None:
        """Save target, processor and every drafter to a local folder (safetensors)."""
        # Accepted and ignored before: push_to_hub=True pushed nothing, safe_serialization=False
        # still wrote safetensors, other options (variant, ...) vanished.
        if kwargs:
            raise TypeError(f"save_pretrained() got unsupported argument(s) {sorted(kwargs)}; it takes the folder only")
        if push_to_hub is not False:
            raise ValueError("push_to_hub=True is not supported: save the folder, then upload it with huggingface_hub")
        if safe_serialization is not True:
            raise ValueError("safe_serialization=False is not supported: the pipeline saves safetensors only")
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.target.save_pretrained(d / "target")
        self.processor.save_pretrained(d / "processor")
        names = dict(self.drafters)
        default = next((n for n, c in names.items() if c is self.drafter), None)
        if self.drafter is not None and default is None:  # an active drafter never registered: a free name
            default = next(n for n in ("default", *(f"default_{i}" for i in range(1, len(names) + 2))) if n not in names)
            names[default] = self.drafter
        for name, comp in names.items():
            comp.save_pretrained(d / "drafters" / name)
        import diffusers

        index = {"_class_name": type(self).__name__, "_diffusers_version": diffusers.__version__,
                 "target": ["transformers", type(self.target).__name__],
                 "processor": ["transformers", type(self.processor).__name__],
                 "drafter": ["mmspec.pipelines.vlm_drafter", "DrafterComponent"] if default else [None, None],
                 "drafters": sorted(names), "default_drafter": default,
                 "caption_prompt": self.config.caption_prompt}
        (d / INDEX).write_text(json.dumps(index, indent=2))

    @classmethod
    def from_pretrained(cls, directory, drafter=None, *, dtype: torch.dtype | None = None,
                        torch_dtype: torch.dtype | None = None, **kwargs) -> "SpeculativeVLMPipeline":
        """A saved pipeline folder, or a transformers checkpoint folder (model + processor) with
        `drafter` = a DrafterComponent, a saved drafter folder, or None (plain decoding only).
        `dtype=None` keeps the checkpoint's dtype, except that float16 / bfloat16 checkpoints are
        loaded in float32 (pipelines load on CPU; pass `dtype=torch.float16` to keep half precision).
        `torch_dtype` (diffusers' name) is taken as `dtype`; any other option is refused by name
        (they were ignored: `torch_dtype=torch.float16` loaded float32, a misspelt `dtpye` passed)."""
        import transformers

        if kwargs:
            raise TypeError(f"from_pretrained() got unsupported argument(s) {sorted(kwargs)}; it takes a local folder, "
                            "drafter= and dtype= (or torch_dtype=)")
        if torch_dtype is not None:
            if dtype is not None and dtype != torch_dtype:
                raise ValueError(f"dtype={dtype} and torch_dtype={torch_dtype} disagree; pass one of them")
            dtype = torch_dtype
        check_dtype(dtype, "dtype / torch_dtype")

        d = Path(directory)
        if not d.is_dir():
            raise ValueError(f"{d} is not a folder (pipelines load from local folders only)")
        index = json.loads((d / INDEX).read_text()) if (d / INDEX).is_file() else None
        if index is not None and index.get("_class_name") != cls.__name__:  # transformers: "Unrecognized model"
            raise ValueError(f"{d} holds a {index.get('_class_name')} pipeline, not a {cls.__name__}")
        if index is None and not (d / "config.json").is_file():
            raise ValueError(f"{d} is neither a saved {cls.__name__} (model_index.json) nor a transformers VLM "
                             "checkpoint folder (config.json)")
        target_dir, proc_dir = (d / "target", d / "processor") if index else (d, d)
        config = transformers.AutoConfig.from_pretrained(target_dir)
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"SpeculativeVLMPipeline supports model types {SUPPORTED_MODEL_TYPES}; {target_dir} holds "
                             f"a {config.model_type!r} model")
        if dtype is None and str(getattr(config, "dtype", "")).replace("torch.", "") in ("float16", "bfloat16"):
            dtype = torch.float32  # half-precision storage (the bundled testbed VLM): compute in float32 on CPU
        model_cls = getattr(transformers, index["target"][1]) if index else transformers.AutoModelForImageTextToText
        target, info = model_cls.from_pretrained(target_dir, output_loading_info=True,
                                                 **({"dtype": dtype} if dtype is not None else {}))
        bad = {k: sorted(info.get(k) or []) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        if any(bad.values()):  # transformers logs a report and keeps the missing weights random
            listed = "; ".join(f"{k.replace('_', ' ')} {v[:6]}" for k, v in bad.items() if v)
            raise ValueError(f"the target in {str(target_dir)!r} does not match its config ({listed}); it would "
                             "answer with those weights random")
        processor = transformers.AutoProcessor.from_pretrained(proc_dir)
        pipe = cls(target, processor, None, caption_prompt=(index or {}).get("caption_prompt", DEFAULT_CAPTION_PROMPT))
        if index:
            for name in index.get("drafters", []):
                check_drafter_name(name, f"{d / INDEX}: drafters entry")
                comp = DrafterComponent.from_pretrained(str(d / "drafters" / name), low_cpu_mem_usage=False,
                                                        torch_dtype=target.dtype)
                pipe.add_drafter(name, comp, active=False)
            if index.get("default_drafter"):
                pipe.load_drafter(index["default_drafter"])
        if isinstance(drafter, DrafterComponent):
            pipe.add_drafter("drafter", drafter)
        elif drafter is not None:
            pipe.load_drafter(drafter)
        return pipe

    # ---- inputs ------------------------------------------------------------------------------------
    def _load_images(self, item) -> list:
        """An item's images: None (text only), one image, or a list of them (PIL or paths)."""
        if item is None:
            return []
        if isinstance(item, (list, tuple)) and any(x is None for x in item):
            raise ValueError("an item's list of images holds None; give None for the whole item (text only) or only "
                             "PIL images / file paths in its list")
        return [self._load_image(x) for x in (item if isinstance(item, (list, tuple)) else [item])]

    def _load_image(self, item):
        from PIL import Image

        if isinstance(item, Image.Image):
            im = item
        elif isinstance(item, (str, Path)):
            try:
                with Image.open(item) as opened:
                    im = _as_displayed_rgb(opened)
            except FileNotFoundError:
                raise OSError(f"image file {str(item)!r} not found") from None
            except Exception as e:  # PIL raises several types for undecodable files
                raise OSError(f"image file {str(item)!r} could not be read ({type(e).__name__}: {e})") from None
        else:
            raise ValueError(f"images must be PIL images, file paths or None, got {type(item).__name__}")
        if 0 in im.size:  # (it failed inside the image processor)
            raise ValueError(f"an image of {im.size[0]}x{im.size[1]} pixels has no content; give images of at least "
                             "1x1 pixels")
        return im

    def _prompt(self, text: str | None, n_images: int) -> str:
        text = self.config.caption_prompt if text is None else text
        if not isinstance(text, str):
            raise ValueError(f"prompts must be strings or None, got {type(text).__name__}")
        if not text.strip():  # the model would answer a question nobody asked
            raise ValueError(f"prompt {text!r} is empty; pass a question, or None to caption with the "
                             f"pipeline's caption prompt")
        placeholders = text.count(self.image_token) if self.image_token else 0
        if placeholders or (n_images and self.image_token is None):  # verbatim: it must carry exactly the images given
            if n_images == 0:
                raise ValueError(f"prompt {text!r} has an image placeholder {self.image_token!r} but no image was given")
            if n_images > placeholders:
                raise ValueError(f"more images ({n_images}) than image placeholders ({placeholders}) in prompt {text!r}")
            if n_images < placeholders:
                raise ValueError(f"prompt {text!r} has {placeholders} image placeholders for {n_images} image(s)")
            return text
        content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
        if getattr(self.processor, "chat_template", None):
            return self.processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        return " ".join([self.image_token] * n_images + [text])

    # ---- call ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, images, prompts=None, *, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, acceptance: Any = "exact",
                 speculative: bool = True, generator: torch.Generator | None = None,
                 batch_size: int | None = None) -> VLMPipelineOutput:
        if not isinstance(images, (list, tuple)):
            images = [images]
        n = len(images)
        if prompts is None or isinstance(prompts, str):
            prompts = [prompts] * n
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be None, a string or a list of them (None = caption), got "
                            f"{type(prompts).__name__}")
        if len(prompts) != n:
            raise ValueError(f"{len(prompts)} prompts for {n} images; give one prompt per image (None = caption)")
        batch_size = plain_number(batch_size)  # (np.int64(2) means 2)
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be None or an int >= 1, got {batch_size!r}")
        if not isinstance(speculative, bool):  # a string such as "no" would read as True
            raise TypeError(f"speculative must be True or False, got {speculative!r}")
        if speculative and self.drafter is None:
            raise ValueError("speculative=True needs a drafter: pass drafter= to from_pretrained, call "
                             "pipe.load_drafter(...), or use speculative=False")
        drafter = self._check_drafter(self.drafter) if speculative else PlainDecoding(self._spec_target.vocab_size)
        unapplied = unapplied_generation_settings(self.target.generation_config, temperature != 0)
        if unapplied:  # (Python shows one warning text once per process)
            warnings.warn(f"the target's generation_config sets {', '.join(unapplied)}, which this pipeline does not "
                          "apply (it decodes the model's own distribution, sampled by the call's temperature / top_k / "
                          "top_p), so its answers can differ from model.generate's; reset them on "
                          "pipe.target.generation_config to silence this", stacklevel=2)
        # The options are checked here, once, not only inside each batch: with no batch to run (no
        # items, every image missing) bad values passed silently.
        max_new = plain_number(max_new_tokens)
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        check_generator(generator)
        # Built once here (a bad rule is refused before any work) and passed on to every batch.
        acceptance = resolve_rule(acceptance, None, SamplingConfig(temperature, top_k, top_p), self._spec_target, drafter)
        if not speculative and not getattr(acceptance, "position_keyed", False):
            acceptance = get_rule("exact")  # plain decoding samples the target exactly, whatever the rule
        texts: list[str | None] = [None] * n
        seqs: list[torch.Tensor | None] = [None] * n
        errors: list[str | None] = [None] * n
        ready = []
        for i, (img, text) in enumerate(zip(images, prompts)):
            if (img is None or (isinstance(img, (list, tuple)) and not img)) and text is None:
                # was captioned from the caption prompt alone: an invented picture ([] too)
                raise ValueError(f"item {i} has neither an image nor a prompt: give an image to caption or a text "
                                 "prompt to answer")
            try:
                loaded = self._load_images(img)
            except OSError as e:
                errors[i] = str(e)
                continue
            ready.append((i, loaded, self._prompt(text, len(loaded))))
        stats = []
        groups = [[r for r in ready if bool(r[1]) == flag] for flag in (True, False)]
        chunks = [group[start:start + (batch_size or len(group))] for group in groups
                  for start in range(0, len(group), batch_size or max(len(group), 1))]
        # A bar over the items once the work spans several batches (`set_progress_bar_config(disable=True)`
        # silences it, as in every diffusers pipeline).
        # (closed also when a batch raises: a dead bar kept its line and pushed the next call's down)
        # (the target and drafter in eval mode for the call, each module's own mode put back after it)
        with eval_modes(self.target, self.drafter if speculative else None), (
                self.progress_bar(total=len(ready)) if len(chunks) > 1 else contextlib.nullcontext()) as bar:
            for chunk in chunks:
                out = self._generate(chunk, drafter, max_new_tokens=max_new_tokens, temperature=temperature,
                                     top_k=top_k, top_p=top_p, acceptance=acceptance, generator=generator)
                stats.append(out.stats)
                L = out.sequences.shape[1] - max(out.stats.new_tokens)
                for row, (i, _, _) in enumerate(chunk):
                    seqs[i] = out.sequences[row, L:L + out.stats.new_tokens[row]]
                    texts[i] = self.processor.tokenizer.decode(seqs[i], skip_special_tokens=True).strip()
                if bar is not None:
                    bar.update(len(chunk))
        merged = merge_stats(stats)
        # Per input row, in the caller's item order: batches group image and text-only items, and an
        # item that failed to load generated nothing.
        merged.new_tokens = [0 if s is None else int(s.numel()) for s in seqs]
        return VLMPipelineOutput(texts=texts, sequences=seqs, stats=merged, errors=errors)

    def _generate(self, chunk, drafter, **options):
        images = [image for _, loaded, _ in chunk for image in loaded]
        enc = self.processor(images=images or None, text=[p for _, _, p in chunk], return_tensors="pt", padding=True,
                             padding_side="left")  # batched decoding continues every row from its last column
        params = self._spec_target.spec.forward_params
        device = self.target.device  # the processor's tensors are made on the CPU
        inputs = {k: v for k, v in enc.items() if k in params and k not in ("input_ids", "attention_mask")}
        for k, v in inputs.items():
            inputs[k] = v.to(device, self.target.dtype) if torch.is_floating_point(v) else v.to(device)
        ids = enc["input_ids"].to(device)
        if self.image_token is not None and images:
            self._check_placeholders(ids, len(images))
        eos = self.target.generation_config.eos_token_id
        if eos is None:
            eos = self.processor.tokenizer.eos_token_id
        pad = self.processor.tokenizer.pad_token_id
        return speculative_generate(self._spec_target, drafter, ids, enc["attention_mask"].to(device), eos_token_id=eos,
                                    pad_token_id=pad if pad is not None else 0, **options, **inputs)

    def _check_placeholders(self, ids, n_images):
        tok_id = self.processor.tokenizer.convert_tokens_to_ids(self.image_token)
        if int((ids == tok_id).sum()) == 0:
            raise ValueError(f"{n_images} images but the processed prompts carry no image token {self.image_token!r}")
