"""prepare: raw conversations (ShareGPT, UltraChat) -> data/prepared/<source>.jsonl.

Cleaning rules, applied in this order to every conversation (each counted in the summary table):
  1. roles normalised: human/user -> user; gpt/chatgpt/bing/bard/assistant/model -> assistant; system stays;
     any other role drops the conversation;
  2. empty turns (blank or non-text) are removed;
  3. one system message is kept if it comes before the first user turn; later system turns are removed;
  4. leading assistant turns are cut;
  5. consecutive turns of the same role are merged (texts joined by a blank line), so roles alternate;
  6. at most `max_user_turns` user->assistant pairs are kept; a trailing user turn without a reply is cut;
  7. a conversation with no user->assistant pair left is dropped;
  8. exact duplicates (same messages) are dropped; a repeated id on different content gets a `#n` suffix.

Held-out split: each source's clean conversations are shuffled with `split_seed` (and capped at
`max_conversations`), then walked in that order to draw `eval_size` eval conversations plus a reserve of
`ceil(eval_size * eval_reserve)`. A conversation is skipped by the draw (it stays a training row; both counts are in
the summary table) when its first user prompt, normalised by `prompt_key`,
  * is context-free (`CONTEXT_FREE`: "continue", "go on", ... answer nothing without the turns before them), or
  * is the first prompt of any other conversation of any source: that one would be trained on (or skipped as well),
    so an eval prompt is never a training prompt, and the test of held-out data is not a test of memory.
The other segments of the drawn conversations (ShareGPT splits long ones into `<id>_0`, `<id>_1`, ...) are dropped,
never trained on. The drawn candidates of all sources are shuffled together and numbered (`scale_rank`); in each
source the first `eval_size` form the `eval` split and the rest the `reserve` split. prepare does not know the
target's tokenizer: regenerate evaluates, per source, the first `eval_size` candidates (in `scale_rank` order) whose
first prompt fits `regenerate.max_prompt_tokens`, so a long eval prompt is replaced by a reserve one rather than lost.

Scales: the training rows of all sources are shuffled together and numbered: `scale_rank` is a row's position in
that order. Scale `s` is every train row with `scale_rank < scales[s]`, so scales are nested by construction;
`used` marks the rows some scale or the eval split needs (eval, reserve and the largest scale's rows; the rest are
kept for larger scales later). A scale larger than the training rows available is an error (a "large" scale that
silently equals "small" would mislabel every result trained on it).
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import re
import unicodedata
from collections import Counter, defaultdict
from typing import Iterable, Literal

from pydantic import Field, field_validator

from stages.common import Paths, Report, Section, StageError, atomic_path
from stages.sources import LoadStats, iter_records, raw_turns, record_id

EVAL = "eval"
RESERVE = "reserve"   # drawn eval candidates regenerate promotes when an eval prompt is over its token limit
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "model": "assistant", "system": "system"}


class SourceParams(Section):
    """One conversation source: the packaged ShareGPT file, an HF `datasets` id, or a local JSON/JSONL path."""

    kind: Literal["embedded", "hub", "local"] = "embedded"
    format: Literal["sharegpt", "ultrachat"] = "sharegpt"
    path: str | None = None          # hub id (kind=hub) or file path (kind=local)
    split: str = "train"             # hub split
    max_conversations: int | None = Field(None, ge=1)   # cap after cleaning (None = all)


class DataParams(Section):
    sources: dict[str, SourceParams] = {"sharegpt": SourceParams()}
    eval_size: int = Field(64, ge=1)                 # held-out conversations per source
    eval_reserve: float = Field(0.5, ge=0.0)         # extra eval candidates per source, a fraction of eval_size
    scales: dict[str, int] = {"small": 400, "large": 1600}   # training conversations per scale (nested subsets)
    max_user_turns: int = Field(2, ge=1)             # user->assistant pairs kept per conversation
    split_seed: int = 0

    @field_validator("scales")
    @classmethod
    def _check_scales(cls, v: dict[str, int]) -> dict[str, int]:
        if not v:
            raise ValueError("at least one scale is needed")
        if EVAL in v:
            raise ValueError(f"{EVAL!r} names the held-out split and cannot be a scale")
        bad = {k: n for k, n in v.items() if n < 1}
        if bad:
            raise ValueError(f"scale sizes must be >= 1, got {bad}")
        return v

    @property
    def largest_scale(self) -> int:
        return max(self.scales.values())

    @property
    def eval_candidates(self) -> int:
        """Eval conversations drawn per source: the eval split and its reserve."""
        return self.eval_size + math.ceil(self.eval_size * self.eval_reserve)


# -- selection helpers the later stages share ----------------------------------------------------------------------

def in_scale(row: dict, limit: int) -> bool:
    return row.get("split") == "train" and row.get("scale_rank", limit) < limit


def select_rows(rows: Iterable[dict], data: DataParams, which: str) -> list[dict]:
    """The rows of scale `which` (or of the `eval` split), ordered by `scale_rank`."""
    if which == EVAL:
        out = [r for r in rows if r.get("split") == EVAL]
    elif which in data.scales:
        out = [r for r in rows if in_scale(r, data.scales[which])]
    else:
        raise StageError(f"unknown scale {which!r}; choices: {', '.join([*data.scales, EVAL])}")
    return sorted(out, key=lambda r: r["scale_rank"])


def needed_rows(rows: Iterable[dict], data: DataParams) -> list[dict]:
    """Rows some scale or the eval split uses: eval, its reserve and the largest scale's (later stages ignore the
    rest)."""
    top = data.largest_scale
    return [r for r in rows if r.get("split") in (EVAL, RESERVE) or in_scale(r, top)]


# -- cleaning ------------------------------------------------------------------------------------------------------

def normalize(turns: list[tuple[str, object]], max_user_turns: int, edits: Counter) -> list[dict] | str:
    """Clean one conversation's (role, text) turns; returns messages, or the reason it is dropped."""
    if not turns:
        return "empty conversation"
    msgs: list[dict] = []
    seen_user = False
    for role, text in turns:
        norm = ROLES.get(role.strip().lower())
        if norm is None:
            return "unknown role"
        if not isinstance(text, str) or not text.strip():
            edits["empty turns removed"] += 1
            continue
        if norm == "system":
            if msgs:  # only a leading system prompt is a system prompt
                edits["late system turns removed"] += 1
                continue
        elif norm == "user":
            seen_user = True
        elif not seen_user:
            edits["leading assistant turns cut"] += 1
            continue
        if msgs and msgs[-1]["role"] == norm:
            msgs[-1]["content"] += "\n\n" + text
            edits["same-role turns merged"] += 1
            continue
        msgs.append({"role": norm, "content": text})
    out: list[dict] = [m for m in msgs[:1] if m["role"] == "system"]
    body = msgs[len(out):]
    pairs = 0
    for i in range(0, len(body) - 1, 2):
        if pairs == max_user_turns:
            break
        out += body[i:i + 2]
        pairs += 1
    cut = len(body) - 2 * pairs
    if cut:
        edits["turns cut (max_user_turns / no reply)"] += cut
    if pairs == 0:
        return "no user->assistant pair"
    return out


def clean_source(name: str, records: Iterable[dict], fmt: str, max_user_turns: int, stats: LoadStats,
                 edits: Counter) -> list[dict]:
    """Normalise and de-duplicate one source's records into prepared rows (without split fields yet)."""
    rows, seen_content, seen_ids = [], set(), Counter()
    schema_ok = 0
    for n, record in enumerate(records):
        turns = raw_turns(record, fmt)
        if turns is None:
            stats.dropped[f"not {fmt} schema"] += 1
            continue
        schema_ok += 1
        msgs = normalize(turns, max_user_turns, edits)
        if isinstance(msgs, str):
            stats.dropped[msgs] += 1
            continue
        digest = hashlib.sha1(json.dumps(msgs, sort_keys=True).encode()).hexdigest()
        if digest in seen_content:
            stats.dropped["duplicate"] += 1
            continue
        seen_content.add(digest)
        rid = record_id(record) or digest[:12]
        seen_ids[rid] += 1
        if seen_ids[rid] > 1:
            rid = f"{rid}#{seen_ids[rid] - 1}"
        rows.append({"id": rid, "source": name, "messages": msgs})
    if stats.records and not schema_ok:
        fields = FORMATS_FIELD[fmt]
        raise StageError(f"{stats.origin}: no record has the {fmt} schema (a {fields!r} list of turns); "
                         f"check data.sources.{name}.format")
    if stats.records == 0 and not stats.dropped:
        raise StageError(f"{stats.origin}: no conversations in the file")
    return rows


FORMATS_FIELD = {"sharegpt": "conversations", "ultrachat": "messages"}


SEGMENT = re.compile(r"_\d+$")
EVAL_SEGMENT = "segment of an eval conversation"


def conversation_of(row_id: str) -> str:
    """The conversation a row comes from: its id without prepare's `#n` suffix and ShareGPT's segment `_k`."""
    return SEGMENT.sub("", row_id.split("#", 1)[0])


# -- the held-out split ---------------------------------------------------------------------------------------------

# Text a page scrape of ShareGPT appended to some prompts: a translation extension's button ("translate now"), the
# site's own "share prompt" button and a "1 / 1" answer counter. Not part of what the user asked.
SCRAPE_TAILS = ("지금 번역하기", "share prompt", "1 / 1")
# First prompts that ask for nothing without the turns before them (the openers of ShareGPT's later segments and
# of conversations whose start was lost), compared with `prompt_key` (so "Continue." and "CONTINUE" match "continue").
CONTEXT_FREE = frozenset({
    "", "continue", "please continue", "continue please", "pls continue", "continue writing", "continue writing please",
    "continue generating", "continue the answer", "keep going", "keep going further", "go on", "please go on",
    "carry on", "proceed", "go ahead", "more", "more please", "next", "ok", "okay", "yes", "no", "thanks",
    "thank you", "elaborate", "please elaborate", "finish", "finish it", "finish your answer", "complete it",
    "继续", "繼續", "계속", "continua", "continuar", "pokracuj", "продолжай",
})
SKIP_CONTEXT_FREE = "context-free prompt"
SKIP_IN_TRAINING = "prompt also in training"


def first_prompt(messages: list[dict]) -> str:
    return next((m["content"] for m in messages if m["role"] == "user"), "")


def prompt_key(text: str) -> str:
    """A prompt as the held-out rules compare it: NFKC, case-folded, the scrape's tails removed, trailing punctuation
    stripped (so "Continue." is "continue" and "...?" is the question without its mark), whitespace collapsed."""
    key = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    while True:
        before = key
        key = key.rstrip()
        while key and unicodedata.category(key[-1]).startswith("P"):
            key = key[:-1].rstrip()
        for tail in SCRAPE_TAILS:
            key = key.removesuffix(tail)
        if key == before:
            return key


def split_and_rank(per_source: dict[str, list[dict]], data: DataParams, stats: dict[str, LoadStats] | None = None,
                   skipped: dict[str, Counter] | None = None) -> dict[str, list[dict]]:
    """Held-out eval split and reserve per source, then one global, seeded order of the training rows (`scale_rank`).

    A training row from a held-out conversation (another segment of it) is dropped, counted in `stats`; the
    conversations the eval draw passes over (context-free, or their prompt is another conversation's) are counted in
    `skipped` and stay training rows."""
    orders = {name: _source_order(name, rows, data) for name, rows in per_source.items()}
    # the conversations (of every source) that open with each prompt: two of them means one is trained on
    openers: dict[str, set] = defaultdict(set)
    keys: dict[int, str] = {}
    for name, order in orders.items():
        for r in order:
            keys[id(r)] = prompt_key(first_prompt(r["messages"]))
            openers[keys[id(r)]].add((name, conversation_of(r["id"])))
    evals, trains = [], []
    for name, order in orders.items():
        drawn, passed = _draw_eval(name, order, lambda r: keys[id(r)], openers, data)
        held = {conversation_of(r["id"]) for r in drawn}
        drawn_ids = {id(r) for r in drawn}
        rest = [r for r in order if id(r) not in drawn_ids and conversation_of(r["id"]) not in held]
        segments = len(order) - len(drawn) - len(rest)
        if stats is not None and segments:
            stats[name].dropped[EVAL_SEGMENT] += segments
        if skipped is not None:
            skipped[name].update(passed)
        evals += [dict(r, split=EVAL) for r in drawn]
        trains += [dict(r, split="train") for r in rest]
    _rank(evals, trains, data, list(per_source))
    out: dict[str, list[dict]] = {name: [] for name in per_source}
    for row in evals + trains:
        out[row["source"]].append(row)
    return out


def _source_order(name: str, rows: list[dict], data: DataParams) -> list[dict]:
    """One source's conversations in their seeded order, capped at its `max_conversations`."""
    cap = data.sources[name].max_conversations
    order = list(rows)
    random.Random(f"{data.split_seed}:{name}").shuffle(order)
    if cap is not None:
        order = order[:cap]
    if len(order) <= data.eval_size:
        raise StageError(f"data source {name!r}: {len(order)} clean conversations, not more than "
                         f"data.eval_size={data.eval_size}; nothing would be left to train on")
    return order


def _draw_eval(name: str, order: list[dict], key, openers: dict[str, set], data: DataParams) -> tuple[list, Counter]:
    """The first `eval_candidates` conversations of `order` whose prompt is neither context-free nor another
    conversation's, and how many were passed over for each reason."""
    drawn, passed = [], Counter()
    for r in order:
        if len(drawn) == data.eval_candidates:
            break
        if key(r) in CONTEXT_FREE:
            passed[SKIP_CONTEXT_FREE] += 1
        elif len(openers[key(r)]) > 1:
            passed[SKIP_IN_TRAINING] += 1
        else:
            drawn.append(r)
    if len(drawn) < data.eval_size:
        raise StageError(f"data source {name!r}: only {len(drawn)} of {len(order):,} conversations open with a "
                         f"prompt that is neither context-free nor another conversation's; data.eval_size="
                         f"{data.eval_size} is too many")
    return drawn, passed


def _rank(evals: list[dict], trains: list[dict], data: DataParams, sources: list[str]) -> None:
    """One seeded order of the eval candidates and one of the training rows (`scale_rank`, `used`); each source's
    first `eval_size` candidates are its eval split, the rest its reserve."""
    for group, tag in ((evals, "eval"), (trains, "train")):
        random.Random(f"{data.split_seed}:{tag}").shuffle(group)
        for rank, row in enumerate(group):
            row["scale_rank"] = rank
            row["used"] = tag == "eval" or rank < data.largest_scale  # what regenerate has to answer
    per_source_eval: Counter = Counter()
    for row in evals:  # in candidate order: each source's first eval_size are its eval split, the rest its reserve
        per_source_eval[row["source"]] += 1
        if per_source_eval[row["source"]] > data.eval_size:
            row["split"] = RESERVE
    short = {s: n for s, n in data.scales.items() if n > len(trains)}
    if short:
        s, n = max(short.items(), key=lambda kv: kv[1])
        raise StageError(f"data.scales.{s}={n} asks for more training conversations than the {len(trains):,} "
                         f"left after cleaning and the eval split (sources: {', '.join(sources)}); "
                         f"lower the scale or add a source")


def write_jsonl(path, rows: Iterable[dict]) -> int:
    n = 0
    with atomic_path(path) as tmp:
        with tmp.open("w") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                n += 1
    return n


def _summary_table(stats: dict[str, LoadStats], edits: dict[str, Counter], kept: dict[str, list[dict]],
                   data: DataParams, skipped: dict[str, Counter] | None = None):
    from rich.table import Table

    names = list(stats)
    table = Table(title="prepare: conversations per rule", show_lines=False)
    table.add_column("rule")
    for n in names:
        table.add_column(n, justify="right")
    table.add_row("records read", *[f"{stats[n].records:,}" for n in names])
    reasons = sorted({r for s in stats.values() for r in s.dropped})
    for r in reasons:
        table.add_row(f"dropped: {r}", *[f"{stats[n].dropped.get(r, 0):,}" for n in names])
    for e in sorted({e for c in edits.values() for e in c}):
        table.add_row(f"[dim]turns: {e}[/dim]", *[f"{edits[n].get(e, 0):,}" for n in names])
    table.add_row("kept", *[f"{len(kept[n]):,}" for n in names])
    for why in (SKIP_IN_TRAINING, SKIP_CONTEXT_FREE):   # always shown: a zero is a finding too
        table.add_row(f"eval draw skipped: {why} (trained on)",
                      *[f"{(skipped or {}).get(n, Counter()).get(why, 0):,}" for n in names])
    table.add_row("eval split", *[f"{sum(r['split'] == EVAL for r in kept[n]):,}" for n in names])
    table.add_row("eval reserve", *[f"{sum(r['split'] == RESERVE for r in kept[n]):,}" for n in names])
    for s, lim in data.scales.items():
        table.add_row(f"scale {s} (first {lim:,} train)", *[f"{sum(in_scale(r, lim) for r in kept[n]):,}"
                                                            for n in names])
    return table


def run(params: DataParams, paths: Paths, report: Report) -> None:
    """Load, clean, split and rank every configured source; write data/prepared/<source>.jsonl."""
    from rich.console import Console

    console = Console(stderr=True)
    stats: dict[str, LoadStats] = {}
    edits: dict[str, Counter] = {}
    cleaned: dict[str, list[dict]] = {}
    for name, src in params.sources.items():
        stats[name] = LoadStats(origin=src.path or name)
        edits[name] = Counter()
        records = iter_records(src.kind, src.path, src.split, stats[name])
        cleaned[name] = clean_source(name, records, src.format, params.max_user_turns, stats[name], edits[name])
        for note in stats[name].notes:
            console.print(f"[yellow]{name}: {note}[/yellow]")
    skipped = {name: Counter() for name in cleaned}
    ranked = split_and_rank(cleaned, params, stats, skipped)
    metrics: dict[str, float] = {}
    for name, rows in ranked.items():
        write_jsonl(paths.prepared(name), rows)
        st = stats[name]
        metrics.update({f"prepare/{name}/read": st.records, f"prepare/{name}/kept": len(rows),
                        f"prepare/{name}/dropped": sum(st.dropped.values()),
                        f"prepare/{name}/eval": sum(r["split"] == EVAL for r in rows),
                        f"prepare/{name}/eval_reserve": sum(r["split"] == RESERVE for r in rows),
                        f"prepare/{name}/eval_skipped_in_training": skipped[name][SKIP_IN_TRAINING],
                        f"prepare/{name}/eval_skipped_context_free": skipped[name][SKIP_CONTEXT_FREE]})
    console.print(_summary_table(stats, edits, ranked, params, skipped))
    report(metrics)


def sample_conversations(n: int, max_chars: int) -> list[dict]:
    """The first `n` cleaned one-pair conversations of the packaged ShareGPT file whose question is at most
    `max_chars` long (benchmarks and examples: no cleaning report, no split)."""
    rows: list[dict] = []
    for rec in iter_records("embedded", None, "train", LoadStats()):
        turns = raw_turns(rec, "sharegpt")
        msgs = normalize(turns, 1, Counter()) if turns else None
        if isinstance(msgs, list) and msgs[0]["role"] == "user" and len(msgs[0]["content"]) <= max_chars:
            rows.append({"id": str(len(rows)), "split": "train", "scale_rank": len(rows), "messages": msgs})
            if len(rows) == n:
                break
    return rows
