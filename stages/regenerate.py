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

import hashlib
import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Protocol

from pydantic import Field

from stages.common import (Paths, Report, Section, StageError, StageProgress, TargetParams, atomic_path,
                           read_jsonl)

EVAL = "eval"
RESERVE = "reserve"             # prepare's spare eval candidates (see stages.prepare)
OVER_LONG = "prompt over max_prompt_tokens"


class RegenerateParams(Section):
    backend: Literal["transformers", "openai"] = "transformers"
    servers: list[str] = []                # OpenAI-compatible base URLs (backend=openai)
    server_model: str | None = None        # model name sent to the server (default: target.source)
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    batch_size: int = Field(8, ge=1)
    window: int = Field(4, ge=1)           # batches per length-sorted window (the unit a restart recomputes)
    concurrency: int = Field(8, ge=1)      # in-flight requests per server (backend=openai)
    workers: int = Field(1, ge=1)          # Ray actors sharing the work (one per GPU at scale)
    max_prompt_tokens: int = Field(1024, ge=16)
    request_timeout_s: float = Field(600.0, gt=0)
    sampling_seed: int = 0
    original_answers_from: int | None = Field(None, ge=0)  # train rows ranked >= this keep the dataset's answers


@dataclass
class Answer:
    text: str | None             # None: no answer (see reason)
    tokens: int = 0              # generated tokens, eos included
    reason: str | None = None    # why there is no answer
    cut: bool = False            # stopped at max_new_tokens


class Backend(Protocol):
    def answer(self, histories: list[list[dict]]) -> list[Answer]: ...


# -- backends ------------------------------------------------------------------------------------------------------

class TransformersBackend:
    """The target in this process: length-sorted, left-padded batched `generate`."""

    def __init__(self, target, params: RegenerateParams):
        from transformers import GenerationConfig

        self.target, self.params = target, params
        tok = target.tokenizer
        if tok is None:
            raise StageError(f"target {target.name!r}: no tokenizer, cannot regenerate")
        eos = target.model.generation_config.eos_token_id
        eos = eos if eos is not None else tok.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos])
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else min(self.eos)
        sample = params.temperature > 0
        self.gen_config = GenerationConfig(
            max_new_tokens=params.max_new_tokens, do_sample=sample,
            temperature=params.temperature if sample else None, top_p=params.top_p if sample else None,
            top_k=None, pad_token_id=self.pad, eos_token_id=sorted(self.eos))

    def too_long(self, history: list[dict]) -> bool:
        return len(self.target.chat_ids(history, add_generation_prompt=True)) > self.params.max_prompt_tokens

    def answer(self, histories: list[list[dict]]) -> list[Answer]:
        import torch

        prompts = [self.target.chat_ids(h, add_generation_prompt=True) for h in histories]
        out: list[Answer | None] = [None] * len(prompts)
        ok = []
        for i, ids in enumerate(prompts):
            if len(ids) > self.params.max_prompt_tokens:
                out[i] = Answer(None, reason=OVER_LONG)
            else:
                ok.append(i)
        ok.sort(key=lambda i: (len(prompts[i]), i))
        bs = self.params.batch_size
        for b in range(0, len(ok), bs):
            idx = ok[b:b + bs]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.full((len(idx), width), self.pad, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for r, i in enumerate(idx):  # left padding: every prompt ends where generation starts
                ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
                mask[r, width - len(prompts[i]):] = 1
            dev = self.target.device
            with torch.no_grad():
                gen = self.target.model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                                                 generation_config=self.gen_config)
            for r, i in enumerate(idx):
                out[i] = self._decode(gen[r, width:].tolist())
        return out  # type: ignore[return-value]

    def _decode(self, new: list[int]) -> Answer:
        stop = next((k for k, t in enumerate(new) if t in self.eos), None)
        body = new if stop is None else new[:stop]
        text = self.target.tokenizer.decode(body, skip_special_tokens=True).strip()
        tokens = len(new) if stop is None else stop + 1
        if not text:
            return Answer(None, tokens, reason="empty answer")
        return Answer(text, tokens, cut=stop is None)


class OpenAIBackend:
    """An OpenAI-compatible chat-completions server (vLLM, SGLang, ...): concurrent requests over `servers`."""

    def __init__(self, params: RegenerateParams, model: str, tokenizer=None):
        if not params.servers:
            raise StageError("regenerate.backend=openai needs regenerate.servers=[URL, ...]")
        self.params, self.model, self.tokenizer = params, model, tokenizer
        self.urls = [s.rstrip("/") + "/chat/completions" for s in params.servers]
        self.pool = ThreadPoolExecutor(max_workers=params.concurrency * len(self.urls))

    def answer(self, histories: list[list[dict]]) -> list[Answer]:
        jobs = [self.pool.submit(self._one, h, self.urls[i % len(self.urls)]) for i, h in enumerate(histories)]
        return [j.result() for j in jobs]

    def too_long(self, history: list[dict]) -> bool:
        """Over `max_prompt_tokens` by the target's tokenizer; without one the server's own check decides (400)."""
        if self.tokenizer is None:
            return False
        return prompt_tokens(self.tokenizer, history) > self.params.max_prompt_tokens

    def _one(self, history: list[dict], url: str) -> Answer:
        if self.too_long(history):
            return Answer(None, reason=OVER_LONG)
        p = self.params
        body = {"model": self.model, "messages": history, "max_tokens": p.max_new_tokens,
                "temperature": p.temperature, "top_p": p.top_p, "seed": p.sampling_seed}
        data = json.dumps(body).encode()
        last = ""
        for attempt in range(4):
            req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=p.request_timeout_s) as resp:
                    reply = json.loads(resp.read())
                break
            except urllib.error.HTTPError as exc:
                if exc.code == 400:  # the server's own context-length check
                    return Answer(None, reason="prompt rejected by server (400)")
                last = f"HTTP {exc.code}"
            except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError) as exc:
                last = str(getattr(exc, "reason", exc))
            time.sleep(0.5 * 2 ** attempt)
        else:
            raise StageError(f"regenerate server {url}: no answer after 4 tries ({last})")
        try:
            choice = reply["choices"][0]
            text = (choice["message"].get("content") or "").strip()
        except (KeyError, IndexError, TypeError, AttributeError):
            raise StageError(f"regenerate server {url}: reply is not a chat completion: {str(reply)[:120]}") from None
        tokens = int((reply.get("usage") or {}).get("completion_tokens") or 0)
        if not text:
            return Answer(None, tokens, reason="empty answer")
        return Answer(text, tokens, cut=choice.get("finish_reason") == "length")


def prompt_tokens(tokenizer, history: list[dict]) -> int:
    """Tokens of the prompt that asks for the next answer after `history` (the target's chat template)."""
    ids = tokenizer.apply_chat_template(history, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return len(ids)


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


# -- partial files and resumption ----------------------------------------------------------------------------------

def partial_paths(final: Path) -> list[Path]:
    return sorted(final.parent.glob(f".{final.name}.partial*"))


def partial_path(final: Path, worker: int) -> Path:
    return final.parent / f".{final.name}.partial.w{worker}"


def read_partials(final: Path, fingerprint: dict) -> dict[str, dict]:
    """Conversations finished by earlier (killed) runs; partials of other settings are discarded."""
    done: dict[str, dict] = {}
    for p in partial_paths(final):
        lines = [line for line in p.read_text().split("\n") if line]   # not splitlines(): text may hold U+2028
        try:
            header = json.loads(lines[0]) if lines else {}
        except json.JSONDecodeError:
            header = {}
        if header.get("fingerprint") != fingerprint:
            p.unlink()
            continue
        for line in lines[1:]:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # the line a kill cut in half
                continue
            done[row["id"]] = row
    return done


class PartialWriter:
    """Append-only, fsynced record of finished conversations."""

    def __init__(self, path: Path, fingerprint: dict):
        path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not path.exists() or path.stat().st_size == 0
        self.f = path.open("a")
        if not fresh:  # a kill may have cut the last line: start ours on a new one
            self.f.write("\n")
        else:
            self.f.write(json.dumps({"fingerprint": fingerprint}) + "\n")
        self._sync()

    def __call__(self, row: dict) -> None:
        self.f.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._sync()

    def _sync(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self) -> None:
        self.f.close()


def finished_path(final: Path) -> Path:
    return final.parent / f".{final.name}.done.json"


def input_key(row: dict) -> str:
    """What a regenerated conversation was made from: its prepared messages."""
    return hashlib.sha256(json.dumps(row["messages"], sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def read_finished(final: Path, fingerprint: dict, rows: list[dict]) -> dict[str, dict]:
    """Conversations of an earlier finished run (same settings, same input) that `rows` asks for again."""
    record = finished_path(final)
    if not (record.is_file() and final.is_file()):
        return {}
    try:
        meta = json.loads(record.read_text())
    except json.JSONDecodeError:
        return {}                          # an unreadable record: nothing is reused, everything is regenerated
    if not isinstance(meta, dict) or meta.get("fingerprint") != fingerprint:
        return {}
    try:
        previous = read_jsonl(final) + list(meta.get("dropped", []))
    except StageError:
        return {}
    made_from = meta.get("inputs", {})
    wanted = {r["id"]: input_key(r) for r in rows}
    return {r["id"]: r for r in previous
            if isinstance(r, dict) and r.get("id") in wanted and made_from.get(r["id"]) == wanted[r["id"]]}


def write_finished(final: Path, fingerprint: dict, rows: list[dict], done: dict[str, dict]) -> None:
    record = {"fingerprint": fingerprint, "inputs": {r["id"]: input_key(r) for r in rows},
              "dropped": [done[r["id"]] for r in rows if "dropped" in done[r["id"]]]}
    with atomic_path(finished_path(final)) as tmp:
        tmp.write_text(json.dumps(record, ensure_ascii=False))


def fingerprint_of(params: RegenerateParams, target: TargetParams) -> dict:
    """Settings that change the answers: a partial file made under others is not resumed."""
    keep = ("backend", "server_model", "max_new_tokens", "temperature", "top_p", "batch_size", "window",
            "max_prompt_tokens", "sampling_seed", "original_answers_from")
    return {**{k: getattr(params, k) for k in keep}, "target": target.source, "dtype": target.dtype}


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


def opening(row: dict) -> list[dict]:
    """The history the first answer is asked for from: a leading system message and the first user turn."""
    msgs = row["messages"]
    first = next((m for m in msgs if m.get("role") == "user"), None)
    if first is None:
        raise StageError(f"prepared row {row['id']!r}: no user turn")
    return [dict(m) for m in msgs[:1] if m.get("role") == "system"] + [dict(first)]


@dataclass
class EvalChoice:
    rows: list[dict]             # the eval rows to regenerate now (split `eval`)
    spare: list[dict]            # further fitting candidates, in rank order, for eval rows that get no answer
    size: int                    # eval rows wanted: the number prepare put in the eval split
    counts: dict[str, int]


def choose_eval(candidates: list[dict], too_long: Callable[[list[dict]], bool]) -> EvalChoice:
    """The first `size` eval candidates (eval and reserve rows, by `scale_rank`) whose first prompt fits.

    `size` is the number of rows prepare put in the eval split (data.eval_size); the reserve only fills in."""
    size = sum(r.get("split") == EVAL for r in candidates)
    ranked = sorted(candidates, key=lambda r: (r.get("scale_rank", 0), r["id"]))
    fits = [not too_long(opening(r)) for r in ranked]
    fitting = [i for i, ok in enumerate(fits) if ok]
    used = fitting[:size]
    seen = used[-1] + 1 if len(used) == size and used else len(ranked)   # the candidates the choice looked at
    chosen = [dict(ranked[i], split=EVAL) for i in used]
    counts = {"eval_candidates": len(ranked), "eval_wanted": size, "eval_chosen": len(chosen),
              "eval_over_long": fits[:seen].count(False),
              "eval_from_reserve": sum(ranked[i].get("split") == RESERVE for i in used)}
    return EvalChoice(chosen, [dict(ranked[i], split=EVAL) for i in fitting[size:]], size, counts)


# -- progress ------------------------------------------------------------------------------------------------------

def _progress() -> StageProgress:
    """A bar on a terminal, a line every few seconds in a log (a regeneration can take hours)."""
    return StageProgress()


# -- the stage -----------------------------------------------------------------------------------------------------

def load_tokenizer(target: TargetParams, paths: Paths):
    """The target's tokenizer alone (the openai backend checks prompt lengths with it)."""
    from transformers import AutoTokenizer

    from models.target import EMBEDDED, EMBEDDED_GGUF, embedded_model_dir

    try:
        if target.source == EMBEDDED:
            cached = paths.model_cache / "smollm2-135m-instruct"
            if (cached / "tokenizer_config.json").is_file():
                return AutoTokenizer.from_pretrained(cached)
            return AutoTokenizer.from_pretrained(embedded_model_dir(), gguf_file=EMBEDDED_GGUF)
        return AutoTokenizer.from_pretrained(target.source)
    except (OSError, ValueError) as exc:
        raise StageError(f"target.source={target.source!r}: cannot load its tokenizer ({exc})") from None


def make_backend(params: RegenerateParams, target: TargetParams, paths: Paths, loaded_target=None) -> Backend:
    if params.backend == "openai":
        return OpenAIBackend(params, params.server_model or target.source, load_tokenizer(target, paths))
    if loaded_target is None:
        from stages.common import load_target_for

        loaded_target = load_target_for(target, paths)
    return TransformersBackend(loaded_target, params)


def keeps_dataset_answers(row: dict, params: RegenerateParams) -> bool:
    """A train row past the regeneration budget (`original_answers_from`) keeps the dataset's own answers."""
    limit = params.original_answers_from
    return limit is not None and row.get("split") == "train" and row.get("scale_rank", 0) >= limit


def regenerate_rows(rows: list[dict], final: Path, params: RegenerateParams, target: TargetParams, paths: Paths,
                    backend: Backend | None = None, label: str = "regenerate") -> dict[str, float]:
    """Regenerate `rows` into `final` (resuming from its partial files); returns counts for the report.

    Rows past the budget (`keeps_dataset_answers`) are written with their own answers, never generated."""
    import torch

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
            writer = PartialWriter(partial_path(final, 0), fp)

            live = [0]   # tokens of the conversations this run finished, counted as they finish (for the log)

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


def length_check(params: RegenerateParams, target: TargetParams, paths: Paths,
                 backend: Backend | None = None) -> Callable[[list[dict]], bool]:
    """Whether a history's next prompt is over `max_prompt_tokens`: the backend's own check where it has one (the
    same count it refuses by), else the target's tokenizer (Ray workers hold the backends)."""
    check = getattr(backend, "too_long", None)
    if check is not None:
        return check
    tokenizer = load_tokenizer(target, paths)
    return lambda history: prompt_tokens(tokenizer, history) > params.max_prompt_tokens


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
