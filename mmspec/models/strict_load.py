"""Strict loading of mmspec's diffusers-format components (`LlamaGenGPT`, `LlamaGenVQModel`).

diffusers' `ModelMixin.from_pretrained` only logs "Some weights ... newly initialized" for keys
missing from a checkpoint (and, without accelerate, keeps their random initial values) and drops
unexpected ones: a folder with a renamed or missing tensor loaded as a partly random model. Here
any missing, unexpected or mismatched key is a ValueError naming the keys, as for the official
checkpoints (`from_official`), which `torch_checkpoint` reads."""

from __future__ import annotations

import argparse
import pickle
import struct
from pathlib import Path

import torch


def torch_checkpoint(path: Path):
    """`torch.load` of an official `.pt` / `.pth` file in weights-only mode (no code from the file
    runs), with `argparse.Namespace` allowed: LlamaGen's training scripts (train_c2i.py,
    vq_train.py) and MAR's (misc.save_model) save their `args` beside the weights, which a plain
    weights-only load refuses.
    A file holding other Python objects is refused with what to do (ValueError)."""
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if "Weights only load failed" not in str(err):
            raise ValueError(f"{path}: not a torch checkpoint ({err})") from err
        first = next((line.strip() for line in str(err).splitlines() if "GLOBAL" in line or "Unsupported" in line), "")
        raise ValueError(f"{path}: the checkpoint holds Python objects besides tensors, which mmspec does not unpickle "
                         f"({first or 'weights-only load refused it'}); if you trust the file, load it with "
                         "torch.load(path, weights_only=False) and pass the loaded dict (or its state dict)") from err
    except (RuntimeError, OSError, EOFError, struct.error) as err:
        raise ValueError(f"{path}: not a torch checkpoint ({err})") from err


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


def strip_wrapper_prefix(state: dict) -> dict:
    """A state dict saved from a wrapped model (DDP's `module.`, torch.compile's `_orig_mod.`, in
    any nesting) with the prefix removed, when every key carries it; otherwise unchanged."""
    changed = True
    while changed and state:
        changed = False
        for prefix in ("module.", "_orig_mod."):
            if all(isinstance(k, str) and k.startswith(prefix) for k in state):
                state = {k[len(prefix):]: v for k, v in state.items()}
                changed = True
    return state
