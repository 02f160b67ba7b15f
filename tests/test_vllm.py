"""A real serving engine runs kvshot's export: vLLM's CPU build, greedy, with and without the drafter (slow).

The drafter is an EAGLE-3 head trained here for a few steps against the embedded SmolLM2 on the target's own greedy
answers to the two test prompts (so it drafts those answers well: a drafter vLLM loaded wrong would show near-zero
acceptance, not a pass). It is exported with `--save-verifier` (the target as the dequantized weights it was trained
on, a local directory: vLLM runs offline) in both formats. vLLM decodes both prompts greedily, plainly and with the
`speculators` export alone, and the e2e stage serves the `eagle3` export (`e2e.engines: [kvshot, vllm]`); the outputs
must be token-identical (lossless), the acceptance counters of `llm.get_metrics()` must have been read, and vLLM's
acceptance must agree with kvshot's own chain decoding of the same export on the same prompts. A KV-only drafter,
trained alike, is served through kvshot's own proposer inside vLLM (`stages/vllm_proposer.py`) under the same
checks. Everything runs in fp32 (bf16 rounds differently with the batch shape, so only fp32 is compared token for token).
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.vllm_env import ROOT, engine_env, vllm_python

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France? Answer in one sentence.", "Name three primary colors."]
NEW_TOKENS = 32
K = 3                    # draft tokens per step (the fallback the speculators export writes without a measured row)
RUNNER = ROOT / "stages" / "vllm_generate.py"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the two prompts as token ids, the target, the trained run, the exports, the verifier directory)."""
    from models.decoding import greedy_generate
    from models.target import load_target
    from stages import export as ex
    from stages.common import Paths, TargetParams
    from stages.train import DrafterParams, TrainParams, online_source, run

    python = vllm_python()          # skip before any training when the engine cannot be had
    tmp = tmp_path_factory.mktemp("vllm")
    paths = Paths(root=ROOT)        # the converted-model cache under scratch/models
    params = TargetParams(source="embedded", dtype="float32")
    tgt = load_target(params.source, params.dtype, cache_dir=paths.model_cache)
    prompts = [tgt.chat_ids([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS]
    answers = [greedy_generate(tgt, torch.tensor(p), NEW_TOKENS + 8).tokens for p in prompts]
    convs = [(p + a, [False] * len(p) + [True] * len(a)) for p, a in zip(prompts, answers)] * 4
    run_dir = tmp / "runs" / "engine" / "eagle3"
    t0 = time.perf_counter()
    run(DrafterParams(variant="eagle3", draft_vocab_size=1024),
        TrainParams(max_steps=24, batch_size=2, lr=3e-3, precision="fp32", log_every=100, checkpoint_every=100,
                    warmup_ratio=0.1, ttt_steps=K), run_dir, Paths(run_dir.parent), lambda *a, **k: None,
        target=params, source=online_source(tgt, convs), loaded_target=tgt)
    train_s = time.perf_counter() - t0
    verifier = ex.save_verifier(params, paths, tmp / "verifier")
    exports = {fmt: ex.export(run_dir, fmt, tmp / fmt, verifier, num_speculative_tokens=K) for fmt in ex.FORMATS}
    print(f"trained in {train_s:.1f} s; verifier {verifier.name_or_path}")
    return dict(python=python, prompts=prompts, target=tgt, run_dir=run_dir, exports=exports,
                verifier=Path(verifier.name_or_path), tmp=tmp, convs=convs, params=params)


def vllm_generate(served, name: str, *args: str) -> dict:
    tmp = served["tmp"]
    (tmp / "prompts.json").write_text(json.dumps(served["prompts"]))
    out = tmp / f"{name}.json"
    res = subprocess.run([str(served["python"]), str(RUNNER), *args, "--prompts", str(tmp / "prompts.json"),
                          "--max-tokens", str(NEW_TOKENS), "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
                          "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=tmp,
                         env=engine_env(served["python"]))
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-4000:])
    return json.loads(out.read_text())


def kvshot_chain(served, fmt: str, run_dir: Path | None = None) -> list[list[int]]:
    """kvshot's own chain decoding of the export (or of `run_dir`) (K draft tokens a round): its tokens and accepted
    lengths."""
    from models.decoding import DrafterProposer, TreeSpec, speculative_generate
    from stages import checkpoint as ckpt

    tgt = served["target"]
    drafter, _ = ckpt.load_drafter(run_dir or served["exports"][fmt].out, tgt)
    return [speculative_generate(tgt, torch.tensor(p), NEW_TOKENS, DrafterProposer(drafter, tgt),
                                 TreeSpec(K - 1, 1, K + 1)) for p in served["prompts"]]


def per_position(accept_lengths: list[int]) -> tuple[int, list[int]]:
    """(rounds, accepted drafts at each position) from kvshot's accepted lengths (accepted drafts + 1 a round)."""
    return len(accept_lengths), [sum(1 for a in accept_lengths if a - 1 > i) for i in range(K)]


@pytest.fixture(scope="module")
def plain(served) -> dict:
    """vLLM's own greedy decoding of the two prompts (the reference every speculative run must equal), with each
    step's top-5 log-probabilities."""
    return vllm_generate(served, "plain", "--model", str(served["verifier"]), "--logprobs", "5")


def test_vllm_serves_the_export_losslessly_and_its_acceptance_is_kvshots(served, plain):
    t0 = time.perf_counter()
    # the speculators format alone: vLLM reads the verifier (a local directory) and K from its config, offline (the
    # eagle3 format goes through the e2e stage, next test)
    spec = vllm_generate(served, "speculators", "--model", str(served["exports"]["speculators"].out))
    engine_s = time.perf_counter() - t0
    assert plain["speculative"] is None and plain["dtype"] == "torch.float32"
    assert spec["speculative"]["num_speculative_tokens"] == K
    assert all(len(t) == NEW_TOKENS for t in plain["tokens"])
    # it kept each step's top log-probabilities (what a bf16 departure is judged by): greedy chose the top one
    for tokens, steps in zip(plain["tokens"], plain["top_logprobs"]):
        assert len(steps) == len(tokens) and all(
            len(ids) >= 5 and dict(zip(ids, lps))[t] == max(lps) for t, (ids, lps) in zip(tokens, steps))
    assert spec["tokens"] == plain["tokens"]                                                # lossless
    # kvshot's plain greedy of the same weights in fp32 gives the same text as the engine
    from models.decoding import greedy_generate
    mine = [greedy_generate(served["target"], torch.tensor(p), NEW_TOKENS).tokens for p in served["prompts"]]
    assert mine == plain["tokens"]
    lines = []
    for name, res in (("speculators", spec),):
        c = res["counters"]
        assert c["drafts"] and c["draft_tokens"] == K * c["drafts"] and c["accepted_per_pos"] is not None
        assert len(c["accepted_per_pos"]) == K and sum(c["accepted_per_pos"]) == c["accepted_tokens"]
        vllm_pos = [a / c["drafts"] for a in c["accepted_per_pos"]]
        vllm_tau = 1 + c["accepted_tokens"] / c["drafts"]
        ours = kvshot_chain(served, name)
        assert [r.tokens for r in ours] == plain["tokens"]
        rounds, pos = per_position([a for r in ours for a in r.accept_lengths])
        kv_pos = [p / rounds for p in pos]
        kv_tau = sum(a for r in ours for a in r.accept_lengths) / rounds
        lines.append(f"{name}: vLLM mean acceptance length {vllm_tau:.3f} over {c['drafts']} drafts, per position "
                     f"{[round(p, 3) for p in vllm_pos]}; kvshot {kv_tau:.3f} over {rounds} rounds, "
                     f"{[round(p, 3) for p in kv_pos]}; {res['generated'] / res['seconds']:.1f} tok/s vs plain "
                     f"{plain['generated'] / plain['seconds']:.1f}")
        # the drafter drafts the answers it was trained on: loaded right, it is accepted most of the time
        assert vllm_pos[0] > 0.5, lines[-1]
        # the same drafter, weights and prompts in fp32: the engine accepts what kvshot's chain accepts (measured:
        # the same rounds and the same counts per position; the margin allows a near-tie draft or two to flip
        # between the two implementations' sums)
        assert abs(c["drafts"] - rounds) <= 2, lines[-1]
        assert abs(vllm_tau - kv_tau) <= 0.15 and all(abs(a - b) <= 0.11 for a, b in zip(vllm_pos, kv_pos)), \
            lines[-1]
    print("\n".join(lines) + f"\nengine runs {engine_s:.0f} s")


def test_the_e2e_stage_serves_the_drafter_with_vllm_beside_kvshot(served, tmp_path):
    """`e2e.engines: [kvshot, vllm]`: the stage exports the drafter, serves it with vLLM at the draft length kvshot
    decodes its chain with, and writes one row: lossless, vLLM's acceptance beside kvshot's on the same prompts
    (measured: equal), both speedups; the report renders it."""
    from stages.common import Paths, TargetParams
    from stages.e2e import E2EParams, run
    from stages.engine_report import engine_section

    prompts = tmp_path / "prompts.jsonl"           # two to tune on (the same texts), two measured
    prompts.write_text("".join(json.dumps({"id": str(i), "source": "t", "messages": [{"role": "user", "content": p}]})
                               + "\n" for i, p in enumerate(PROMPTS * 2)))
    params = E2EParams(prompts=str(prompts), num_prompts=2, max_new_tokens=NEW_TOKENS, dtype="float32",
                       paper_tree=[2, 2, 5], tree_candidates=[[K - 1, 1, K + 1]], prompt_lookup=False,
                       engines=["kvshot", "vllm"], engine_draft_tokens=[K], engine_eager=True)
    t0 = time.perf_counter()
    run(params, [served["run_dir"]], Paths(tmp_path), lambda *a, **k: None,
        target=TargetParams(source="embedded", dtype="float32"), loaded_target=served["target"])
    rows = json.loads((tmp_path / "metrics" / "engine.json").read_text())
    assert len(rows) == 1 and rows[0]["status"] == "ok", rows
    r = rows[0]
    line = (f"stage: vLLM τ {r['tau']:.3f} {[round(p, 3) for p in r['accepted_per_pos']]}, kvshot τ "
            f"{r['kvshot_tau']:.3f} {[round(p, 3) for p in r['kvshot_accepted_per_pos']]}; speedup vLLM "
            f"{r['speedup']:.2f}x, kvshot {r['kvshot_speedup']:.2f}x; {time.perf_counter() - t0:.0f} s")
    assert r["lossless"] and r["same_as_kvshot_greedy"] == 1.0 and r["draft_tokens"] == K, line
    assert r["accepted_per_pos"][0] > 0.5 and abs(r["tau"] - r["kvshot_tau"]) <= 0.15, line
    assert len(r["per_prompt"]["drafts"]) == 2 and r["engine_version"]
    assert r["scored_plain_identical"] is None       # fp32: lossless is exact equality, no scored plain run
    assert "## Serving engines" in "\n".join(engine_section(rows))
    print(line)


def test_vllm_serves_a_kv_only_drafter_through_kvshots_proposer(served, plain):
    """A KV-only drafter (it reads the target's KV of `target.kv_layers`, no hidden states), trained like the EAGLE-3
    head above, served by vLLM through `stages/vllm_proposer.py` (a custom_class proposer that collects the
    target's KV with hooks): lossless, and it accepts what kvshot's own chain decoding of the same drafter accepts."""
    from stages.common import Paths
    from stages.train import DrafterParams, TrainParams, online_source, run
    from stages.vllm_proposer import write_spec

    tgt, tmp = served["target"], served["tmp"]
    run_dir = tmp / "runs" / "engine" / "kv_only"
    run(DrafterParams(variant="kv_only", draft_vocab_size=1024),
        TrainParams(max_steps=24, batch_size=2, lr=3e-3, precision="fp32", log_every=100, checkpoint_every=100,
                    warmup_ratio=0.1, ttt_steps=K), run_dir, Paths(run_dir.parent), lambda *a, **k: None,
        target=served["params"], source=online_source(tgt, served["convs"]), loaded_target=tgt)
    spec_file = write_spec(tmp / "kv-drafter.json", run_dir, tgt.kv_layers, tgt.feature_layers)
    t0 = time.perf_counter()
    spec = vllm_generate(served, "kv", "--model", str(served["verifier"]), "--kvshot-drafter", str(spec_file),
                         "--num-speculative-tokens", str(K), "--one-by-one")
    engine_s = time.perf_counter() - t0
    assert spec["speculative"]["method"] == "custom_class" and spec["speculative"]["num_speculative_tokens"] == K
    assert spec["tokens"] == plain["tokens"] and all(len(t) == NEW_TOKENS for t in spec["tokens"])   # lossless
    c = spec["counters"]
    assert c["drafts"] and c["draft_tokens"] == K * c["drafts"] and sum(c["accepted_per_pos"]) == c["accepted_tokens"]
    # the proposer's own time reached the runner: one proposal per step (the final step's included), hooks and drafting
    assert c["proposer_steps"] >= c["drafts"] and 0 < c["proposer_draft_s"] + c["proposer_hook_s"] < spec["seconds"]
    vllm_pos = [a / c["drafts"] for a in c["accepted_per_pos"]]
    vllm_tau = 1 + c["accepted_tokens"] / c["drafts"]
    ours = kvshot_chain(served, "", run_dir)
    assert [r.tokens for r in ours] == plain["tokens"]
    rounds, pos = per_position([a for r in ours for a in r.accept_lengths])
    kv_pos = [p / rounds for p in pos]
    kv_tau = sum(a for r in ours for a in r.accept_lengths) / rounds
    line = (f"kv_only in vLLM: τ {vllm_tau:.3f} over {c['drafts']} drafts, per position {[round(p, 3) for p in vllm_pos]};"
            f" kvshot {kv_tau:.3f} over {rounds} rounds, {[round(p, 3) for p in kv_pos]}; "
            f"{spec['generated'] / spec['seconds']:.1f} tok/s (eager, batch 1); engine run {engine_s:.0f} s")
    # trained on these answers, a drafter handed the right KV at the right positions is accepted most of the time;
    # one handed other positions' KV (or none) is not
    assert vllm_pos[0] > 0.5, line
    assert abs(c["drafts"] - rounds) <= 2, line
    assert abs(vllm_tau - kv_tau) <= 0.15 and all(abs(a - b) <= 0.11 for a, b in zip(vllm_pos, kv_pos)), line
    print(line)
