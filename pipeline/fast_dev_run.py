"""`kvshot repro --fast-dev-run`: a profile's whole path at the smoke profile's sizes, before its long run.

A study profile runs for hours (the CPU study about 34 hours of native-bf16 CPU in 24 parts); a mistake in its
plan (a part that waits on a validation study, a `choose`, a parent in another part, the fold of parts into one
report) would show after hours. The fast dev run (as Lightning's `fast_dev_run`) keeps everything that decides
*what* runs (the studies with their grids, includes, parts, validation studies, `choose`, e2e marks; the tree
shapes, the Ray and tracking settings) and takes every size and precision from the smoke profile: its data sizes,
sequence lengths, draft vocabulary, training and evaluation lengths, end-to-end prompts and fp32 throughout. So
every trial of the real plan runs, under the same names and parents, in minutes; the numbers mean nothing.

It runs in a workspace of its own, `<profile>-fast-dev-run` (scratch/workspaces/), never in the real one, so its
tiny trials cannot be adopted by the real run (their configs, and so their fingerprints, differ anyway).
"""
from __future__ import annotations

from pathlib import Path

from pipeline.config import Config, flatten, load_config, with_values

SUFFIX = "-fast-dev-run"
SIZES_FROM = "smoke"    # the profile whose sizes a fast dev run takes
# The dotted keys whose value comes from the smoke profile: sizes, lengths and precision, nothing that decides
# which trials exist or how they relate (train.epochs stays: a trial's `train.parent` names its parent's epochs).
SIZE_KEYS = (
    "target.dtype", "data.eval_size",
    "regenerate.max_new_tokens", "regenerate.batch_size", "regenerate.max_prompt_tokens",
    "features.max_len", "features.shard_size", "features.batch_size",
    "drafter.draft_vocab_size",
    "train.precision", "train.checkpoint_every", "train.log_every",
    "eval.max_conversations", "eval.max_len",
    "e2e.dtype", "e2e.num_prompts", "e2e.max_new_tokens", "e2e.tree_candidates", "e2e.block_tree_candidates",
    "e2e.prompt_lookup", "e2e.lookup_tokens",
)
VALIDATION_MAX = 4      # conversations a validation study evaluates on (beyond the smallest scale)


def workspace_name(profile: str | None) -> str:
    """The fast dev run's profile (and workspace) name: the profile's name (a YAML path's file name) + suffix."""
    name = profile or "default"
    return (Path(name).stem if Path(name).suffix in (".yaml", ".yml") else name) + SUFFIX


def shrink(cfg: Config, name: str) -> Config:
    """`cfg` at the smoke profile's sizes (SIZE_KEYS; each scale and source cap from the smoke profile's, in size
    order; validation studies on at most VALIDATION_MAX conversations), named `name`: the same studies, parts
    and relations, so the same trials run."""
    smoke = load_config(SIZES_FROM)
    flat = flatten(smoke)
    values = {key: flat[key] for key in SIZE_KEYS}
    # the scales keep their names (studies name them), ranked by size onto the smoke sizes (doubling past them)
    sizes = sorted(smoke.data.scales.values())
    scales = {scale: sizes[rank] if rank < len(sizes) else sizes[-1] * 2 ** (rank - len(sizes) + 1)
              for rank, scale in enumerate(sorted(cfg.data.scales, key=cfg.data.scales.get))}
    values.update({f"data.scales.{scale}": size for scale, size in scales.items()})
    cap = max(s.max_conversations or 0 for s in smoke.data.sources.values())
    values.update({f"data.sources.{source}.max_conversations": cap for source in cfg.data.sources})
    if cfg.regenerate.original_answers_from is not None:     # keep both kinds of rows in training
        values["regenerate.original_answers_from"] = min(scales.values())
    values.update({f"studies.{study}.validation": min(s.validation, VALIDATION_MAX)
                   for study, s in cfg.studies.items() if s.validation})
    values["profile"] = name
    values["report.title"] = f"{cfg.report.title} (fast dev run: smoke sizes, the numbers mean nothing)"
    return with_values(cfg, values, origin=f"profile {name}")


__all__ = ["SIZE_KEYS", "SUFFIX", "shrink", "workspace_name"]
