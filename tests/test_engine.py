"""The serving-engine rows of the e2e stage without an engine: a row from vLLM's and kvshot's outputs, the report's
table of them, the e2e section's check, and the stage's empty output without engines. The engine itself runs in
tests/test_vllm.py (slow)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from stages.engine import engine_row, per_position
from stages.engine_report import engine_frame, engine_section

K = 3


def vllm_out(tokens, drafts, accepted, per_pos, seconds):
    per_prompt = [{"tokens": t, "seconds": s, "counters": {"drafts": d, "accepted_tokens": a, "draft_tokens": K * d,
                                                          "accepted_per_pos": None}}
                  for t, d, a, s in zip(tokens, drafts, accepted, seconds)]
    return {"tokens": tokens, "seconds": sum(seconds), "per_prompt": per_prompt, "vllm": "0.32.0",
            "counters": {"drafts": sum(drafts), "accepted_tokens": sum(accepted), "accepted_per_pos": per_pos}}


def decoded(tokens, accept_lengths, seconds):
    return SimpleNamespace(tokens=tokens, accept_lengths=accept_lengths, seconds=seconds)


def test_accepted_drafts_per_position_from_accepted_lengths():
    # lengths 4 (3 drafts accepted), 1 (none), 2 (the first)
    assert per_position([4, 1, 2], K) == [2, 1, 1]


def test_a_row_compares_the_engines_on_the_same_prompts():
    a, b = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]
    plain = vllm_out([a, b], [0, 0], [0, 0], None, [1.0, 1.0])
    spec = vllm_out([a, b], [3, 4], [3, 2], [2, 2, 1], [0.5, 0.6])
    chain = [decoded(a, [4, 1, 1], 0.4), decoded(b, [2, 2, 2], 0.5)]    # 3 and 3 accepted drafts over 3 + 3 rounds
    greedy = [decoded(a, [], 1.2), decoded(b, [], 1.2)]
    row = engine_row({"trial": "eagle3", "study": "scale"}, K, plain, spec, chain, greedy)
    assert row["lossless"] and row["exact_match"] == 1.0 and row["same_as_kvshot_greedy"] == 1.0
    assert row["tau"] == pytest.approx(1 + 5 / 7) and row["accepted_per_pos"] == pytest.approx([2 / 7, 2 / 7, 1 / 7])
    assert row["kvshot_tau"] == pytest.approx(12 / 6)
    assert row["kvshot_accepted_per_pos"] == pytest.approx([4 / 6, 1 / 6, 1 / 6])
    assert row["speedup"] == pytest.approx(2.0 / 1.1) and row["kvshot_speedup"] == pytest.approx(2.4 / 0.9)
    assert row["per_prompt"]["kvshot_accepted"] == [3, 3] and row["per_prompt"]["drafts"] == [3, 4]
    # an output the drafter changed is not lossless, and says how many prompts stayed identical
    lossy = engine_row({"trial": "eagle3"}, K, plain, vllm_out([a, b[:-1] + [0]], [3, 4], [3, 2], [2, 2, 1],
                                                               [0.5, 0.6]), chain, greedy)
    assert not lossy["lossless"] and lossy["exact_match"] == 0.5


def test_the_report_table_shows_both_acceptances_with_the_interval_of_their_difference():
    a = list(range(8))
    n = 12
    plain = vllm_out([a] * n, [0] * n, [0] * n, None, [1.0] * n)
    spec = vllm_out([a] * n, [4] * n, [4] * n, [2, 1, 1], [0.5] * n)
    same = [decoded(a, [2, 2, 2, 2], 0.5) for _ in range(n)]                    # kvshot: 4 accepted over 4 rounds
    row = engine_row({"trial": "eagle3", "study": "scale"}, K, plain, spec, same, [decoded(a, [], 1.0)] * n)
    frame = engine_frame([row, {"trial": "kv_only-d4", "study": "scale", "draft_tokens": K,
                                "status": "not served: reads the target's KV"}])
    assert frame.loc[0, "vLLM − kvshot"] == "+0.000 [+0.000, +0.000]"
    assert frame.loc[1, "vLLM − kvshot"].startswith("not served")
    section = "\n".join(engine_section([row]))
    assert "## Serving engines" in section and "vLLM 0.32.0" in section and "2.000" in section
    assert engine_section([]) == [] and engine_section(None) == []


def test_engines_must_include_kvshot_and_draft_lengths_are_positive():
    from pydantic import ValidationError

    from stages.e2e import E2EParams

    assert E2EParams(engines=["kvshot", "vllm"]).engines == ["kvshot", "vllm"]
    with pytest.raises(ValidationError, match="kvshot decodes every drafter"):
        E2EParams(engines=["vllm"])
    with pytest.raises(ValidationError, match="draft lengths"):
        E2EParams(engine_draft_tokens=[0])


def test_study_results_merges_engine_rows_like_e2e_rows(tmp_path):
    from pipeline.study_results import _merge_e2e
    from stages.engine_report import ENGINE_METRICS

    ws, kept, out = tmp_path / "ws.json", tmp_path / "kept.json", tmp_path / "out.json"
    kept.write_text(json.dumps([{"study": "block", "trial": "eagle3", "draft_tokens": 3},
                                {"study": "scale", "trial": "eagle3", "draft_tokens": 3}]))
    ws.write_text(json.dumps([{"study": "scale", "trial": "eagle3", "draft_tokens": 3, "tau": 2.0}]))
    _merge_e2e(ws, kept, out)
    assert [(r["study"], r.get("tau")) for r in json.loads(out.read_text())] == [("block", None), ("scale", 2.0)]
    assert ENGINE_METRICS.as_posix() == "metrics/engine.json"
