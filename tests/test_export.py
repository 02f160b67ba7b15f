"""`kvshot export`: engine formats checked against an independent loader, the round trip, bad input."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models.decoding import DrafterProposer, TreeSpec, greedy_generate, speculative_generate
from stages import checkpoint as ckpt
from stages import export as ex
from stages.common import StageError
from tests.drafter_helpers import make_drafter, naive_logits
from tests.engine_reference import EngineDraft, engine_logits

ROOT = Path(__file__).resolve().parent.parent
# fp32 logits of the reference loader against kvshot's drafter: both compute the same sums in another order
ATOL = 1e-5
MAX_DIFFS: dict[str, float] = {}


def tiny8(**kw):
    """A tiny fp32 Llama target with 8 layers: default feature layers [2, 4, 5] (distinct, as engines need)."""
    from models.target import tiny_target

    args = dict(num_layers=8, hidden_size=48, num_heads=6, num_kv_heads=2, vocab_size=64)
    args.update(kw)
    return tiny_target("llama", **args)


@pytest.fixture(scope="module")
def target():
    return tiny8()


@pytest.fixture(scope="module")
def verifier(target):
    return ex.Verifier.from_target(target, "tiny/llama-verifier")


def save_run_dir(path: Path, drafter, feature_layers=None, result: dict | None = None, **config) -> Path:
    """A finished run directory as the train stage writes it, for a drafter built in the test."""
    cfg = drafter.config
    run = {"drafter": cfg.to_dict(), "draft_vocab_size": cfg.draft_vocab_size,
           "params": {"drafter": {"variant": cfg.variant, "depth": cfg.depth},
                      "train": {"scale": "small", "ttt_steps": 7, "step_decay": 0.8, "lr": 1e-3, "batch_size": 2,
                                "precision": "fp32", "seed": 0},
                      "target": {"source": "tiny", "dtype": "float32", "feature_layers": feature_layers,
                                 "kv_layers": None}},
           "data": {"scale": "small", "conversations": 4, "steps": 3},
           "summary": {"steps": 3, "tokens": 120, "finished": True}}
    run.update(config)
    ckpt.save_run(path, run, ckpt.trainable_weights(drafter))
    if result is not None:
        (path / ex.RESULT_FILE).write_text(json.dumps(result))
    return path


def drafter_for(target, seed: int = 0, **kw):
    d = make_drafter(target, seed=seed, draft_vocab_size=40, **kw)
    d.set_vocab(torch.randperm(64, generator=torch.Generator().manual_seed(seed + 5))[:40].sort().values)
    return d


def no_leftovers(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if p.name.startswith(".") and (".tmp-" in p.name or ".old-" in p.name)]


# -- what each format writes --------------------------------------------------------------------------------------

def test_eagle3_format_fields_and_tensors(tmp_path, target, verifier):
    run = save_run_dir(tmp_path / "runs" / "depth" / "eagle3", drafter_for(target))
    out = tmp_path / "export"
    res = ex.export(run, "eagle3", out, verifier)
    assert res.files == ["README.md", "config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["vocab_size"] == 64 and cfg["draft_vocab_size"] == 40 and cfg["target_hidden_size"] == 48
    assert cfg["tie_word_embeddings"] is False and cfg["num_hidden_layers"] == 1
    heads = (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"])
    assert cfg["hidden_size"] == 48 and heads == (6, 2, 8)
    # kvshot's hidden_states[2, 4, 5] are the inputs of layers 2, 4, 5 (vLLM) = outputs of layers 1, 3, 4 (SGLang)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert cfg["rope_theta"] == 10000.0 and cfg["rope_scaling"] is None
    assert cfg["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    # EAGLE-3.1 options off: not named at all (a plain EAGLE-3 config, as every engine release reads it)
    assert "fc_norm" not in cfg and "norm_output" not in cfg and cfg["norm_before_residual"] is False
    assert cfg["torch_dtype"] == "float32"                                # the target's dtype (tiny: float32)
    w = load_file(str(out / "model.safetensors"))
    layer = {"input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
             "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
             "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
    assert set(w) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {"midlayer." + n for n in layer}
    assert w["midlayer.self_attn.q_proj.weight"].shape == (48, 96)       # q/k/v read [emb; hidden] = 2d
    assert w["midlayer.self_attn.k_proj.weight"].shape == (16, 96)
    assert w["fc.weight"].shape == (48, 144) and w["lm_head.weight"].shape == (40, 48)
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    ids = ckpt.load_run(run)[1]["d2t"]
    assert torch.equal(torch.arange(40) + w["d2t"], ids)                  # offsets: target id = i + d2t[i]
    assert torch.equal(w["t2d"].nonzero().squeeze(1), ids) and w["t2d"].shape == (64,)
    assert (out / "README.md").is_file() and no_leftovers(tmp_path)


def test_speculators_format_fields_and_tensors(tmp_path, target, verifier):
    run = save_run_dir(tmp_path / "run", drafter_for(target, depth=2, fc_norm=True, norm_output=True))
    out = tmp_path / "spec"
    ex.export(run, "speculators", out, verifier)
    text = (out / "config.json").read_text()
    cfg = json.loads(text)
    assert '"norm_before_residual": false' in text                   # vLLM's reader defaults it to true
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    # never evaluated: the documented fallback, not the trained horizon (ttt_steps 7)
    assert sc["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": ex.FALLBACK_SPECULATIVE_TOKENS,
                                       "verifier_accept_k": 1, "accept_tolerance": 0.0}]
    assert ex.FALLBACK_SPECULATIVE_TOKENS != 7
    assert sc["verifier"] == {"name_or_path": "tiny/llama-verifier", "architectures": ["LlamaForCausalLM"]}
    tl = cfg["transformer_layer_config"]
    assert tl["model_type"] == "llama" and tl["num_hidden_layers"] == 2 and tl["vocab_size"] == 64
    assert tl["tie_word_embeddings"] is False and cfg["tie_word_embeddings"] is False
    assert cfg["draft_vocab_size"] == 40 and cfg["target_hidden_size"] == 48
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True and cfg["norm_before_fc"] is False
    w = load_file(str(out / "model.safetensors"))
    assert {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight", "layers.0.hidden_norm.weight",
            "layers.1.input_layernorm.weight", "layers.1.self_attn.q_proj.weight"} <= set(w)
    assert w["layers.0.self_attn.q_proj.weight"].shape == (48, 96)       # layer 0 reads [emb; hidden]
    assert w["layers.1.self_attn.q_proj.weight"].shape == (48, 48)
    assert not any(k.startswith("midlayer.") or "embed_tokens" in k for k in w)


def test_bfloat16_export_halves_the_weights_and_keeps_the_maps(tmp_path, target, verifier):
    run = save_run_dir(tmp_path / "run", drafter_for(target))
    ex.export(run, "eagle3", tmp_path / "bf16", verifier, dtype="bfloat16")
    w = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert w["fc.weight"].dtype == torch.bfloat16 and w["d2t"].dtype == torch.int64
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"


# -- the independent loader ----------------------------------------------------------------------------------------

CASES = [("eagle3", {}), ("eagle3", dict(fc_norm=True, norm_output=True)), ("speculators", {}),
         ("speculators", dict(depth=2, fc_norm=True, norm_output=True))]


@pytest.mark.parametrize("fmt, kw", CASES, ids=lambda v: v if isinstance(v, str) else "-".join(v) or "plain")
def test_reference_loader_reproduces_kvshot_logits(tmp_path, target, verifier, fmt, kw):
    """An engine-semantics loader, reading only the exported files, gives kvshot's drafter's next-token choice at
    every position and step of a held-out sequence, logits within ATOL (fp32)."""
    drafter = drafter_for(target, seed=3, **kw)
    out = tmp_path / fmt
    ex.export(save_run_dir(tmp_path / "run", drafter), fmt, out, verifier)
    seq = torch.randint(0, 64, (14,), generator=torch.Generator().manual_seed(123))   # not training data
    K = 4
    ref = engine_logits(out, target.model, target.embed_tokens.weight.detach(), seq, K)
    cap = target.capture(seq[None])
    mine = naive_logits(drafter, seq[None], torch.cat(cap.features, -1), None, K)[:, 0]   # [K, T, V_draft]
    full = torch.full_like(ref, float("-inf"))
    full[..., drafter.d2t] = mine
    valid = ~torch.isnan(ref[..., 0])
    assert int(valid.sum()) == sum(max(0, 14 - 1 - k) for k in range(K))
    assert torch.equal(ref[valid].argmax(-1), full[valid].argmax(-1))
    finite = torch.isfinite(full[valid])
    assert torch.equal(finite, torch.isfinite(ref[valid]))                 # the same draft vocabulary
    diff = (ref[valid][finite] - full[valid][finite]).abs().max().item()
    MAX_DIFFS[f"{fmt}-{kw}"] = diff
    print(f"max |logit diff| {fmt} {kw}: {diff:.2e}")
    assert diff < ATOL


def test_both_layer_id_conventions_tap_the_features_kvshot_trained_on(tmp_path, target, verifier):
    out = tmp_path / "e"
    ex.export(save_run_dir(tmp_path / "run", drafter_for(target)), "eagle3", out, verifier)
    eng = EngineDraft(out)
    seq = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(4))
    vllm = eng.aux_hidden(target.model, seq, eng.vllm_layer_ids())
    sglang = eng.aux_hidden(target.model, seq, eng.sglang_capture_ids())
    kvshot = torch.cat(target.capture(seq[None]).features, -1)[0]
    assert torch.equal(vllm, sglang) and torch.allclose(vllm, kvshot.float(), atol=1e-6)
    # an off-by-one export would tap other layers: the reference sees the difference
    shifted = eng.aux_hidden(target.model, seq, [i - 1 for i in eng.vllm_layer_ids()])
    assert not torch.allclose(shifted, kvshot.float(), atol=1e-3)


# -- the round trip ----------------------------------------------------------------------------------------------

def peaked_target():
    """A tiny target with peaked next-token distributions, so a few training steps give real acceptance."""
    t = tiny8()
    with torch.no_grad():
        t.lm_head.weight.normal_(0, 0.6, generator=torch.Generator().manual_seed(0))
    return t


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny eagle3 run trained by the train stage (fp32), and its target."""
    from stages.common import Paths, TargetParams
    from stages.train import DrafterParams, TrainParams, online_source, run

    tgt = peaked_target()
    g = torch.Generator().manual_seed(0)
    convs = [(torch.randint(0, 64, (16 + i % 3,), generator=g).tolist(), [j >= 4 for j in range(16 + i % 3)])
             for i in range(4)]
    src = online_source(tgt, convs)
    run_dir = tmp_path_factory.mktemp("runs") / "scale" / "eagle3"
    params = TrainParams(max_steps=12, batch_size=2, lr=1e-2, precision="fp32", log_every=100, checkpoint_every=100,
                         warmup_ratio=0.1)
    run(DrafterParams(variant="eagle3", draft_vocab_size=48), params, run_dir, Paths(run_dir.parent),
        lambda *a, **k: None, target=TargetParams(), source=src, loaded_target=tgt)
    return run_dir, tgt


def decode_all(drafter, tgt, prompts, spec):
    return [speculative_generate(tgt, p, 24, DrafterProposer(drafter, tgt), spec) for p in prompts]


@pytest.mark.parametrize("fmt", list(ex.FORMATS))
def test_round_trip_decodes_losslessly_with_the_same_tau(tmp_path, trained, fmt):
    from stages.e2e import _setting

    run_dir, tgt = trained
    out = tmp_path / f"export-{fmt}"
    # float32 as trained (the run's target dtype, bfloat16, is the default): the same weights come back
    ex.export(run_dir, fmt, out, ex.Verifier.from_target(tgt, "tiny/peaked"), dtype="float32")
    assert ckpt.trained_run_dirs([out], "none") == [out]              # e2e.checkpoints takes an export
    original, _ = ckpt.load_drafter(run_dir, tgt)
    loaded, config = ckpt.load_drafter(out, tgt)
    assert loaded.config.to_dict() | {"extra": {}} == original.config.to_dict() | {"extra": {}}
    sd, osd = loaded.state_dict(), original.state_dict()
    assert set(sd) == set(osd) and all(torch.equal(sd[k], osd[k]) for k in sd)
    row = _setting(out, config, tmp_path)
    assert row["variant"] == "eagle3" and row["depth"] == 1 and row["scale"] == "small"
    prompts = [torch.randint(0, 64, (10,), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    spec = TreeSpec(4, 2, 8)
    mine, theirs = decode_all(original, tgt, prompts, spec), decode_all(loaded, tgt, prompts, spec)
    for p, a, b in zip(prompts, mine, theirs):
        assert b.tokens == greedy_generate(tgt, p, 24).tokens          # lossless
        assert b.accept_lengths == a.accept_lengths                    # the same drafts accepted, round by round
    tau = sum(sum(r.accept_lengths) for r in theirs) / sum(len(r.accept_lengths) for r in theirs)
    assert tau == sum(sum(r.accept_lengths) for r in mine) / sum(len(r.accept_lengths) for r in mine)
    assert tau > 1.0                                                   # the drafter does draft something


def test_round_trip_of_the_eagle31_options(tmp_path, target, verifier):
    for fmt, kw in (("eagle3", dict(fc_norm=True, norm_output=True)), ("speculators", dict(depth=2, norm_output=True))):
        drafter = drafter_for(target, **kw)
        out = tmp_path / fmt
        ex.export(save_run_dir(tmp_path / f"run-{fmt}", drafter), fmt, out, verifier)
        loaded, _ = ckpt.load_drafter(out, target)
        assert (loaded.config.fc_norm, loaded.config.norm_output, loaded.config.depth) == \
               (drafter.config.fc_norm, drafter.config.norm_output, drafter.config.depth)
        prompt = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(1))
        a = speculative_generate(target, prompt, 16, DrafterProposer(drafter, target), [3, 2, 6])
        b = speculative_generate(target, prompt, 16, DrafterProposer(loaded, target), [3, 2, 6])
        assert a.tokens == b.tokens == greedy_generate(target, prompt, 16).tokens
        assert a.accept_lengths == b.accept_lengths


def test_a_specforge_style_directory_loads_too(tmp_path, target, verifier):
    """Only what SGLang reads (nested output-of-layer ids, rope_theta/rope_scaling, no kvshot provenance)."""
    drafter = drafter_for(target)
    out = tmp_path / "e"
    ex.export(save_run_dir(tmp_path / "run", drafter), "eagle3", out, verifier)
    cfg = json.loads((out / "config.json").read_text())
    for key in ("eagle_aux_hidden_state_layer_ids", "rope_parameters", "kvshot", "norm_before_residual"):
        cfg.pop(key)
    (out / "config.json").write_text(json.dumps(cfg))
    loaded, config = ckpt.load_drafter(out, target)
    assert config["export"]["feature_layers"] == [2, 4, 5]
    sd = drafter.state_dict()
    assert all(torch.equal(v, sd[k]) for k, v in loaded.state_dict().items())


def test_loading_an_export_against_other_tapped_layers_is_an_error(tmp_path, target, verifier):
    out = tmp_path / "e"
    ex.export(save_run_dir(tmp_path / "run", drafter_for(target)), "eagle3", out, verifier)
    other = tiny8()
    other.feature_layers = [1, 4, 5]
    with pytest.raises(StageError, match=r"taps target hidden_states \[2, 4, 5\].*\[1, 4, 5\]"):
        ckpt.load_drafter(out, other)


# -- the card ----------------------------------------------------------------------------------------------------

def test_card_reports_training_data_acceptance_and_serving(tmp_path, target, verifier):
    result = {"alpha": [0.5, 0.25, None, None, None, None, None], "acc": [0.5, 0.4, 0.3, 0.2, 0.1, 0.1, 0.05],
              "mat": 1.9, "retention": 0.1, "n_positions": 321}
    run = save_run_dir(tmp_path / "runs" / "scale" / "eagle3-small", drafter_for(target), result=result)
    ex.export(run, "eagle3", tmp_path / "e", verifier)
    card = (tmp_path / "e" / "README.md").read_text()
    assert "scale/eagle3-small" in card and "4 conversations" in card and "120 tokens" in card
    assert "| step accuracy acc_k | 0.500 | 0.400 |" in card and "| chain acceptance α_k | 0.500 | 0.250 | – |" in card
    assert "mat 1.900" in card and "321 positions" in card
    assert "vllm serve tiny/llama-verifier" in card and "--speculative-algorithm EAGLE3" in card
    assert "[2, 4, 5]" in card and "[1, 3, 4]" in card
    ex.export(save_run_dir(tmp_path / "bare", drafter_for(target)), "speculators", tmp_path / "s", verifier)
    card = (tmp_path / "s" / "README.md").read_text()
    assert "Not evaluated" in card and "vllm serve DIR" in card


# -- what an engine needs to serve it as trained --------------------------------------------------------------------

def _with_target(run: Path, **target) -> Path:
    cfg = json.loads((run / "config.json").read_text())
    cfg["params"]["target"].update(target)
    (run / "config.json").write_text(json.dumps(cfg))
    return run


def test_torch_dtype_and_weights_follow_the_targets_dtype(tmp_path, target, verifier):
    """SGLang serves the draft in the torch_dtype it reads: by default it is the target's, not float32."""
    run = _with_target(save_run_dir(tmp_path / "run", drafter_for(target)), dtype="bfloat16")
    for fmt in ex.FORMATS:
        done = ex.export(run, fmt, tmp_path / fmt, verifier)
        assert done.dtype == "bfloat16" and done.config["torch_dtype"] == "bfloat16"
        assert load_file(str(tmp_path / fmt / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    done = ex.export(run, "eagle3", tmp_path / "fp32", verifier, dtype="float32")      # asked for: as trained
    assert done.config["torch_dtype"] == "float32"
    assert load_file(str(tmp_path / "fp32" / "model.safetensors"))["fc.weight"].dtype == torch.float32
    _with_target(run, dtype="float16")
    assert ex.export(run, "eagle3", tmp_path / "fp16", verifier).config["torch_dtype"] == "float16"


def test_eagle31_options_are_named_only_when_on(tmp_path, target, verifier):
    run = save_run_dir(tmp_path / "run", drafter_for(target, norm_output=True))
    cfg = ex.export(run, "eagle3", tmp_path / "e", verifier).config
    assert cfg["norm_output"] is True and "fc_norm" not in cfg
    cfg = ex.export(run, "speculators", tmp_path / "s", verifier).config     # speculators' config declares both
    assert cfg["norm_output"] is True and cfg["fc_norm"] is False


def test_speculative_tokens_rule():
    # expected tokens per round over (1 + 0.1 n): a weak drafter proposes one token, a strong one several
    assert ex.speculative_tokens_for([0.1] * 7, 7) == 1
    assert ex.speculative_tokens_for([0.145, 0.05, 0.2], 3) == 1
    # the study's small-scale EAGLE-3 (metrics/stepwise/scale.json): chain acceptance 0.383, 0.426, 0.505, ...
    assert ex.speculative_tokens_for([0.383, 0.426, 0.505, 0.604, 0.615, 0.676, 0.690], 7) == 2
    assert ex.speculative_tokens_for([0.8] * 7, 7) == 6
    assert ex.speculative_tokens_for([0.99] * 7, 7) == 7 == ex.speculative_tokens_for([0.99] * 9, 7)
    assert ex.speculative_tokens_for([0.9, None, None], 3) == 1                 # no chain reached step 1
    assert ex.speculative_tokens_for([], 7) == 1


def _spec_tokens(out: Path) -> int:
    cfg = json.loads((out / "config.json").read_text())
    return cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]


def test_speculative_tokens_come_from_the_trials_measured_acceptance(tmp_path, target, verifier):
    strong = {"alpha": [0.8] * 7, "acc": [0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]}
    run = save_run_dir(tmp_path / "a" / "runs" / "scale" / "eagle3-small", drafter_for(target), result=strong)
    done = ex.export(run, "speculators", tmp_path / "s1", verifier)
    assert done.speculative_tokens == _spec_tokens(tmp_path / "s1") == 6
    card = (tmp_path / "s1" / "README.md").read_text()
    assert "Speculative tokens per step: 6" in card and "chain acceptance α_k in `result.json`" in card
    # no result.json: the trial's row in the workspace's metrics/stepwise/<study>.json
    (run / ex.RESULT_FILE).unlink()
    table = tmp_path / "a" / "metrics" / "stepwise" / "scale.json"
    table.parent.mkdir(parents=True)
    table.write_text(json.dumps([{"trial": "other", "alpha": [0.99] * 7},
                                 {"trial": "eagle3-small", "alpha": [0.383, 0.426, 0.505, 0.604, 0.615, 0.676, 0.69]}]))
    ex.export(run, "speculators", tmp_path / "s2", verifier)
    assert _spec_tokens(tmp_path / "s2") == 2
    card = (tmp_path / "s2" / "README.md").read_text()
    assert "`metrics/stepwise/scale.json`" in card and "| chain acceptance α_k | 0.383 |" in card
    # the eagle3 card's serving commands use the same count
    ex.export(run, "eagle3", tmp_path / "e", verifier)
    card = (tmp_path / "e" / "README.md").read_text()
    assert '"num_speculative_tokens": 2' in card and "--speculative-num-steps 2 " in card
    # no measured row at all: the documented fallback; a count given to the export wins
    table.unlink()
    ex.export(run, "speculators", tmp_path / "s3", verifier)
    assert _spec_tokens(tmp_path / "s3") == ex.FALLBACK_SPECULATIVE_TOKENS
    assert "never evaluated" in (tmp_path / "s3" / "README.md").read_text()
    ex.export(run, "speculators", tmp_path / "s4", verifier, num_speculative_tokens=5)
    assert _spec_tokens(tmp_path / "s4") == 5
    with pytest.raises(StageError, match="--speculative-tokens 0"):
        ex.export(run, "speculators", tmp_path / "s5", verifier, num_speculative_tokens=0)
    assert not (tmp_path / "s5").exists()


def test_card_and_warning_name_the_engines_that_load_eagle31_wrong(tmp_path, target, verifier):
    plain = ex.export(save_run_dir(tmp_path / "p", drafter_for(target)), "eagle3", tmp_path / "pe", verifier)
    assert plain.warnings == []
    card = (tmp_path / "pe" / "README.md").read_text()
    assert "## Engines" in card and "| SGLang |" in card and "ignored silently" not in card
    run = save_run_dir(tmp_path / "r", drafter_for(target, fc_norm=True, norm_output=True))
    done = ex.export(run, "eagle3", tmp_path / "e", verifier)
    assert len(done.warnings) == 1 and "\n" not in done.warnings[0]
    assert "SGLang ignores fc_norm.* and norm_output silently" in done.warnings[0]
    card = (tmp_path / "e" / "README.md").read_text()
    sglang = next(ln for ln in card.splitlines() if ln.startswith("| SGLang |"))
    assert "ignored silently" in sglang and "drafts wrong" in sglang
    vllm = next(ln for ln in card.splitlines() if ln.startswith("| vLLM |"))
    assert "older builds drop `norm_output` silently" in vllm
    done = ex.export(run, "speculators", tmp_path / "s", verifier)    # vLLM only: older builds drop norm_output
    assert len(done.warnings) == 1 and "older vLLM builds drop it silently" in done.warnings[0]
    assert ex.export(save_run_dir(tmp_path / "f", drafter_for(target, fc_norm=True)), "speculators",
                     tmp_path / "fs", verifier).warnings == []
    assert "| SGLang | no (it reads the `eagle3` format)" in (tmp_path / "s" / "README.md").read_text()


def test_a_local_verifier_directory_is_read_and_named_by_its_path(tmp_path, target):
    model_dir = tmp_path / "verifier"
    target.model.save_pretrained(model_dir)
    params = ex.TargetParams(source="hub/not-here", dtype="float32")
    v = ex.load_verifier(params, None, str(model_dir))            # the hub name is never looked up
    assert v.name_or_path == str(model_dir.resolve()) and v.num_layers == 8 and v.hidden_size == 48
    ex.export(save_run_dir(tmp_path / "run", drafter_for(target)), "speculators", tmp_path / "s", v)
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(model_dir.resolve())
    assert "engines load it offline" in (tmp_path / "s" / "README.md").read_text()
    other = tmp_path / "other"
    tiny8(hidden_size=64, num_heads=8).model.save_pretrained(other)
    with pytest.raises(StageError, match="hidden size 64"):
        ex.export(save_run_dir(tmp_path / "run2", drafter_for(target)), "eagle3", tmp_path / "o",
                  ex.load_verifier(params, None, str(other)))
    (tmp_path / "empty").mkdir()
    from models.target import TargetLoadError
    with pytest.raises(TargetLoadError, match="without config.json"):
        ex.load_verifier(params, None, str(tmp_path / "empty"))


def test_save_verifier_writes_the_target_as_a_model_directory(tmp_path, target, monkeypatch):
    """The run's target as loaded for training (the embedded GGUF dequantized; here a tiny one) is written."""
    import models.target as mt
    from transformers import AutoModelForCausalLM

    loads = []
    monkeypatch.setattr(mt, "load_target", lambda *a, **k: loads.append((a, k)) or target)
    params = ex.TargetParams(source="embedded", dtype="float32")
    out = tmp_path / "serve" / "verifier"
    v = ex.save_verifier(params, None, out)
    assert [a[:2] for a, _ in loads] == [("embedded", "float32")]
    assert v.name_or_path == str(out.resolve()) and (out / "config.json").is_file()
    back = AutoModelForCausalLM.from_pretrained(out)
    sd = target.model.state_dict()
    assert all(torch.equal(t, sd[k]) for k, t in back.state_dict().items())
    stamp = (out / "config.json").stat().st_mtime_ns
    assert ex.save_verifier(params, None, out).name_or_path == v.name_or_path      # reused, not rewritten
    assert len(loads) == 1
    assert (out / "config.json").stat().st_mtime_ns == stamp and no_leftovers(out.parent)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x").write_text("x")
    with pytest.raises(StageError, match="--save-verifier .*holds no model"):
        ex.save_verifier(params, None, tmp_path / "junk")


# -- bad input ---------------------------------------------------------------------------------------------------

def _kv_run(tmp: Path, target, variant: str) -> Path:
    kw = dict(injection="linear") if variant != "eagle3" else {}
    return save_run_dir(tmp / variant, make_drafter(target, variant=variant, **kw))


BAD = {
    "missing": (lambda tmp, t: tmp / "nope", "eagle3", "does not exist"),
    "empty": (lambda tmp, t: (tmp / "empty").mkdir() or tmp / "empty", "eagle3", "not a finished run"),
    "checkpoint only": (lambda tmp, t: (tmp / "half" / "checkpoint").mkdir(parents=True) or tmp / "half", "eagle3",
                        "has only checkpoint/"),
    "unfinished": (lambda tmp, t: save_run_dir(tmp / "unf", drafter_for(t), summary={"finished": False}), "eagle3",
                   "finished: false"),
    "unknown format": (lambda tmp, t: save_run_dir(tmp / "r", drafter_for(t)), "gguf",
                       "unknown export format; formats: eagle3, speculators"),
    "kv_only": (lambda tmp, t: _kv_run(tmp, t, "kv_only"), "eagle3", "variant 'kv_only' reads the target's KV cache"),
    "hybrid": (lambda tmp, t: _kv_run(tmp, t, "hybrid"), "speculators", "variant 'hybrid' reads the target's KV"),
    "cross_only": (lambda tmp, t: _kv_run(tmp, t, "cross_only"), "eagle3", "variant 'cross_only'"),
    "deep eagle3": (lambda tmp, t: save_run_dir(tmp / "d2", drafter_for(t, depth=2)), "eagle3",
                    "drafter.depth=2 cannot be expressed in format 'eagle3'"),
    "repeated layers": (lambda tmp, t: save_run_dir(tmp / "rep", drafter_for(t), feature_layers=[2, 4, 4]), "eagle3",
                        "repeats a layer"),
    "unsorted layers": (lambda tmp, t: save_run_dir(tmp / "uns", drafter_for(t), feature_layers=[5, 2, 4]), "eagle3",
                        "not in ascending order"),
    "embedding layer": (lambda tmp, t: save_run_dir(tmp / "emb", drafter_for(t), feature_layers=[0, 4, 5]),
                        "speculators", "[0] cannot be expressed"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_and_leaves_no_output(tmp_path, target, verifier, case):
    make, fmt, needle = BAD[case]
    run = make(tmp_path, target)
    out = tmp_path / "out"
    with pytest.raises(StageError) as err:
        ex.export(run, fmt, out, verifier)
    msg = str(err.value)
    assert needle in msg and "\n" not in msg, msg
    if case in ("kv_only", "hybrid", "cross_only"):
        assert "eagle3, speculators" in msg
    assert not out.exists() and no_leftovers(tmp_path)


def test_block_variant_is_named_with_the_formats(tmp_path, target, verifier):
    run = save_run_dir(tmp_path / "blk", drafter_for(target))
    cfg = json.loads((run / "config.json").read_text())
    cfg["drafter"]["variant"] = "block"
    (run / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(StageError, match="variant 'block' is a block drafter.*formats: eagle3, speculators"):
        ex.export(run, "speculators", tmp_path / "out", verifier)
    assert not (tmp_path / "out").exists()


def test_an_export_is_not_a_run_to_export_again(tmp_path, target, verifier):
    ex.export(save_run_dir(tmp_path / "run", drafter_for(target)), "eagle3", tmp_path / "e", verifier)
    with pytest.raises(StageError, match="already an export"):
        ex.export(tmp_path / "e", "speculators", tmp_path / "again", verifier)


def test_an_export_is_not_a_run_to_continue_training(tmp_path, target, verifier):
    from stages.train import copy_run_weights

    ex.export(save_run_dir(tmp_path / "run", drafter_for(target)), "eagle3", tmp_path / "e", verifier)
    with pytest.raises(StageError, match=r"train.continue_from=.*is an export \(eagle3 format\), not a training "
                                         r"run; start from .*run instead"):
        copy_run_weights(drafter_for(target), tmp_path / "e", "eagle3", "train.continue_from=e", "no trained drafter")


def test_a_verifier_of_another_size_is_an_error(tmp_path, target):
    run = save_run_dir(tmp_path / "run", drafter_for(target))
    other = ex.Verifier.from_target(tiny8(hidden_size=64, num_heads=8), "other")
    with pytest.raises(StageError, match="hidden size 64"):
        ex.export(run, "eagle3", tmp_path / "out", other)
    assert not (tmp_path / "out").exists()


def test_a_failure_while_writing_leaves_out_untouched(tmp_path, target, verifier, monkeypatch):
    run = save_run_dir(tmp_path / "run", drafter_for(target))
    out = tmp_path / "out"

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ex, "_fsync_dir_files", broken)
    with pytest.raises(OSError):
        ex.export(run, "eagle3", out, verifier)
    assert not out.exists() and no_leftovers(tmp_path)
    monkeypatch.undo()
    # a previous export stays as it was unless --force; with it, it is replaced whole
    ex.export(run, "eagle3", out, verifier)
    before = (out / "config.json").read_text()
    with pytest.raises(StageError, match="already exists"):
        ex.export(run, "speculators", out, verifier)
    assert (out / "config.json").read_text() == before
    monkeypatch.setattr(ex, "_fsync_dir_files", broken)
    with pytest.raises(OSError):
        ex.export(run, "speculators", out, verifier, overwrite=True)
    assert (out / "config.json").read_text() == before and no_leftovers(tmp_path)
    monkeypatch.undo()
    ex.export(run, "speculators", out, verifier, overwrite=True)
    assert ex.export_format(out) == "speculators" and no_leftovers(tmp_path)


# -- the command -------------------------------------------------------------------------------------------------

def _cli(*args: str):
    from typer.testing import CliRunner

    from pipeline.cli import app

    return CliRunner().invoke(app, list(args))


def test_cli_exports_a_run_whose_target_is_a_local_model(tmp_path, target):
    model_dir = tmp_path / "tiny-model"
    target.model.save_pretrained(model_dir)
    run = save_run_dir(tmp_path / "run", drafter_for(target))
    cfg = json.loads((run / "config.json").read_text())
    cfg["params"]["target"]["source"] = str(model_dir)
    (run / "config.json").write_text(json.dumps(cfg))
    res = _cli("export", str(run), "--format", "speculators", "--out", str(tmp_path / "out"), "--root", str(tmp_path))
    assert res.exit_code == 0, res.output
    spec = json.loads((tmp_path / "out" / "config.json").read_text())["speculators_config"]
    assert spec["verifier"]["name_or_path"] == str(model_dir)
    assert spec["verifier"]["architectures"] == ["LlamaForCausalLM"]
    res = _cli("export", str(run), "--format", "eagle3", "--out", str(tmp_path / "out2"), "--verifier", "org/model")
    assert res.exit_code == 0, res.output
    assert "vllm serve org/model" in (tmp_path / "out2" / "README.md").read_text()


def test_cli_warns_in_one_line_and_says_what_it_chose(tmp_path, target):
    model_dir = tmp_path / "tiny-model"
    target.model.save_pretrained(model_dir)
    run = save_run_dir(tmp_path / "run", drafter_for(target, fc_norm=True), result={"alpha": [0.8] * 7})
    res = _cli("export", str(run), "--format", "eagle3", "--out", str(tmp_path / "out"), "--verifier", str(model_dir))
    assert res.exit_code == 0, res.output
    warned = [ln for ln in res.output.splitlines() if ln.startswith("warning:")]
    assert len(warned) == 1 and "SGLang ignores fc_norm.* and norm_output silently" in warned[0], res.output
    assert "float32, 6 speculative tokens" in res.output and str(model_dir.resolve()) in res.output
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["fc_norm"] is True and "norm_output" not in cfg


@pytest.mark.parametrize("args, needle", [
    (("--format", "onnx"), "formats: eagle3, speculators"),
    (("--format", "eagle3", "--dtype", "int4"), "--dtype 'int4'"),
    (("--format", "eagle3"), "already exists and is not empty"),
    (("--format", "speculators", "--verifier", "x"), "not a finished run"),
    (("--format", "speculators", "--speculative-tokens", "0"), "--speculative-tokens 0"),
    (("--format", "eagle3", "--verifier", "x", "--save-verifier", "y"), "give one"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, target, args, needle):
    run = save_run_dir(tmp_path / "run", drafter_for(target))
    out = tmp_path / "out"
    if "already exists" in needle:
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    if "not a finished" in needle:
        (run / "model.safetensors").unlink()
    res = _cli("export", str(run), *args, "--out", str(out))
    assert res.exit_code == 2
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], res.output
    if "already exists" in needle:
        assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    else:
        assert not out.exists()
    assert no_leftovers(tmp_path)


# -- the speculators package itself (slow: a scratch environment) -------------------------------------------------

SPEC_SCRIPT = r'''
import json, sys
import torch
from safetensors.torch import load_file
from speculators.models.eagle3 import Eagle3SpeculatorConfig
from speculators.models.eagle3.core import Eagle3DraftModel

export_dir, inputs, out = sys.argv[1], sys.argv[2], sys.argv[3]
config = Eagle3SpeculatorConfig.from_pretrained(export_dir)
config.transformer_layer_config._attn_implementation = "eager"     # dense masks on CPU (flex attention needs compile)
model = Eagle3DraftModel.from_pretrained(export_dir, config=config).float().eval()
x = load_file(inputs)
with torch.no_grad():
    model.embed_tokens.weight.copy_(x["embed"])                     # the engines share the verifier's embedding
captured = []
model.lm_head.register_forward_hook(lambda m, i, o: captured.append(o.detach()))
with torch.no_grad():
    tokens = model(hidden_states=x["features"], input_ids=x["input_ids"], document_ids=torch.zeros_like(x["input_ids"]),
                   ttt_steps=int(x["steps"]))
from safetensors.torch import save_file
save_file({"logits": torch.stack([c[0] for c in captured]), "d2t": model.d2t.clone(),
           "tokens": torch.stack([t[0] for t in tokens])}, out)
print(json.dumps({"aux": model.config.eagle_aux_hidden_state_layer_ids, "fc_norm": model.fc_norm is not None,
                  "norm_output": model.config.norm_output, "layers": len(model.layers)}))
'''


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, dict(depth=2, fc_norm=True, norm_output=True)], ids=["plain", "eagle31-d2"])
def test_speculators_package_loads_the_export_and_agrees(tmp_path, target, kw):
    """vllm-project/speculators' own Eagle3SpeculatorConfig / Eagle3DraftModel.from_pretrained read the export;
    its teacher-forced TTT forward gives kvshot's logits (fp32) and the same top-1 at every position and step."""
    from safetensors.torch import save_file

    from tests.vllm_env import speculators_python

    python = str(speculators_python())
    model_dir = tmp_path / "verifier"
    target.model.save_pretrained(model_dir)          # speculators reads the verifier's config (no hub access)
    drafter = drafter_for(target, seed=7, **kw)
    out = tmp_path / "spec"
    ex.export(save_run_dir(tmp_path / "run", drafter), "speculators", out,
              ex.Verifier.from_target(target, str(model_dir)))
    T, K = 12, 3
    seq = torch.randint(0, 64, (T + 1,), generator=torch.Generator().manual_seed(11))
    cap = target.capture(seq[None])
    feats = torch.cat(cap.features, -1)[:, :T].float()
    # speculators pairs the features of t with the token t+1 (and feeds t+1+k at step k, teacher-forced)
    save_file({"features": feats.contiguous(), "input_ids": seq[None, 1:].contiguous(), "steps": torch.tensor(K),
               "embed": target.embed_tokens.weight.detach().float().contiguous()}, str(tmp_path / "in.safetensors"))
    res = subprocess.run([python, "-c", SPEC_SCRIPT, str(out), str(tmp_path / "in.safetensors"),
                          str(tmp_path / "o.safetensors")], capture_output=True, text=True, timeout=600,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["aux"] == [2, 4, 5] and info["layers"] == drafter.config.depth
    assert info["fc_norm"] == drafter.config.fc_norm and info["norm_output"] == drafter.config.norm_output
    got = load_file(str(tmp_path / "o.safetensors"))
    assert torch.equal(torch.arange(40) + got["d2t"], drafter.d2t)
    mine = naive_logits(drafter, seq[None], torch.cat(cap.features, -1), None, K)[:, 0]      # [K, T+1, V_draft]
    for k in range(K):
        n = T - k                                     # positions whose token t+1+k exists in the inputs
        a, b = got["logits"][k, :n], mine[k, :n]
        assert torch.equal(a.argmax(-1), b.argmax(-1)), k
        diff = (a - b).abs().max().item()
        MAX_DIFFS[f"speculators-pkg-{kw}-k{k}"] = diff
        print(f"max |logit diff| speculators package {kw} step {k}: {diff:.2e}")
        assert diff < ATOL, (k, diff)
