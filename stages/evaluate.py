"""evaluate: step accuracy (acc_k, step MAT) and chain acceptance (α_k, chain MAT) of trained drafters.

Each trained drafter runs the same K-step teacher-forced unroll it was trained with (models.ttt), without
gradients, over the held-out conversations: the eval feature cache `data/features/eval/` by default, or any
conversation JSONL (DESIGN §10 schema) given as `eval.data=PATH`, tokenised with the target's chat template and
run through the target here. Scoring follows DESIGN §4: at position t and step k the drafter's top-1 (mapped to
a target id through d2t) must equal the target's top-1 for token t+2+k, over assistant tokens. Unlike the
training loss, a position whose target top-1 lies outside the draft vocabulary is scored as a miss (a drafter
cannot propose that token). A chain (α_k) also stops where the data token fed to the next step differs from the
target's greedy top-1, so it is the chain tree decoding would see; the row's `agreement` is how often they agree.

Each row keeps the counts of every conversation (`per_conversation`), which is what the report's bootstrap
intervals resample; `kvshot evaluate` prints acc_6 and α_6 with their standard errors.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from stages import checkpoint as ckpt
from stages.code_hash import code_hash
from stages.common import Paths, Report, StageError, TargetParams, fmt, load_target_for, write_json_atomic
from stages.sections import EvalParams  # noqa: F401 (re-exported: the stage's own section)

EVAL_SPLIT = "eval"


def _shift(x: torch.Tensor, s: int, fill) -> torch.Tensor:
    """x[:, s:] padded at the end with `fill` back to length T (position t reads t+s)."""
    return torch.cat([x[:, s:], torch.full_like(x[:, :s], fill)], 1)


@torch.no_grad()
def stepwise_masks(model, batch, lm_head_weight: torch.Tensor, steps: int,
                   strict: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """(correct, valid, agree [K, B, T], the unroll's output) of one batch.

    valid: token t+2+k exists, is an assistant token, not padding. correct: the drafter's top-1 at (t, k) is the
    target's top-1 for that token (False where valid is False: the drafter runs only where step k is scored).
    agree: that token in the data is the target's top-1 (what step k+1 is fed is what decoding would have
    accepted). strict=False also drops positions whose target top-1 is outside the draft vocabulary from `valid`,
    as the training loss does (the TTT's own counts then agree with these masks).

    The unroll runs without a loss (models.ttt, score=False), and the target's top-1 comes from the feature cache
    when the batch carries it; otherwise it is the argmax of the target's logits from its last hidden state.
    """
    from models.ttt import ttt_unroll

    top = getattr(batch, "top1", None)                              # target id predicted after position t
    if model.config.variant == "block":     # block position k+1 of every anchor plays step k (models.block)
        from models.block import block_unroll, sample_anchors

        # the blocks some scored token lies in: the others' predictions are never counted
        anchors = sample_anchors(batch.loss_mask, batch.attention_mask, None, span=model.config.block_size - 1)
        out = block_unroll(model, batch.input_ids, batch.loss_mask, attention_mask=batch.attention_mask,
                           features=batch.features if model.config.uses_features else None,
                           target_kv=batch.kv if model.config.reads_kv else None, anchors=anchors,
                           target_hidden=batch.last_hidden, lm_head_weight=lm_head_weight, return_logits=True,
                           target_top1=top, target_top1_logit=getattr(batch, "top1_logit", None))
        out.top1 = [z.argmax(-1) for z in out.logits[:steps]]
    else:
        out = ttt_unroll(model, batch.input_ids, batch.loss_mask, attention_mask=batch.attention_mask,
                         features=batch.features if model.config.uses_features else None,
                         target_kv=batch.kv if model.config.reads_kv else None, steps=steps, score=False)
    if top is None:
        top = F.linear(batch.last_hidden.to(lm_head_weight.dtype), lm_head_weight).argmax(-1)
    scored = batch.loss_mask.bool() & batch.attention_mask.bool()
    in_vocab = model.t2d[top]
    correct, valid, agree = [], [], []
    for k, drafted in enumerate(out.top1):
        want = _shift(top, 1 + k, -1)
        v = _shift(scored, 2 + k, False)
        if not strict:
            v = v & _shift(in_vocab, 1 + k, False)
        correct.append((drafted >= 0) & (model.d2t[drafted.clamp(min=0)] == want))
        valid.append(v)
        agree.append(_shift(batch.input_ids, 2 + k, -1) == want)
    return torch.stack(correct), torch.stack(valid), torch.stack(agree), out


def evaluate_drafter(model, source, lm_head_weight: torch.Tensor, steps: int, batch_size: int,
                     precision: str = "fp32", progress=None) -> list:
    """The step counts (models.metrics.StepCounts) of one drafter on each conversation of `source`, in order;
    their sum is the data set's."""
    from models.metrics import step_counts

    device = lm_head_weight.device
    per_conversation = []
    dtype = None if precision == "bf16" else torch.float32
    for start in range(0, len(source), batch_size):
        batch = source.batch(list(range(start, min(start + batch_size, len(source))))).to(dtype, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            correct, valid, agree, _ = stepwise_masks(model, batch, lm_head_weight, steps)
        per_conversation += [step_counts(correct[:, b], valid[:, b], agree[:, b]) for b in range(correct.shape[1])]
        if progress is not None:
            progress(batch.input_ids.shape[0])
    return per_conversation


def conversation_ids(source) -> list[str]:
    """The ids of the source's conversations in order (positions when the source has none)."""
    ids = getattr(getattr(source, "reader", None), "ids", None) or getattr(source, "ids", None)
    n = len(source)
    return [str(i) for i in ids[:n]] if ids is not None and len(ids) >= n else [str(i) for i in range(n)]


def pack_conversations(ids: list[str], counts: list) -> dict:
    """Per-conversation counts as compact columns: {"ids": [...], "valid": [[K ints] per conversation], ...}."""
    from models.metrics import FIELDS

    out = {"ids": list(ids)}
    for f in (*FIELDS, "agree"):
        out[f] = [list(getattr(c, f)) for c in counts]
    return out


# -- where the held-out conversations come from ------------------------------------------------------------------

def open_eval_source(params: EvalParams, paths: Paths, target, *, data: Any = None, features: Any = None):
    """The held-out conversations: `params.data` (a JSONL, run through the target here) or the eval cache."""
    from stages.feature_cache import OnlineFeatures
    from stages.train import ReaderSource, open_cache

    if params.data:
        path = Path(params.data)
        rows = read_conversations(path)[:params.max_conversations]
        if target.tokenizer is None:
            raise StageError(f"eval.data={path}: the target {target.name!r} has no tokenizer")
        reader = OnlineFeatures.from_conversations(rows, target, params.max_len)
        if len(reader) == 0:
            raise StageError(f"eval.data={path}: no conversation has an assistant token within {params.max_len} "
                             "tokens")
        return ReaderSource(reader)
    online = features is not None and not getattr(features, "offline", True)
    return open_cache(paths.features(EVAL_SPLIT), target, "eval", online=online, limit=params.max_conversations,
                      max_len=params.max_len)


def read_conversations(path: Path) -> list[dict]:
    """Rows of a conversation JSONL in the DESIGN §10 schema; a row without messages is a one-line error."""
    from stages.common import read_jsonl

    rows = read_jsonl(path)
    if not rows:
        raise StageError(f"eval.data={path}: no conversations in the file")
    for n, row in enumerate(rows, 1):
        msgs = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in msgs):
            raise StageError(f"eval.data={path}: row {n} has no 'messages' list of {{role, content}}")
        if not any(m["role"] == "assistant" for m in msgs):
            raise StageError(f"eval.data={path}: row {n} has no assistant turn to score")
    return rows


# -- the stage ---------------------------------------------------------------------------------------------------

SETTING_FIELDS = ("fc_norm", "norm_output", "no_target", "token_context")   # drafter options a row names (when on)
BLOCK_FIELDS = ("block_size", "context")                     # and a block drafter's own


def row_for(run_dir: Path, config: dict, counts, steps: int, positions: int,
            per_conversation: dict | None = None) -> dict:
    """One stepwise row (DESIGN §10) from a run's config.json and its summed counts (plus, when given, the
    per-conversation counts the report's intervals resample)."""
    from models.metrics import summary

    d = config.get("params", {}).get("drafter", {})
    t = config.get("params", {}).get("train", {})
    row = {"trial": Path(run_dir).name, "variant": config["drafter"]["variant"], "depth": config["drafter"]["depth"],
           "injection": d.get("injection", config["drafter"].get("injection")),
           "rope_fix": d.get("rope_fix", config["drafter"].get("rope_fix")), "init": d.get("init"),
           "scale": t.get("scale"), "seed": t.get("seed"), "steps": steps,
           **{k: bool(d.get(k)) for k in SETTING_FIELDS if d.get(k)},
           **({k: config["drafter"].get(k) for k in BLOCK_FIELDS} if config["drafter"]["variant"] == "block" else {}),
           **({"block_anchors": t.get("block_anchors")} if config["drafter"]["variant"] == "block" else {}),
           **summary(counts), "n_positions": positions, "counts": counts.to_dict(),
           **_training_cost(config.get("summary") or {}), "code": code_hash()}
    if per_conversation is not None:
        row["per_conversation"] = per_conversation
    return row


def _training_cost(summary: dict) -> dict:
    """What the drafter's training cost (from its run summary): optimizer steps, wall time per step, tokens."""
    steps, wall = summary.get("steps"), summary.get("wall_s")
    if not isinstance(steps, int) or not steps or not isinstance(wall, (int, float)):
        return {}
    return {"train_steps": steps, "train_s_per_step": round(wall / steps, 4), "train_tokens": summary.get("tokens")}


def standard_errors(per_conversation: list, k: int) -> tuple[float, float]:
    """Standard errors of acc_k and α_k over conversations (a bootstrap of the conversations' counts)."""
    from models.stats import bootstrap_counts, counts_array

    draws = bootstrap_counts(counts_array([per_conversation]), draws=400, seed=0)
    return float(draws.acc[:, k].std()), float(draws.alpha[:, k].std())


def run(params: EvalParams, run_dirs: list[Path], paths: Paths, report: Report, *, target: TargetParams,
        data: Any = None, features: Any = None, loaded_target: Any = None, source: Any = None,
        **_: Any) -> list[dict]:
    """Step-wise α_k / acc_k / MAT / retention of each trained drafter in `run_dirs`, one row each.

    Each drafter's α_k and acc_k curves go to `report({"alpha": α_k, "acc": acc_k}, step=k)`. Rows are returned,
    not written (the sweep runner writes metrics/stepwise/<study>.json, e.g. with `write_stepwise`).
    """
    from stages.common import StageProgress

    run_dirs = ckpt.trained_run_dirs(run_dirs, "evaluate: no run directories given")
    tgt = loaded_target if loaded_target is not None else load_target_for(target, paths)
    src = source if source is not None else open_eval_source(params, paths, tgt, data=data, features=features)
    lm_head = tgt.lm_head.weight.detach()
    rows = []
    with StageProgress() as bar:
        for run_dir in run_dirs:
            model, config = ckpt.load_drafter(run_dir, tgt)
            trained = config.get("params", {}).get("train", {})
            steps = model.config.steps if model.config.variant == "block" else int(trained.get("ttt_steps", 7))
            steps = min(params.steps, steps) if params.steps and model.config.variant == "block" else \
                params.steps or steps
            precision = params.precision or trained.get("precision", "fp32")
            task = bar.add_task(f"eval {run_dir.name}", total=len(src), unit="conv")
            per_conv = evaluate_drafter(model, src, lm_head, steps, params.batch_size, precision,
                                        progress=lambda n: bar.advance(task, n))
            counts = sum(per_conv[1:], per_conv[0])
            row = row_for(run_dir, config, counts, steps, positions=counts.valid[0],
                          per_conversation=pack_conversations(conversation_ids(src), per_conv))
            k = steps - 1
            se_acc, se_alpha = standard_errors(per_conv, k)
            row.update({f"acc_{k}_se": se_acc, f"alpha_{k}_se": se_alpha})
            bar.console.print(f"eval {run_dir.name}: acc_{k} {row['acc'][k]:.3f} ± {se_acc:.3f} (se), "
                              f"α_{k} {fmt(row['alpha'][k])} ± {fmt(se_alpha)} "
                              f"(se, {counts.chain[k]} chains), "
                              f"step MAT {row['step_mat']:.3f}, chain MAT {row['chain_mat']:.3f}, "
                              f"{len(per_conv)} conversations", highlight=False)
            for k, (a, c) in enumerate(zip(row["alpha"], row["acc"])):
                report({"alpha": a, "acc": c}, step=k)
            report({k: row[k] for k in ("step_mat", "step_retention", "chain_mat", "chain_retention", "mat",
                                        "retention", "agreement")}, step=None)
            rows.append(row)
    return rows


def write_stepwise(rows: list[dict], path: Path) -> None:
    """metrics/stepwise/<study>.json: the rows as a JSON list, written atomically (NaN written as null)."""
    import math

    def clean(v):
        if isinstance(v, float) and math.isnan(v):
            return None
        if isinstance(v, list):
            return [clean(x) for x in v]
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return v
    write_json_atomic(Path(path), [clean(r) for r in rows])
