"""features: regenerated conversations -> the offline feature cache data/features/<scale>/."""
from __future__ import annotations

from pydantic import Field

from stages.common import Paths, Report, Section, TargetParams


class FeaturesParams(Section):
    max_len: int = Field(512, ge=8)        # tokens per conversation after truncation
    shard_size: int = Field(128, ge=1)     # conversations per safetensors shard
    batch_size: int = Field(4, ge=1)
    offline: bool = True                   # false: no cache; training runs the target online


def run(params: FeaturesParams, target: TargetParams, data, paths: Paths, report: Report) -> None:
    raise NotImplementedError("features is not built yet")
