"""prepare: loaders (truncated JSON, JSONL, datasets folder), cleaning rules, split and nested scales."""
import json
from collections import Counter
from pathlib import Path

import pytest

from stages.common import Paths, StageError, read_jsonl
from stages.prepare import DataParams, SourceParams, normalize, run, select_rows
from stages.sources import LoadStats, iter_json_array

FIXTURE = Path(__file__).parent / "fixtures" / "ultrachat_sample.jsonl"


def _quiet(metrics, step=None):
    pass


def _data(**kw) -> DataParams:
    base = dict(sources={"ultrachat": SourceParams(kind="local", format="ultrachat", path=str(FIXTURE))},
                eval_size=2, scales={"small": 3, "large": 8}, max_user_turns=2)
    base.update(kw)
    return DataParams(**base)


def test_normalize_rules():
    edits = Counter()
    turns = [("gpt", "stray"), ("system", "sys"), ("human", "a"), ("human", "b"), ("bing", " "), ("chatgpt", "A"),
             ("user", "c"), ("bard", "C"), ("user", "d"), ("gpt", "D"), ("user", "no reply")]
    out = normalize(turns, max_user_turns=2, edits=edits)
    assert out == [{"role": "system", "content": "sys"}, {"role": "user", "content": "a\n\nb"},
                   {"role": "assistant", "content": "A"}, {"role": "user", "content": "c"},
                   {"role": "assistant", "content": "C"}]
    assert edits["leading assistant turns cut"] == 1 and edits["same-role turns merged"] == 1
    assert edits["empty turns removed"] == 1 and edits["turns cut (max_user_turns / no reply)"] == 3
    assert normalize([("human", "only a question")], 2, Counter()) == "no user->assistant pair"
    assert normalize([("robot", "x"), ("gpt", "y")], 2, Counter()) == "unknown role"
    assert normalize([], 2, Counter()) == "empty conversation"


def test_truncated_json_array_is_recovered(tmp_path):
    records = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"q{i}"},
                                                  {"from": "gpt", "value": f"a{i}"}]} for i in range(5)]
    text = json.dumps(records, indent=2)
    cut = text.index('"r4"') + 10  # inside the last record
    path = tmp_path / "cut.json"
    path.write_text(text[:cut])
    stats = LoadStats()
    got = list(iter_json_array(path, stats))
    assert [r["id"] for r in got] == ["r0", "r1", "r2", "r3"]
    assert stats.dropped["truncated tail"] == 1 and stats.records == 4


def test_prepare_ultrachat_fixture_split_and_scales(tmp_path):
    paths = Paths(tmp_path)
    data = _data()
    run(data, paths, _quiet)
    rows = read_jsonl(paths.prepared("ultrachat"))
    assert len(rows) == 12  # 14 minus one duplicate and one without a reply
    assert {r["split"] for r in rows} == {"eval", "reserve", "train"}
    ev = select_rows(rows, data, "eval")
    assert sum(r["split"] == "reserve" for r in rows) == 1                  # ceil(2 * eval_reserve 0.5)
    small, large = select_rows(rows, data, "small"), select_rows(rows, data, "large")
    assert len(ev) == 2 and len(small) == 3 and len(large) == 8
    assert [r["id"] for r in large[:3]] == [r["id"] for r in small]       # nested by construction
    assert not {r["id"] for r in ev} & {r["id"] for r in large}
    assert sum(r["used"] for r in rows) == 11                              # eval, reserve + the largest scale
    for r in rows:
        roles = [m["role"] for m in r["messages"] if m["role"] != "system"]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and 1 <= len(roles) // 2 <= 2
    by_id = {r["id"]: r for r in rows}
    assert by_id["uc-05"]["messages"][0]["content"].endswith("\n\nPlease?")
    assert by_id["uc-02"]["messages"][0]["role"] == "system"
    # deterministic
    run(data, paths, _quiet)
    assert read_jsonl(paths.prepared("ultrachat")) == rows
    # another seed, another split
    run(_data(split_seed=1), paths, _quiet)
    assert [r["id"] for r in read_jsonl(paths.prepared("ultrachat"))] != [r["id"] for r in rows]


def test_prepare_hub_path_with_a_local_dataset_folder(tmp_path):
    folder = tmp_path / "hub"
    folder.mkdir()
    (folder / "train.jsonl").write_text(FIXTURE.read_text())
    paths = Paths(tmp_path)
    run(_data(sources={"uc": SourceParams(kind="hub", format="ultrachat", path=str(folder), split="train")}),
        paths, _quiet)
    assert len(read_jsonl(paths.prepared("uc"))) == 12


def test_bad_inputs_are_one_line_errors(tmp_path):
    paths = Paths(tmp_path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(StageError, match="empty.jsonl: empty file"):
        run(_data(sources={"x": SourceParams(kind="local", format="ultrachat", path=str(empty))}), paths, _quiet)
    with pytest.raises(StageError, match="missing.json: no such file"):
        run(_data(sources={"x": SourceParams(kind="local", path=str(tmp_path / "missing.json"))}), paths, _quiet)
    with pytest.raises(StageError, match="no record has the sharegpt schema"):
        run(_data(sources={"x": SourceParams(kind="local", format="sharegpt", path=str(FIXTURE))}), paths, _quiet)
    with pytest.raises(StageError, match=r"data.scales.large=50 asks for more .* than the 9"):
        run(_data(scales={"small": 3, "large": 50}), paths, _quiet)
    with pytest.raises(ValueError, match="held-out split"):
        DataParams(scales={"eval": 3})
    # a cut-off last line of a JSONL file is a counted drop, not an error
    cut = tmp_path / "cut.jsonl"
    cut.write_text(FIXTURE.read_text()[:-40])
    run(_data(sources={"x": SourceParams(kind="local", format="ultrachat", path=str(cut))}), paths, _quiet)
    assert len(read_jsonl(paths.prepared("x"))) == 11


def test_embedded_sharegpt_recovers_every_complete_record():
    from stages.sources import iter_records

    stats = LoadStats()
    n = sum(1 for _ in iter_records("embedded", None, "train", stats))
    assert n == stats.records and 17_000 < n < 18_000
    assert stats.dropped["truncated tail"] == 1


def test_segments_of_a_held_out_conversation_are_never_trained_on():
    from stages.prepare import EVAL_SEGMENT, conversation_of, split_and_rank

    assert conversation_of("SGFlIg3_12") == conversation_of("SGFlIg3_0#1") == "SGFlIg3"
    assert conversation_of("uc-05") == "uc-05"
    def msgs(c):   # the segments of one conversation may open alike: that is not a prompt of another one
        return [{"role": "user", "content": f"q{c}"}, {"role": "assistant", "content": "a"}]

    rows = [{"id": f"c{c}_{k}", "source": "sg", "messages": msgs(c)} for c in range(12) for k in range(3)]
    data = DataParams(sources={"sg": SourceParams(kind="local", format="sharegpt", path="x")}, eval_size=4,
                      scales={"small": 5})
    stats = {"sg": LoadStats()}
    out = split_and_rank({"sg": rows}, data, stats)["sg"]
    held = {conversation_of(r["id"]) for r in out if r["split"] == "eval"}
    train = [r for r in out if r["split"] == "train"]
    assert len(held) >= 2 and not held & {conversation_of(r["id"]) for r in train}
    assert len(out) + stats["sg"].dropped[EVAL_SEGMENT] == len(rows) and stats["sg"].dropped[EVAL_SEGMENT] > 0
    assert sorted(r["scale_rank"] for r in train) == list(range(len(train)))


def test_prompt_key_folds_case_space_punctuation_and_the_scrape_tails():
    from stages.prepare import CONTEXT_FREE, prompt_key

    assert prompt_key("  Explain quantum\n computing in   SIMPLE terms?? ") == "explain quantum computing in simple terms"
    assert prompt_key("Continue.") == prompt_key("CONTINUE") == prompt_key("continueShare Prompt") == "continue"
    assert prompt_key("Keep going further지금 번역하기") == "keep going further"
    assert prompt_key("please continue Please write in English language.1 / 1") == \
        "please continue please write in english language"
    assert prompt_key("call f(x)") == "call f(x"            # only equality matters: both sides lose the same marks
    assert prompt_key("...") == "" and "" in CONTEXT_FREE    # nothing left to ask
    assert {prompt_key(p) for p in ("Go on!", "Thanks", "繼續", "ok")} <= CONTEXT_FREE
    assert prompt_key("Continue the story of the lost dog") not in CONTEXT_FREE


def _overlap_fixture(path: Path, tag: str, unique: int) -> None:
    """ShareGPT records where most first prompts repeat another conversation's (modulo case, spaces, punctuation)
    or ask for nothing on their own, as in the packaged ShareGPT."""
    quantum = ["Explain quantum computing in simple terms", "explain quantum  computing in simple terms.",
               "EXPLAIN QUANTUM COMPUTING IN SIMPLE TERMS?"]
    shared = ["How do I make an HTTP request in Javascript?", "how do i make an http request in javascript"]
    context_free = ["continue", "Continue.", "CONTINUE", "go on", "Keep going", "continueshare prompt", "more",
                    "ok", "Please continue"]
    prompts = [f"{tag} unique question number {i}" for i in range(unique)]
    prompts += quantum * 4 + shared * 3 + context_free * 2 + ["cross-source question"]
    records = [{"id": f"{tag}{i}", "conversations": [{"from": "human", "value": p},
                                                     {"from": "gpt", "value": f"answer {tag}{i}"}]}
               for i, p in enumerate(prompts)]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_eval_prompt_appears_in_training(tmp_path, seed):
    from stages.prepare import (SKIP_CONTEXT_FREE, SKIP_IN_TRAINING, CONTEXT_FREE, _summary_table, first_prompt,
                                prompt_key, split_and_rank)

    for tag in ("a", "b"):
        _overlap_fixture(tmp_path / f"{tag}.jsonl", tag, unique=14)
    data = DataParams(sources={t: SourceParams(kind="local", format="sharegpt", path=str(tmp_path / f"{t}.jsonl"))
                               for t in ("a", "b")},
                      eval_size=6, eval_reserve=0.5, scales={"small": 20, "large": 40}, split_seed=seed)
    metrics = {}
    run(data, Paths(tmp_path), lambda m, step=None: metrics.update(m))
    rows = [r for t in ("a", "b") for r in read_jsonl(Paths(tmp_path).prepared(t))]

    def key(r):
        return prompt_key(first_prompt(r["messages"]))

    train = {key(r) for r in rows if r["split"] == "train"}
    held = [r for r in rows if r["split"] in ("eval", "reserve")]
    assert not {key(r) for r in held} & train                 # the property: no held-out prompt is trained on
    assert not {key(r) for r in held} & CONTEXT_FREE
    for t in ("a", "b"):
        assert sum(r["split"] == "eval" and r["source"] == t for r in rows) == 6      # eval_size still met
        assert sum(r["split"] == "reserve" and r["source"] == t for r in rows) == 3
    # not vacuous: 37 of each source's 51 prompts repeat or are context-free, and the draw met and passed over both
    skipped_train = metrics["prepare/a/eval_skipped_in_training"] + metrics["prepare/b/eval_skipped_in_training"]
    skipped_free = metrics["prepare/a/eval_skipped_context_free"] + metrics["prepare/b/eval_skipped_context_free"]
    assert skipped_train > 0 and skipped_free > 0
    assert "cross-source question" not in {key(r) for r in held}   # a prompt of another source counts too
    assert sum(r["split"] == "train" for r in rows) == 2 * 51 - 2 * 9  # the skipped ones are trained on
    # the counts table shows both
    stats = {t: LoadStats(records=51) for t in ("a", "b")}
    skipped = {t: Counter() for t in ("a", "b")}
    by_source = {t: [r for r in rows if r["source"] == t] for t in ("a", "b")}
    split_and_rank({t: [{k: v for k, v in r.items() if k in ("id", "source", "messages")} for r in by_source[t]]
                    for t in ("a", "b")}, data, None, skipped)
    table = _summary_table(stats, {t: Counter() for t in ("a", "b")}, by_source, data, skipped)
    labels = list(table.columns[0]._cells)
    for why in (SKIP_IN_TRAINING, SKIP_CONTEXT_FREE):
        (i,) = [n for n, label in enumerate(labels) if why in label]
        assert int(table.columns[1]._cells[i]) + int(table.columns[2]._cells[i]) > 0


def test_too_few_eligible_prompts_is_a_one_line_error(tmp_path):
    path = tmp_path / "dups.jsonl"
    records = [{"id": f"d{i}", "conversations": [{"from": "human", "value": "continue" if i % 2 else "same question"},
                                                 {"from": "gpt", "value": f"a{i}"}]} for i in range(20)]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    with pytest.raises(StageError, match=r"only 0 of 20 conversations open with a prompt .* data.eval_size=2"):
        run(_data(sources={"d": SourceParams(kind="local", format="sharegpt", path=str(path))}), Paths(tmp_path),
            _quiet)
