"""The serving-engine rows of the e2e stage without an engine: a row from vLLM's and kvshot's outputs, the report's
table of them, the e2e section's check, and the stage's empty output without engines. The engine itself runs in
tests/test_vllm.py (slow)."""
from __future__ import annotations

import json
from pathlib import Path
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


def decoded(tokens, accept_lengths, seconds, draft_seconds=0.0):
    return SimpleNamespace(tokens=tokens, accept_lengths=accept_lengths, seconds=seconds,
                           draft_seconds=draft_seconds, verify_seconds=seconds - draft_seconds)


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
    # an eagle3 export's drafting is inside vLLM's step: no proposer time; kvshot's own split is always there
    assert row["proposer_share"] is None and "proposer_draft_seconds" not in row["per_prompt"]


def test_a_bf16_departure_is_lossless_only_at_a_near_tie_of_vllms_own_plain_run():
    from stages.engine import lossless_fields

    ref = [5, 6, 7]
    plain = vllm_out([ref], [0], [0], None, [1.0])
    # the plain run's top log-probabilities at each step: a near tie (6 vs 9) at step 1, no tie at step 2
    plain["top_logprobs"] = [[[[5, 1], [-0.1, -3.0]], [[6, 9], [-0.70, -0.80]], [[7, 2, 3], [-0.2, -2.5, -4.0]]]]
    at_tie = vllm_out([[5, 9, 4]], [1], [0], None, [1.0])            # departs at step 1 by 0.10
    far = vllm_out([[5, 6, 2]], [1], [0], None, [1.0])                # departs at step 2 by 2.3
    unseen = vllm_out([[5, 6, 8]], [1], [0], None, [1.0])             # a token outside the plain run's top-3
    tie = lossless_fields(plain, at_tie, 0.25, exact_required=False)
    assert tie["lossless"] and tie["exact_match"] == 0.0 and tie["max_tie_gap"] == pytest.approx(0.10)
    assert not lossless_fields(plain, far, 0.25, exact_required=False)["lossless"]
    assert not lossless_fields(plain, unseen, 0.25, exact_required=False)["lossless"]
    # in fp32 only identical outputs are lossless; a plain run without scores can only be exact
    assert not lossless_fields(plain, at_tie, 0.25, exact_required=True)["lossless"]
    del plain["top_logprobs"]
    assert not lossless_fields(plain, at_tie, 0.25, exact_required=False)["lossless"]
    assert lossless_fields(plain, plain, 0.25, exact_required=False)["lossless"]
    # the report says at which gaps a bf16 output departed
    row = engine_row({"trial": "eagle3"}, K, {**plain, "top_logprobs": [[[[5], [0.0]], [[6, 9], [-0.7, -0.8]]]]},
                     at_tie, [decoded(ref, [1, 1, 1], 1.0)], [decoded(ref, [], 1.0)], 0.25, exact_required=False)
    assert row["lossless"]
    assert engine_frame([row]).loc[0, "lossless"] == "yes (0% identical; departures at gaps ≤ 0.100)"


def test_the_kvshot_proposers_own_time_is_split_out_of_vllms():
    a = [1, 2, 3, 4, 5, 6]
    plain = vllm_out([a], [0], [0], None, [1.0])
    spec = vllm_out([a], [3], [3], [2, 1, 0], [0.8])
    spec["per_prompt"][0]["counters"] |= {"proposer_hook_s": 0.1, "proposer_draft_s": 0.3, "proposer_steps": 4}
    row = engine_row({"trial": "kv_only"}, K, plain, spec, [decoded(a, [4, 1, 1], 0.5, draft_seconds=0.2)],
                     [decoded(a, [], 1.0)])
    assert row["proposer_share"] == pytest.approx(0.4 / 0.8) and row["kvshot_draft_share"] == pytest.approx(0.2 / 0.5)
    assert row["per_prompt"]["proposer_hook_seconds"] == [0.1] and row["per_prompt"]["proposer_draft_seconds"] == [0.3]
    assert row["per_prompt"]["kvshot_draft_seconds"] == [0.2]
    assert row["per_prompt"]["kvshot_verify_seconds"] == [0.3]
    # the report says how much of each engine's time went into drafting (an eagle3 export's is not measured)
    frame = engine_frame([row])
    assert frame.loc[0, "vLLM speedup"].endswith("; drafting 50%)")
    assert frame.loc[0, "kvshot speedup"].endswith("; drafting 40%)")


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
    assert "drafting" not in frame.loc[0, "vLLM speedup"] and frame.loc[0, "kvshot speedup"].endswith("drafting 0%)")
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


def test_run_engines_serves_eagle3_by_export_and_every_other_drafter_through_kvshots_proposer(tmp_path,
                                                                                             embedded_target,
                                                                                             monkeypatch):
    """The routing of the e2e stage's engine part, with vLLM's process replaced by one that returns kvshot's greedy
    tokens: an EAGLE-3 head goes through an eagle3 export beside the compiled plain run; a KV-only drafter and a
    hybrid through kvshot's proposer (a spec file naming the run and the target layers it reads), beside one plain
    run that is eager and recomputes every prompt as that route does. (vLLM itself serves them in
    tests/test_vllm.py, slow.)"""
    import torch

    from models.decoding import greedy_generate
    from models.drafter import Drafter
    from models.drafter_config import DrafterConfig
    from stages import engine, engine_env, export, export_verifier
    from stages.checkpoint import save_run, trainable_weights
    from stages.common import Paths, TargetParams

    tgt = embedded_target
    prompts = [torch.tensor(tgt.chat_ids([{"role": "user", "content": "Say yes."}], add_generation_prompt=True))]
    n_new = 4
    tokens = [greedy_generate(tgt, prompts[0], n_new).tokens]
    runs = []
    for variant in ("eagle3", "kv_only", "hybrid"):
        torch.manual_seed(0)
        cfg = DrafterConfig.from_target(tgt, variant=variant, draft_vocab_size=512)
        runs.append(tmp_path / "runs" / "block" / variant)
        save_run(runs[-1], {"drafter": cfg.to_dict()}, trainable_weights(Drafter(cfg)))
    calls = []

    def fake_vllm(python, out, prompts_file, model, n, dtype, draft=None, k=None, eager=False, kvshot_drafter=None,
                  no_prefix_caching=False, logprobs=0):
        calls.append({"draft": draft, "k": k, "eager": eager, "spec": kvshot_drafter, "fresh": no_prefix_caching,
                      "logprobs": logprobs, "model": model})
        counters = {"drafts": 2, "accepted_tokens": 1, "draft_tokens": 2 * (k or 0),
                    "accepted_per_pos": [1] + [0] * ((k or 1) - 1)}
        return {"tokens": tokens, "seconds": 1.0, "vllm": "0.32.0", "counters": counters,
                "per_prompt": [{"tokens": tokens[0], "seconds": 1.0, "counters": counters}]}

    monkeypatch.setattr(engine, "run_vllm", fake_vllm)
    monkeypatch.setattr(engine_env, "vllm_python", lambda: tmp_path / "python")
    monkeypatch.setattr(export_verifier, "save_verifier",
                        lambda params, paths, directory: SimpleNamespace(name_or_path=str(directory)))
    exported = []

    def fake_export(run_dir, fmt, out, verifier, **kwargs):
        exported.append(verifier)
        return out

    monkeypatch.setattr(export, "export", fake_export)
    settings = [{"trial": r.name, "study": "block"} for r in runs]
    rows = engine.run_engines([2], runs, settings, prompts, tgt, TargetParams(), "bfloat16", n_new, Paths(tmp_path))
    by = {r["trial"]: r for r in rows}
    assert by["eagle3"]["engine_route"] == "eagle3 export"
    assert by["kv_only"]["engine_route"] == by["hybrid"]["engine_route"] == engine.PROPOSER_ROUTE
    plain, scored, eagle, plain_eager, scored_eager, kv, hybrid = calls
    assert plain["draft"] is None and plain["spec"] is None and not plain["fresh"]
    # the timed plain runs keep no scores (that slows vLLM); a second, untimed run of each does, for the bf16 check
    assert not plain["logprobs"] and not plain_eager["logprobs"] and not eagle["logprobs"]
    assert scored["logprobs"] == scored_eager["logprobs"] == engine.TOP_LOGPROBS
    assert (scored["eager"], scored["fresh"]) == (plain["eager"], plain["fresh"])
    assert (scored_eager["eager"], scored_eager["fresh"]) == (True, True)
    assert eagle["draft"] is not None and eagle["k"] == 2
    # the export is made for the saved verifier itself (its sizes are checked), vLLM loads it from its folder
    assert [v.name_or_path for v in exported] == [str(plain["model"])] == [
        str(tmp_path / "exports" / "verifier-bfloat16")]
    assert plain_eager["eager"] and plain_eager["fresh"] and plain_eager["spec"] is None
    for call, run_dir in ((kv, runs[1]), (hybrid, runs[2])):
        assert call["k"] == 2 and json.loads(Path(call["spec"]).read_text()) == {
            "run_dir": str(run_dir.resolve()), "kv_layers": list(tgt.kv_layers),
            "feature_layers": list(tgt.feature_layers)}
    assert all(r["lossless"] and r["kvshot_tau"] >= 1.0 and r["scored_plain_identical"] == 1.0 for r in rows)
