"""The CPU attention choice (mmspec/cpu_attention.py) for transformers models.

The plain form is registered as the attention implementation `"mmspec_cpu"` with transformers'
`AttentionInterface` and selected, by setting the attention modules' config for the duration of
one step forward, around the step forwards of a whitelisted decoder family
(mmspec/models/hf_direct.py) whose attention runs "sdpa". The function takes only what
`mmspec.cpu_attention.eligible` accepts; anything else (dropout, soft-capping, position biases,
attention-weight outputs, sinks, one-token forwards without a mask) goes to transformers' own
sdpa function with the same arguments. Prefill never takes part.
"""

from __future__ import annotations

import contextlib

from transformers.integrations.sdpa_attention import sdpa_attention_forward

from mmspec.cpu_attention import attend, eligible

HF_NAME = "mmspec_cpu"


def _hf_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers attention function: the chosen form for eligible step inputs, else
    transformers' own sdpa function with the same arguments."""
    def torch_path():
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)

    if (dropout or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
            or kwargs.get("output_attentions") or kwargs.get("s_aux") is not None or not eligible(query, attention_mask)):
        return torch_path()
    out = attend(query, key, value, attention_mask, scaling, lambda: torch_path()[0].transpose(1, 2))
    return out.transpose(1, 2).contiguous(), None


_REGISTERED = [False]


def register_hf() -> str:
    """Register `"mmspec_cpu"` with transformers' attention (and mask) interfaces, once."""
    if not _REGISTERED[0]:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        from transformers.modeling_utils import AttentionInterface

        AttentionInterface.register(HF_NAME, _hf_attention)
        # Masks a model builds itself (none in mmspec's step forwards, which pass 4-D masks) are
        # built as for sdpa, whose function this one falls back to.
        ALL_MASK_ATTENTION_FUNCTIONS.register(HF_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        _REGISTERED[0] = True
    return HF_NAME


def attention_configs(model) -> list:
    """The distinct config objects the attention modules of `model` read their implementation
    from, or [] when any of them runs something other than transformers' "sdpa"."""
    configs = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(m, "is_causal") and hasattr(cfg, "_attn_implementation_internal"):
            configs[id(cfg)] = cfg
    found = list(configs.values())
    if not found or any(c._attn_implementation_internal != "sdpa" for c in found):
        return []
    return found


@contextlib.contextmanager
def hf_selected(configs: list):
    """Within the block the attention modules reading `configs` run `"mmspec_cpu"`."""
    if not configs:
        yield
        return
    name = register_hf()
    for c in configs:
        c._attn_implementation_internal = name
    try:
        yield
    finally:
        for c in configs:
            c._attn_implementation_internal = "sdpa"
