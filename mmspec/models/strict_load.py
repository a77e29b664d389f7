"""Strict loading of mmspec's diffusers-format components (`LlamaGenGPT`, `LlamaGenVQModel`).

diffusers' `ModelMixin.from_pretrained` only logs "Some weights ... newly initialized" for keys
missing from a checkpoint (and, without accelerate, keeps their random initial values) and drops
unexpected ones: a folder with a renamed or missing tensor loaded as a partly random model. Here
any missing, unexpected or mismatched key is a ValueError naming the keys, as for the official
checkpoints (`from_official`)."""

from __future__ import annotations


def strict_from_pretrained(load, name: str, path, *args, **kwargs):
    """Call diffusers' `load(path, *args, **kwargs)` (a bound parent `from_pretrained`) and refuse
    a checkpoint whose keys do not match the model exactly. `name`: the class, for the message."""
    wants_info = bool(kwargs.pop("output_loading_info", False))
    try:
        model, info = load(path, *args, output_loading_info=True, **kwargs)
    except RuntimeError as e:  # torch's load_state_dict: "size mismatch for ..."
        if "size mismatch" in str(e):
            raise ValueError(f"{name}: the weights in {str(path)!r} do not fit its config ({e})") from None
        raise
    bad = {kind: sorted(info.get(kind) or []) for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    bad = {k: v for k, v in bad.items() if v}
    if bad:
        listed = "; ".join(f"{k.replace('_', ' ')} {v[:8]}{' ...' if len(v) > 8 else ''}" for k, v in bad.items())
        raise ValueError(f"{name}: the checkpoint in {str(path)!r} does not match the model ({listed}); "
                         "it is another architecture or an edited file, and would load partly random")
    return (model, info) if wants_info else model
