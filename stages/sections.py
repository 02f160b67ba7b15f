"""The params sections of the train, evaluate and report stages: pydantic models only, no torch, no pandas.

They live here rather than beside their stage's loop so that `pipeline.config` composes the whole schema (and
`kvshot --help`, `kvshot keys` start) without importing torch or pandas; each stage re-exports its own sections
(`from stages.train import DrafterParams` keeps working). The data stages' sections are light already and stay in
their modules.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from stages.common import Section

Variant = Literal["eagle3", "kv_only", "hybrid", "cross_only", "block"]
# The variants built on an EAGLE-3 drafter: their `init=ckpt` loads the trained eagle3 drafter of the same data
# (DESIGN §5), and they take EAGLE-3.1's norms.
CKPT_CHILDREN: tuple[str, ...] = ("hybrid", "cross_only")
CONTINUED = "continued"     # eagle3 init: every tensor of the trained eagle3 parent, then a schedule of its own


class DrafterParams(Section):
    """Which drafter (DESIGN §5). Dimensions follow the target; the KV layers are target.kv_layers."""

    variant: Variant = "eagle3"
    depth: int = Field(1, ge=1, le=8)
    injection: Literal["linear", "head_concat"] = "linear"
    rope_fix: bool = False
    # hybrid / cross_only: `ckpt` loads the shared tensors of the trained eagle3 of the same data, `random` starts
    # fresh. eagle3: `continued` is the compute-matched control of a ckpt child: the same trained eagle3 continued
    # for the child's schedule (ckpt / random: a fresh eagle3)
    init: Literal["ckpt", "random", "continued"] = "ckpt"
    draft_vocab_size: int = Field(8192, ge=0)   # 0 = the full target vocabulary
    # EAGLE-3.1 (eagle3, hybrid, cross_only): an RMSNorm per fused feature before fc; the post-norm output hidden
    # fed to the next step. eagle3 with both on is "EAGLE-3.1".
    fc_norm: bool = False
    norm_output: bool = False
    # kv_only with the target prefix masked out of its keys: the paper's "no target information" control
    no_target: bool = False
    # with no_target: the control with context, a small causal language model of the drafter's own shape over the
    # prefix's token embeddings (its own keys of the prefix instead of none)
    token_context: bool = False
    # block (block-wise drafting, DFlash-style): B positions per pass (the root + B-1 predicted tokens) and what its
    # context keys are made of: the fused target features (hidden), the target's own KV (kv), or both
    block_size: int = Field(8, ge=2, le=64)
    context: Literal["hidden", "kv", "both"] = "hidden"

    def module_options(self) -> dict:
        """The options `DrafterConfig.from_target` takes (it refuses block options set on another variant)."""
        return dict(variant=self.variant, depth=self.depth, injection=self.injection, rope_fix=self.rope_fix,
                    draft_vocab_size=self.draft_vocab_size, fc_norm=self.fc_norm, norm_output=self.norm_output,
                    no_target=self.no_target, token_context=self.token_context, block_size=self.block_size,
                    context=self.context)


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
    # length bucketing: within windows of this many batches (of the epoch's seeded permutation) conversations are
    # sorted by length before being cut into batches, whose order is then shuffled: less padding per batch, but
    # other batches than the plain order (1, the default, keeps it). The unroll already skips most of padding's
    # cost, so on the default chats it gains little (benchmarks/train.py measures it)
    bucket_window: int = Field(1, ge=1)
    # LM head: random (EAGLE-3), or the target's rows of the draft vocabulary (trains slower early on: the target's
    # head expects the target's own hidden states, which a fresh drafter does not produce)
    head_init: Literal["random", "target"] = "random"
    # start from the weights of a trained run of the same variant and shape (a run directory; relative paths are
    # taken from the workspace root): more epochs, or other data, for a drafter already trained
    continue_from: str | None = None
    # block drafters: anchors (blocks) per conversation and step, drawn at random among the positions whose block
    # carries loss; 0 = every such position (the block counterpart of the TTT unroll scoring every position)
    block_anchors: int = Field(0, ge=0)
    # a ckpt child (or the continued eagle3): the train settings of the eagle3 it starts from where they differ from
    # its own, e.g. {scale: small, epochs: 1.5} starts children trained on the large scale from the small scale's
    # eagle3 (the paper's Table 4 starts both from an existing checkpoint); empty: the same as its own
    parent: dict[str, Any] = {}

    @field_validator("parent")
    @classmethod
    def _parent_keys_are_train_settings(cls, value: dict[str, Any]) -> dict[str, Any]:
        allowed = sorted(set(cls.model_fields) - {"parent", "continue_from"})
        for key in value:
            if key not in allowed:
                raise ValueError(f"{key!r} is not a train setting of the parent eagle3 "
                                 f"(one of {', '.join(allowed)})")
        # each value checked as that setting would be: a parent with epochs 0 fails here, not after its children
        TrainParams.model_validate(value)
        return value


class EvalParams(Section):
    data: str | None = None               # conversation JSONL; default: the held-out regenerated split
    max_conversations: int = Field(64, ge=1)
    max_len: int = Field(512, ge=8)
    batch_size: int = Field(2, ge=1)
    steps: int | None = Field(None, ge=1)                   # K; default: the K the drafter was trained with
    precision: Literal["bf16", "fp32"] | None = None        # default: the drafter's training precision


class ReportParams(Section):
    title: str = "KVShot reproduction"
    figure_width: float = 7.0
    figure_height: float = 4.5
    dpi: int = 110
    bootstrap_draws: int = Field(2000, ge=100)         # resamples behind every interval
    level: float = Field(0.95, gt=0.5, lt=1.0)         # interval coverage
    much_smaller_ratio: float = Field(0.5, gt=0)       # claim E: e2e relative gain < ratio x step-wise gain
    budget_min: float | None = Field(None, gt=0)      # the wall time a study part should take from a fresh workspace
    # the training length (optimizer steps) at which a verdict decides a claim: trials trained much less (the
    # default and smoke profiles) get verdicts that say they are a demonstration (None: every verdict decides)
    decisive_steps: int | None = Field(None, ge=1)
