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
from typing import Any

from pipeline.config import Config, load_config, validate_tree

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


def _get(tree: dict, key: str) -> Any:
    node = tree
    for part in key.split("."):
        node = node[part]
    return node


def _put(tree: dict, key: str, value: Any) -> None:
    *path, last = key.split(".")
    node = tree
    for part in path:
        node = node.setdefault(part, {})
    node[last] = value


def workspace_name(profile: str | None) -> str:
    """The fast dev run's profile (and workspace) name: the profile's name (a YAML path's file name) + suffix."""
    name = profile or "default"
    return (Path(name).stem if Path(name).suffix in (".yaml", ".yml") else name) + SUFFIX


def shrink(cfg: Config, name: str) -> Config:
    """`cfg` at the smoke profile's sizes (SIZE_KEYS; each scale and source cap from the smoke profile's, in size
    order; validation studies on at most VALIDATION_MAX conversations), named `name`: the same studies, parts
    and relations, so the same trials run."""
    tree = cfg.model_dump(mode="json")
    small = load_config(SIZES_FROM).model_dump(mode="json")
    for key in SIZE_KEYS:
        _put(tree, key, _get(small, key))
    # the scales keep their names (studies name them), ranked by size onto the smoke sizes (doubling past them)
    sizes = sorted(small["data"]["scales"].values())
    for rank, scale in enumerate(sorted(tree["data"]["scales"], key=tree["data"]["scales"].get)):
        tree["data"]["scales"][scale] = sizes[rank] if rank < len(sizes) else sizes[-1] * 2 ** (rank - len(sizes) + 1)
    cap = max(s["max_conversations"] or 0 for s in small["data"]["sources"].values())
    for source in tree["data"]["sources"].values():
        source["max_conversations"] = cap
    if tree["regenerate"].get("original_answers_from") is not None:   # keep both kinds of rows in training
        tree["regenerate"]["original_answers_from"] = min(tree["data"]["scales"].values())
    for study in tree["studies"].values():
        if study.get("validation"):
            study["validation"] = min(study["validation"], VALIDATION_MAX)
    tree["profile"] = name
    tree["report"]["title"] = f"{tree['report']['title']} (fast dev run: smoke sizes, the numbers mean nothing)"
    return validate_tree(tree, f"profile {name}")


__all__ = ["SIZE_KEYS", "SUFFIX", "shrink", "workspace_name"]
