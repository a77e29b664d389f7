"""The speculative loop behind transformers' `generate(custom_generate=...)`.

    from mmspec.models.hf_generate import speculative_decoding
    out = model.generate(**inputs, custom_generate=speculative_decoding, drafter=ModelDrafter(small),
                         max_new_tokens=64, do_sample=False)

transformers 5.x runs all of generate's own preparation (generation config, special tokens,
image inputs, logits processors, stopping criteria, left-padding checks) and then calls the
callable in place of its decoding loop, batches included. Keyword arguments that `_sample`
does not know (`drafter`, `acceptance`, `return_stats`) are routed to us.

What is honoured, exactly: greedy search and sampling (`do_sample`), with the sampling
warpers in the prepared `logits_processor` list (TemperatureLogitsWarper, TopKLogitsWarper,
TopPLogitsWarper, in that order, whether built from the generation config or passed
explicitly; several TopK filters keep the smallest k) mapped onto `mmspec.SamplingConfig`; the prepared stopping criteria
MaxLengthCriteria (the smallest max_length wins) and EosTokenCriteria (its token ids);
`num_return_sequences` with sampling (generate has already repeated the rows);
`return_dict_in_generate=True` (a `GenerateDecoderOnlyOutput` holding `.sequences`); images
of a LLaVA-family VLM, which generate encodes before calling us (`mm_encoder_outputs` in place
of `pixel_values`; the model's prefill merges them as it would the pixels).

Refused with a ValueError naming the option (never silently ignored): beam search and the
other decoding modes (`num_beams > 1`, `penalty_alpha`, `dola_layers`, prompt lookup),
`max_time`, any other logits processor or stopping criterion (repetition penalty, a
minimum length that can act, stop strings, ...: `min_new_tokens=0` or a `min_length` the prompt
reaches changes nothing and is let through; they would change the target distribution in a way the acceptance
rule must see per draft position), warpers with a non-default `filter_value` /
`min_tokens_to_keep`, warpers under greedy decoding, `output_scores` / `output_logits` /
`output_attentions` / `output_hidden_states` with `return_dict_in_generate`, `streamer`,
`assistant_model`, `synced_gpus` (transformers does not hand these three to the callable; they
are read off the calling `generate`), `inputs_embeds` and `position_ids` other than each row's
default numbering; images on Qwen2-VL / Qwen2.5-VL
(generate drops `image_grid_thw` with the pixels, and mmspec's M-RoPE positions need it: call
`mmspec.speculative_generate` there).

Accepted and not used, because they change no output: `cache_implementation` and
`compile_config` (the loop keeps its own ragged cache; the tokens are `generate`'s).
"""

from __future__ import annotations

import sys

import torch

from mmspec.engine import speculative_generate
from mmspec.models.qwen2vl_spec import MROPE_MODEL_TYPES
from mmspec.models.qwen2vl_spec import model_type as model_type_of

_WARPER_ORDER = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper")  # mmspec.process_logits order
_ALLOWED_CRITERIA = {"MaxLengthCriteria", "EosTokenCriteria"}
# generate() prepares these for its own loop; the speculative loop manages its own cache.
_DROPPED_KWARGS = {"use_cache", "logits_to_keep", "past_key_values", "cache", "cache_position", "output_attentions", "output_hidden_states",
                   "return_dict_in_generate", "position_ids"}
_CACHE_KWARGS = ("past_key_values", "cache")
_OUTPUT_FLAGS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def _check_mode(cfg) -> None:
    """Only greedy search and multinomial sampling are speculative-decoded."""
    if getattr(cfg, "num_beams", 1) not in (None, 1):
        raise ValueError(
            f"num_beams={cfg.num_beams} is not supported by speculative decoding (it decodes one sequence per row); "
            "use num_beams=1, or call generate without custom_generate for beam search"
        )
    mode = cfg.get_generation_mode()
    name = getattr(mode, "value", str(mode))
    if name not in ("greedy_search", "sample"):
        raise ValueError(
            f"generation mode {name!r} (from the generation config: penalty_alpha, dola_layers, prompt_lookup_num_tokens, "
            "assistant, ...) is not supported by speculative decoding; only greedy search and sampling are"
        )
    if getattr(cfg, "max_time", None) is not None:
        raise ValueError(
            f"max_time={cfg.max_time} is not supported by the speculative loop (it would not stop on time); "
            "remove max_time and bound the output with max_new_tokens"
        )
    if cfg.return_dict_in_generate:
        asked = [f for f in _OUTPUT_FLAGS if getattr(cfg, f, False)]
        if asked:
            raise ValueError(
                f"{', '.join(f'{f}=True' for f in asked)} with return_dict_in_generate=True: the speculative loop "
                "returns only .sequences (its verify forwards score several positions at once); drop these flags "
                "or call generate without custom_generate"
            )


def _no_op(proc, prompt_length: int) -> bool:
    """A minimum-length processor that can never act here: `min_new_tokens=0` or a `min_length`
    the prompt already reaches (generate builds them for those settings too)."""
    name = type(proc).__name__
    if name == "MinLengthLogitsProcessor":
        return int(getattr(proc, "min_length", prompt_length + 1)) <= prompt_length
    if name == "MinNewTokensLengthLogitsProcessor":
        return int(getattr(proc, "min_new_tokens", 1)) <= 0
    return False


# The generation options behind transformers' processors, named in a refusal (min_new_tokens
# arrives as MinLengthLogitsProcessor in transformers 5.24).
_OPTION_OF = {
    "MinLengthLogitsProcessor": "min_length / min_new_tokens", "MinNewTokensLengthLogitsProcessor": "min_new_tokens",
    "RepetitionPenaltyLogitsProcessor": "repetition_penalty", "NoRepeatNGramLogitsProcessor": "no_repeat_ngram_size",
    "SuppressTokensLogitsProcessor": "suppress_tokens", "SuppressTokensAtBeginLogitsProcessor": "begin_suppress_tokens",
    "NoBadWordsLogitsProcessor": "bad_words_ids", "SequenceBiasLogitsProcessor": "sequence_bias",
    "ForcedBOSTokenLogitsProcessor": "forced_bos_token_id", "ForcedEOSTokenLogitsProcessor": "forced_eos_token_id",
    "ExponentialDecayLengthPenalty": "exponential_decay_length_penalty", "MinPLogitsWarper": "min_p",
    "TypicalLogitsWarper": "typical_p", "EpsilonLogitsWarper": "epsilon_cutoff", "EtaLogitsWarper": "eta_cutoff",
    "LogitNormalization": "renormalize_logits", "InfNanRemoveLogitsProcessor": "remove_invalid_values",
}


def _sampling_from_processors(logits_processor, do_sample: bool,
                              prompt_length: int = 0) -> tuple[float, int | None, float | None]:
    """(temperature, top_k, top_p) from the prepared warpers, which are the truth: generate has
    already merged the ones built from the generation config with any passed explicitly.
    Minimum-length processors that cannot act (`_no_op`) are dropped."""
    procs = [p for p in (logits_processor or []) if not _no_op(p, prompt_length)]
    names = [type(p).__name__ for p in procs]
    for proc, name in zip(procs, names):
        if name not in _WARPER_ORDER:
            option = f" (the generation option {_OPTION_OF[name]})" if name in _OPTION_OF else ""
            raise ValueError(
                f"logits_processor {name}{option} is not supported in speculative verification; remove the generation "
                "option or logits_processor entry that adds it (only temperature, top_k and top_p are supported)"
            )
        if not do_sample:
            raise ValueError(
                f"logits_processor {name} with greedy decoding (do_sample=False): the speculative loop decodes "
                "greedily on the raw logits; remove it or pass do_sample=True"
            )
        if name != "TemperatureLogitsWarper":
            fv = float(getattr(proc, "filter_value", float("-inf")))
            keep = int(getattr(proc, "min_tokens_to_keep", 1))
            if fv != float("-inf") or keep != 1:
                raise ValueError(
                    f"logits_processor {name}(filter_value={fv}, min_tokens_to_keep={keep}) is not supported; "
                    "only filter_value=-inf and min_tokens_to_keep=1 are (the generate defaults)"
                )
    ranks = [_WARPER_ORDER.index(n) for n in names]
    twice = [n for n in ("TemperatureLogitsWarper", "TopPLogitsWarper") if names.count(n) > 1]
    if twice or ranks != sorted(ranks):
        raise ValueError(
            f"logits_processor list {names} (generate's own warpers merged with the ones passed) is not supported: "
            f"the speculative loop applies temperature, then top-k, then top-p, each once; pass the settings as "
            "temperature=, top_k=, top_p= instead of logits_processor entries"
        )
    if not do_sample:
        return 0.0, None, None
    temperature, top_k, top_p = 1.0, None, None
    for proc, name in zip(procs, names):
        if name == "TemperatureLogitsWarper":
            temperature = float(proc.temperature)
        elif name == "TopKLogitsWarper":
            # Consecutive top-k filters keep the top-min(k) set (ties at the k-th value included).
            top_k = int(proc.top_k) if top_k is None else min(top_k, int(proc.top_k))
        else:
            top_p = float(proc.top_p)
    return temperature, top_k, top_p


def _stopping(stopping_criteria, prompt_len: int) -> tuple[int, list[int] | None]:
    """(max_new_tokens, eos ids) from the prepared stopping criteria."""
    max_lengths, eos = [], []
    has_eos = False
    for crit in stopping_criteria or []:
        name = type(crit).__name__
        if name == "MaxTimeCriteria":
            raise ValueError(
                "max_time / MaxTimeCriteria is not supported by the speculative loop (it would not stop on time); "
                "bound the output with max_new_tokens instead"
            )
        if name not in _ALLOWED_CRITERIA:
            raise ValueError(
                f"stopping criterion {name} is not supported by the speculative loop; "
                "use max_new_tokens and eos_token_id instead"
            )
        if name == "MaxLengthCriteria":
            max_lengths.append(int(crit.max_length))
        else:
            has_eos = True
            eos += [int(t) for t in torch.as_tensor(crit.eos_token_id).flatten().tolist()]
    if not max_lengths:
        raise ValueError("generate prepared no MaxLengthCriteria; pass max_new_tokens or max_length")
    max_new = min(max_lengths) - prompt_len
    if max_new < 1:
        raise ValueError(
            f"max_length={min(max_lengths)} leaves no room after the {prompt_len}-token prompt; pass max_new_tokens >= 1"
        )
    return max_new, (sorted(set(eos)) if has_eos else None)


def _cached_length(cache) -> int:
    """Tokens already held by a transformers cache (a `Cache` or the legacy tuple of tuples)."""
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    try:
        return int(cache[0][0].shape[-2])
    except (TypeError, IndexError, AttributeError):
        return 0


def _check_position_ids(position_ids, input_ids, attention_mask) -> None:
    """Caller-given `position_ids` are honoured by plain `generate`; the loop numbers each row's
    real tokens 0, 1, ... itself, so positions other than those are refused, not dropped."""
    if position_ids is None:
        return
    given = torch.as_tensor(position_ids).to(input_ids.device)
    mask = torch.ones_like(input_ids) if attention_mask is None else torch.as_tensor(attention_mask).to(input_ids.device)
    default = mask.long().cumsum(-1) - 1
    real = mask != 0
    if given.shape != input_ids.shape or not torch.equal(given.long()[real], default[real]):  # SYNC: once per call
        raise ValueError("position_ids other than each row's 0, 1, 2, ... over its real tokens are not supported by the "
                         "speculative loop (it numbers positions itself); call generate without position_ids=")


def _synced_by_default(model) -> bool:
    """What `generate` takes `synced_gpus=None` to mean (on under DeepSpeed ZeRO-3 or FSDP with
    more than one process); it computes that for its own loops only, not for a callable
    `custom_generate`, which then ran unsynced where ranks must step together."""
    from transformers.generation import utils

    try:
        sharded = utils.is_deepspeed_zero3_enabled() or utils.is_fsdp_managed_module(model)
        return bool(sharded and utils._get_torch_distributed_world_size() > 1)
    except AttributeError:  # another transformers: its own refusal of explicit synced_gpus still holds
        return False


def _dropped_generate_options() -> dict:
    """`streamer`, `assistant_model` and `synced_gpus` as given to the `generate` that called us.
    transformers 5 does not pass them to a callable `custom_generate` (it keeps only the callable's
    own extra keywords), so a streamer silently received the prompt alone and never `end()` (a
    TextIteratorStreamer consumer hung) and an assistant model was ignored. Read off the calling
    frame, found by name; empty when there is none (called directly, or another transformers)."""
    frame = sys._getframe(2)  # speculative_decoding's caller
    while frame is not None and frame.f_code.co_name != "generate":
        frame = frame.f_back if frame.f_code.co_name in ("decorate_context", "_wrapper") else None
    if frame is None:
        return {}
    seen = frame.f_locals
    given = {k: seen.get(k) for k in ("streamer", "assistant_model", "synced_gpus")}
    return {k: v for k, v in given.items() if v is not None}  # synced_gpus=False kept: asked off


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
    """`custom_generate` callable: returns the sequences [B, L + N], or a
    `GenerateDecoderOnlyOutput` with `.sequences` when `return_dict_in_generate=True` (and
    the `SpecStats` as a second element when `return_stats=True`)."""
    if drafter is None:
        raise ValueError("drafter is required: pass drafter=mmspec.drafters.ModelDrafter(small_model) to generate()")
    dropped = _dropped_generate_options()
    streamer = streamer if streamer is not None else dropped.get("streamer")
    asked = dropped.get("synced_gpus")
    synced_gpus = synced_gpus or bool(asked) or (asked is None and _synced_by_default(model))
    if dropped.get("assistant_model") is not None:
        raise ValueError("assistant_model= is transformers' own assisted generation; with custom_generate=speculative_"
                         "decoding pass the small model as drafter=mmspec.drafters.ModelDrafter(small_model) instead")
    if streamer is not None:
        if callable(getattr(streamer, "end", None)):
            streamer.end()  # generate has already sent it the prompt: a consumer thread would wait forever
        raise ValueError("streamer is not supported by the speculative loop; call generate without streamer=")
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError(
            "inputs_embeds is not supported by the speculative loop (the drafter needs token ids); pass input_ids"
        )
    if synced_gpus:
        raise ValueError("synced_gpus=True is not supported by the speculative loop (rows finish at different "
                         "steps on each rank); call generate without custom_generate for multi-GPU ZeRO-3 runs")
    for name in _CACHE_KWARGS:  # transformers >= 5.24 calls it `cache`
        pkv = model_kwargs.get(name)
        if pkv is not None and _cached_length(pkv) > 0:
            raise ValueError(
                f"{name} already holds {_cached_length(pkv)} cached tokens; the speculative loop builds its own "
                "cache from the whole prompt and cannot continue a transformers cache: pass the full input_ids "
                f"without {name}"
            )
    cfg = generation_config
    _check_mode(cfg)
    temperature, top_k, top_p = _sampling_from_processors(logits_processor, bool(cfg.do_sample), input_ids.shape[1])
    max_new, eos = _stopping(stopping_criteria, input_ids.shape[1])
    pad = getattr(cfg, "_pad_token_tensor", None)  # what generate pads finished rows with
    pad = cfg.pad_token_id if pad is None else int(torch.as_tensor(pad).flatten()[0])
    if pad is None:
        pad = eos[0] if eos else 0
    attention_mask = model_kwargs.pop("attention_mask", None)
    if attention_mask is not None and cfg.pad_token_id is not None and attention_mask.shape == input_ids.shape:
        am = attention_mask.long()
        seen_before, seen_after = am.cummax(1).values, am.flip(1).cummax(1).values.flip(1)
        hole = (am == 0) & (seen_before == 1) & (seen_after == 1)  # a 0 between 1s (right padding is no hole)
        if bool(hole.any()) and torch.equal(am, (input_ids != pad).long()):  # SYNC: once
            raise ValueError(  # most likely the mask generate built from pad_token_id, not a tokenizer's
                f"the attention_mask has a hole inside a prompt and equals input_ids != pad_token_id={pad}: transformers' "
                "generate builds it that way when no attention_mask is passed and pad_token_id occurs inside a prompt; "
                "pass the tokenizer's (left-padded) attention_mask, or a pad_token_id the prompts do not hold"
            )
    if model_type_of(model) not in MROPE_MODEL_TYPES:  # there generate fills in its own M-RoPE positions
        _check_position_ids(model_kwargs.get("position_ids"), input_ids, attention_mask)
    extra = {k: v for k, v in model_kwargs.items() if k not in _DROPPED_KWARGS and v is not None}
    if extra.get("mm_encoder_outputs") and model_type_of(model) in MROPE_MODEL_TYPES:
        # generate encoded the images and dropped `image_grid_thw` with the pixels; mmspec's Qwen2-VL
        # forward spec builds its M-RoPE positions from it, so it cannot continue from here.
        raise ValueError(
            f"generate(custom_generate=...) on {model_type_of(model)}: transformers encodes the images before calling "
            "the custom loop and drops image_grid_thw, which mmspec needs for M-RoPE positions; call "
            "mmspec.speculative_generate(model, drafter, **inputs) or use SpeculativeVLMPipeline instead"
        )
    out = speculative_generate(
        model, drafter, input_ids, attention_mask, acceptance=acceptance, max_new_tokens=max_new,
        temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos, pad_token_id=int(pad),
        **extra,
    )
    result = out.sequences
    if cfg.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        result = GenerateDecoderOnlyOutput(sequences=out.sequences)
    return (result, out.stats) if return_stats else result
