from mmspec.pipelines.cspd import MARStats, sample_mar  # noqa: E402,F401  (MAR / CSpD)
from mmspec.pipelines.mar_pipeline import MARPipelineOutput, SpeculativeMARPipeline  # noqa: E402,F401
