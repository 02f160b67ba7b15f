"""The e2e stage on the embedded target with an untrained drafter saved as a run directory (short)."""
import json

import pytest
import torch

from stages.common import Paths, StageError, TargetParams, write_text_atomic
from stages.e2e import E2EParams, run


@pytest.fixture()
def run_dir(tmp_path, embedded_target):
    from models.drafter import Drafter
    from models.drafter_config import DrafterConfig
    from stages.checkpoint import save_run, trainable_weights

    torch.manual_seed(0)
    cfg = DrafterConfig.from_target(embedded_target, variant="hybrid", draft_vocab_size=2048)
    drafter = Drafter(cfg)
    d = tmp_path / "runs" / "scale" / "hybrid-small"
    save_run(d, {"drafter": cfg.to_dict(), "params": {"drafter": {"init": "random"}, "train": {"scale": "small"}}},
             trainable_weights(drafter))
    return d


@pytest.mark.parametrize("weights", ["native", "int8"])
def test_e2e_stage_writes_rows(tmp_path, run_dir, embedded_target, weights):
    prompts = tmp_path / "prompts.jsonl"
    write_text_atomic(prompts, "\n".join(json.dumps({"id": str(i), "source": "t", "messages": [
        {"role": "user", "content": c}]}) for i, c in enumerate(["Count to three.", "Say yes.", "Say hello.",
                                                                   "Name a colour."])) + "\n")
    params = E2EParams(prompts=str(prompts), num_prompts=2, max_new_tokens=8, paper_tree=[3, 3, 8],
                       tree_candidates=[[2, 1, 3], [2, 2, 5]], prompt_lookup=True, lookup_tokens=4,
                       drafter_weights=weights)
    seen = []
    # the files hold a row of another drafter and one of this drafter decoded before: a run decoding some drafters
    # (`kvshot e2e --part`, here the int8 one) keeps the first and replaces the second; a whole run writes anew
    keep = weights == "int8"
    other, before = {"study": "block", "trial": "block-kv", "tau": 2.0}, {"study": "scale", "trial": "hybrid-small"}
    (tmp_path / "metrics").mkdir()
    for name in ("e2e.json", "engine.json"):
        (tmp_path / "metrics" / name).write_text(json.dumps([other, before]))
    rows = run(params, [run_dir], Paths(tmp_path), lambda m, step=None: seen.append(m), target=TargetParams(),
               loaded_target=embedded_target, keep_others=keep)
    on_disk = json.loads((tmp_path / "metrics" / "e2e.json").read_text())
    kept = [other] if keep else []
    assert json.loads((tmp_path / "metrics" / "engine.json").read_text()) == kept   # no serving engine asked for
    assert on_disk == kept + json.loads(json.dumps(rows))
    assert [r["tree_kind"] for r in rows] == ["tuned", "tuned_lookup", "paper"]
    for r in rows:
        assert r["trial"] == "hybrid-small" and r["variant"] == "hybrid" and r["scale"] == "small"
        assert r["drafter_weights"] == weights
        assert r["tau"] >= 1.0 and r["tokens_per_s"] > 0 and r["baseline_tokens_per_s"] > 0
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / r["baseline_tokens_per_s"])
        assert 0 <= r["draft_time_share"] < 1 and 0 <= r["exact_match"] <= 1 and r["lossless"] is True
        assert r["prompt_lookup_tau"] >= 1.0 and r["lookup_loop_tau"] >= 1.0 and r["lookup_loop_lossless"] is True
        assert r["lookup_tokens"] == (4 if r["tree_kind"] == "tuned_lookup" else 0)
        assert r["run_dir"] == "runs/scale/hybrid-small"   # relative to the workspace: metrics travel
        # trees tuned on the first two prompts, the other two measured
        assert r["num_prompts"] == 2 and r["tuned_on"] == "held-out prompts"
        assert len(r["per_prompt"]["tokens"]) == 2
    assert rows[2]["tree"] == [3, 3, 8] and {tuple(r["tree"]) for r in rows[:2]} <= {(2, 1, 3), (2, 2, 5)}
    assert any("hybrid-small/paper/tau" in m for m in seen) and any("spec_off_tokens_per_s" in m for m in seen)


def test_trees_are_tuned_on_prompts_that_are_not_measured():
    from stages.e2e import TUNE_PROMPTS, split_prompts

    texts = [f"p{i}" for i in range(TUNE_PROMPTS + 3)]
    tune, measured, apart = split_prompts(texts, 3)
    assert apart and tune == texts[:TUNE_PROMPTS] and measured == texts[TUNE_PROMPTS:] and not set(tune) & set(measured)
    # a prompt file too short to set any apart: tuned on the first measured ones, and the rows say so
    tune, measured, apart = split_prompts(texts[:3], 3)
    assert not apart and measured == texts[:3] and tune == texts[:TUNE_PROMPTS]


def test_e2e_stage_names_a_bad_input(tmp_path, run_dir, embedded_target):
    with pytest.raises(StageError, match="no trained drafter"):
        run(E2EParams(), [tmp_path / "nope"], Paths(tmp_path), lambda *a, **k: None, target=TargetParams(),
            loaded_target=embedded_target)
    with pytest.raises(StageError, match="no prompts"):
        run(E2EParams(), [run_dir], Paths(tmp_path), lambda *a, **k: None, target=TargetParams(),
            loaded_target=embedded_target)


def test_e2e_stage_decodes_a_block_drafter_with_its_own_trees(tmp_path, embedded_target):
    """A block drafter proposes one block per round, decoded losslessly, its tree picked among its own candidates."""
    from models.build import build_drafter
    from models.drafter_config import DrafterConfig
    from stages.checkpoint import save_run, trainable_weights

    torch.manual_seed(0)
    cfg = DrafterConfig.from_target(embedded_target, variant="block", context="kv", block_size=4,
                                    draft_vocab_size=2048)
    d = tmp_path / "runs" / "block" / "block-kv"
    save_run(d, {"drafter": cfg.to_dict(), "params": {"drafter": {"init": "ckpt"}, "train": {"scale": "small"}}},
             trainable_weights(build_drafter(cfg)))
    prompts = tmp_path / "prompts.jsonl"
    write_text_atomic(prompts, json.dumps({"id": "0", "source": "t", "messages": [
        {"role": "user", "content": "Say hello."}]}) + "\n")
    params = E2EParams(prompts=str(prompts), num_prompts=1, max_new_tokens=8, paper_tree=[3, 3, 8],
                       tree_candidates=[[2, 1, 3]], block_tree_candidates=[[3, 1, 4], [2, 2, 5]],
                       prompt_lookup=False)
    rows = run(params, [d], Paths(tmp_path), lambda m, step=None: None, target=TargetParams(),
               loaded_target=embedded_target)
    assert [r["tree_kind"] for r in rows] == ["tuned", "paper"]
    assert rows[0]["variant"] == "block" and rows[0]["context"] == "kv" and rows[0]["study"] == "block"
    assert tuple(rows[0]["tree"]) in {(3, 1, 4), (2, 2, 5)} and all(r["lossless"] for r in rows)
    assert len(rows[0]["per_prompt"]["rounds"]) == 1


def test_decoding_some_drafters_keeps_the_rows_of_the_others(tmp_path):
    """`kvshot e2e --study S` or `--part P` decodes some drafters: the workspace's rows of the others (another part,
    another study) stay in metrics/e2e.json and metrics/engine.json beside the new ones, those of the drafters
    decoded again are replaced."""
    import json

    from stages.common import StageError
    from stages.e2e import rows_of_others

    path = tmp_path / "e2e.json"
    assert rows_of_others(path, []) == []
    rows = [{"study": "block", "trial": "block-hidden", "tree_kind": "paper"},
            {"study": "block", "trial": "block-kv", "tree_kind": "paper"},
            {"study": "scale", "trial": "block-hidden", "tree_kind": "paper"}]
    path.write_text(json.dumps(rows))
    again = [tmp_path / "runs" / "block" / "block-hidden"]
    assert rows_of_others(path, again) == rows[1:]
    path.write_text("[{")
    with pytest.raises(StageError, match=r"e2e.json: not valid JSON .*; move it aside to decode anew"):
        rows_of_others(path, again)
