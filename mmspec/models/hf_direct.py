"""`DirectDecoder`: step forwards of plain decoder-only transformers LMs without the model-level
wrappers, calling the model's own modules in the order its forward would.

Why: a drafter is a small model called K times per step, and at CPU batch sizes a small model's
forward is dominated by fixed costs, most of them above the decoder layers (`Model.forward`'s
mask builder and argument plumbing, the `CausalLM` wrapper, output dataclasses, the forward hooks
that read features). Measured on a 2-core EPYC VM (1 thread, a 1-layer 512-wide Llama, one
token): 2.1 ms through `model(...)`, 1.65 ms through the same modules called directly; a
14-layer model of the same width gains ~1%. So this path matters for drafters and changes
nothing else: every decoder layer, the rotary embedding, the norms and the LM head are the
model's own modules, called with the arguments its `Model.forward` passes them, so the logits
are bit-identical (tested for Llama, Mistral, Qwen2 and Qwen3, chains and trees, padding).

Which models: an exact whitelist of families whose `Model.forward` is embed -> rotary ->
layers (one mask per attention type) -> norm and whose `CausalLM.forward` is `lm_head` over the
kept positions (no embedding scale, no logit soft-capping or scaling): Llama, Mistral, Qwen2,
Qwen3; and LLaVA-1.5 / LLaVA-NeXT over one of those language models, whose forward without
images is exactly that (the image features are merged at prefill only). Anything else, a model
in training mode, or one with forward hooks on the wrapper modules this path skips (they would
silently not run) goes through the model's own forward. Prefill always runs the model's own
forward (once per request; image merging etc.).
"""

from __future__ import annotations

import torch

from mmspec.models.hf_cache import cache_argument

# model_type -> (CausalLM class name, base model class name), checked by exact type name so that
# a subclass with its own forward never takes this path.
DIRECT_FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaModel"),
    "mistral": ("MistralForCausalLM", "MistralModel"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Model"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Model"),
}


# VLM model_type -> (ConditionalGeneration class name, wrapper model class name): the language
# model under `model.language_model` must itself be a whitelisted base model.
DIRECT_VLMS = {
    "llava": ("LlavaForConditionalGeneration", "LlavaModel"),
    "llava_next": ("LlavaNextForConditionalGeneration", "LlavaNextModel"),
}


def decoder_path(model) -> tuple[str, ...] | None:
    """Attribute path from `model` (the user's model, not a prepacked view) to the decoder base
    model a direct step runs, or None when the model is not whitelisted."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in DIRECT_VLMS:
        names = DIRECT_VLMS[model_type]
        wrapper = getattr(model, "model", None)
        if type(model).__name__ != names[0] or type(wrapper).__name__ != names[1]:
            return None
        text_type = getattr(config.get_text_config(), "model_type", None)
        path, base = ("model", "language_model"), getattr(wrapper, "language_model", None)
    else:
        names = DIRECT_FAMILIES.get(model_type)
        if names is None or type(model).__name__ != names[0]:
            return None
        text_type, path, base = model_type, ("model",), getattr(model, "model", None)
    family = DIRECT_FAMILIES.get(text_type)
    if family is None or base is None or type(base).__name__ != family[1]:
        return None
    if not (all(hasattr(base, a) for a in ("embed_tokens", "rotary_emb", "layers", "norm")) and hasattr(model, "lm_head")):
        return None
    return path


def direct_supported(model) -> bool:
    """True when `model` (the user's model, not a prepacked view) is a whitelisted family."""
    return decoder_path(model) is not None


def check_layer_range(hidden_layers, num_layers: int) -> None:
    """Feature layers are decoder-layer indices in [-num_layers, num_layers)."""
    for i in hidden_layers:
        if not -num_layers <= i < num_layers:
            raise ValueError(f"hidden layer {i} out of range for a {num_layers}-layer model")


def _hooked(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


class DirectDecoder:
    """Runs one step forward of `run` (the model or its prepacked view) module by module."""

    def __init__(self, source):
        config = source.config.get_text_config() if hasattr(source.config, "get_text_config") else source.config
        self.num_layers = int(config.num_hidden_layers)
        self.layer_types = getattr(config, "layer_types", None)
        self.path = decoder_path(source)
        if self.path is None:
            raise ValueError(f"{type(source).__name__} is not a model the direct step path supports")

    def base(self, run):
        """The decoder base model of `run` (the model or its prepacked view)."""
        for name in self.path:
            run = getattr(run, name)
        return run

    def usable(self, run) -> bool:
        """Per forward: the model is in eval mode and no hook sits on a skipped wrapper."""
        if run.training or _hooked(run):
            return False
        module = run
        for name in self.path:  # the wrappers between the model and its decoder, the decoder included
            module = getattr(module, name)
            if _hooked(module):
                return False
        from torch.nn.modules import module as nn_module

        return not (nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)

    def forward(self, run, tokens, mask, positions, cache, *, keep: int, last_hidden: bool,
                hidden_layers: tuple[int, ...]):
        """Returns (logits, final hidden or None, {layer: output}). `mask`: None, a 4-D additive
        mask, or {attention type: mask} (as `HFSpec._additive` builds them)."""
        check_layer_range(hidden_layers, self.num_layers)
        base = self.base(run)
        hidden = base.embed_tokens(tokens)
        position_embeddings = base.rotary_emb(hidden, position_ids=positions)
        wanted = {i % self.num_layers for i in hidden_layers}
        layers: dict[int, torch.Tensor] = {}
        cache_kw = None
        for i, layer in enumerate(base.layers[: self.num_layers]):
            layer_mask = mask[self.layer_types[i]] if isinstance(mask, dict) else mask
            cache_kw = cache_kw or {cache_argument(layer): cache}
            hidden = layer(hidden, attention_mask=layer_mask, position_embeddings=position_embeddings,
                           position_ids=positions, use_cache=True, **cache_kw)
            if i in wanted:
                layers[i] = hidden
        hidden = base.norm(hidden)
        logits = run.lm_head(hidden[:, -keep:] if keep else hidden)
        captured = {i: layers[i % self.num_layers] for i in hidden_layers}
        return logits, (hidden if last_hidden else None), captured
