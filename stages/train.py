"""train: one drafter variant trained with the K-step training-time-test unroll -> runs/<study>/<trial>/.

The loop (DESIGN §6): batches of target information (offline feature cache, or the target run online) go
through `models.ttt`'s K-step unroll; AdamW, linear warm-up then cosine decay, gradient clipping, bf16 autocast
when asked. Every `checkpoint_every` steps the model, optimizer, scheduler and RNG state are written atomically
(stages.checkpoint) and a restarted run continues from there; the data order is a pure function of (seed, step),
so a resumed run sees exactly the batches an uninterrupted one would and ends with the same weights on CPU.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from stages import checkpoint as ckpt
from stages.common import Paths, Report, StageError, StageProgress, TargetParams, load_target_for
from stages.sections import (CKPT_CHILDREN, CONTINUED, DrafterParams, TrainParams,  # noqa: F401 (re-exported:
                             Variant)                                                # the stage's own sections)


# -- pure helpers: schedule and data order -------------------------------------------------------------------------

def total_steps(params: TrainParams, num_conversations: int) -> int:
    """Optimizer steps of the run: `max_steps` when set, else ceil(epochs x batches per epoch)."""
    if params.max_steps is not None:
        return params.max_steps
    per_epoch = math.ceil(num_conversations / params.batch_size)
    return max(1, math.ceil(params.epochs * per_epoch))


def lr_factor(step: int, total: int, warmup_ratio: float) -> float:
    """Linear warm-up over the first warmup_ratio of the run, then cosine decay to zero (multiplies params.lr)."""
    warmup = int(round(warmup_ratio * total))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def batch_indices(step: int, num_conversations: int, batch_size: int, seed: int,
                  lengths: list[int] | torch.Tensor | None = None, window: int = 1) -> list[int]:
    """Conversation indices of optimizer step `step`: a fresh seeded permutation per epoch, no state carried.

    An epoch is ceil(n / batch_size) batches; its last batch is short rather than wrapping into the next epoch,
    so every conversation is seen exactly once per epoch. With `lengths` and window > 1 the batches are bucketed
    by length: the permutation is cut into windows of `window` batches, each window sorted by length (ties in
    permutation order) and cut into batches, and the epoch's full batches are shuffled (the short one stays last),
    all seeded by (seed, epoch), so the order is still a pure function of the step.
    """
    per_epoch = math.ceil(num_conversations / batch_size)
    epoch, pos = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(num_conversations, generator=g)
    if lengths is None or window <= 1 or per_epoch == 1:
        return perm[pos * batch_size:(pos + 1) * batch_size].tolist()
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    if lengths.numel() < num_conversations:
        raise ValueError(f"batch_indices: {lengths.numel()} lengths for {num_conversations} conversations")
    span = window * batch_size
    windows = math.ceil(num_conversations / span)
    keys = torch.full((windows * span,), torch.iinfo(torch.long).max, dtype=torch.long)   # the last window's tail
    keys[:num_conversations] = lengths[perm]                                           # sorts after everything
    within = torch.sort(keys.view(windows, span), dim=1, stable=True).indices
    order = perm[(within + torch.arange(windows)[:, None] * span).flatten()[:num_conversations]]
    full = num_conversations // batch_size
    b = pos if pos >= full else int(torch.randperm(full, generator=g)[pos])
    return order[b * batch_size:(b + 1) * batch_size].tolist()


def anchor_generator(seed: int, step: int) -> torch.Generator:
    """The random source of a block drafter's anchors at optimizer step `step`: a pure function of (seed, step),
    so a resumed run draws the anchors an uninterrupted one would."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step * 7 + 1)


# -- target information: where batches come from ----------------------------------------------------------------

@dataclass
class TargetBatch:
    """What one TTT step needs from the target, as plain tensors (right-padded)."""

    input_ids: torch.Tensor                        # [B, T] long
    loss_mask: torch.Tensor                        # [B, T] bool, assistant tokens
    attention_mask: torch.Tensor                   # [B, T] bool, real tokens
    features: torch.Tensor                         # [B, T, 3d] concat of the target features
    last_hidden: torch.Tensor                      # [B, T, d] final norm applied (target logits via lm_head)
    kv: list[tuple[torch.Tensor, torch.Tensor]]    # per kv layer (K, V) [B, Hkv, T, hd], post-RoPE
    top1: torch.Tensor | None = None               # [B, T] long: the target's top-1 over its whole vocabulary, and
    top1_logit: torch.Tensor | None = None         # [B, T] fp32 its logit (the feature cache's; None: computed here)

    @classmethod
    def from_features(cls, fb) -> "TargetBatch":
        """From the feature reader's batch (stages.feature_cache.FeatureBatch)."""
        return cls(fb.input_ids, fb.loss_mask.bool(), fb.attention_mask.bool(), fb.concat_features,
                   fb.last_hidden, list(fb.kv), getattr(fb, "top1", None), getattr(fb, "top1_logit", None))

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> "TargetBatch":
        """Float tensors cast to `dtype` (fp32 training reads a bf16 cache), all moved to `device`."""
        def f(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)
        def keep(t: torch.Tensor | None) -> torch.Tensor | None:     # the top-1 logit stays fp32
            return None if t is None else t.to(device=device)
        return TargetBatch(f(self.input_ids), f(self.loss_mask), f(self.attention_mask), f(self.features),
                           f(self.last_hidden), [(f(k), f(v)) for k, v in self.kv], keep(self.top1),
                           keep(self.top1_logit))

    def truncate(self, max_len: int) -> "TargetBatch":
        if self.input_ids.shape[1] <= max_len:
            return self
        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[:, :max_len]
        return TargetBatch(self.input_ids[:, :max_len], self.loss_mask[:, :max_len],
                           self.attention_mask[:, :max_len], self.features[:, :max_len],
                           self.last_hidden[:, :max_len], [(k[:, :, :max_len], v[:, :, :max_len]) for k, v in self.kv],
                           cut(self.top1), cut(self.top1_logit))


class TargetSource(Protocol):
    """A set of tokenised conversations with target information, addressable by index."""

    def __len__(self) -> int: ...
    def batch(self, indices: list[int]) -> TargetBatch: ...
    def token_counts(self, vocab_size: int) -> torch.Tensor: ...    # loss-masked token frequencies [V]
    # optional: `lengths() -> list[int]`, tokens per conversation (length-bucketed batches when given)


class ReaderSource:
    """A feature reader (offline cache or online target, stages.feature_cache) seen as a TargetSource.

    `limit` keeps the first conversations of the reader's order, `max_len` truncates each batch.
    """

    def __init__(self, reader, counts: torch.Tensor | None = None, limit: int | None = None,
                 max_len: int | None = None):
        self.reader, self.counts, self.max_len = reader, counts, max_len
        self.n = len(reader) if limit is None else min(limit, len(reader))

    def __len__(self) -> int:
        return self.n

    def batch(self, indices: list[int]) -> TargetBatch:
        b = TargetBatch.from_features(self.reader.batch(indices))
        return b.truncate(self.max_len) if self.max_len else b

    def lengths(self) -> list[int]:
        """Tokens per conversation after truncation to max_len."""
        lengths = self.reader.lengths()[:self.n]
        return [min(n, self.max_len) for n in lengths] if self.max_len else lengths

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        from models.vocab import count_tokens

        if self.counts is not None:
            return self.counts
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for i in range(self.n):
            ids, mask = self.reader.tokens(i)
            counts = count_tokens(ids, mask, vocab_size, counts)
        return counts


def online_source(target, conversations: list[tuple[list[int], list[bool]]], max_len: int | None = None,
                 ids: list[str] | None = None) -> ReaderSource:
    """Tokenised conversations (input ids, loss mask) run through `target` batch by batch."""
    from stages.feature_cache import OnlineFeatures

    if not conversations:
        raise StageError("online target source: no conversations")
    tokens = [(torch.tensor(i[:max_len], dtype=torch.long), torch.tensor(m[:max_len], dtype=torch.bool))
              for i, m in conversations]
    return ReaderSource(OnlineFeatures(target, tokens, ids or [str(n) for n in range(len(tokens))]))


def check_cache_target(index: dict, target, where: Path) -> None:
    """A cache extracted from another target (or other layers) would train on the wrong features."""
    info = index.get("target", {})
    want = {"hidden_size": target.hidden_size, "vocab_size": target.vocab_size, "num_layers": target.num_layers,
            "feature_layers": target.feature_layers, "kv_layers": target.kv_layers}
    bad = {k: (info[k], v) for k, v in want.items() if k in info and info[k] != v}
    if bad:
        k, (got, exp) = next(iter(bad.items()))
        raise StageError(f"{where}: feature cache was extracted with {k}={got}, the target has {exp} "
                         "(re-run `kvshot features`)")


def open_cache(directory: Path, target, what: str, online: bool = False, limit: int | None = None,
               max_len: int | None = None) -> ReaderSource:
    """The feature cache in `directory` as a source; online (or a tokens-only cache) runs the target here."""
    from stages.feature_cache import open_features, read_index, token_frequencies

    if not (Path(directory) / "index.json").is_file():
        raise StageError(f"{what}: no feature cache at {directory} (run `kvshot features` first)")
    index = read_index(directory)
    check_cache_target(index, target, directory)
    online = online or not index.get("offline", True)
    reader = open_features(directory, target=target if online else None)
    if len(reader) == 0:
        raise StageError(f"{what}: the feature cache at {directory} holds no conversations")
    counts = token_frequencies(directory, target.vocab_size) if limit is None else None
    return ReaderSource(reader, counts, limit=limit, max_len=max_len)


def open_source(params: TrainParams, paths: Paths, target, *, data: Any = None, features: Any = None) -> TargetSource:
    """Batches for scale `params.scale`: the offline feature cache, or the target run online on its tokens."""
    if data is not None and params.scale not in data.scales:
        raise StageError(f"train.scale={params.scale!r}: not a data scale; choices: {', '.join(data.scales)}")
    online = params.online or (features is not None and not getattr(features, "offline", True))
    return open_cache(paths.features(params.scale), target, f"train.scale={params.scale!r}", online=online)


# -- the drafter -------------------------------------------------------------------------------------------------

def needs_parent(drafter: DrafterParams) -> bool:
    """Does this drafter start from a trained eagle3 run (init=ckpt child, or the continued eagle3 control)?"""
    if drafter.init == CONTINUED and drafter.variant != "eagle3":
        raise StageError(f"drafter.init={CONTINUED!r} continues a trained eagle3; variant {drafter.variant!r} takes "
                         "init=ckpt or init=random")
    return (drafter.variant in CKPT_CHILDREN and drafter.init == "ckpt") or \
        (drafter.variant == "eagle3" and drafter.init == CONTINUED)


def build_drafter(target, drafter: DrafterParams, counts: torch.Tensor, head_init: str = "random"):
    """A fresh drafter sized from the target, with the draft vocabulary chosen from `counts`."""
    from models.build import build_drafter as build_module
    from models.drafter_config import DrafterConfig
    from models.vocab import build_draft_vocab

    try:
        cfg = DrafterConfig.from_target(target, **drafter.module_options())
    except ValueError as exc:
        raise StageError(str(exc)) from None
    model = build_module(cfg)
    d2t, _ = build_draft_vocab(counts, cfg.draft_vocab_size)
    model.set_vocab(d2t)
    head = target.lm_head.weight.detach().float().cpu() if head_init == "target" else None
    model.load_target_weights(target.embed_tokens.weight.detach().float().cpu(), head)
    return model


def copy_run_weights(model, run: Path, variant: str, what: str, missing: str) -> tuple[list[str], list[str]]:
    """Copy the tensors the trained `variant` run in `run` shares with `model` (same names, shapes checked);
    returns (loaded, new) names. Every problem is a one-line StageError starting with `what`."""
    from models.drafter import init_from_eagle3
    from stages.export import exported_config

    exported = exported_config(run)
    if exported is not None:      # an engine's layout: no optimizer-side names or kvshot config to continue from
        fmt, raw = exported
        source = (raw.get("kvshot") or {}).get("run") or "the run it was exported from"
        raise StageError(f"{what}: {run} is an export ({fmt} format), not a training run; start from {source} "
                         f"instead")
    if not ckpt.is_trained(run):
        raise StageError(f"{what}: {missing}")
    config, weights = ckpt.load_run(run)
    found = config.get("drafter", {}).get("variant")
    if found != variant:
        raise StageError(f"{what}: {run} holds a {found!r} drafter, expected {variant!r}")
    try:
        loaded, new = init_from_eagle3(model, weights)
    except ValueError as exc:
        raise StageError(f"{what}: {run}: {exc}") from None
    return loaded, [k for k in new if k not in ckpt.FROZEN]   # frozen tensors (the target's embedding) are not saved


def init_from_parent(model, init_from: Path | None, drafter: DrafterParams) -> dict:
    """init=ckpt: copy the shared tensors of the trained eagle3 run in `init_from` (DESIGN §5); an eagle3 with
    init=continued copies every tensor of it (the compute-matched control)."""
    what = f"drafter.init={drafter.init} for variant {drafter.variant!r}"
    if init_from is None:
        raise StageError(f"{what}: needs the trained eagle3 run directory (init_from), none given")
    if drafter.init == CONTINUED:
        if not ckpt.is_trained(init_from):
            raise StageError(f"{what}: no trained eagle3 drafter in {init_from} (train the eagle3 trial first)")
        return {"init_from": str(init_from), "continued_from": str(init_from),
                **continue_training(model, Path(init_from), drafter)}
    loaded, new = copy_run_weights(model, init_from, "eagle3", what,
                                   f"no trained eagle3 drafter in {init_from} (train the eagle3 trial first)")
    return {"init_from": str(init_from), "loaded": len(loaded), "new": new}


def continue_training(model, run: Path, drafter: DrafterParams) -> dict:
    """train.continue_from: copy every tensor (draft vocabulary included) of a trained run of the same drafter."""
    what = f"train.continue_from={run}"
    loaded, new = copy_run_weights(model, run, drafter.variant, what, "no trained drafter there")
    if new:
        raise StageError(f"{what}: the drafter there lacks {new[0]} (another depth or injection?)")
    return {"loaded": len(loaded)}


# -- the run -----------------------------------------------------------------------------------------------------

def resolved_config(model, drafter: DrafterParams, params: TrainParams, target: TargetParams,
                    num_conversations: int, steps: int) -> dict:
    """The run's identity: what config.json records and what a resumed run must agree with."""
    return {"drafter": model.config.to_dict(), "draft_vocab_size": model.config.draft_vocab_size,
            "params": {"drafter": drafter.model_dump(), "train": params.model_dump(),
                       # where and on how many threads the target runs does not change what is trained
                       "target": target.model_dump(exclude={"device", "threads"})},
            "data": {"scale": params.scale, "conversations": num_conversations, "steps": steps}}


def _autocast(params: TrainParams, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=params.precision == "bf16")


def _progress() -> StageProgress:
    """A bar on a terminal; in a log (DVC, a Ray worker, nohup) a line every few seconds."""
    return StageProgress()


def run(drafter: DrafterParams, params: TrainParams, run_dir: Path, paths: Paths, report: Report, *,
        target: TargetParams, data: Any = None, features: Any = None, init_from: Path | None = None,
        source: TargetSource | None = None, loaded_target: Any = None, stop_after: int | None = None) -> dict:
    """Train one drafter into `run_dir` (config.json, model.safetensors); resume from its last checkpoint.

    `source` / `loaded_target` inject ready objects (tests, callers holding a target); by default the target is
    loaded from `target` and batches come from the feature cache of `params.scale` (or the target online).
    `stop_after` ends the run after that many optimizer steps with a checkpoint, as a kill would, leaving the
    schedule of the full run unchanged.
    """
    run_dir = Path(run_dir)
    torch.manual_seed(params.seed)
    tgt = loaded_target if loaded_target is not None else load_target_for(target, paths)
    src = source if source is not None else open_source(params, paths, tgt, data=data, features=features)
    n_conv = len(src)
    steps = total_steps(params, n_conv)

    torch.manual_seed(params.seed)
    model = build_drafter(tgt, drafter, src.token_counts(tgt.vocab_size), params.head_init)
    init_info = starting_weights(model, drafter, params, init_from, paths)
    config = resolved_config(model, drafter, params, target, n_conv, steps)
    if ckpt.is_trained(run_dir):
        done, _ = ckpt.load_run(run_dir)
        if {k: done.get(k) for k in config} == config and "summary" in done:
            return done["summary"]

    model.to(tgt.device)
    loop = Loop(model, params, steps, config, run_dir)
    loop.resume()
    end = steps if stop_after is None else min(steps, stop_after)
    loss_value = loop.train(src, tgt, end, report)

    wall = loop.wall_s()
    summary = {"steps": end, "total_steps": steps, "tokens": loop.tokens, "wall_s": round(wall, 3),
               "tokens_per_s": round(loop.tokens / wall, 1) if wall > 0 else None, "final_loss": loss_value,
               "conversations": n_conv, **init_info}
    if end < steps:     # stopped early on purpose: leave a checkpoint to resume from, no final model
        loop.save_state(end)
        return {**summary, "finished": False}
    model.eval()
    ckpt.save_run(run_dir, {**config, "summary": {**summary, "finished": True}}, ckpt.trainable_weights(model))
    ckpt.remove_checkpoints(run_dir)
    return {**summary, "finished": True}


def starting_weights(model, drafter: DrafterParams, params: TrainParams, init_from: Path | None,
                     paths: Paths) -> dict:
    """Load what the drafter starts from (its parent eagle3 for init=ckpt, a trained run for `continue_from`);
    returns what was loaded, for the run's summary (empty for a drafter trained from scratch)."""
    init_info = init_from_parent(model, init_from, drafter) if needs_parent(drafter) else {}
    if init_info and Path(init_from).resolve().is_relative_to(Path(paths.root).resolve()):
        init_info["init_from"] = str(Path(init_from).resolve().relative_to(Path(paths.root).resolve()))
    if params.continue_from:
        if init_info:
            raise StageError(f"train.continue_from and drafter.init=ckpt both set the starting weights of the "
                             f"{drafter.variant} drafter; use one (drafter.init=random with continue_from)")
        init_info = {"continued_from": params.continue_from,
                     **continue_training(model, Path(paths.root) / params.continue_from, drafter)}
    return init_info


class Loop:
    """The optimizer loop of one run: AdamW with warm-up and cosine decay, resumable from the run's checkpoint,
    counting the tokens and the wall time it has trained (those before a resume included)."""

    def __init__(self, model, params: TrainParams, steps: int, config: dict, run_dir: Path):
        self.model, self.params, self.steps, self.config, self.run_dir = model, params, steps, config, run_dir
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.trainable, lr=params.lr, weight_decay=params.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, steps, params.warmup_ratio))
        self.start, self.tokens, self.wall_before = 0, 0, 0.0
        self.t_start = time.perf_counter()

    def resume(self) -> None:
        """Continue from the run's latest checkpoint when it was written for this configuration."""
        latest = ckpt.latest_checkpoint(self.run_dir)
        if latest is None:
            return
        state = ckpt.load_checkpoint(latest)
        if state.extra.get("config") != self.config:   # a checkpoint of another configuration is not this run's past
            ckpt.remove_checkpoints(self.run_dir)
            return
        ckpt.load_weights(self.model, state.model)
        self.opt.load_state_dict(state.optimizer)
        self.sched.load_state_dict(state.scheduler)
        ckpt.set_rng_state(state.rng)
        self.start = state.step
        self.tokens, self.wall_before = state.extra.get("tokens", 0), state.extra.get("wall_s", 0.0)

    def wall_s(self) -> float:
        return self.wall_before + time.perf_counter() - self.t_start

    def save_state(self, step: int) -> None:
        ckpt.save_checkpoint(self.run_dir, ckpt.TrainState(
            step=step, model=ckpt.trainable_weights(self.model), optimizer=self.opt.state_dict(),
            scheduler=self.sched.state_dict(), rng=ckpt.rng_state(),
            extra={"config": self.config, "tokens": self.tokens, "wall_s": self.wall_s()}))

    def train(self, src: TargetSource, tgt, end: int, report: Report) -> float:
        """Optimizer steps `start` .. `end` over `src`'s batches, with a checkpoint every `checkpoint_every` steps
        and metrics every `log_every`; returns the last step's loss."""
        params, model, run_dir, n_conv = self.params, self.model, self.run_dir, len(src)
        device, lm_head = tgt.device, tgt.lm_head.weight.detach()
        data_dtype = None if params.precision == "bf16" else torch.float32
        self.t_start = time.perf_counter()
        window, win_tokens, win_t0 = None, 0, time.perf_counter()
        loss_value = float("nan")
        model.train()
        lengths = torch.tensor(src.lengths()) if params.bucket_window > 1 and hasattr(src, "lengths") else None
        with _progress() as bar:
            # named by study/trial: concurrent trials of a sweep print to the same log
            task = bar.add_task(f"train {run_dir.parent.name}/{run_dir.name}", total=self.steps, unit="steps",
                                note="loss {loss:.3f}, α0 {alpha0:.3f}, {tps:.0f} tok/s", completed=self.start,
                                tps=0.0, loss=float("nan"), alpha0=float("nan"))
            for step in range(self.start, end):
                idx = batch_indices(step, n_conv, params.batch_size, params.seed, lengths, params.bucket_window)
                batch = src.batch(idx).to(data_dtype, device)
                with _autocast(params, device):
                    out = ttt_step(model, batch, lm_head, params, anchor_generator(params.seed, step))
                self.opt.zero_grad(set_to_none=True)
                out.loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, params.grad_clip)
                lr = self.opt.param_groups[0]["lr"]
                self.opt.step()
                self.sched.step()

                loss_value = float(out.loss.detach())
                self.tokens += batch.tokens
                win_tokens += batch.tokens
                window = out.counts if window is None else window + out.counts
                done = step + 1
                if done % params.log_every == 0 or done == end:
                    dt = max(time.perf_counter() - win_t0, 1e-9)
                    metrics = step_metrics(out, window, loss_value, lr, float(grad_norm), win_tokens / dt)
                    report(metrics, done)
                    bar.update(task, tps=win_tokens / dt, alpha0=metrics["alpha_0"])
                    window, win_tokens, win_t0 = None, 0, time.perf_counter()
                bar.update(task, completed=done, loss=loss_value)
                if done % params.checkpoint_every == 0 and done < end:
                    self.save_state(done)
        return loss_value


def ttt_step(model, batch: TargetBatch, lm_head_weight: torch.Tensor, params: TrainParams,
             generator: torch.Generator | None = None):
    """One K-step unroll over a batch (models.ttt), target logits from the last hidden state (the draft
    vocabulary's rows only when the batch carries the target's top-1); a block drafter runs its blocks at the
    anchors of this step instead (models.block)."""
    from models.ttt import ttt_unroll

    if model.config.variant == "block":
        from models.block import block_unroll, sample_anchors

        # the blocks the loss reaches (all of them, or block_anchors of them at random): no other block is computed
        anchors = sample_anchors(batch.loss_mask, batch.attention_mask, params.block_anchors or None, generator,
                                 span=model.config.block_size - 1)
        return block_unroll(model, batch.input_ids, batch.loss_mask, attention_mask=batch.attention_mask,
                            features=batch.features if model.config.uses_features else None,
                            target_kv=batch.kv if model.config.reads_kv else None,
                            target_hidden=batch.last_hidden, lm_head_weight=lm_head_weight, anchors=anchors,
                            target_top1=batch.top1, target_top1_logit=batch.top1_logit, decay=params.step_decay)
    return ttt_unroll(model, batch.input_ids, batch.loss_mask, attention_mask=batch.attention_mask,
                      features=batch.features if model.config.uses_features else None,
                      target_kv=batch.kv if model.config.reads_kv else None,
                      target_hidden=batch.last_hidden, lm_head_weight=lm_head_weight,
                      target_top1=batch.top1, target_top1_logit=batch.top1_logit,
                      steps=params.ttt_steps, decay=params.step_decay)


def step_metrics(out, window, loss: float, lr: float, grad_norm: float, tokens_per_s: float) -> dict[str, float]:
    """Flat metrics of a log step: total and per-step loss, acc_k/α_k over the log window, lr, gate means."""
    m = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s}
    for k, v in enumerate(out.losses):
        m[f"loss_{k}"] = v
    for k, (a, c) in enumerate(zip(window.alpha, window.acc)):
        m[f"alpha_{k}"] = a
        m[f"acc_{k}"] = c
    for layer, g in out.gate_means.items():
        m[f"gate_{layer}"] = g
    return m

