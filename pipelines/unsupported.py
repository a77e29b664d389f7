"""diffusers' memory switches that mmspec's pipelines do not honour, refused by name.

`enable_model_cpu_offload` / `enable_sequential_cpu_offload` / `enable_group_offload` work
through accelerate hooks on each component's `forward`; the speculative loop calls the models'
pieces (a forward spec's `embed` / `backbone` / `head`, the VQ's `decode`), so the hooks never
fired and the models stayed where they were (on a GPU machine: on the CPU, silently), or, for
sequential offload, the run died on meta tensors. Attention slicing and xformers change nothing
here (the pipelines choose their own attention). Each is refused with what to do instead.
"""

from __future__ import annotations


class RefusesOffload:
    """Mixin for the pipelines: the diffusers switches above raise a ValueError naming them."""

    def _refuse(self, name: str, instead: str):
        raise ValueError(f"{type(self).__name__}.{name} is not supported: the speculative loop does not call the "
                         f"models' forward, which is where diffusers hooks in; {instead}")

    def enable_model_cpu_offload(self, *args, **kwargs):
        self._refuse("enable_model_cpu_offload", "move the pipeline with pipe.to(device)")

    def enable_sequential_cpu_offload(self, *args, **kwargs):
        self._refuse("enable_sequential_cpu_offload", "move the pipeline with pipe.to(device)")

    def enable_group_offload(self, *args, **kwargs):
        self._refuse("enable_group_offload", "move the pipeline with pipe.to(device)")

    def enable_attention_slicing(self, *args, **kwargs):
        self._refuse("enable_attention_slicing", "the pipelines choose their attention kernels themselves")

    def enable_xformers_memory_efficient_attention(self, *args, **kwargs):
        self._refuse("enable_xformers_memory_efficient_attention",
                     "the pipelines choose their attention kernels themselves")
