"""`LlamaGenSpec`: the LlamaGen c2i GPT (`mmspec.models.llamagen_gpt`) as a forward spec of the
speculative core, and `llamagen_target`, which builds the target (optionally with CFG).
LlamaGen: Sun et al. 2024, arXiv 2406.06525; github.com/FoundationVision/LlamaGen.

What: the "prompt" of a class-conditional request is its class label: `input_ids` [B, 1] hold
class ids (`num_classes` = the CFG null class), embedded with the GPT's `class_embed` at
prefill; every later token is an image token (VQ code) embedded with `embed`. Logical positions
of the ragged store (`mmspec.ragged`) index the GPT's official 2-D RoPE table directly: the
class token sits at 0 (a zero rotary row, as in the official model), image token i at
`cls_token_num + i` (raster order). The backbone runs the GPT's own layers over the ragged
cache through its `kv` callable, with the store's dense tree visibility as attention mask, so
chains, trees and per-row rollback work as for transformers models. `head` is the GPT's output.

CFG: `llamagen_target(gpt, guidance_scale, cfg_schedule=...)` wraps the spec target in
`mmspec.GuidedTarget` whose unconditional rows use the null class (LlamaGen's
`autoregressive/models/generate.py`, github.com/FoundationVision/LlamaGen: doubled batch,
`u + s * (c - u)` before temperature / top-k / top-p). Schedules as in
`mmspec.models.llamagen_sample.cfg_scale_at` ("constant"; "linear" from 1 to s over the image).

Acceptance tables: the targets built here expose `acceptance_tables()`, so the named rules get
what they need: `"gsd"` the GPT's input token embeddings, `"lantern"` the VQ codebook when one
is given (`codebook=`, e.g. `LlamaGenVQ.codebook()`).

Limits: c2i with one class token (what the GPT supports); a request for more tokens than the
image grid (`block_size`) is refused (`max_output_tokens`); positions past the last image token
(drafts beyond the end of an image) are clamped to the last table row: their outputs can only
influence tokens past the end, which the loop never emits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mmspec import cpu_attention
from mmspec.guided import GuidedTarget
from mmspec.models.eval_mode import check_eval_mode
from mmspec.models.llamagen_sample import check_guidance_scale
from mmspec.models.prepack import for_rows, kernels_of, maybe_packed, refresh
from mmspec.ragged import Attention, RaggedKV
from mmspec.sampling import plain_number
from mmspec.spec import ForwardSpec, SpecOutput
from mmspec.spec_target import SpecTarget
from mmspec.types import FeatureRequest

CFG_SCHEDULES = ("constant", "linear")


class LlamaGenSpec(ForwardSpec):
    """Forward spec of a `LlamaGenGPT` (see module docstring). Works as target and as drafter spec.

    `prepack` ("auto", True, False): run the GPT's linear layers on oneDNN-prepacked weights
    through a view of the model (mmspec/models/prepack.py; its weights and modules are not
    modified, the view is cached on it). "auto" times both kernels on the GPT's own layers at a
    few row counts, once per model, and keeps the faster one per row count
    (mmspec/models/kernel_choice.py): on CPUs where a verify of
    16 tokens x 2 CFG rows runs ~2x faster prepacked while a one-token step runs faster on
    stock kernels, each step gets its faster kernel. `kernels` says what was chosen."""

    def __init__(self, gpt, *, prepack="auto"):
        if not all(hasattr(gpt, name) for name in ("class_embed", "embed", "freqs_at", "backbone", "head", "args")):
            raise TypeError(f"LlamaGenSpec needs a mmspec LlamaGenGPT, got {type(gpt).__name__}")
        self.model = gpt  # the user's model; `gpt` is what runs (the model or its packed view)
        self.gpt = maybe_packed(gpt, prepack)
        self.kernels = kernels_of(self.gpt, gpt)
        self._prepack = prepack
        self._fresh = True  # the view was just checked against the model: the first request skips `refresh`
        self.args = gpt.args
        self.num_layers = gpt.args.n_layer
        self.vocab_size = gpt.args.vocab_size
        self.num_classes = gpt.args.num_classes
        self.has_null_class = gpt.args.has_null_class
        self.dtype = gpt.tok_embeddings.weight.dtype
        self.last_position = gpt.seq_len - 1
        self.max_output_tokens = gpt.args.block_size  # the image grid (the loop refuses more)

    def for_compile(self) -> None:
        """Called by a runner that compiles this spec's forward: oneDNN-prepacked weights are an
        eager CPU kernel choice whose per-call checks break the graph, so "auto" runs the model
        itself there and prepack=True is refused."""
        if self.gpt is self.model:
            return
        if self._prepack is True:
            raise ValueError("LlamaGenSpec(gpt, prepack=True) cannot be compiled (prepacked oneDNN weights are an eager "
                             "CPU kernel choice); pass prepack=False or 'auto' with compile")
        self.gpt, self.kernels = self.model, "stock"

    # ---- per request -----------------------------------------------------------------------
    def begin(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, model_inputs: dict[str, Any]) -> None:
        super().begin(input_ids, attention_mask, model_inputs)  # refuses extra model inputs
        self.dtype = self.model.tok_embeddings.weight.dtype  # follows `gpt.to(dtype)` since the wrap (static buffers)
        if not self._fresh:  # a packed view follows changes to its model since the last request
            self.gpt = refresh(self.gpt)
        self._fresh = False
        n_cls = self.args.cls_token_num
        if input_ids.shape[1] != n_cls:
            raise ValueError(
                f"a LlamaGen c2i request is its class label: input_ids must be [B, {n_cls}] class ids, got "
                f"{tuple(input_ids.shape)}"
            )
        if not bool(attention_mask.bool().all()):  # SYNC: once per request
            raise ValueError("LlamaGen class-label prompts take no padding: attention_mask must be all ones")
        top = self.num_classes + int(self.has_null_class)
        if bool(((input_ids < 0) | (input_ids >= top)).any()):  # SYNC: once per request
            null = f" ({self.num_classes} = the null class)" if self.has_null_class else " (this model has no null class)"
            raise ValueError(
                f"unknown class id in {input_ids.flatten().tolist()}: must be in [0, {top}){null}"
            )

    # ---- the pieces --------------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt.embed(tokens)

    def positions(self, logical: torch.Tensor) -> torch.Tensor:
        # Logical position = row of the 2-D RoPE table (class token 0, image token i at 1 + i).
        return logical.clamp(max=self.last_position)

    def backbone(
        self, x: torch.Tensor, positions: torch.Tensor, attention: Attention, kv: RaggedKV, features: FeatureRequest
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        gpt = for_rows(self.gpt, x.shape[0] * x.shape[1])  # this forward's faster kernel
        freqs = gpt.freqs_at(positions)
        mask = attention.dense()
        update = lambda i, k, v: kv.update(i, k, v)  # noqa: E731
        attend = self._attend(mask, x) if self.cpu_attention else None
        if not features.hidden_layers:
            return gpt.backbone(x, freqs, mask, kv=update, attend=attend), {}
        wanted = {i % self.num_layers: i for i in features.hidden_layers}
        layers: dict[int, torch.Tensor] = {}
        h = x
        for i, layer in enumerate(gpt.layers):  # the GPT's own blocks, outputs kept where asked
            h = layer(h, freqs, mask, update, i, attend)
            if i in wanted:
                layers[wanted[i]] = h
        return gpt.norm(h), layers

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return for_rows(self.gpt, hidden.numel() // hidden.shape[-1]).head(hidden)

    def _attend(self, mask: torch.Tensor, x: torch.Tensor):
        """This forward's attention by the form measured fastest for its shapes on CPU
        (mmspec/cpu_attention.py), over one additive mask built for all layers; None where the
        choice takes no part (GPU, float64 unless forced, autograd), decided before any mask is built."""
        if not cpu_attention.takes_part(x):
            return None
        additive = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(
            ~mask, torch.finfo(x.dtype).min).unsqueeze(1)
        return lambda q, k, v, torch_path: cpu_attention.attend(q, k, v, additive, None, torch_path)

    def prefill(
        self, input_ids: torch.Tensor, attention: Attention, kv: RaggedKV, model_inputs: dict[str, Any],
        features: FeatureRequest,
    ) -> SpecOutput:
        x = self.gpt.class_embed(input_ids[:, 0])  # [B, cls_token_num, dim]
        pos = self.positions(attention.q_pos)
        hidden, layers = self.backbone(x, pos, attention, kv, features)
        return SpecOutput(
            logits=self.head(hidden[:, -1:]),
            hidden=hidden if features.last_hidden else None,
            layers=layers,
            positions=pos if features.positions else None,
        )

    # ---- tables for the named acceptance rules --------------------------------------------------
    def token_embeddings(self) -> torch.Tensor:
        return self.gpt.tok_embeddings.weight.detach()


def null_class_uncond(num_classes: int) -> Callable:
    """`make_uncond` for `GuidedTarget`: every row's unconditional prompt is the null class."""

    def make(input_ids: torch.Tensor, attention_mask: torch.Tensor, model_inputs: dict):
        return torch.full_like(input_ids, num_classes), torch.ones_like(attention_mask), model_inputs

    return make


def cfg_schedule_fn(schedule: str, scale: float, num_tokens: int) -> Callable[[torch.Tensor], Any] | float:
    """The guidance scale as `GuidedTarget` takes it: a number (constant) or a callable of the
    predicted image-token index ([B, Q] long; 0 = the first image token), with the same
    arithmetic as `llamagen_sample.cfg_scale_at` (so greedy outputs agree bit for bit). "linear"
    reaches `scale` at token num_tokens - 1 and stays there for any token after it (a request
    longer than `num_tokens`), rather than growing past it."""
    if schedule == "constant":
        return float(scale)
    if schedule == "linear":
        s, denom = float(scale), max(int(num_tokens) - 1, 1)
        return lambda index: 1.0 + (s - 1.0) * (index.clamp(max=denom).to(torch.float64) / denom)
    raise ValueError(f"cfg_schedule={schedule!r}: must be one of {CFG_SCHEDULES}")


def _tables(spec: LlamaGenSpec, codebook: torch.Tensor | None) -> dict[str, torch.Tensor]:
    tables = {"embeddings": spec.token_embeddings()}
    if codebook is not None:
        tables["codebook"] = codebook
    return tables


class LlamaGenTarget(SpecTarget):
    """`SpecTarget(LlamaGenSpec(gpt))` with `acceptance_tables()` (GSD embeddings, LANTERN codebook)."""

    def __init__(self, gpt, *, codebook: torch.Tensor | None = None, prepack="auto"):
        check_eval_mode(gpt)
        super().__init__(LlamaGenSpec(gpt, prepack=prepack))
        self.codebook = _check_codebook(codebook, self.vocab_size)
        self.kernels = self.spec.kernels

    def acceptance_tables(self) -> dict[str, torch.Tensor]:
        return _tables(self.spec, self.codebook)


class GuidedLlamaGenTarget(GuidedTarget):
    """CFG over a `LlamaGenTarget` (null-class unconditional half) that keeps its acceptance tables."""

    def __init__(self, gpt, guidance_scale, *, codebook: torch.Tensor | None = None, prepack="auto"):
        inner = LlamaGenTarget(gpt, codebook=codebook, prepack=prepack)
        super().__init__(inner, guidance_scale, make_uncond=null_class_uncond(gpt.args.num_classes))
        self.kernels = inner.kernels

    def acceptance_tables(self) -> dict[str, torch.Tensor]:
        return self.target.acceptance_tables()


def _check_codebook(codebook, vocab_size: int):
    if codebook is None:
        return None
    if not isinstance(codebook, torch.Tensor) or codebook.dim() != 2 or codebook.shape[0] != vocab_size:
        raise ValueError(
            f"codebook must be a [vocab_size={vocab_size}, D] tensor (the VQ codebook of the GPT's image tokens), got "
            f"{tuple(getattr(codebook, 'shape', ()))}"
        )
    return codebook.detach()


def guidance_needed(guidance_scale: float, cfg_schedule: str) -> bool:
    """Whether a (scale, schedule) pair differs from no guidance at all."""
    return float(guidance_scale) != 1.0


def llamagen_target(
    gpt,
    guidance_scale: float = 1.0,
    *,
    cfg_schedule: str = "constant",
    num_tokens: int | None = None,
    codebook: torch.Tensor | None = None,
    prepack="auto",
):
    """The speculative target of a LlamaGen c2i GPT: plain (`guidance_scale == 1`) or CFG with the
    constant / linear schedule over `num_tokens` image tokens (default: the GPT's block size).
    `prepack`: see `LlamaGenSpec`. Refuses guidance on a GPT without a null class (ValueError)."""
    check_guidance_scale(guidance_scale)
    num_tokens = gpt.args.block_size if num_tokens is None else plain_number(num_tokens)
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or not 1 <= num_tokens <= gpt.args.block_size:
        raise ValueError(f"num_tokens={num_tokens!r}: must be an int in [1, block_size={gpt.args.block_size}] (the "
                         "image tokens the guidance schedule spans)")
    schedule = cfg_schedule_fn(cfg_schedule, guidance_scale, num_tokens)  # validates the name
    if not guidance_needed(guidance_scale, cfg_schedule):
        return LlamaGenTarget(gpt, codebook=codebook, prepack=prepack)
    if not gpt.args.has_null_class:
        raise ValueError(
            f"guidance_scale={guidance_scale}: this LlamaGen GPT has no unconditional branch (no null class: "
            "class_dropout_prob=0); use guidance_scale=1"
        )
    return GuidedLlamaGenTarget(gpt, schedule, codebook=codebook, prepack=prepack)
