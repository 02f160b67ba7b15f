"""Progress in logs: off a terminal every stage loop prints lines with done/total, rate and time left."""
from __future__ import annotations

import io
import json
import re

import pytest
import torch
from rich.console import Console

from stages.common import Paths, StageProgress, TargetParams, write_text_atomic

# `<label>: <done>/<total> <unit> ...`: a progress line as a log shows it
LINE = re.compile(r"^(?P<label>[^:\n]+): (?P<done>[\d,.]+)/(?P<total>[\d,.]+) (?P<unit>\S+)", re.M)


def _lines(text: str, label: str) -> list[re.Match]:
    return [m for m in LINE.finditer(text) if m["label"].startswith(label)]


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_log_gets_a_line_every_interval_and_at_the_end():
    out, clock = io.StringIO(), Clock()
    console = Console(file=out, force_terminal=False, width=200)
    with StageProgress(console, every_s=20, clock=clock) as bar:
        assert not bar.live
        task = bar.add_task("regenerate sharegpt", total=400, unit="conv", note="{tokens:,} tok", tokens=0)
        clock.t = 10
        bar.advance(task, 40, tokens=5000)         # within the interval: nothing yet
        assert out.getvalue() == ""
        clock.t = 25
        bar.advance(task, 60, tokens=12345)        # 100 conv in 25 s: 4 conv/s, 300 left -> 75 s
        clock.t = 30
        bar.advance(task, 1)
        clock.t = 100
        bar.update(task, completed=400)
    lines = out.getvalue().splitlines()
    assert lines == ["regenerate sharegpt: 100/400 conv (25%), 4.0 conv/s, 1:15 left; 12,345 tok",
                     "regenerate sharegpt: 400/400 conv in 1:40, 4.0 conv/s; 12,345 tok"]


def test_slow_rates_read_per_minute_and_a_terminal_gets_a_live_bar_instead():
    out, clock = io.StringIO(), Clock()
    with StageProgress(Console(file=out, force_terminal=False), every_s=20, clock=clock) as bar:
        task = bar.add_task("train depth/kv_only-d1", total=100, unit="steps")
        clock.t = 120
        bar.advance(task, 1)
        clock.t = 130                               # stopped short of its total: a last line on the way out
        bar.advance(task, 1)
    assert out.getvalue().splitlines() == [
        "train depth/kv_only-d1: 1/100 steps (1%), 0.5 steps/min, 3:18:00 left",
        "train depth/kv_only-d1: 2/100 steps (2%), 0.9 steps/min, 1:46:10 left"]
    live = StageProgress(Console(file=io.StringIO(), force_terminal=True))
    assert live.live


def test_skipped_items_move_the_count_but_not_the_rate():
    """Regenerate drops over-long prompts at once: a line made of those alone shows no time left, and the rate
    later counts only the conversations really generated."""
    out, clock = io.StringIO(), Clock()
    with StageProgress(Console(file=out, force_terminal=False, width=200), every_s=20, clock=clock) as bar:
        task = bar.add_task("regenerate sharegpt", total=400, unit="conv", completed=100)
        clock.t = 22
        bar.skip(task, 1)
        clock.t = 60
        bar.advance(task, 60)                       # 60 generated in 60 s: 1 conv/s, 239 left
    assert out.getvalue().splitlines() == ["regenerate sharegpt: 101/400 conv (25%)",
                                           "regenerate sharegpt: 161/400 conv (40%), 1.0 conv/s, 3:59 left"]


# -- every stage, with a captured (non-terminal) output ------------------------------------------------------------

def test_regenerate_prints_progress(tmp_path, capsys):
    from stages.regenerate import RegenerateParams, regenerate_rows
    from test_regenerate import EchoBackend, conv

    regenerate_rows([conv(i) for i in range(5)], tmp_path / "out.jsonl", RegenerateParams(batch_size=2, window=1),
                    TargetParams(), Paths(tmp_path), backend=EchoBackend(), label="regenerate uc")
    (line,) = _lines(capsys.readouterr().err, "regenerate uc")
    assert (line["done"], line["total"], line["unit"]) == ("5", "5", "conv")
    assert re.search(r"; 21 tok, \d+ tok/s$", line.string[line.start():].splitlines()[0])   # counted live


def test_features_prints_progress(tmp_path, capsys):
    from test_features import tokens_only_cache

    tokens_only_cache(tmp_path)
    (line,) = _lines(capsys.readouterr().err, "features")
    assert line["done"] == line["total"] and line["unit"] == "tok" and "4 conv" in line.string


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny target and a drafter trained on it for a few steps (train prints its progress too)."""
    from stages.train import DrafterParams, TrainParams, online_source
    from stages.train import run as train_run
    from test_train import conversations, peaked_target

    target = peaked_target()
    run_dir = tmp_path_factory.mktemp("runs") / "study" / "kv_only-d1"
    train_run(DrafterParams(variant="kv_only", draft_vocab_size=40),
              TrainParams(max_steps=4, batch_size=2, precision="fp32", log_every=2), run_dir, Paths(run_dir),
              lambda m, step=None: None, target=TargetParams(), source=online_source(target, conversations(n=4)),
              loaded_target=target)
    return target, run_dir


def test_train_prints_progress(tmp_path, capsys):
    from stages.train import DrafterParams, TrainParams, online_source
    from stages.train import run as train_run
    from test_train import conversations, peaked_target

    target = peaked_target()
    run_dir = tmp_path / "runs" / "depth" / "eagle3"
    train_run(DrafterParams(variant="eagle3", draft_vocab_size=40),
              TrainParams(max_steps=3, batch_size=2, precision="fp32", log_every=1), run_dir, Paths(tmp_path),
              lambda m, step=None: None, target=TargetParams(), source=online_source(target, conversations(n=4)),
              loaded_target=target)
    (line,) = _lines(capsys.readouterr().err, "train depth/eagle3")
    assert (line["done"], line["total"], line["unit"]) == ("3", "3", "steps") and "loss" in line.string


def test_evaluate_prints_progress(tiny_run, tmp_path, capsys):
    from stages.evaluate import EvalParams, run
    from stages.train import online_source
    from test_train import conversations

    target, run_dir = tiny_run
    run(EvalParams(batch_size=2), [run_dir], Paths(tmp_path), lambda m, step=None: None, target=TargetParams(),
        source=online_source(target, conversations(n=3, T=14, seed=1)), loaded_target=target)
    err = capsys.readouterr().err
    (line,) = _lines(err, "eval kv_only-d1")
    assert (line["done"], line["total"], line["unit"]) == ("3", "3", "conv")
    summary = next(ln for ln in err.splitlines() if ln.startswith("eval kv_only-d1: acc_6"))
    assert "nan" not in summary and re.search(r"α_6 (–|\d\.\d{3}) ± (–|\d\.\d{3}) \(se, \d+ chains\)", summary)


def test_e2e_prints_progress(tmp_path, embedded_target, capsys):
    from models.drafter import Drafter
    from models.drafter_config import DrafterConfig
    from stages.checkpoint import save_run, trainable_weights
    from stages.e2e import E2EParams, run

    torch.manual_seed(0)
    cfg = DrafterConfig.from_target(embedded_target, variant="eagle3", draft_vocab_size=256)
    run_dir = tmp_path / "runs" / "depth" / "eagle3"
    save_run(run_dir, {"drafter": cfg.to_dict(), "params": {"drafter": {}, "train": {}}},
             trainable_weights(Drafter(cfg)))
    prompts = tmp_path / "prompts.jsonl"
    write_text_atomic(prompts, json.dumps({"id": "0", "source": "t", "messages": [
        {"role": "user", "content": "Say hello."}]}) + "\n")
    params = E2EParams(prompts=str(prompts), num_prompts=1, max_new_tokens=4, paper_tree=[2, 1, 2],
                       tree_candidates=[[2, 1, 2], [2, 2, 3]], prompt_lookup=False, lookup_tokens=0)
    run(params, [run_dir], Paths(tmp_path), lambda m, step=None: None, target=TargetParams(),
        loaded_target=embedded_target)
    err = capsys.readouterr().err
    # the last line of each task (a slow machine prints intermediate ones too)
    tune, decode = _lines(err, "e2e tune trees")[-1], _lines(err, "e2e decode")[-1]
    assert tune["done"] == tune["total"] == "2"          # each candidate on the one prompt
    assert decode["done"] == decode["total"] == "4"      # greedy, spec_off, the tuned tree, the paper's
    assert decode["unit"] == "decodes"
    # one candidate: nothing to choose between, so no tuning decodes and no tuning line
    rows = run(params.model_copy(update={"tree_candidates": [[2, 2, 3]]}), [run_dir], Paths(tmp_path),
               lambda m, step=None: None, target=TargetParams(), loaded_target=embedded_target)
    err = capsys.readouterr().err
    assert not _lines(err, "e2e tune trees") and _lines(err, "e2e decode")[0]["total"] == "4"
    assert rows[0]["tree_kind"] == "tuned" and rows[0]["tree"] == [2, 2, 3]
