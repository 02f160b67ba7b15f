"""train: one drafter variant trained with the K-step training-time-test unroll -> runs/<study>/<trial>/."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from stages.common import Paths, Report, Section

Variant = Literal["eagle3", "kv_only", "hybrid", "cross_only"]


class DrafterParams(Section):
    """Which drafter (DESIGN §5). Dimensions follow the target; the KV layers are target.kv_layers."""

    variant: Variant = "eagle3"
    depth: int = Field(1, ge=1, le=8)
    injection: Literal["linear", "head_concat"] = "linear"
    rope_fix: bool = False
    init: Literal["ckpt", "random"] = "ckpt"
    draft_vocab_size: int = Field(8192, ge=0)   # 0 = the full target vocabulary


class TrainParams(Section):
    scale: str = "small"                  # which data scale of data.scales to train on
    epochs: float = Field(1.0, gt=0)
    max_steps: int | None = Field(None, ge=1)
    batch_size: int = Field(1, ge=1)      # conversations per optimizer step
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_ratio: float = Field(0.05, ge=0, le=1)
    grad_clip: float = Field(0.5, gt=0)
    ttt_steps: int = Field(7, ge=1)       # K
    step_decay: float = Field(0.8, gt=0)  # loss weight 0.8^k
    precision: Literal["bf16", "fp32"] = "bf16"
    online: bool = False                  # run the target inside training instead of reading the cache
    checkpoint_every: int = Field(200, ge=1)
    log_every: int = Field(10, ge=1)
    seed: int = 0


def run(drafter: DrafterParams, params: TrainParams, run_dir, paths: Paths, report: Report) -> None:
    raise NotImplementedError("train is not built yet")
