"""regenerate: replace every assistant turn with the target's own answer -> data/regenerated/<source>.jsonl.

Turn by turn: answer j is generated from the target's chat template over the *regenerated* history (system, user_0,
answer_0, ..., user_j). Only the rows some scale or the eval split uses are regenerated (eval + the largest scale).

The eval split: prepare draws, per source, `eval_size` eval rows and a reserve of further candidates, all ranked by
`scale_rank`, without knowing the target's tokenizer. This stage evaluates the first `eval_size` candidates (eval or
reserve, in rank order) whose first prompt fits `max_prompt_tokens`; a candidate that still gets no answer (an empty
one, a server's refusal) is replaced by the next fitting one. The candidates left over are not regenerated. So the
later stages see `eval_size` eval rows per source whenever enough candidates fit (the counts are reported).

Over-long prompts: a turn whose prompt exceeds `max_prompt_tokens` ends the conversation there (the pairs answered so
far are kept); when that is the first turn the conversation is dropped. Both are counted. An empty answer does the same.

Budget: `original_answers_from: N` regenerates only the eval rows and the train rows with scale_rank < N; the rest
keep the dataset's own answers (EAGLE-1 trained on such fixed data), marked `"answers": "dataset"`. Generation is
the costly part of the data on a CPU; a forward pass over fixed text (the features stage) is ~20x cheaper.

Resumption: the work is cut into windows of `batch_size * window` conversations in a fixed order; inside a window,
prompts are sorted by length into left-padded batches. Finished (or dropped) conversations are appended to a partial
file as soon as they finish (flush + fsync). A restarted run skips every conversation already in the partial file
and recomputes only unfinished windows, whose batches are the same as before, so a killed and restarted greedy run
writes the same final file as an uninterrupted one. The final file is written atomically in the fixed order.

Reuse: beside the final file a small record (`.<name>.done.json`) keeps the settings it was made under and a hash
of each conversation's input. A later run under the same settings (more rows after a scale grows, say) reuses every
finished conversation whose input is unchanged, dropped ones included, and generates only the rest, in windows of
their own: the new rows are batched as a fresh run over them alone would batch them.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from stages.common import Paths, Report, StageError, StageProgress, TargetParams, atomic_path, read_jsonl
from stages.eval_choice import EVAL, RESERVE, choose_eval
from stages.regenerate_backends import Backend, RegenerateParams, length_check, make_backend
from stages.regenerate_resume import (PartialWriter, finished_path, fingerprint_of, partial_path, partial_paths,
                                      read_finished, read_partials, write_finished)


# -- the turn-by-turn loop -----------------------------------------------------------------------------------------

@dataclass
class Conversation:
    row: dict
    out: list[dict] = field(default_factory=list)
    next_pair: int = 0
    tokens: int = 0
    cut: int = 0
    reason: str | None = None
    finished: bool = False

    @property
    def users(self) -> list[dict]:
        return [m for m in self.row["messages"] if m["role"] == "user"]

    def result(self) -> dict:
        if not any(m["role"] == "assistant" for m in self.out):
            return {"id": self.row["id"], "dropped": self.reason or "no answer"}
        row = {k: v for k, v in self.row.items() if k != "messages"}
        return dict(row, messages=self.out, gen_tokens=self.tokens, gen_cut=self.cut,
                    **({"ended": self.reason} if self.reason else {}))


def regenerate_window(rows: list[dict], backend: Backend, sink: Callable[[dict], None]) -> tuple[int, int]:
    """Regenerate a window of conversations turn by turn; each is passed to `sink` as soon as it finishes.

    Returns (conversations, generated tokens)."""
    convs = []
    for row in rows:
        c = Conversation(row)
        c.out = [dict(m) for m in row["messages"][:1] if m["role"] == "system"]
        convs.append(c)
    total = 0
    turn = 0
    while True:
        active = [c for c in convs if not c.finished and turn < len(c.users)]
        for c in convs:
            if not c.finished and c not in active:
                c.finished = True
                sink(c.result())
        if not active:
            break
        answers = backend.answer([c.out + [dict(c.users[turn])] for c in active])
        for c, a in zip(active, answers):
            if a.text is None:
                c.reason, c.finished = a.reason, True
                sink(c.result())
                continue
            c.out += [dict(c.users[turn]), {"role": "assistant", "content": a.text}]
            c.tokens += a.tokens
            c.cut += int(a.cut)
            total += a.tokens
        turn += 1
    return len(convs), total


# -- the rows and their order --------------------------------------------------------------------------------------

def windows(rows: list[dict], size: int) -> list[list[dict]]:
    return [rows[i:i + size] for i in range(0, len(rows), size)]


def canonical_order(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: (r.get("split") != EVAL, r.get("scale_rank", 0), r["id"]))


def select_needed(rows: list[dict], largest_scale: int | None) -> list[dict]:
    """Eval candidates (eval and reserve) plus train rows under `largest_scale`; without a limit, the rows prepare
    marked `used`."""
    if largest_scale is None:
        return [r for r in rows if r.get("used", True)]
    return [r for r in rows if r.get("split") in (EVAL, RESERVE)
            or (r.get("split") == "train" and r.get("scale_rank", largest_scale) < largest_scale)]


# -- progress ------------------------------------------------------------------------------------------------------

def _progress() -> StageProgress:
    """A bar on a terminal, a line every few seconds in a log (a regeneration can take hours)."""
    return StageProgress()


# -- the stage -----------------------------------------------------------------------------------------------------

def keeps_dataset_answers(row: dict, params: RegenerateParams) -> bool:
    """A train row past the regeneration budget (`original_answers_from`) keeps the dataset's own answers."""
    limit = params.original_answers_from
    return limit is not None and row.get("split") == "train" and row.get("scale_rank", 0) >= limit


def regenerate_rows(rows: list[dict], final: Path, params: RegenerateParams, target: TargetParams, paths: Paths,
                    backend: Backend | None = None, label: str = "regenerate") -> dict[str, float]:
    """Regenerate `rows` into `final` (resuming from its partial files); returns counts for the report.

    Rows past the budget (`keeps_dataset_answers`) are written with their own answers, never generated."""
    fp = fingerprint_of(params, target)
    order = canonical_order(rows)
    kept_as_is = {r["id"]: dict(r, answers="dataset") for r in order if keeps_dataset_answers(r, params)}
    to_generate = [r for r in order if r["id"] not in kept_as_is]
    finished = read_finished(final, fp, to_generate)
    to_generate = [r for r in to_generate if r["id"] not in finished]
    done = {**finished, **read_partials(final, fp), **kept_as_is}
    size = params.batch_size * params.window
    todo = [(w, win) for w, win in enumerate(windows(to_generate, size)) if any(r["id"] not in done for r in win)]
    resumed = sum(r["id"] in done for r in to_generate) + len(finished)
    tokens = sum(d.get("gen_tokens", 0) for d in done.values())
    t0 = time.perf_counter()
    new_tokens = 0
    with _progress() as bar:
        task = bar.add_task(label, total=len(order), unit="conv", note="{tokens:,} tok, {tps:.0f} tok/s",
                            completed=resumed + len(kept_as_is), tokens=tokens, tps=0.0)
        if params.workers > 1 and todo:
            new_tokens = _run_ray(todo, final, params, target, paths, fp, bar, task, done)
        elif todo:
            backend = backend or make_backend(params, target, paths)
            new_tokens = _run_here(todo, final, params, fp, backend, bar, task, done, tokens, t0)
    done = {**finished, **read_partials(final, fp), **kept_as_is}
    missing = [r["id"] for r in order if r["id"] not in done]
    if missing:
        raise StageError(f"{final}: {len(missing)} conversations were not regenerated (first: {missing[0]})")
    kept = [done[r["id"]] for r in order if "dropped" not in done[r["id"]]]
    finished_path(final).unlink(missing_ok=True)      # never a record beside a final file it does not describe
    with atomic_path(final) as tmp:
        with tmp.open("w") as f:
            for row in kept:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    write_finished(final, fp, [r for r in order if r["id"] not in kept_as_is], done)
    for p in partial_paths(final):
        p.unlink()
    dt = time.perf_counter() - t0
    drops: dict[str, int] = {}
    for r in done.values():
        if "dropped" in r:
            drops[r["dropped"]] = drops.get(r["dropped"], 0) + 1
    return {"conversations": len(order), "kept": len(kept), "dropped": len(order) - len(kept),
            "eval_kept": sum(r.get("split") == EVAL for r in kept),
            "resumed": resumed, "ended_early": sum("ended" in r for r in kept),
            "answers_cut": sum(r.get("gen_cut", 0) for r in kept), "dataset_answers": len(kept_as_is),
            "tokens": sum(r.get("gen_tokens", 0) for r in kept), "new_tokens": new_tokens,
            "seconds": dt, "tokens_per_s": new_tokens / max(dt, 1e-9), **{f"dropped/{k}": v for k, v in drops.items()}}


def _run_here(todo, final: Path, params: RegenerateParams, fp: str, backend: Backend, bar, task, done: dict,
              tokens: int, t0: float) -> int:
    """The windows `todo` generated in this process, each row appended to the partial file as it finishes;
    returns the tokens generated."""
    import torch

    writer = PartialWriter(partial_path(final, 0), fp)
    live = [0]   # tokens of the conversations this run finished, counted as they finish (for the log)
    new_tokens = 0

    def sink(row: dict) -> None:
        if row["id"] not in done:  # a recomputed window: keep what the earlier run wrote
            writer(row)
            done[row["id"]] = row
            live[0] += row.get("gen_tokens", 0)
        count = bar.skip if "dropped" in row else bar.advance
        count(task, tokens=tokens + live[0], tps=live[0] / max(time.perf_counter() - t0, 1e-9))

    try:
        for w, win in todo:
            torch.manual_seed(params.sampling_seed + w)
            already = sum(r["id"] in done for r in win)
            bar.advance(task, -already)  # recounted by the sink
            _, n = regenerate_window(win, backend, sink)
            new_tokens += n
    finally:
        writer.close()
    return new_tokens


def _run_ray(todo, final, params, target, paths, fp, bar, task, done) -> int:
    """Windows dealt round-robin to `workers` Ray actors; each appends to its own partial file."""
    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True, log_to_driver=False)
    gpus = 1 if target.device.startswith("cuda") or target.device == "auto" and _has_cuda() else 0
    actor_cls = ray.remote(num_gpus=gpus, num_cpus=1)(RegenerateWorker)
    actors = [actor_cls.remote(params.model_dump(), target.model_dump(), str(paths.root), str(final), k, fp)
              for k in range(params.workers)]
    pending = {}
    for j, (w, win) in enumerate(todo):
        fresh = [r for r in win if r["id"] not in done]
        pending[actors[j % len(actors)].window.remote(w, win, [r["id"] for r in win if r["id"] in done])] = len(fresh)
    t0, new_tokens = time.perf_counter(), 0
    before = sum(d.get("gen_tokens", 0) for d in done.values())
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        n_tok = ray.get(ready[0])
        new_tokens += n_tok
        bar.advance(task, pending.pop(ready[0]), tokens=before + new_tokens,
                    tps=new_tokens / max(time.perf_counter() - t0, 1e-9))
    for a in actors:
        ray.kill(a)
    return new_tokens


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class RegenerateWorker:
    """One Ray actor: its own target (or server client) and its own partial file."""

    def __init__(self, params: dict, target: dict, root: str, final: str, worker: int, fp: dict):
        self.params, self.target = RegenerateParams(**params), TargetParams(**target)
        self.backend = make_backend(self.params, self.target, Paths(Path(root)))
        self.writer = PartialWriter(partial_path(Path(final), worker), fp)

    def window(self, w: int, rows: list[dict], skip: list[str]) -> int:
        import torch

        torch.manual_seed(self.params.sampling_seed + w)
        skip_set = set(skip)
        _, n = regenerate_window(rows, self.backend, lambda r: None if r["id"] in skip_set else self.writer(r))
        return n


def regenerate_source(rows: list[dict], final: Path, params: RegenerateParams, target: TargetParams, paths: Paths,
                      too_long: Callable[[list[dict]], bool], backend: Backend | None = None,
                      label: str = "regenerate") -> dict[str, float]:
    """One source's needed rows: the eval split chosen among prepare's candidates (`choose_eval`), refilled from the
    fitting spares while an eval row gets no answer, and the training rows."""
    held = (EVAL, RESERVE)
    others = [r for r in rows if r.get("split") not in held]
    choice = choose_eval([r for r in rows if r.get("split") in held], too_long)
    evals, spare = choice.rows, choice.spare
    new_tokens, seconds, resumed = 0, 0.0, None
    while True:   # a refill regenerates only the added rows: the finished ones are reused from the record
        stats = regenerate_rows(others + evals, final, params, target, paths, backend=backend, label=label)
        new_tokens, seconds = new_tokens + stats["new_tokens"], seconds + stats["seconds"]
        resumed = stats["resumed"] if resumed is None else resumed
        missing = choice.size - stats["eval_kept"]
        if missing <= 0 or not spare:
            break
        evals, spare = evals + spare[:missing], spare[missing:]
    return {**stats, "resumed": resumed, "new_tokens": new_tokens, "seconds": seconds,
            "tokens_per_s": new_tokens / max(seconds, 1e-9), **choice.counts,
            "eval_refilled": len(evals) - len(choice.rows)}


def run(params: RegenerateParams, target: TargetParams, sources: list[str], paths: Paths, report: Report,
        largest_scale: int | None = None, backend: Backend | None = None) -> None:
    """Regenerate every source's prepared rows that the eval split or some scale uses.

    `largest_scale` limits the training rows to `scale_rank < largest_scale`; by default the `used` flag prepare
    set on each row (eval candidates + the largest scale's rows) decides. `backend` replaces the configured one.
    """
    too_long = None
    metrics: dict[str, float] = {}
    from rich.console import Console

    console = Console(stderr=True)
    for source in sources:
        rows = read_jsonl(paths.prepared(source))
        if not rows:
            raise StageError(f"{paths.prepared(source)}: no conversations (run prepare first)")
        for n, r in enumerate(rows, 1):
            if not isinstance(r.get("messages"), list) or "id" not in r:
                raise StageError(f"{paths.prepared(source)}:{n}: not a prepared row (needs id and messages)")
        rows = select_needed(rows, largest_scale)
        if backend is None and params.workers == 1:
            backend = make_backend(params, target, paths)
        if too_long is None:
            too_long = length_check(params, target, paths, backend)
        stats = regenerate_source(rows, paths.regenerated(source), params, target, paths, too_long,
                                  backend=backend, label=f"regenerate {source}")
        console.print(f"regenerate {source}: {stats['kept']:,}/{stats['conversations']:,} conversations kept "
                      f"({stats['resumed']:,} resumed), {stats['new_tokens']:,} new tokens at "
                      f"{stats['tokens_per_s']:.0f} tok/s{_kept_as_is(stats)}; dropped {stats['dropped']:,}"
                      f"{_reasons(stats)}, ended early "
                      f"{stats['ended_early']:,}, answers cut at max_new_tokens {stats['answers_cut']:,}; "
                      f"{_eval_line(stats)}")
        if stats["eval_kept"] < stats["eval_wanted"]:
            console.print(f"[yellow]regenerate {source}: only {stats['eval_kept']:,} of {stats['eval_wanted']:,} "
                          f"eval conversations: too few of prepare's {stats['eval_candidates']:,} candidates fit "
                          f"max_prompt_tokens={params.max_prompt_tokens} (raise data.eval_reserve)[/yellow]")
        metrics.update({f"regenerate/{source}/{k}": float(v) for k, v in stats.items()})
    report(metrics)


def _eval_line(stats: dict) -> str:
    """'eval 400 of 600 candidates (71 over max_prompt_tokens, 71 from the reserve, 0 refilled)'."""
    return (f"eval {stats['eval_kept']:,} of {stats['eval_candidates']:,} candidates "
            f"({stats['eval_over_long']:,} over max_prompt_tokens, {stats['eval_from_reserve']:,} from the reserve, "
            f"{stats['eval_refilled']:,} refilled)")


def _kept_as_is(stats: dict) -> str:
    n = int(stats.get("dataset_answers", 0))
    return f", {n:,} keep the dataset's answers" if n else ""


def _reasons(stats: dict) -> str:
    """' (reason: n, ...)' for the dropped conversations, or ''."""
    parts = [f"{k.removeprefix('dropped/')}: {v:,}" for k, v in stats.items() if k.startswith("dropped/")]
    return f" ({', '.join(parts)})" if parts else ""
