"""`check_device`: a `--device` / `device=` value is refused up front when this machine cannot
run on it, instead of minutes into a training run (after its data stage) or deep in a forward."""

from __future__ import annotations


def device_name(device) -> str:
    """The name a report gives `device`: the GPU's own name on CUDA, else the device type."""
    import torch

    dev = torch.device(device)
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type


def check_device(device, what: str = "device", allowed: tuple[str, ...] = ("cpu", "cuda")) -> None:
    """`device` (a str or torch.device: cpu, cuda, cuda:N) must name a device type in `allowed`
    that torch can use here; ValueError naming `what` otherwise."""
    import torch  # here, so that option modules importing this stay light

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{what}={device!r} is not a device (use one of {', '.join(allowed)}"
                         f"{'[:N]' if 'cuda' in allowed else ''})") from None
    if dev.type not in allowed:
        raise ValueError(f"{what}={device!r}: must be one of {', '.join(allowed)}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{what}={device!r} asked for but torch sees no CUDA device; use cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{what}={device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def check_dtype(dtype, what: str = "torch_dtype") -> None:
    """`dtype` must be None or a torch.dtype: a pipeline's `from_pretrained` loaded float32 for a
    string ("float16") or a per-component dict, or took the string for a device (TypeError);
    and one the models compute in (float8 loaded, then failed in a kernel; ValueError)."""
    import torch

    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"{what} must be a torch.dtype (torch.float16, ...), got {dtype!r}")
    usable = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    if dtype is not None and dtype not in usable:
        raise ValueError(f"{what}={dtype} is not a dtype the models compute in; use torch.float16, torch.bfloat16, "
                         "torch.float32 or torch.float64")


def move_pipeline(pipe, device):
    """Move a pipeline the CLIs loaded (on the CPU) to `device` (checked before loading); the
    seeds' generators stay on the CPU (diffusers' convention), so a seed draws the same numbers
    on either device. Returns the pipeline."""
    import torch

    if torch.device(device).type != "cpu":
        pipe.to(device)
    return pipe
