"""`HFTarget`: any transformers causal LM or VLM as an `mmspec.Target`.

A `SpecTarget` over `HFSpec` (mmspec/models/hf_spec.py): the prompt (with image inputs such as
`pixel_values` for LLaVA, which the model's own forward merges) is prefilled once; every step
verifies [root] + draft nodes in one forward with tree attention; commit keeps the root and the
accepted path. The spec is chosen by model type (`spec_class`): Qwen2-VL / Qwen2.5-VL get
`Qwen2VLSpec` (M-RoPE positions and per-row rope deltas, mmspec/models/qwen2vl_spec.py);
other models with an M-RoPE position scheme are refused instead of decoded with wrong
positions. LLaVA-1.5 / LLaVA-NeXT run through the plain `HFSpec` (their image inputs,
`pixel_values` and `image_sizes`, go to the model's own prefill forward).
"""

from __future__ import annotations

import inspect

import torch

from mmspec.models.eval_mode import check_eval_mode
from mmspec.models.hf_spec import HFSpec, placeholder_ids, text_vocab_size
from mmspec.models.prepack import kernels_of, maybe_packed
from mmspec.models.qwen2vl_spec import MROPE_MODEL_TYPES, Qwen2VLSpec
from mmspec.models.qwen2vl_spec import model_type as model_type_of
from mmspec.spec_target import SpecTarget, chain_visibility

__all__ = ["HFTarget", "chain_visibility", "text_vocab_size"]


# Recurrent / state-space / hybrid families keep a state that cannot be rolled back per row
# by slot bookkeeping; ALiBi families add position biases from the mask that a 4-D custom mask
# bypasses. Refused by name rather than decoded wrongly.
STATE_SPACE = {"mamba", "mamba2", "falcon_mamba", "rwkv", "jamba", "zamba", "zamba2", "bamba", "falcon_h1",
               "qwen3_next", "lfm2", "granitemoehybrid", "recurrent_gemma", "xlstm", "minimax", "nemotron_h"}
ALIBI = {"bloom", "mpt", "baichuan"}


def check_supported(model) -> None:
    """Refuse model families whose attention or state the ragged cache cannot reproduce."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):  # None, "gpt2", an nn.Linear
        raise TypeError(f"the target must be a transformers model (a PreTrainedModel with a config), got "
                        f"{type(model).__name__}; load it first, e.g. AutoModelForCausalLM.from_pretrained(...)")
    params = inspect.signature(model.forward).parameters
    name = type(model).__name__
    if "image_grid_thw" in params and model_type_of(model) not in MROPE_MODEL_TYPES:
        # M-RoPE families other than Qwen2-VL / Qwen2.5-VL compute their 3-D positions their own
        # way; the positions derived here would be silently wrong, so refuse instead.
        raise ValueError(
            f"target {name} ({model_type_of(model)}) uses M-RoPE positions (image_grid_thw) that mmspec does not "
            f"derive; supported M-RoPE model types: {', '.join(MROPE_MODEL_TYPES)}"
        )
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    model_type = getattr(config, "model_type", "")
    if model_type in STATE_SPACE or "mamba" in model_type or "ssm" in model_type:
        raise ValueError(
            f"target/drafter {name} ({model_type}) keeps a recurrent state that mmspec's KV cache cannot roll back per "
            "row; state-space and hybrid models are not supported (use an attention-only model)"
        )
    if model_type in ALIBI or getattr(config, "alibi", False):
        raise ValueError(
            f"{name} ({model_type}) uses ALiBi position biases, which mmspec's tree masks would drop; ALiBi models are "
            "not supported (use a RoPE or learned-position model)"
        )
    if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        raise ValueError(f"{name} has no LM head (get_output_embeddings() is None); load it with a *ForCausalLM / "
                         "*ForConditionalGeneration class")
    if getattr(model.config, "is_encoder_decoder", False) or getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{name} ({model_type}) is an encoder-decoder model; mmspec decodes decoder-only causal LMs "
                         "and VLMs (load a *ForCausalLM, or use transformers' own generate for seq2seq)")
    if callable(getattr(model, "can_generate", None)) and not model.can_generate():
        raise ValueError(f"{name} is not a generative model (transformers' can_generate() is False: e.g. a masked or "
                         "classification LM); load a *ForCausalLM / *ForConditionalGeneration class")
    if not {"cache", "past_key_values"} & set(params):
        # OpenAI-GPT: no KV cache at all (each forward re-reads the whole sequence), so the ragged
        # cache never reached it and every request failed with a shape error deep in attention.
        raise ValueError(f"{name} ({model_type}) takes no KV cache (neither cache nor past_key_values), which "
                         "mmspec's verify forwards extend; such models are not supported (use a model with a cache)")
    if "position_ids" not in params:
        # BART-family decoders (Bart/Marian/Pegasus/Blenderbot ForCausalLM, ...) number positions
        # from the cache length: a tree node or a shorter padded row would get the wrong position.
        raise ValueError(f"{name} ({model_type}) takes no position_ids (it numbers positions from its cache length), so "
                         "the per-row positions of padded batches and draft trees cannot reach it; such models are "
                         "not supported (use a model whose forward takes position_ids, e.g. Llama, Qwen2, GPT-2)")


def rope_switches(model) -> list[tuple[str, int]]:
    """(RoPE type, position count) for each RoPE whose frequencies transformers recomputes from
    the largest position in a forward: dynamic NTK past `max_position_embeddings`, LongRoPE's
    long factor past `original_max_position_embeddings` (Phi-3 / Phi-4 128k). A verify forward
    reaches further than plain decoding's one-token forward, so their frequencies differ there."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return []
    entries = [params] if ("rope_type" in params or "type" in params) else [v for v in params.values() if isinstance(v, dict)]
    found = []
    for entry in entries:
        kind = str(entry.get("rope_type", entry.get("type", "default")))
        if "dynamic" in kind:
            found.append((kind, int(config.max_position_embeddings)))
        elif kind == "longrope":
            limit = entry.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings",
                                                                            None) or config.max_position_embeddings
            found.append((kind, int(limit)))
    return found


def check_rope_switch(model, attention_mask, max_new_tokens: int, max_draft_nodes) -> None:
    """Refuse a request whose forwards could cross a RoPE frequency switch (`rope_switches`):
    plain `generate` recomputes the frequencies (or, for LongRoPE, re-runs the whole sequence)
    there, which a cache of verified keys cannot follow. Prompts that all start past a LongRoPE
    switch run on the long factor throughout, as in `generate`."""
    switches = rope_switches(model)
    if not switches:
        return
    lengths = attention_mask.long().sum(1).tolist()  # SYNC: once per request
    depth = int(max_draft_nodes or 0)
    reach = max(lengths) + max_new_tokens - 1 + depth  # the largest position + 1 a forward may see
    for kind, limit in switches:
        if reach <= limit or (kind == "longrope" and min(lengths) > limit):
            continue
        also = f", or give every row a prompt longer than {limit} tokens" if kind == "longrope" else ""
        room = limit - max(lengths) + 1 - depth
        fix = f"lower max_new_tokens to {room}" if room >= 1 else "shorten the prompt"
        raise ValueError(
            f"{type(model).__name__} uses {kind} RoPE, whose frequencies change once a forward sees more than {limit} "
            f"positions; this request may reach {reach} (longest prompt {max(lengths)} + max_new_tokens "
            f"{max_new_tokens} + up to {depth} draft positions), where verify forwards cannot match plain decoding: "
            f"{fix}{also}")


_PIXEL_INPUTS = {"image": "pixel_values", "video": "pixel_values_videos"}


def check_placeholders_have_pixels(model, input_ids, model_inputs: dict) -> None:
    """A VLM prompt with image (video) placeholder tokens but no pixel_values
    (pixel_values_videos) runs, in transformers too: the model embeds each placeholder as a
    text token and answers about an image it never saw. Refused by name (SYNC: once per
    request, and only when a VLM gets no pixels)."""
    config = getattr(model, "config", None)
    # transformers' `generate` encodes the images itself before it calls a `custom_generate` and
    # passes the features as `mm_encoder_outputs[kind]` instead of the pixels: the image is there.
    encoded = model_inputs.get("mm_encoder_outputs") or {}
    for kind, key in _PIXEL_INPUTS.items():
        if model_inputs.get(key) is not None or encoded.get(kind) is not None:
            continue
        ids = placeholder_ids(config, (kind,))
        if ids and bool(torch.isin(input_ids, torch.tensor(ids, device=input_ids.device)).any()):
            raise ValueError(
                f"input_ids hold {kind} placeholder tokens (id {ids[0]}) but no {key} was given: the model would embed "
                f"each placeholder as a text token and answer without the {kind}; pass the processor's outputs "
                f"(**inputs, {key} included), or drop the placeholders from a text-only prompt"
            )


def check_image_sizes(model, model_inputs: dict) -> None:
    """`image_sizes` given to a LLaVA whose vision tower is CLIP-like (LLaVA-1.5): its forward takes
    the argument (Pixtral-style towers use it), but the CLIP tower fails deep inside with "object
    has no attribute 'patch_size'", in transformers' `generate` too. Refused by name: LLaVA-1.5's
    processor never produces it (LLaVA-NeXT's does, for its own model class)."""
    if model_inputs.get("image_sizes") is None and model_inputs.get("pixel_values") is not None:
        takes = inspect.signature(getattr(getattr(model, "model", model), "get_image_features", lambda: None)).parameters
        if "image_sizes" in takes and takes["image_sizes"].default is inspect.Parameter.empty:
            # LLaVA-NeXT: failed deep in transformers ("'NoneType' object is not iterable")
            raise ValueError(f"{type(model).__name__} needs image_sizes with pixel_values (the original size of each "
                             "image); pass the processor's outputs together")
    if model_inputs.get("image_sizes") is None or model_type_of(model) != "llava":
        return
    tower = getattr(getattr(model, "model", model), "vision_tower", None)
    if tower is not None and not hasattr(tower, "patch_size"):
        raise ValueError(
            f"image_sizes was given to a LLaVA with a {type(tower).__name__} vision tower, which does not take it "
            "(LLaVA-1.5's processor does not produce it; LLaVA-NeXT's inputs belong to "
            "LlavaNextForConditionalGeneration); drop image_sizes"
        )


def prepack_for_compile(prepack, compile):
    """The prepack choice under `compile`: "auto" -> False, True refused."""
    if compile is None or compile is False:
        return prepack
    if prepack is True:
        raise ValueError(f"prepack=True cannot be combined with compile={compile!r} (prepacked oneDNN weights are an "
                         "eager CPU kernel); pass prepack=False or 'auto'")
    return False


def spec_class(model) -> type[HFSpec]:
    """The forward spec a transformers model runs through, by model type."""
    return Qwen2VLSpec if model_type_of(model) in MROPE_MODEL_TYPES else HFSpec


class HFTarget(SpecTarget):
    """Wraps a `transformers.PreTrainedModel` with an LM head.

    `prepack` ("auto", True, False): run the model's linear layers on oneDNN-prepacked
    weights (float32 CPU models; see mmspec/models/prepack.py). The model's weights, modules and
    modes are not modified (its views are cached on it as `_mmspec_packed_views`, which pickling
    and copying leave empty).
    Build it once and reuse it across calls: the wrap (and the packed view) is paid once.

    `static` / `compile`: the opt-in GPU path (`SpecTarget`; docs/architecture.md, "GPU path").
    With `compile`, `prepack="auto"` means no prepacking (oneDNN packed weights are an eager
    CPU kernel choice) and `prepack=True` is refused.

    `attention` ("auto", "torch"): the attention choice of `SpecTarget` (CUDA backends; on CPU,
    "torch" also turns off mmspec's CPU attention)."""

    def __init__(self, model, *, prepack="auto", static: bool | None = None, compile=None, attention: str = "auto"):
        check_supported(model)
        prepack = prepack_for_compile(prepack, compile)
        self.model = model
        run = maybe_packed(model, prepack)
        spec = spec_class(model)(run, source=model)
        spec.kernels = kernels_of(run, model)
        self.kernels = spec.kernels
        super().__init__(spec, static=static, compile=compile, attention=attention)

    def prefill(self, input_ids, attention_mask, model_inputs, max_new_tokens, max_draft_nodes, *args, **kwargs):
        check_eval_mode(self.model)  # per request: a target wrapped once may be switched to training later
        check_placeholders_have_pixels(self.model, input_ids, model_inputs)
        check_image_sizes(self.model, model_inputs)
        check_rope_switch(self.model, attention_mask, max_new_tokens, max_draft_nodes)
        return super().prefill(input_ids, attention_mask, model_inputs, max_new_tokens, max_draft_nodes, *args, **kwargs)

    @property
    def placeholder_token_ids(self) -> dict[str, list[int]]:
        """A VLM's image / video placeholder token ids (empty lists for a text model): what
        `GuidedTarget` counts to pair each half's prompts with its model inputs and features."""
        config = getattr(self.model, "config", None)
        return {kind: placeholder_ids(config, (kind,)) for kind in ("image", "video")}

    def acceptance_tables(self) -> dict:
        """Tables rules named by string can use: GSD clusters by input-embedding distance."""
        return {"embeddings": self.model.get_input_embeddings().weight.detach()}
