"""The speculative loop behind transformers' `generate(custom_generate=...)`.

    from mmspec.models.hf_generate import speculative_decoding
    out = model.generate(**inputs, custom_generate=speculative_decoding, drafter=ModelDrafter(small),
                         max_new_tokens=64, do_sample=False)

transformers 5.x runs all of generate's own preparation (generation config, special tokens,
image inputs, logits processors, stopping criteria, left-padding checks) and then calls the
callable in place of its decoding loop, batches included. Keyword arguments that `_sample`
does not know (`drafter`, `acceptance`, `return_stats`) are routed to us.

Supported processing: the sampling warpers generate builds from the generation config
(temperature, top-k, top-p) are mapped onto `mmspec.SamplingConfig`, and EOS / max-length
stopping onto the loop's own. Any other logits processor or stopping criterion would change
the target distribution in a way the acceptance rule must see per draft position; rather
than ignore it silently we raise a ValueError that names it.
"""

from __future__ import annotations

import torch

from mmspec.engine import speculative_generate

_ALLOWED_PROCESSORS = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"}
_ALLOWED_CRITERIA = {"MaxLengthCriteria", "EosTokenCriteria", "MaxTimeCriteria"}
# generate() prepares these for its own loop; the speculative loop manages its own cache.
_DROPPED_KWARGS = {"use_cache", "logits_to_keep", "past_key_values", "cache_position", "output_attentions", "output_hidden_states",
                   "return_dict_in_generate", "position_ids"}


def speculative_decoding(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    synced_gpus: bool = False,
    streamer=None,
    drafter=None,
    acceptance="exact",
    return_stats: bool = False,
    **model_kwargs,
):
    """`custom_generate` callable: returns the sequences [B, L + N] (and the `SpecStats` when
    `return_stats=True`)."""
    if drafter is None:
        raise ValueError("drafter is required: pass drafter=mmspec.drafters.ModelDrafter(small_model) to generate()")
    if streamer is not None:
        raise ValueError("streamer is not supported by the speculative loop; call generate without streamer=")
    for proc in logits_processor or []:
        if type(proc).__name__ not in _ALLOWED_PROCESSORS:
            raise ValueError(
                f"logits_processor {type(proc).__name__} is not supported in speculative verification; "
                "remove the generation option that adds it (only temperature, top_k and top_p are supported)"
            )
    for crit in stopping_criteria or []:
        if type(crit).__name__ not in _ALLOWED_CRITERIA:
            raise ValueError(
                f"stopping criterion {type(crit).__name__} is not supported by the speculative loop; "
                "use max_new_tokens and eos_token_id instead"
            )
    cfg = generation_config
    temperature = float(cfg.temperature if cfg.temperature is not None else 1.0) if cfg.do_sample else 0.0
    top_k = cfg.top_k if cfg.do_sample and cfg.top_k else None
    top_p = cfg.top_p if cfg.do_sample and cfg.top_p is not None and cfg.top_p < 1.0 else None
    max_new = int(cfg.max_length) - input_ids.shape[1]
    eos = cfg.eos_token_id
    pad = cfg.pad_token_id
    if pad is None:
        pad = eos if isinstance(eos, int) else (eos[0] if eos else 0)
    attention_mask = model_kwargs.pop("attention_mask", None)
    extra = {k: v for k, v in model_kwargs.items() if k not in _DROPPED_KWARGS and v is not None}
    out = speculative_generate(
        model, drafter, input_ids, attention_mask, acceptance=acceptance, max_new_tokens=max_new,
        temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos, pad_token_id=int(pad),
        **extra,
    )
    return (out.sequences, out.stats) if return_stats else out.sequences
