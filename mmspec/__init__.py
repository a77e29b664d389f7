"""mmspec: speculative decoding for vision-language models and autoregressive image generators.

The core (this package) holds the modality-agnostic speculative loop, batched chain/tree
verification, KV-cache bookkeeping, the shared types and protocols, and statistics.
Acceptance rules live in `mmspec.acceptance`, drafters in `mmspec.drafters`, user-facing
pipelines in `mmspec.pipelines`. The core imports only torch, numpy and the standard library
at import time.
"""

from mmspec.engine import SpecOutput, speculative_generate
from mmspec.guided import GuidedTarget
from mmspec.protocols import AcceptanceRule, Drafter, Target
from mmspec.ragged import Attention, RaggedKV
from mmspec.sampling import SamplingConfig, process_logits
from mmspec.spec import ForwardSpec, SpecRunner
from mmspec.spec_target import SpecTarget
from mmspec.stats import SpecStats
from mmspec.types import (
    AcceptanceResult,
    CommitInfo,
    Draft,
    FeatureRequest,
    TargetOutput,
    TreeAcceptance,
    TreeConfig,
    Verdict,
)

__version__ = "0.1.0"

__all__ = [
    "AcceptanceResult",
    "AcceptanceRule",
    "Attention",
    "FeatureRequest",
    "ForwardSpec",
    "GuidedTarget",
    "RaggedKV",
    "SpecRunner",
    "SpecTarget",
    "Verdict",
    "CommitInfo",
    "Draft",
    "Drafter",
    "SamplingConfig",
    "SpecOutput",
    "SpecStats",
    "Target",
    "TargetOutput",
    "TreeAcceptance",
    "TreeConfig",
    "process_logits",
    "speculative_generate",
]
