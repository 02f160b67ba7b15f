"""The target's answers committed beside a profile's results: a fresh workspace seeded from them regenerates into
the same bytes (so its rows have the committed rows' data hashes and combine with them), asks the target nothing
it answered already, and answers what changed."""
import gzip
import json

import pytest

from pipeline.conversations import committed_files, pack, read_committed, seed
from stages.common import Paths, StageError, TargetParams, read_jsonl
from stages.regenerate import regenerate_rows
from stages.regenerate_backends import RegenerateParams
from tests.test_regenerate import EchoBackend, conv

PARAMS = RegenerateParams(batch_size=2, window=1, original_answers_from=4)


def rows() -> list[dict]:
    """Six conversations: four the target answers (c1 is dropped: its prompt is too long), two past the budget
    that keep the dataset's answers, and one eval conversation."""
    out = [dict(conv(i), scale_rank=i) for i in range(6)]
    out.append(dict(conv(6), split="eval", scale_rank=0))
    return out


def regenerated_workspace(root, backend=None):
    final = Paths(root).regenerated("s")
    regenerate_rows(rows(), final, PARAMS, TargetParams(), Paths(root), backend=backend or EchoBackend())
    return final


class NoTarget:
    def answer(self, histories):
        raise AssertionError(f"asked the target for {len(histories)} answers it had")


def test_a_seeded_workspace_regenerates_the_same_bytes_without_asking_the_target(tmp_path):
    final = regenerated_workspace(tmp_path / "ws1")
    results = tmp_path / "results"
    assert pack(tmp_path / "ws1", results) == ["s"]
    record, lines = read_committed(committed_files(results)["s"])
    kept = {json.loads(line)["id"] for line in lines.split("\n") if line}
    assert kept == {"c0", "c2", "c3", "c6"}                       # the answers generated, not the dataset's
    assert [d["id"] for d in record["dropped"]] == ["c1"]

    ws2 = tmp_path / "ws2"
    assert seed(results, ws2) == ["s"]
    again = Paths(ws2).regenerated("s")
    stats = regenerate_rows(rows(), again, PARAMS, TargetParams(), Paths(ws2), backend=NoTarget())
    assert again.read_bytes() == final.read_bytes() and stats["new_tokens"] == 0
    assert read_jsonl(again)[0]["messages"][1]["content"].startswith("re:")


def test_packing_twice_gives_the_same_bytes_and_seeding_keeps_a_workspace_s_own_answers(tmp_path):
    regenerated_workspace(tmp_path / "ws")
    results = tmp_path / "results"
    pack(tmp_path / "ws", results)
    first = committed_files(results)["s"].read_bytes()
    pack(tmp_path / "ws", results)
    assert committed_files(results)["s"].read_bytes() == first     # no time in the gzip header
    own = Paths(tmp_path / "other").regenerated("s")
    own.parent.mkdir(parents=True)
    own.write_text('{"id": "mine"}\n')
    assert seed(results, tmp_path / "other") == [] and own.read_text() == '{"id": "mine"}\n'
    assert seed(tmp_path / "nothing committed", tmp_path / "third") == []


def test_a_changed_prompt_or_setting_is_answered_again(tmp_path):
    regenerated_workspace(tmp_path / "ws")
    results = tmp_path / "results"
    pack(tmp_path / "ws", results)
    seed(results, tmp_path / "ws2")
    changed = rows()
    changed[0]["messages"][0]["content"] = "a new question"
    backend = EchoBackend()
    regenerate_rows(changed, Paths(tmp_path / "ws2").regenerated("s"), PARAMS, TargetParams(),
                    Paths(tmp_path / "ws2"), backend=backend)
    assert {h[0]["content"] for h in backend.seen} == {"a new question"}

    seed(results, tmp_path / "ws3")
    backend = EchoBackend()
    other = RegenerateParams(batch_size=2, window=1, original_answers_from=4, max_new_tokens=7)
    regenerate_rows(rows(), Paths(tmp_path / "ws3").regenerated("s"), other, TargetParams(),
                    Paths(tmp_path / "ws3"), backend=backend)
    assert {h[0]["content"].split(".")[0] for h in backend.seen} == {"q0", "q1", "q2", "q3", "q6"}


def test_a_damaged_committed_file_is_a_one_line_error(tmp_path):
    folder = tmp_path / "results" / "conversations"
    folder.mkdir(parents=True)
    (folder / "s.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(StageError, match=r"s\.jsonl\.gz: not a file of committed conversations"):
        seed(tmp_path / "results", tmp_path / "ws")
    (folder / "s.jsonl.gz").write_bytes(gzip.compress(b'["a list"]\n'))
    with pytest.raises(StageError, match="first line is not the regenerate stage's record"):
        seed(tmp_path / "results", tmp_path / "ws")
    assert not (tmp_path / "ws" / "data" / "regenerated" / "s.jsonl").exists()


def test_a_new_workspace_is_seeded_unless_fresh_answers_are_asked_for(tmp_path, monkeypatch):
    from pipeline.config import load_config
    from pipeline.dvc_workspace import prepare_workspace

    regenerated_workspace(tmp_path / "ws")
    cfg = load_config("smoke")
    pack(tmp_path / "ws", tmp_path / "results" / cfg.profile)
    monkeypatch.setenv("KVSHOT_RESULTS", str(tmp_path / "results"))
    monkeypatch.setenv("KVSHOT_WORKSPACES", str(tmp_path / "workspaces"))
    said = []
    ws = prepare_workspace(cfg, "smoke", committed_answers=False, echo=said.append)
    assert not said and not (ws / "data" / "regenerated").exists()
    ws = prepare_workspace(cfg, "smoke", echo=said.append)
    assert len(said) == 1 and said[0].startswith("data/regenerated/s.jsonl: the target's answers from")
    assert Paths(ws).regenerated("s").is_file()
