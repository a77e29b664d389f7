"""`SpeculativeARImagePipeline`: class-conditional autoregressive image generation (LlamaGen c2i GPT
+ VQ decoder) with speculative decoding, as a diffusers `DiffusionPipeline`.

What: `pipe(class_labels, guidance_scale=4.0, acceptance="exact")` samples the image tokens of
each label with `mmspec.speculative_generate` over the GPT's forward spec
(`mmspec.models.llamagen_spec`: CFG through `GuidedTarget` with the null class, constant or
linear schedule) and decodes them with the VQ. Registered components: `target` (`LlamaGenGPT`),
`vq` (`LlamaGenVQModel`) and `drafter`: a small `LlamaGenGPT` (drafts chains, or trees with
`drafter_config["tree"]`, under the same guidance: `GuidedModelDrafter`; a drafter GPT without
a null class drafts unguided, which stays exact but is accepted less often), a `JacobiDrafter`
(self-drafting, SJD / coupled drafts; no extra model) or None (Jacobi with the saved settings).
`pipe.drafter = JacobiDrafter(...)` swaps drafters like a diffusers scheduler; the settings are
saved with the pipeline (`drafter_config`). A drafter GPT stays at hand as `pipe.drafter_model` while
Jacobi drafts (`pipe.drafter = pipe.drafter_model` switches back); a saved folder keeps it (as its
drafter component, with kind "jacobi"), and saving leaves the live pipeline as it was. `speculative=False` decodes one token per forward
through the same target code (`NullDrafter`), which is the baseline every speed-up is
measured against. With `acceptance="invariant"` (Gumbel-max sampling with noise keyed by seed,
row and position) `speculative=False` keeps that rule, so a seed gives the same images with and
without speculation, whatever the drafter or window; with any other rule plain decoding samples
exactly (`"exact"`). `acceptance` takes any rule name or object; named rules that need tables
get them from the pipeline (LANTERN: the VQ codebook, and by default `k` = the same
fraction of the codebook as LANTERN's k=1000 of LlamaGen's 16384 codes, see `lantern_k`; GSD:
the GPT's token embeddings). `pipe.prepack` ("auto", False, True) sets the linear kernels of
target and GPT drafter (mmspec/models/prepack.py: "auto" measures stock against oneDNN-prepacked
weights per row count on this machine, once per model; False keeps stock kernels, and so the same
float rounding across processes). Sources: LlamaGen (Sun et al. 2024, github.com/FoundationVision/
LlamaGen, `autoregressive/sample/sample_c2i.py`) for the sampling setup; diffusers'
`DiffusionPipeline` conventions for the interface (`callback_on_step_end`, `output_type`,
`return_dict`, progress bar).

`from_pretrained` reads a folder saved by `save_pretrained` and the testbed layout (`target/`,
`vq/` in `LlamaGenVQ`'s format, optional `drafter/`, no model_index.json), strictly: a folder of
another pipeline class or a target that is not a LlamaGen GPT is refused (ValueError).

Limits: class-conditional only; images are square (the GPT's 2-D RoPE grid must equal the VQ's
token grid); a generation stopped by `callback_on_step_end` returns the tokens decoded so far
(`tokens` padded with -1, `interrupted=True`, images only for complete rows).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from diffusers import DiffusionPipeline, ModelMixin
from diffusers.utils import BaseOutput, is_accelerate_available

import mmspec
from mmspec.acceptance import RULES, get_rule, is_position_keyed
from mmspec.acceptance.lantern import lantern_k  # noqa: F401 (LANTERN's k for a codebook; imported from here too)
from mmspec.engine import resolve_rule
from mmspec.devices import check_dtype
from mmspec.in_use import PerThreadFlag
from mmspec.drafters import GuidedModelDrafter, JacobiDrafter, ModelDrafter, NullDrafter
from mmspec.models.llamagen_gpt import LlamaGenGPT
from mmspec.models.llamagen_sample import CFG_SCHEDULES, check_guidance_scale
from mmspec.models.llamagen_spec import LlamaGenSpec, cfg_schedule_fn, llamagen_target, null_class_uncond
from mmspec.models.llamagen_vq_model import LlamaGenVQModel
from mmspec.pipelines.unsupported import RefusesOffload
from mmspec.protocols import implements_drafter
from mmspec.sampling import SamplingConfig, check_generator, plain_number
from mmspec.stats import SpecStats


_NOT_GIVEN = object()  # from_pretrained(drafter=None) means "no drafter", unlike not passing it

DEFAULT_DRAFTER_CONFIG = {"kind": "model", "num_draft_tokens": 4, "tree": None, "window": 16,
                          "coupling": "maximal", "init": "random", "max_window": None}


# What `from_pretrained` of a saved folder hands to diffusers (anything else is refused by name).
SAVED_LAYOUT_OPTIONS = frozenset({"torch_dtype", "dtype", "variant", "use_safetensors", "low_cpu_mem_usage", "drafter",
                                  "drafter_config", "target", "vq"})


def jacobi_from_config(settings: dict) -> JacobiDrafter:
    """The JacobiDrafter a drafter_config describes (window an int, or "auto" with max_window)."""
    full = {**DEFAULT_DRAFTER_CONFIG, **settings}
    return JacobiDrafter(full["window"], full["coupling"], full["init"], max_window=full["max_window"])


OUTPUT_TYPES = ("pil", "np", "pt", "latent")


@dataclasses.dataclass
class ARImageStats(SpecStats):
    """`SpecStats` of the run plus per-image figures."""

    images: int = 0
    target_forwards_per_image: float = 0.0  # forwards each image took part in (prefill included), mean
    drafter: str = ""
    interrupted: bool = False


@dataclasses.dataclass
class ARImagePipelineOutput(BaseOutput):
    images: Any  # list of PIL images, np.ndarray [B, H, W, 3] or torch [B, 3, H, W] in [0, 1]; None for "latent"
    tokens: torch.Tensor  # [B, T] image tokens in raster order (-1: not decoded, interrupted runs only)
    stats: ARImageStats
    interrupted: bool = False


def _steers(given: dict, out, tokens: torch.Tensor, counts: list[int]) -> bool:
    """Whether a callback tried to edit the decoded tokens: in the dict it was given, or in the
    one it returned."""
    seen = [given] + ([out] if isinstance(out, dict) else [])
    for d in seen:
        t, n = d.get("tokens", tokens), d.get("num_tokens", counts)
        if not (isinstance(t, torch.Tensor) and t.shape == tokens.shape and torch.equal(t.to(tokens.device), tokens)):
            return True
        if not isinstance(n, (list, tuple, torch.Tensor)) or [int(c) for c in n] != list(counts):
            return True
    return False


class _Watch:
    """Wraps the target: counts emitted image tokens per step (progress bar) and, with a
    callback, records them and lets the callback stop the run."""

    def __init__(self, target, batch: int, num_tokens: int, on_step: Callable | None, progress):
        self.target = target
        self.vocab_size = target.vocab_size
        self.supports_features = getattr(target, "supports_features", False)
        self.kernels = getattr(target, "kernels", "")
        self.T = num_tokens
        self.count = [0] * batch
        self.rows = list(range(batch))
        self.tokens = torch.full((batch, num_tokens), -1, dtype=torch.long)
        self.on_step = on_step
        self.progress = progress
        self.steps = 0
        self.stop_requested = False  # the loop ends the request after a step that set it

    def acceptance_tables(self):
        provide = getattr(self.target, "acceptance_tables", None)
        return provide() if callable(provide) else {}

    def prefill(self, *args, **kw):
        return self.target.prefill(*args, **kw)

    def check_inputs(self, *args):
        check = getattr(self.target, "check_inputs", None)
        if callable(check):
            check(*args)

    def verify(self, tokens, parents):
        if self.steps == 0 and self.on_step is not None:
            for r, t in zip(self.rows, tokens[:, 0].tolist()):
                self.tokens[r, 0] = t
        if self.steps == 0:
            self.count = [1] * len(self.count)
            self.progress.update(len(self.count))
        return self.target.verify(tokens, parents)

    def commit(self, info):
        self.target.commit(info)
        self.steps += 1
        n = info.num_accepted_list
        acc = info.accepted_tokens.tolist() if self.on_step is not None else None
        nxt = info.next_tokens.tolist() if self.on_step is not None else None
        done = 0
        for i, r in enumerate(self.rows):
            emitted = (acc[i][: n[i]] + [nxt[i]]) if acc is not None else None
            take = min(n[i] + 1, self.T - self.count[r])
            if emitted is not None and take > 0:
                self.tokens[r, self.count[r]: self.count[r] + take] = torch.tensor(emitted[:take])
            self.count[r] += max(take, 0)
            done += max(take, 0)
        self.progress.update(done)
        if self.on_step is not None and self.on_step(self.steps, self.tokens, list(self.count)):
            self.stop_requested = True

    def select_rows(self, rows, rows_host):
        self.target.select_rows(rows, rows_host)
        self.rows = [self.rows[i] for i in rows_host]


class SpeculativeARImagePipeline(RefusesOffload, DiffusionPipeline):
    """LlamaGen c2i image generation with speculative decoding (see module docstring)."""

    _optional_components = ["drafter"]
    model_cpu_offload_seq = "target->vq"

    def __init__(self, target: LlamaGenGPT, vq: LlamaGenVQModel, drafter=None, drafter_config: dict | None = None):
        super().__init__()
        if drafter_config is not None and not isinstance(drafter_config, dict):
            raise TypeError(f"drafter_config must be None or a dict, got {type(drafter_config).__name__}")
        unknown = sorted(set(drafter_config or {}) - set(DEFAULT_DRAFTER_CONFIG))
        if unknown:  # a misspelt key ("windw") was saved and ignored
            raise ValueError(f"drafter_config has unknown key(s) {unknown}; known: {sorted(DEFAULT_DRAFTER_CONFIG)}")
        settings = {**DEFAULT_DRAFTER_CONFIG, **(drafter_config or {})}
        if settings["tree"] and settings["num_draft_tokens"] != 4:  # never used beside a tree: old folders still load
            warnings.warn(f"drafter_config num_draft_tokens={settings['num_draft_tokens']!r} has no effect beside a 'tree'; "
                          "the default 4 is kept in its place", stacklevel=2)
            settings["num_draft_tokens"] = 4
        if settings["kind"] not in ("model", "jacobi"):
            raise ValueError(f"drafter_config['kind'] must be 'model' or 'jacobi', got {settings['kind']!r}")
        if not isinstance(target, LlamaGenGPT):
            raise ValueError(f"target must be a LlamaGenGPT, got {type(target).__name__}")
        if not isinstance(vq, LlamaGenVQModel):
            raise ValueError(f"vq must be a LlamaGenVQModel (wrap a LlamaGenVQ with LlamaGenVQModel.from_vq), got "
                             f"{type(vq).__name__}")
        # The small GPT at hand for `pipe.drafter = pipe.drafter_model`; with kind "jacobi" a given
        # GPT is held there while Jacobi drafts (how a folder keeps both: the testbed layout, and a
        # saved pipeline whose drafter GPT was at hand while Jacobi was active).
        held = drafter if isinstance(drafter, LlamaGenGPT) else None
        if settings["kind"] == "jacobi" and (drafter is None or held is not None):
            drafter = jacobi_from_config(settings)
        self.register_modules(target=target, vq=vq, drafter=drafter)
        self.drafter_model = held
        self.register_to_config(drafter_config=settings)
        # Linear kernels of the target and of a GPT drafter (mmspec/models/prepack.py): "auto"
        # measures stock against oneDNN-prepacked weights once per model and row count on this
        # machine and runs each forward on the faster; False: stock kernels always (the same
        # float rounding in every process, for bit-reproducible images across runs); True: packed.
        self.prepack = "auto"
        self.check_components()

    # ---- components ---------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return self.target.args.block_size

    @property
    def num_classes(self) -> int:
        return self.target.args.num_classes

    def check_components(self) -> None:
        """Codebook and grid agreement of target, VQ and drafter (ValueError naming the mismatch)."""
        V = self.target.args.vocab_size
        if self.vq.codebook_size != V:
            raise ValueError(f"codebook mismatch: the VQ has {self.vq.codebook_size} codes but the target GPT predicts "
                             f"vocab_size={V} image tokens")
        if self.vq.token_grid ** 2 != self.num_tokens:
            side = round(self.num_tokens ** 0.5)
            down = getattr(getattr(getattr(self.vq, "vq", None), "config", None), "downsample", None)
            hint = (f"; the VQ is convolutional: load it for {side * down}-px images, e.g. "
                    f"LlamaGenVQ.from_pretrained(file, image_size={side * down})"
                    if side * side == self.num_tokens and isinstance(down, int) else "")
            raise ValueError(f"grid mismatch: the VQ decodes {self.vq.token_grid}x{self.vq.token_grid} tokens but the "
                             f"target GPT generates block_size={self.num_tokens}{hint}")
        held = self.__dict__.get("drafter_model")
        if isinstance(held, LlamaGenGPT) and held is not self.drafter:
            self._check_gpt_drafter(held)
        d = self.drafter
        if isinstance(d, LlamaGenGPT):
            self._check_gpt_drafter(d)
        elif isinstance(d, JacobiDrafter) and d.vocab_size not in (None, V):
            raise ValueError(f"drafter/target codebook mismatch: JacobiDrafter(vocab_size={d.vocab_size}), target {V}")
        elif d is not None and not isinstance(d, JacobiDrafter):
            if not implements_drafter(d):
                raise ValueError(f"drafter must be a LlamaGenGPT, a JacobiDrafter or an mmspec Drafter, got "
                                 f"{type(d).__name__}")
            if d.vocab_size != V:
                raise ValueError(f"drafter/target codebook mismatch: drafter vocab_size={d.vocab_size}, target {V}")

    def _check_gpt_drafter(self, d: LlamaGenGPT) -> None:
        V = self.target.args.vocab_size
        if d.args.vocab_size != V:
            raise ValueError(f"drafter/target codebook mismatch: the drafter GPT predicts {d.args.vocab_size} "
                             f"tokens, the target {V}")
        if d.args.num_classes != self.num_classes:
            raise ValueError(f"drafter/target class mismatch: drafter {d.args.num_classes} classes, target "
                             f"{self.num_classes}")
        if d.args.block_size < self.num_tokens:  # its positions would be clamped: drafts of the wrong places
            raise ValueError(f"drafter/target grid mismatch: the drafter GPT has block_size={d.args.block_size}, "
                             f"the target generates {self.num_tokens} tokens")

    def _drafter_for(self, speculative: bool, schedule, guided: bool):
        V = self.target.args.vocab_size
        if not speculative:
            return NullDrafter(V), "plain"
        d = self.drafter
        settings = self.config.drafter_config
        if d is None:
            # One drafter per settings, kept across calls: a window="auto" drafter learns across them.
            key = tuple(settings.get(k) for k in ("window", "coupling", "init", "max_window"))
            d = self.__dict__.setdefault("_config_jacobi", {}).get(key)
            if d is None:
                d = self._config_jacobi[key] = jacobi_from_config(settings)
        if isinstance(d, JacobiDrafter):
            if d.vocab_size is None:
                d.vocab_size = V
            return d, repr(d)
        if isinstance(d, LlamaGenGPT):
            tree = mmspec.TreeConfig(**settings["tree"]) if settings.get("tree") else None
            K = settings["num_draft_tokens"]
            if K != "auto" and (isinstance(K, bool) or not isinstance(K, int) or K < 0):
                raise ValueError(f"drafter_config['num_draft_tokens'] must be an int >= 0 or 'auto', got {K!r}")
            if tree and K != DEFAULT_DRAFTER_CONFIG["num_draft_tokens"]:
                raise ValueError(f"drafter_config['num_draft_tokens']={K!r} has no effect beside a 'tree' (it drafts "
                                 "tree num_nodes): leave it at its default")
            spec, what = LlamaGenSpec(d, prepack=self.prepack), f"tree={tree}" if tree else f"K={K}"
            if guided and d.args.has_null_class:
                drafter = GuidedModelDrafter(spec, schedule, None if tree else K, tree,
                                             make_uncond=null_class_uncond(d.args.num_classes))
                name = f"GuidedModelDrafter({what})"
            else:
                drafter = ModelDrafter(spec, tree=tree) if tree else ModelDrafter(spec, K)
                name = f"ModelDrafter({what})"
            if drafter.controller is not None:
                # A drafter is built per call (its guidance is the call's); what K = "auto" (or a
                # tree's num_nodes="auto") has learnt carries over from call to call, per drafter
                # model, guidance on / off and tree.
                controllers = self.__dict__.setdefault("_draft_length_controllers", {})
                key = (id(d), guided and d.args.has_null_class, tree)
                held, controller = controllers.get(key, (None, None))
                if held is not d:  # keyed by address: the entry holds its model, so no other takes the address
                    controllers[key] = (d, drafter.controller)
                else:
                    drafter.controller = controller
            return drafter, name
        return d, type(d).__name__

    # set in a callback: stops the call it runs in (per thread; kept across a nested call)
    _interrupt = PerThreadFlag()

    def __setattr__(self, name, value):
        # diffusers registers a component on assignment and fails on a value that is not an object
        # of a class (`pipe.drafter = "jacobi"`: AttributeError '__module__'): name what fits instead
        if (name == "drafter" and value is not None and not isinstance(value, (LlamaGenGPT, JacobiDrafter))
                and not implements_drafter(value)):
            raise TypeError(f"drafter must be None, a LlamaGenGPT, a JacobiDrafter or an mmspec Drafter, got "
                            f"{type(value).__name__}")
        super().__setattr__(name, value)

    def to(self, *args, **kwargs):
        """diffusers' `to`, and the drafter GPT held aside while Jacobi drafts (`drafter_model`)
        follows the target (it stayed where it was: after `to(torch.float16)` switching back to it
        drafted in float32 and saved float32 weights)."""
        out = super().to(*args, **kwargs)
        held = self.__dict__.get("drafter_model")
        if isinstance(held, torch.nn.Module) and held is not self.drafter:
            torch.nn.Module.to(held, device=self.target.device, dtype=self.target.dtype)
        return out

    @property
    def components(self) -> dict:
        """diffusers' components plus the drafter settings, so that `type(pipe)(**pipe.components)`
        drafts as this pipeline does (a model drafter's K / tree live in `drafter_config`; without
        it the copy drafted a default chain). A drafter GPT held aside while Jacobi drafts
        (`drafter_model`) is not carried: set it on the copy if wanted."""
        return {**super().components, "drafter_config": dict(self.config.drafter_config)}

    # ---- save / load ----------------------------------------------------------------------------
    def save_pretrained(self, save_directory, *args, **kwargs):
        from diffusers.pipelines.pipeline_loading_utils import _fetch_class_library_tuple

        settings = dict(self.config.drafter_config)
        d = self.drafter
        if isinstance(d, JacobiDrafter):
            settings.update(kind="jacobi", window=d.window, coupling=d.coupling, init=d.init,
                            max_window=d.max_window if d.adaptive else None)
        elif isinstance(d, LlamaGenGPT):
            settings["kind"] = "model"
        elif d is not None:  # the saved folder would silently draft with something else
            raise ValueError(f"pipe.drafter is a {type(d).__name__}, which a saved pipeline cannot hold (it saves a "
                             "JacobiDrafter's settings or a LlamaGenGPT drafter); set pipe.drafter to one of those, or "
                             "to None (the folder then drafts with its drafter_config), before save_pretrained")
        # The folder keeps a drafter GPT held at hand while Jacobi drafts (the testbed layout's
        # default) as its drafter component, with kind "jacobi"; `from_pretrained` holds it again.
        held = self.__dict__.get("drafter_model")
        saved = held if isinstance(d, JacobiDrafter) and isinstance(held, LlamaGenGPT) else d
        live = dict(self.config.drafter_config), self.config.drafter  # restored after: saving changes nothing
        try:
            self.register_to_config(drafter_config=settings)
            self.register_to_config(drafter=_fetch_class_library_tuple(saved) if isinstance(saved, ModelMixin)
                                    else (None, None))
            self.__dict__["drafter"] = saved
            return super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            self.__dict__["drafter"] = d
            self.register_to_config(drafter_config=live[0], drafter=live[1])

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        path = Path(pretrained_model_name_or_path)
        if not path.is_dir():
            raise ValueError(f"{path}: not a pipeline folder (mmspec loads local folders only)")
        for key in ("torch_dtype", "dtype"):
            check_dtype(kwargs.get(key), key)
        index = path / "model_index.json"
        if not index.is_file():
            return cls._from_testbed_layout(path, **kwargs)
        unknown = sorted(set(kwargs) - SAVED_LAYOUT_OPTIONS)
        if unknown:  # diffusers only logs "will be ignored" (torch_dtpye= loaded float32)
            raise TypeError(f"from_pretrained() got unsupported argument(s) {unknown}; a saved pipeline folder takes "
                            f"{sorted(SAVED_LAYOUT_OPTIONS)}")
        name = json.loads(index.read_text()).get("_class_name")
        if name != cls.__name__:
            raise ValueError(f"{path} holds a {name} pipeline, not a {cls.__name__}")
        for component in ("target", "vq"):
            _check_component_class(path / component, component)
        if not is_accelerate_available():  # diffusers would fall back to this itself, warning each time
            kwargs.setdefault("low_cpu_mem_usage", False)
        pipe = super().from_pretrained(str(path), **kwargs)
        pipe.check_components()
        return pipe

    @classmethod
    def _from_testbed_layout(cls, path: Path, **kwargs):
        """target/ (LlamaGenGPT), vq/ (LlamaGenVQ or LlamaGenVQModel), optional drafter/ (LlamaGenGPT).
        `drafter=` and `drafter_config=` replace the folder's, as for a saved pipeline; `dtype` /
        `torch_dtype` set the weights' dtype; any other option is refused (all were ignored)."""
        dtype = kwargs.pop("dtype", None)
        torch_dtype = kwargs.pop("torch_dtype", None)
        dtype = torch_dtype if dtype is None else dtype
        given_drafter = kwargs.pop("drafter", _NOT_GIVEN)
        given_config = kwargs.pop("drafter_config", None)
        if kwargs:
            raise TypeError(f"from_pretrained() of a testbed folder got unsupported argument(s) {sorted(kwargs)}; it "
                            "takes drafter=, drafter_config= and dtype= (or torch_dtype=)")
        if not (path / "target").is_dir() or not (path / "vq").is_dir():
            raise ValueError(f"{path}: neither a saved pipeline (model_index.json) nor the testbed layout "
                             "(target/ and vq/ folders)")
        _check_component_class(path / "target", "target")
        load = {} if dtype is None else {"dtype": dtype}
        if not is_accelerate_available():
            load["low_cpu_mem_usage"] = False
        target = LlamaGenGPT.from_pretrained(str(path / "target"), **load).eval()
        vq = LlamaGenVQModel.from_pretrained(str(path / "vq"), **load).eval()
        drafter = None
        if (path / "drafter").is_dir():
            _check_component_class(path / "drafter", "drafter")
            drafter = LlamaGenGPT.from_pretrained(str(path / "drafter"), **load).eval()
        settings = {}
        if (path / "drafter_config.json").is_file():
            settings = json.loads((path / "drafter_config.json").read_text())
        elif drafter is None:
            settings = {"kind": "jacobi"}
        if given_config is not None:
            settings = given_config
        if given_drafter is _NOT_GIVEN:
            # kind "jacobi" (the folder's default, the best drafter measured) drafts with Jacobi and
            # holds the folder's drafter GPT at hand for `pipe.drafter = pipe.drafter_model`.
            return cls(target=target, vq=vq, drafter=drafter, drafter_config=settings)
        pipe = cls(target=target, vq=vq, drafter=given_drafter, drafter_config=settings)
        if drafter is not None and pipe.drafter_model is None:
            pipe.drafter_model = drafter
            pipe.check_components()
        return pipe

    # ---- generation ----------------------------------------------------------------------------
    def _labels(self, class_labels) -> torch.Tensor:
        if isinstance(class_labels, int) and not isinstance(class_labels, bool):
            class_labels = [class_labels]
        if isinstance(class_labels, torch.Tensor):
            if class_labels.dim() > 1:  # one image per label: a grid of labels has no meaning here
                raise ValueError(f"class_labels must be an int, a list of ints or a 0-/1-D tensor, got a tensor of "
                                 f"shape {tuple(class_labels.shape)}")
            class_labels = class_labels.flatten().tolist()
        if type(class_labels).__module__ == "numpy" and getattr(class_labels, "ndim", 2) <= 1:  # an array / scalar
            class_labels = class_labels.reshape(-1).tolist()
        if isinstance(class_labels, (list, tuple)):
            class_labels = [plain_number(c) for c in class_labels]
        if not isinstance(class_labels, (list, tuple)) or not class_labels or not all(
            isinstance(c, int) and not isinstance(c, bool) for c in class_labels
        ):
            raise ValueError(f"class_labels must be an int or a non-empty list of ints, got {class_labels!r}")
        bad = [c for c in class_labels if not 0 <= c < self.num_classes]
        if bad:
            raise ValueError(f"unknown class id(s) {bad}: this model has classes 0..{self.num_classes - 1}")
        return torch.tensor(class_labels, dtype=torch.long)

    @torch.no_grad()
    def __call__(
        self,
        class_labels,
        *,
        num_images_per_prompt: int = 1,
        guidance_scale: float = 4.0,
        cfg_schedule: str = "constant",
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        acceptance: Any = "exact",
        acceptance_kwargs: dict | None = None,
        speculative: bool = True,
        generator: torch.Generator | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
        callback_on_step_end: Callable | None = None,
    ):
        """Generate `num_images_per_prompt` images per class label. `callback_on_step_end(pipe,
        step, tokens_done, {"tokens": [B, T] (-1 = not yet), "num_tokens": [B]})` runs after every
        target forward; it stops the run by returning {"stop": True} or setting `pipe._interrupt` (in the callback: it is per thread)
        (edited `tokens` / `num_tokens`, returned or changed in place, are refused: the run is not
        steered; other entries are not read, as in diffusers)."""
        num_images_per_prompt, guidance_scale, temperature, top_p = (  # np.float32(3.0) means 3.0
            plain_number(x) for x in (num_images_per_prompt, guidance_scale, temperature, top_p))
        labels = self._labels(class_labels)
        if not isinstance(speculative, bool):  # a string such as "no" would read as True
            raise TypeError(f"speculative must be True or False, got {speculative!r}")
        if callback_on_step_end is not None and not callable(callback_on_step_end):  # failed at the first step
            raise TypeError(f"callback_on_step_end must be None or callable, got {type(callback_on_step_end).__name__}")
        if not isinstance(return_dict, bool):  # diffusers reads any truthy value as True
            raise TypeError(f"return_dict must be True or False, got {return_dict!r}")
        if isinstance(num_images_per_prompt, bool) or not isinstance(num_images_per_prompt, int) or num_images_per_prompt < 1:
            raise ValueError(f"num_images_per_prompt must be an int >= 1, got {num_images_per_prompt!r}")
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type={output_type!r}: must be one of {OUTPUT_TYPES}")
        if cfg_schedule not in CFG_SCHEDULES:
            raise ValueError(f"cfg_schedule={cfg_schedule!r}: must be one of {CFG_SCHEDULES}")
        V, T = self.target.args.vocab_size, self.num_tokens
        top_k = plain_number(top_k)
        if top_k is not None and (not isinstance(top_k, int) or top_k > V):
            raise ValueError(f"top_k={top_k!r} exceeds the codebook size {V} (or is not an int)")
        # Refused here, before the progress bar starts, rather than inside the loop under a 0% bar.
        SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
        check_guidance_scale(guidance_scale)  # before float() below turns None / "high" into a bare TypeError
        check_generator(generator)
        if acceptance_kwargs is not None and (not isinstance(acceptance_kwargs, dict) or not isinstance(acceptance, str)):
            raise ValueError("acceptance_kwargs must be a dict and goes with a rule name (acceptance='lantern', ...); "
                             "configure a rule object through its constructor instead")
        if isinstance(acceptance, str) and acceptance not in RULES:
            get_rule(acceptance)  # raises, naming the known rules
        self.check_components()
        labels = labels.repeat_interleave(num_images_per_prompt).to(self.target.device)
        B = labels.shape[0]
        guided = float(guidance_scale) != 1.0
        target = llamagen_target(self.target, guidance_scale, cfg_schedule=cfg_schedule, num_tokens=T,
                                 codebook=self.vq.codebook().detach(), prepack=self.prepack)
        schedule = cfg_schedule_fn(cfg_schedule, guidance_scale, T)
        drafter, drafter_name = self._drafter_for(speculative, schedule, guided)
        kwargs = dict(acceptance_kwargs or {}) if isinstance(acceptance, str) else None
        if acceptance == "lantern" and "k" not in kwargs:
            kwargs["k"] = lantern_k(V)
        # Built and checked once, before any work (its greedy form at temperature 0): the object runs.
        rule = resolve_rule(acceptance, kwargs, SamplingConfig(temperature, top_k, top_p), target, drafter)
        if not speculative and not is_position_keyed(rule):
            # Plain decoding samples the target exactly; "invariant" keeps its position-keyed
            # Gumbel-max sampling, so speculative and plain images are the same for a seed. A call
            # that fails with speculative=True (a greedy rule at temperature 1) fails without it too.
            rule = get_rule("exact")
        outer, self._interrupt = self._interrupt, False  # (a nested call from a callback keeps the outer stop)

        def on_step(step, tokens, counts):
            given = {"tokens": tokens.clone(), "num_tokens": list(counts)}
            out = callback_on_step_end(self, step, sum(counts), given)
            if _steers(given, out, tokens, counts):
                raise ValueError("callback_on_step_end edited 'tokens' or 'num_tokens'; the pipeline does not steer "
                                 "a generation from its callback (the model's cache holds the decoded tokens): "
                                 "return them unchanged, or {'stop': True} to stop")
            return bool(self._interrupt or (isinstance(out, dict) and out.get("stop")))

        with self.progress_bar(total=B * T) as bar:
            watch = _Watch(target, B, T, on_step if callback_on_step_end is not None else None, bar)
            try:
                out = mmspec.speculative_generate(
                    watch, drafter, labels.view(B, 1), acceptance=rule,
                    max_new_tokens=T, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator,
                )
            finally:
                self._interrupt = outer
            stats, tokens, interrupted = out.stats, out.sequences[:, 1:].cpu(), False
            if watch.stop_requested:  # a stop after the last token leaves nothing undecoded: complete, not flagged
                tokens, interrupted = watch.tokens, any(c < T for c in watch.count)
        row_steps = stats.row_steps
        info = ARImageStats(**dataclasses.asdict(stats), images=B, target_forwards_per_image=(row_steps + B) / B,
                            drafter=drafter_name, interrupted=interrupted)
        images = None if output_type == "latent" else self._decode(tokens, output_type)
        if not return_dict:
            return images, tokens, info
        return ARImagePipelineOutput(images=images, tokens=tokens, stats=info, interrupted=interrupted)

    def _decode(self, tokens: torch.Tensor, output_type: str):
        g = self.vq.token_grid
        complete = (tokens >= 0).all(1)
        pixels = torch.zeros(tokens.shape[0], 3, g * self.vq.vq_config.downsample, g * self.vq.vq_config.downsample)
        if bool(complete.any()):
            codes = tokens[complete].view(-1, g, g).to(self.vq.device)
            pixels[complete] = self.vq.decode(codes).float().cpu()
            if not bool(torch.isfinite(pixels).all()):  # clamp keeps NaN: it would become a broken image
                raise ValueError("the VQ decoder produced non-finite pixels (NaN or inf); check its weights and dtype "
                                 "(output_type='latent' returns the tokens without decoding)")
        pixels = ((pixels + 1) / 2).clamp(0, 1)
        if output_type == "pt":
            return pixels if bool(complete.all()) else [p if c else None for p, c in zip(pixels, complete.tolist())]
        arr = pixels.permute(0, 2, 3, 1).numpy()
        if output_type == "np":
            return arr if bool(complete.all()) else [a if c else None for a, c in zip(arr, complete.tolist())]
        pil = self.numpy_to_pil(arr)
        return [p if c else None for p, c in zip(pil, complete.tolist())]


def _check_component_class(folder: Path, name: str) -> None:
    config = folder / "config.json"
    if not config.is_file():
        raise ValueError(f"{folder}: no config.json for component {name!r}")
    cls_name = json.loads(config.read_text()).get("_class_name")
    if name in ("target", "drafter") and cls_name != "LlamaGenGPT":
        raise ValueError(f"{folder}: component {name!r} is a {cls_name or 'non-diffusers'} checkpoint, not a "
                         "LlamaGenGPT (checkpoint of another architecture)")
    if name == "vq" and cls_name not in (None, "LlamaGenVQModel"):
        raise ValueError(f"{folder}: component 'vq' is a {cls_name} checkpoint, not a LlamaGen VQ")
