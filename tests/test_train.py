"""The train stage on a tiny target: run directory contents, learning, bit-exact resume, ckpt init, bad input."""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stages import checkpoint as ckpt
from stages.common import Paths, StageError, TargetParams
from stages.train import (DrafterParams, online_source, TrainParams, batch_indices, lr_factor, run, total_steps)

ROOT = Path(__file__).resolve().parent.parent


def peaked_target(seed: int = 0):
    """A tiny random target whose next-token distributions are peaked (a random one is near uniform, which
    leaves a drafter nothing to learn)."""
    from models.target import tiny_target

    t = tiny_target("llama", num_layers=6, hidden_size=48, num_heads=6, num_kv_heads=2, vocab_size=64, seed=seed)
    with torch.no_grad():
        t.lm_head.weight.normal_(0, 0.6, generator=torch.Generator().manual_seed(seed))
    return t


def conversations(n: int = 4, T: int = 16, seed: int = 0) -> list[tuple[list[int], list[bool]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = T + i % 3
        out.append((torch.randint(0, 64, (L,), generator=g).tolist(), [j >= 4 for j in range(L)]))
    return out


@pytest.fixture(scope="module")
def target():
    return peaked_target()


@pytest.fixture(scope="module")
def source(target):
    return online_source(target, conversations())


class Log:
    def __init__(self):
        self.rows: list[tuple[int | None, dict]] = []

    def __call__(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))


def train(tmp: Path, target, source, drafter: DrafterParams | None = None, **kw):
    stop_after = kw.pop("stop_after", None)
    init_from = kw.pop("init_from", None)
    params = TrainParams(**{**dict(max_steps=6, batch_size=2, lr=3e-3, precision="fp32", log_every=1,
                                   checkpoint_every=2, warmup_ratio=0.2), **kw})
    log = Log()
    summary = run(drafter or DrafterParams(variant="eagle3", draft_vocab_size=48), params, tmp, Paths(tmp.parent),
                  log, target=TargetParams(), source=source, loaded_target=target, stop_after=stop_after,
                  init_from=init_from)
    return summary, log


# -- pure helpers ------------------------------------------------------------------------------------------------

def test_schedule_warms_up_then_decays_to_zero():
    f = [lr_factor(s, 100, 0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))
    assert f[-1] < 0.01
    assert lr_factor(0, 10, 0.0) == 1.0


def test_every_conversation_once_per_epoch_and_order_is_a_function_of_step():
    n, b = 7, 3
    per_epoch = math.ceil(n / b)
    for epoch in range(2):
        seen = sum((batch_indices(epoch * per_epoch + i, n, b, seed=1) for i in range(per_epoch)), [])
        assert sorted(seen) == list(range(n))
    assert batch_indices(4, n, b, 1) == batch_indices(4, n, b, 1)
    assert batch_indices(0, n, b, 1) != batch_indices(per_epoch, n, b, 1) or n <= b
    assert total_steps(TrainParams(epochs=2, batch_size=3), n) == 6
    assert total_steps(TrainParams(epochs=0.5, batch_size=3), n) == 2
    assert total_steps(TrainParams(max_steps=5), n) == 5


# -- the stage ---------------------------------------------------------------------------------------------------

def test_run_writes_config_and_model(tmp_path, target, source):
    run_dir = tmp_path / "eagle3"
    summary, log = train(run_dir, target, source, max_steps=3)
    assert summary["finished"] and summary["steps"] == 3 and summary["tokens"] > 0
    cfg, weights = ckpt.load_run(run_dir)
    assert cfg["drafter"]["variant"] == "eagle3" and cfg["draft_vocab_size"] == 48
    assert cfg["params"]["train"]["max_steps"] == 3 and cfg["summary"]["finished"]
    assert "embed_tokens.weight" not in weights           # the frozen target embedding is not duplicated
    assert weights["d2t"].shape == (48,) and weights["t2d"].sum() == 48
    assert not (run_dir / ckpt.CHECKPOINT_DIR).exists()   # checkpoints go once the final model is in place
    steps = [s for s, _ in log.rows]
    assert steps == [1, 2, 3]
    m = log.rows[-1][1]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "loss_0", "loss_6", "acc_0", "alpha_0", "alpha_6"):
        assert key in m, key
    assert all(math.isfinite(m[k]) for k in ("loss", "lr", "tokens_per_s", "loss_0", "acc_0"))
    # the saved drafter reloads with the target's embedding and gives the trained weights back
    model, _ = ckpt.load_drafter(run_dir, target)
    for k, v in weights.items():
        assert torch.equal(model.state_dict()[k], v), k
    assert torch.equal(model.embed_tokens.weight, target.embed_tokens.weight.float())
    # the draft vocabulary is the most frequent loss-masked tokens of the training data
    counts = source.token_counts(64).tolist()
    top = sorted(sorted(range(64), key=lambda t: (-counts[t], t))[:48])
    assert weights["d2t"].tolist() == top
    # a finished run is not trained again
    again, log2 = train(run_dir, target, source, max_steps=3)
    assert again["steps"] == 3 and log2.rows == []


def test_loss_falls_when_overfitting(tmp_path, target):
    src = online_source(target, conversations(n=2, T=12))
    summary, log = train(tmp_path / "fit", target, src, max_steps=40, lr=1e-2, batch_size=2, log_every=1,
                         warmup_ratio=0.0)
    losses = [m["loss"] for _, m in log.rows]
    # the soft cross-entropy cannot go below the target's own entropy, so "falls" is relative to the start
    assert losses[-1] < 0.3 * losses[0] and losses[-1] < min(losses[:20]), losses
    assert log.rows[-1][1]["acc_0"] >= 0.9 > log.rows[0][1]["acc_0"]


def test_resume_is_bit_exact(tmp_path, target, source):
    whole, _ = train(tmp_path / "whole", target, source)
    part, _ = train(tmp_path / "split", target, source, stop_after=3)
    assert not part["finished"] and ckpt.latest_checkpoint(tmp_path / "split").name == "step-0000003"
    rest, log = train(tmp_path / "split", target, source)
    assert rest["finished"] and [s for s, _ in log.rows] == [4, 5, 6]
    a = load_file(tmp_path / "whole" / ckpt.MODEL_FILE)
    b = load_file(tmp_path / "split" / ckpt.MODEL_FILE)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_resume_after_a_real_kill(tmp_path, target, source):
    """A subprocess training with a checkpoint every step is killed with SIGKILL; the restarted run ends with
    the weights of an uninterrupted one."""
    run_dir = tmp_path / "killed"
    script = tmp_path / "job.py"
    script.write_text(f"""
import sys, time, torch
sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(Path(__file__).parent)!r})
torch.set_num_threads({torch.get_num_threads()})   # same reduction order as this process
from test_train import peaked_target, conversations, train
from stages.train import online_source
from pathlib import Path
t = peaked_target()
slow = online_source(t, conversations())
fast_batch = slow.batch
def batch(idx):
    time.sleep(0.3)           # leaves the parent time to kill mid-run
    return fast_batch(idx)
slow.batch = batch
train(Path({str(run_dir)!r}), t, slow, max_steps=6, checkpoint_every=1)
""")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            latest = ckpt.latest_checkpoint(run_dir)
            if latest is not None and int(latest.name.split("-")[1]) >= 2:
                break
            if proc.poll() is not None:
                pytest.fail(f"training subprocess ended early: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.05)
        else:
            pytest.fail("training subprocess made no checkpoint in time")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert not ckpt.is_trained(run_dir)
    resumed_from = ckpt.latest_checkpoint(run_dir).name
    rest, log = train(run_dir, target, source, max_steps=6, checkpoint_every=1)
    assert rest["finished"] and log.rows[0][0] == int(resumed_from.split("-")[1]) + 1 < 6
    whole, _ = train(tmp_path / "whole", target, source, max_steps=6, checkpoint_every=1)
    a, b = load_file(run_dir / ckpt.MODEL_FILE), load_file(tmp_path / "whole" / ckpt.MODEL_FILE)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("variant", ["hybrid", "cross_only"])
def test_ckpt_init_loads_the_eagle3_weights(tmp_path, target, source, variant):
    from stages.train import build_drafter, init_from_parent

    parent = tmp_path / "eagle3"
    train(parent, target, source, max_steps=2)
    _, eagle = ckpt.load_run(parent)
    child = DrafterParams(variant=variant, init="ckpt", draft_vocab_size=48)
    model = build_drafter(target, child, source.token_counts(64))
    info = init_from_parent(model, parent, child)
    own = model.state_dict()
    shared = [k for k in eagle if k in own]
    assert info["loaded"] == len(shared) and "fc.weight" in shared and "lm_head.weight" in shared
    for k in shared:
        assert torch.equal(own[k], eagle[k]), k
    assert any("cross_attn" in k for k in info["new"])
    summary, _ = train(tmp_path / variant, target, source, child, max_steps=2, init_from=parent)
    assert summary["finished"] and summary["loaded"] == len(shared)


def test_continue_from_starts_at_the_trained_weights(tmp_path, target, source):
    from stages.train import build_drafter, continue_training

    parent = tmp_path / "first"
    train(parent, target, source, max_steps=2)
    _, first = ckpt.load_run(parent)
    model = build_drafter(target, DrafterParams(variant="eagle3", draft_vocab_size=48), source.token_counts(64))
    info = continue_training(model, parent, DrafterParams(variant="eagle3", draft_vocab_size=48))
    own = {k: v for k, v in model.state_dict().items() if k not in ckpt.FROZEN}
    assert info["loaded"] == len(own) == len(first)
    for k in own:
        assert torch.equal(own[k], first[k]), k
    summary, _ = train(tmp_path / "more", target, source, max_steps=2, continue_from="first")
    assert summary["finished"] and summary["continued_from"] == "first"
    _, more = ckpt.load_run(tmp_path / "more")
    assert torch.equal(more["d2t"], first["d2t"]) and not torch.equal(more["fc.weight"], first["fc.weight"])
    with pytest.raises(StageError, match="holds a 'eagle3' drafter") as e:
        train(tmp_path / "kv", target, source, DrafterParams(variant="kv_only", draft_vocab_size=48), max_steps=1,
              continue_from="first")
    assert "\n" not in str(e.value)
    with pytest.raises(StageError, match="no trained drafter"):
        train(tmp_path / "none", target, source, max_steps=1, continue_from="missing")


def test_continued_eagle3_starts_from_every_tensor_of_its_parent(tmp_path, target, source):
    """init=continued (the compute-matched control of a ckpt child) is the parent continued for a full schedule."""
    parent = tmp_path / "eagle3"
    train(parent, target, source, max_steps=2)
    _, first = ckpt.load_run(parent)
    control = DrafterParams(variant="eagle3", init="continued", draft_vocab_size=48)
    summary, _ = train(tmp_path / "continued", target, source, control, max_steps=2, init_from=parent)
    assert summary["finished"] and summary["loaded"] == len(first) and summary["continued_from"] == str(parent)
    _, more = ckpt.load_run(tmp_path / "continued")
    assert torch.equal(more["d2t"], first["d2t"]) and not torch.equal(more["fc.weight"], first["fc.weight"])
    with pytest.raises(StageError, match="continues a trained eagle3") as e:
        train(tmp_path / "bad", target, source, DrafterParams(variant="hybrid", init="continued",
                                                                 draft_vocab_size=48), max_steps=1)
    assert "\n" not in str(e.value)


def test_bad_inputs_are_one_line_stage_errors(tmp_path, target, source):
    child = DrafterParams(variant="hybrid", init="ckpt", draft_vocab_size=48)
    with pytest.raises(StageError, match="init_from") as e:
        train(tmp_path / "a", target, source, child, max_steps=1)
    assert "\n" not in str(e.value)
    with pytest.raises(StageError, match="no trained eagle3") as e:
        train(tmp_path / "b", target, source, child, max_steps=1, init_from=tmp_path / "missing")
    assert "\n" not in str(e.value)
    with pytest.raises(StageError, match="no feature cache") as e:
        run(DrafterParams(), TrainParams(scale="nowhere", max_steps=1), tmp_path / "c", Paths(tmp_path), Log(),
            target=TargetParams(), loaded_target=target)
    assert "\n" not in str(e.value)


def write_cache(directory: Path, target, convs, name: str = "small") -> Path:
    """A feature cache written by the features stage's own writer (fp32, two conversations a shard)."""
    from stages.features import FeaturesParams, Item, extract, target_info, write_index

    params = FeaturesParams(shard_size=2, batch_size=2, dtype="float32")
    items = [Item(f"c{i}", "test", i, ids, [int(m) for m in mask]) for i, (ids, mask) in enumerate(convs)]
    records = extract(items, directory, params, target, {}, by_rank=True)
    write_index(directory, name, items, records, params, target_info(target, TargetParams()), {}, {})
    return directory


def test_trains_from_the_feature_cache(tmp_path, target):
    convs = conversations(n=5)
    write_cache(tmp_path / "data" / "features" / "small", target, convs)
    paths = Paths(tmp_path)
    params = TrainParams(max_steps=3, batch_size=2, precision="fp32", lr=3e-3)
    summary = run(DrafterParams(variant="kv_only", draft_vocab_size=8), params, tmp_path / "runs" / "kv",
                  paths, Log(), target=TargetParams(), loaded_target=target)
    assert summary["finished"] and summary["conversations"] == 5
    seen = sum((batch_indices(s, 5, 2, params.seed) for s in range(3)), [])
    assert summary["tokens"] == sum(len(convs[i][0]) for i in seen)
    # the draft vocabulary is the 8 most frequent loss-masked tokens of the cache (ties to the lower id)
    from collections import Counter

    c = Counter(t for ids, mask in convs for t, m in zip(ids, mask) if m)
    top = sorted(sorted(c, key=lambda t: (-c[t], t))[:8])
    _, weights = ckpt.load_run(tmp_path / "runs" / "kv")
    assert weights["d2t"].tolist() == top
    # online (the target run here on the cache's tokens) trains the same drafter as the fp32 cache
    online = run(DrafterParams(variant="kv_only", draft_vocab_size=8), params.model_copy(update={"online": True}),
                 tmp_path / "runs" / "kv_online", paths, Log(), target=TargetParams(), loaded_target=target)
    assert online["finished"]
    _, w2 = ckpt.load_run(tmp_path / "runs" / "kv_online")
    for k in weights:
        assert torch.allclose(weights[k].float(), w2[k].float(), atol=1e-5), k


def test_cache_of_another_target_is_refused(tmp_path, target):
    from models.target import tiny_target

    other = tiny_target("llama", num_layers=6, hidden_size=24, num_heads=6, num_kv_heads=2, vocab_size=64)
    write_cache(tmp_path / "data" / "features" / "small", other, conversations(n=2))
    with pytest.raises(StageError, match="hidden_size=24") as e:
        run(DrafterParams(), TrainParams(max_steps=1), tmp_path / "r", Paths(tmp_path), Log(),
            target=TargetParams(), loaded_target=target)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("context", ["hidden", "kv", "both"])
def test_block_drafters_train_resume_and_evaluate(tmp_path, target, source, context):
    """The block variant through the same train stage: anchors drawn per step as a pure function of (seed, step),
    so a killed run resumes to the same weights; the evaluate stage scores block position k+1 as step k."""
    from stages.evaluate import EvalParams
    from stages.evaluate import run as evaluate

    block = DrafterParams(variant="block", context=context, block_size=5, draft_vocab_size=48)
    whole, _ = train(tmp_path / "whole", target, source, block, max_steps=4, block_anchors=3)
    assert whole["finished"]
    half, _ = train(tmp_path / "half", target, source, block, max_steps=4, block_anchors=3, stop_after=2)
    assert not half["finished"]
    rest, _ = train(tmp_path / "half", target, source, block, max_steps=4, block_anchors=3)
    a, b = load_file(tmp_path / "whole" / ckpt.MODEL_FILE), load_file(tmp_path / "half" / ckpt.MODEL_FILE)
    assert a.keys() == b.keys() and "mask_embedding" in a
    for k in a:
        assert torch.equal(a[k], b[k]), k
    rows = evaluate(EvalParams(batch_size=2), [tmp_path / "whole"], Paths(tmp_path), Log(), target=TargetParams(),
                    source=source, loaded_target=target)
    r = rows[0]
    assert r["variant"] == "block" and r["context"] == context and r["block_size"] == 5
    assert len(r["acc"]) == 4 and r["train_steps"] == 4 and r["train_s_per_step"] > 0
    with pytest.raises(StageError, match="block_size / drafter.context are options of the block variant"):
        train(tmp_path / "bad", target, source, DrafterParams(variant="eagle3", context="kv", draft_vocab_size=48),
              max_steps=1)


def test_length_buckets_keep_each_epoch_whole_and_shrink_padding():
    """Bucketed batches: still a pure function of the step, every conversation once per epoch, the short batch
    last, window 1 the plain permutation, and less padding than the plain order."""
    g = torch.Generator().manual_seed(0)
    n, b = 103, 4
    lengths = torch.randint(40, 360, (n,), generator=g)
    per_epoch = math.ceil(n / b)

    def padding(window: int, epoch: int) -> int:
        total = 0
        for i in range(per_epoch):
            idx = batch_indices(epoch * per_epoch + i, n, b, 5, lengths, window)
            total += sum(int(lengths[idx].max() - lengths[j]) for j in idx)
        return total

    for epoch in range(2):
        batches = [batch_indices(epoch * per_epoch + i, n, b, 5, lengths, 8) for i in range(per_epoch)]
        assert sorted(sum(batches, [])) == list(range(n))
        assert [len(x) for x in batches] == [b] * (per_epoch - 1) + [n % b]
        assert batches == [batch_indices(epoch * per_epoch + i, n, b, 5, lengths.tolist(), 8)
                           for i in range(per_epoch)]
        assert padding(8, epoch) < 0.5 * padding(1, epoch)
    assert [batch_indices(s, n, b, 5, lengths, 1) for s in range(per_epoch)] == \
        [batch_indices(s, n, b, 5) for s in range(per_epoch)]
    assert batch_indices(0, n, b, 5, lengths, 8) != batch_indices(per_epoch, n, b, 5, lengths, 8)


def test_bucketed_run_resumes_bit_exactly(tmp_path, target):
    """With length buckets the data order is still a function of the step: a resumed run ends where a whole one
    does, having seen every conversation of the epoch."""
    src = online_source(target, conversations(n=6, T=10))
    whole, _ = train(tmp_path / "whole", target, src, bucket_window=2, max_steps=3)
    train(tmp_path / "split", target, src, bucket_window=2, max_steps=3, stop_after=1)
    rest, _ = train(tmp_path / "split", target, src, bucket_window=2, max_steps=3)
    assert rest["finished"] and whole["tokens"] == rest["tokens"] == sum(len(i) for i, _ in conversations(n=6, T=10))
    a = load_file(tmp_path / "whole" / ckpt.MODEL_FILE)
    b = load_file(tmp_path / "split" / ckpt.MODEL_FILE)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_old_cache_without_the_top1_trains_the_same_drafter(tmp_path, target):
    """A cache written before the target's top-1 was stored trains the same weights (the teacher then takes the
    two-matmul route) as one that has it."""
    from test_features import strip_top1

    convs = conversations(n=4)
    params = TrainParams(max_steps=2, batch_size=2, precision="fp32", lr=3e-3)
    weights = []
    for name, strip in (("new", False), ("old", True)):
        root = tmp_path / name
        cache = write_cache(root / "data" / "features" / "small", target, convs)
        if strip:
            strip_top1(cache)
        run(DrafterParams(variant="eagle3", draft_vocab_size=40), params, root / "runs" / "e", Paths(root), Log(),
            target=TargetParams(), loaded_target=target)
        weights.append(ckpt.load_run(root / "runs" / "e")[1])
    for k in weights[0]:
        torch.testing.assert_close(weights[0][k].float(), weights[1][k].float(), atol=1e-5, rtol=1e-5, msg=k)
