"""`SpeculativeMARPipeline`: class-conditional MAR image generation with CSpD speculative
sampling, as a diffusers `DiffusionPipeline`.

Components: `transformer` (the target `MARModel`), `drafter` (a smaller `MARModel` sharing the
token grid, token dimension, classes and head schedule, or None) and `vae` (diffusers
`AutoencoderKL`; `mmspec.models.kl16.load_kl16` converts MAR's `kl16.ckpt`). The sampling
loop is `mmspec.pipelines.cspd.sample_mar`; `speculative=False` runs plain MAR sampling
through it. Sources: MAR (github.com/LTH14/mar), CSpD (arXiv 2411.11925).

Save / load: `pipe.save_pretrained(dir)` writes the diffusers layout; load it with
`SpeculativeMARPipeline.from_pretrained(dir)` (this class's loader: the components are
mmspec classes, which diffusers' generic loader does not look up). Each component is loaded
strictly: a folder holding another class, or weights that miss or add parameters, is a
ValueError naming the component (diffusers alone would initialise missing weights at random).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import AutoencoderKL, DiffusionPipeline
from diffusers.utils import BaseOutput, is_accelerate_available

from mmspec.acceptance import CONTINUOUS_RULES, ContinuousAcceptance
from mmspec.adaptive_window import WindowBandit
from mmspec.devices import check_dtype
from mmspec.models.mar import MARModel, mar_schedule
from mmspec.pipelines.cspd import MARStats, check_drafter, check_sampling, check_speculative, sample_mar
from mmspec.pipelines.cspd_self import sample_mar_self
from mmspec.pipelines.unsupported import RefusesOffload
from mmspec.sampling import check_generator, plain_number

# num_draft_steps="auto" with draft="self": the arms are K = 0 (plain sampling) .. this many
SELF_DRAFT_K_MAX = 4


@dataclass
class MARPipelineOutput(BaseOutput):
    images: Any  # list of PIL images, np.ndarray [B, H, W, 3] in [0, 1], torch [B, 3, H, W] or latents
    stats: MARStats


class SpeculativeMARPipeline(RefusesOffload, DiffusionPipeline):
    model_cpu_offload_seq = "transformer->vae"
    _optional_components = ["drafter"]

    def __init__(self, transformer: MARModel, vae: AutoencoderKL, drafter: MARModel | None = None) -> None:
        super().__init__()
        self.register_modules(transformer=transformer, vae=vae, drafter=drafter)

    def __setattr__(self, name, value):
        # diffusers' registration fails on a value that is not an object of a class (a string:
        # AttributeError '__module__'); name what fits instead
        if name == "drafter" and value is not None and not isinstance(value, MARModel):
            raise TypeError(f"drafter must be None or a MARModel (a smaller MAR of the same token grid), got "
                            f"{type(value).__name__}")
        super().__setattr__(name, value)

    def check_vae(self) -> None:
        t, v = self.transformer.config, self.vae.config
        if v.latent_channels != t.vae_embed_dim:
            raise ValueError(f"vae latent_channels={v.latent_channels} differs from the transformer's "
                             f"vae_embed_dim={t.vae_embed_dim}")
        stride = 2 ** (len(v.block_out_channels) - 1)
        if stride != t.vae_stride:
            raise ValueError(f"vae downsamples by {stride} but the transformer expects vae_stride={t.vae_stride}")

    @torch.no_grad()
    def __call__(
        self,
        class_labels,
        *,
        num_iter: int = 64,
        guidance_scale: float = 3.0,
        cfg_schedule: str = "linear",
        temperature: float = 1.0,
        acceptance="continuous",
        speculative: bool = True,
        draft: str = "model",
        num_draft_steps: int | str | None = None,
        prefill_fraction: float | None = None,
        generator: torch.Generator | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
    ):
        """Generate one image per class label. -> `MARPipelineOutput(images, stats)` (or a
        tuple when return_dict=False). `draft`: "model" (CSpD with the registered drafter MAR,
        `num_draft_steps` default 4, `prefill_fraction` default 0.15) or "self" (the target drafts from its own earlier
        conditioning and drafts are verified along their whole denoising path; no drafter needed;
        default 3 steps a round, or "auto": per request, K = 0 (plain sampling) to 4 chosen by
        measured speed at each batch size, learned across the pipeline's calls (separately per
        num_iter, guidance, schedule and temperature; every K is exact, but the images a seed gives
        depend on the K chosen, so pass an int where a seed must reproduce images);
        `stats.draft_steps` says which; `pipelines/cspd_self.py`). With draft="self" the residual's
        target proposals come from a `ContinuousAcceptance` object's `tries_per_block` / `max_tries`
        when one is given, and from the sampler's own 4 a round / 256 in all for the name
        "continuous" (both exact; they differ in speed and in the draws a seed gives)."""
        if not isinstance(speculative, bool):  # a string such as "no" would read as True
            raise TypeError(f"speculative must be True or False, got {speculative!r}")
        if not isinstance(return_dict, bool):  # diffusers reads any truthy value as True
            raise TypeError(f"return_dict must be True or False, got {return_dict!r}")
        num_iter, guidance_scale, temperature, num_draft_steps, prefill_fraction = (  # np.float32(3.0) means 3.0
            plain_number(x) for x in (num_iter, guidance_scale, temperature, num_draft_steps, prefill_fraction))
        class_labels = plain_number(class_labels)
        if isinstance(class_labels, int):
            class_labels = [class_labels]
        try:
            labels = torch.as_tensor(class_labels)
        except (TypeError, ValueError, RuntimeError):  # None, "cat", [1, "a"]: torch's own words named no argument
            raise ValueError(f"class_labels must be an int or a non-empty 1-D sequence of ints, got {class_labels!r}") from None
        if labels.dim() != 1 or labels.numel() == 0:
            raise ValueError(f"class_labels must be an int or a non-empty 1-D sequence of ints, got {class_labels!r}")
        if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():  # any int dtype is taken
            raise ValueError(f"class_labels must be integer class ids, got dtype {labels.dtype} ({class_labels!r}); "
                             "pass ints (e.g. labels.long())")
        if labels.is_meta:
            raise ValueError("class_labels is on the 'meta' device (no values to read); pass labels on the CPU")
        labels = labels.long()
        n_cls = self.transformer.config.class_num
        if int(labels.min()) < 0 or int(labels.max()) >= n_cls:
            raise ValueError(f"class_labels must be in [0, {n_cls}), got {labels.tolist()}")
        if output_type not in ("pil", "np", "pt", "latent"):
            raise ValueError(f"output_type must be 'pil', 'np', 'pt' or 'latent', got {output_type!r}")
        self.check_vae()
        mar_schedule(self.transformer.seq_len, num_iter)  # validates num_iter before the progress bar is drawn
        rule_object = not isinstance(acceptance, str)
        if isinstance(acceptance, str):
            if acceptance not in CONTINUOUS_RULES:
                raise ValueError(f"acceptance must be one of {sorted(CONTINUOUS_RULES)} or a ContinuousAcceptance, got {acceptance!r}")
            acceptance = CONTINUOUS_RULES[acceptance]()
        elif not isinstance(acceptance, ContinuousAcceptance):
            raise ValueError(f"acceptance must be a name or a ContinuousAcceptance instance, got {type(acceptance).__name__}")
        if draft not in ("model", "self"):
            raise ValueError(f"draft must be 'model' (the registered drafter MAR) or 'self' (the target's own stale "
                             f"conditioning), got {draft!r}")
        if num_draft_steps is None:
            num_draft_steps = 3 if draft == "self" else 4
        if num_draft_steps == "auto" and draft != "self":
            raise ValueError("num_draft_steps='auto' is for draft='self' (chosen per request by measured speed); "
                             "give draft='model' an int")
        if draft == "self" and prefill_fraction is not None:
            raise ValueError("prefill_fraction is for draft='model' (the target's first steps before a drafter MAR "
                             "takes over); draft='self' has none: each round starts from the target's own conditioning")
        prefill_fraction = 0.15 if prefill_fraction is None else prefill_fraction
        self_draft = speculative and draft == "self"
        if self_draft and type(acceptance) is not ContinuousAcceptance:
            raise ValueError("draft='self' verifies whole denoising paths exactly; it takes only acceptance='continuous' "
                             f"or a ContinuousAcceptance (got {type(acceptance).__name__}); relaxed rules are offered "
                             "with draft='model'")
        # a ContinuousAcceptance given as an object sets the residual's proposals: tries_per_block
        # target paths a round, max_tries in all (the sampler's own defaults otherwise)
        tries = dict(residual_tries=acceptance.tries_per_block, max_residual_tries=acceptance.max_tries) if (
            self_draft and rule_object) else {}
        drafter = None
        if speculative and not self_draft:
            if self.drafter is None:
                raise ValueError("speculative=True needs a drafter: pass drafter= to the pipeline or use speculative=False")
            check_drafter(self.transformer, self.drafter)
            drafter = self.drafter
        # Refused here rather than inside the sampler, under a progress bar already drawn.
        check_sampling(temperature, guidance_scale, cfg_schedule)
        check_generator(generator)
        # The draft options are checked with speculative=False too: a call that fails with it on must
        # fail the same way without it (num_draft_steps=-3 passed silently there).
        if draft == "self" and num_draft_steps != "auto" and (isinstance(num_draft_steps, bool) or not isinstance(
                num_draft_steps, int) or num_draft_steps < 1):  # (the sampler's message leaves "auto" out)
            raise ValueError(f"num_draft_steps must be an int >= 1 or 'auto' with draft='self', got {num_draft_steps!r}")
        check_speculative(temperature if speculative else None, 1 if num_draft_steps == "auto" else num_draft_steps,
                          None if draft == "self" else prefill_fraction)
        done = [0]
        # (closed also when sampling raises: a dead bar kept its line and pushed the next call's down)
        with self.progress_bar(total=num_iter) as bar:
            def callback(steps_done: int) -> None:
                bar.update(steps_done - done[0])
                done[0] = steps_done

            if self_draft:
                k, bandit = num_draft_steps, None
                if k == "auto":  # a per-request choice among K = 0 (plain) .. SELF_DRAFT_K_MAX by measured speed
                    # One bandit per setting that changes a request's time or acceptance (its reward is a
                    # whole request's tokens per second: 16-step requests looked 4x faster than 64-step
                    # ones to whichever arm ran them); each learns per batch size.
                    bandits = self.__dict__.setdefault("_self_draft_bandits", {})
                    setting = (num_iter, float(guidance_scale), cfg_schedule, float(temperature))
                    bandit = bandits.get(setting)
                    if bandit is None:
                        top = min(SELF_DRAFT_K_MAX, num_iter)  # a round drafts at most num_iter steps
                        bandit = bandits[setting] = WindowBandit(top, arms=list(range(top + 1)))
                    bandit.begin_request()  # records the previous request's rate
                    k = bandit.choose(len(labels))
                t0 = time.perf_counter()
                kw = dict(num_iter=num_iter, guidance_scale=guidance_scale, cfg_schedule=cfg_schedule,
                          temperature=temperature, generator=generator, callback=callback)
                if k == 0:  # plain sampling through the same code
                    tokens, stats = sample_mar(self.transformer, labels, **kw)
                else:
                    tokens, stats = sample_mar_self(self.transformer, labels, num_draft_steps=k, **kw, **tries)
                if bandit is not None:  # tokens per second of the whole request (every row emits all its tokens)
                    bandit.observe(len(labels), k, [tokens.shape[1] - 1] * len(labels), 0.0, time.perf_counter() - t0)
            else:
                tokens, stats = sample_mar(
                    self.transformer, labels, num_iter=num_iter, guidance_scale=guidance_scale, cfg_schedule=cfg_schedule,
                    temperature=temperature, drafter=drafter, num_draft_steps=num_draft_steps,
                    prefill_fraction=prefill_fraction, acceptance=acceptance, generator=generator, callback=callback,
                )
        latents = self.transformer.unpatchify(tokens)
        if output_type == "latent":
            images = latents
        else:
            z = (latents / self.vae.config.scaling_factor).to(self.vae.dtype)
            decoded = self.vae.decode(z).sample.float()
            if not bool(torch.isfinite(decoded).all()):  # clamp keeps NaN: it would become a broken image
                raise ValueError("the VAE decoder produced non-finite pixels (NaN or inf); check its weights and dtype "
                                 "(output_type='latent' returns the latents without decoding)")
            pixels = (decoded.clamp(-1, 1) + 1) / 2
            if output_type == "pt":
                images = pixels
            else:
                arr = pixels.permute(0, 2, 3, 1).cpu().numpy()
                images = arr if output_type == "np" else self.numpy_to_pil(arr)
        self.maybe_free_model_hooks()
        if not return_dict:
            return images, stats
        return MARPipelineOutput(images=images, stats=stats)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """diffusers' `save_pretrained`, without the options `from_pretrained` cannot read back
        (a `variant="fp16"` folder loaded with neither call)."""
        bad = sorted(k for k in ("variant", "push_to_hub") if kwargs.get(k))
        if bad:
            raise ValueError(f"SpeculativeMARPipeline.save_pretrained: {bad} not supported (from_pretrained loads a "
                             "plain local folder); cast with pipe.to(dtype) before saving instead of a variant")
        return super().save_pretrained(save_directory, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, torch_dtype: torch.dtype | None = None, **kwargs):
        """Load a folder written by `save_pretrained` (local folders only)."""
        if kwargs:
            raise ValueError(f"SpeculativeMARPipeline.from_pretrained does not take {sorted(kwargs)}")
        check_dtype(torch_dtype)
        root = str(pretrained_model_name_or_path)
        index_path = os.path.join(root, "model_index.json")
        if not os.path.isfile(index_path):
            raise ValueError(f"{root!r} is not a saved SpeculativeMARPipeline folder (no model_index.json)")
        with open(index_path) as f:
            index = json.load(f)
        if index.get("_class_name") != cls.__name__:
            raise ValueError(f"{root!r} holds a {index.get('_class_name')}, not a {cls.__name__}")
        parts = {}
        for name, loader in (("transformer", MARModel), ("drafter", MARModel), ("vae", AutoencoderKL)):
            entry = index.get(name)
            if entry is None or entry[0] is None:
                parts[name] = None
                continue
            parts[name] = _load_component(root, name, loader, entry, torch_dtype)
        if parts["transformer"] is None or parts["vae"] is None:
            raise ValueError(f"{root!r} has no transformer or no vae")
        return cls(**parts)


def _load_component(root: str, name: str, loader, entry, torch_dtype):
    """Load one component strictly: the folder must hold a `loader` (by model_index.json and by
    its config.json) and its weights must cover exactly the parameters of that class (diffusers'
    loader would otherwise initialise missing weights at random and carry on)."""
    folder = os.path.join(root, name)
    cfg_path = os.path.join(folder, "config.json")
    declared = entry[1] if isinstance(entry, (list, tuple)) and len(entry) == 2 else None
    found = None
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            found = json.load(f).get("_class_name")
    if declared != loader.__name__ or found != loader.__name__:
        raise ValueError(f"{name}: {folder!r} must hold a {loader.__name__} (model_index.json says {declared!r}, "
                         f"its config.json says {found!r}); a checkpoint of another architecture cannot be used")
    kw = {} if torch_dtype is None else {"torch_dtype": torch_dtype}
    if not is_accelerate_available():  # diffusers would fall back to this itself, warning each time
        kw["low_cpu_mem_usage"] = False
    model, info = loader.from_pretrained(folder, output_loading_info=True, **kw)
    bad = {k: sorted(map(str, info.get(k) or [])) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if any(bad.values()):
        raise ValueError(f"{name}: the weights in {folder!r} do not match its config ("
                         + ", ".join(f"{k} {v[:6]}{' ...' if len(v) > 6 else ''}" for k, v in bad.items() if v) + ")")
    return model.eval()
