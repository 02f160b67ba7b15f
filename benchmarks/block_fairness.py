"""Is the block contrast fair? Step-0 accuracy of the hidden-context block drafter against the drafters with the same
or less information, trained alike on the embedded target's data.

Arms (the block study's shapes): the block drafter with hidden context (depth 2) as it is (its context through key /
value projections of its own) and as it was (`hidden-shared`: the context through the block's own k_proj/v_proj,
the DFlash layout the study's committed rows were trained with), the block drafter with kv context (depth 2), EAGLE-3
(depth 1, 7 TTT steps) and the no-target control (kv_only with the target prefix masked out: token t+1 alone at step
0). Every arm runs the train stage (`stages.train.run`) for the same optimizer steps over the same batches, learning
rate and schedule, and the evaluate stage's step metrics (`stages.evaluate.evaluate_drafter`) on the same held-out
conversations; acc_k is teacher-forced for the autoregressive drafters and free-running for the block ones, so only
acc_0 (one token past what every arm is given) compares across families.

Data: the first conversations of the packaged ShareGPT (one user turn, `stages.prepare.sample_conversations`) with
their original answers (EAGLE-1's fixed-data setting, as the study's rows past `regenerate.original_answers_from`: no
generation), tokenised and run through the target by the features stage's own functions, the default profile's
max_len; the first `--train` for training, the next `--eval` held out. The caches are kept under
scratch/block_fairness/ and reused.

    .venv/bin/python benchmarks/block_fairness.py [--steps 150] [--train 200] [--eval 48] [--lr 1e-3]
                                                  [--block-size 8] [--max-len 384] [--batch-size 4]
                                                  [--arms hidden-shared hidden kv eagle3 control]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stages import train as train_stage  # noqa: E402
from stages.checkpoint import load_drafter  # noqa: E402
from stages.common import Paths, StageError, TargetParams, native_bf16  # noqa: E402
from stages.evaluate import evaluate_drafter  # noqa: E402
from stages.features import FeaturesParams, extract, target_info, tokenize_rows, write_index  # noqa: E402
from stages.prepare import sample_conversations  # noqa: E402
from stages.sections import DrafterParams, TrainParams  # noqa: E402

ARMS = {
    "hidden-shared": dict(variant="block", context="hidden", depth=2),
    "hidden": dict(variant="block", context="hidden", depth=2),
    "kv": dict(variant="block", context="kv", depth=2),
    "eagle3": dict(variant="eagle3"),
    "control": dict(variant="kv_only", no_target=True),
}


def shared_context_projections(model) -> None:
    """The block drafter as the study's rows were trained: the hidden context through the block's own k/v maps."""
    for layer in model.layers:
        attn = layer.self_attn
        attn.context_k_proj, attn.context_v_proj = attn.k_proj, attn.v_proj


@contextmanager
def built_with(hook):
    """The train stage builds its drafter through `stages.train.build_drafter`; `hook` edits it (None: as is)."""
    real = train_stage.build_drafter

    def build(*a, **kw):
        model = real(*a, **kw)
        hook(model)
        return model

    if hook is not None:
        train_stage.build_drafter = build
    try:
        yield
    finally:
        train_stage.build_drafter = real


def caches(target, n_train: int, n_eval: int, max_len: int, work: Path) -> tuple:
    """The training and held-out feature caches (written by the features stage's functions, reused when current)."""
    rows = [dict(r, source="sharegpt") for r in sample_conversations(n_train + n_eval, 1500)]
    if len(rows) < n_train + n_eval:
        raise StageError(f"block_fairness: the packaged ShareGPT gave {len(rows)} conversations, "
                         f"{n_train + n_eval} asked")
    params = FeaturesParams(max_len=max_len, shard_size=125, batch_size=8)
    info = target_info(target, TargetParams())
    out = []
    for name, part in (("small", rows[:n_train]), ("eval", rows[n_train:])):
        directory = work / "data" / "features" / name
        fingerprint = {"bench": "block_fairness", "rows": len(part), "max_len": max_len, "target": info}
        drops: list = []
        items = tokenize_rows(part, target.tokenizer, max_len, drops)
        t0 = time.perf_counter()
        records = extract(items, directory, params, target, fingerprint, by_rank=False)
        write_index(directory, name, items, records, params, info, Counter(r for _, r in drops), fingerprint)
        print(f"features {name}: {len(items)} conversations, {sum(len(it.ids) for it in items):,} tokens "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        out.append(train_stage.open_cache(directory, target, f"block_fairness {name}"))
    return tuple(out)


def run_arm(name: str, target, train_src, eval_src, params: TrainParams, runs: Path, block_size: int) -> dict:
    """Train one arm with the train stage, then its step counts on the held-out conversations."""
    spec = ARMS[name]
    drafter = DrafterParams(**spec, **({"block_size": block_size} if spec["variant"] == "block" else {}))
    run_dir = runs / name
    hook = shared_context_projections if name == "hidden-shared" else None
    t0 = time.perf_counter()
    with built_with(hook):
        summary = train_stage.run(drafter, params, run_dir, Paths(runs), lambda metrics, step=None: None,
                                  target=TargetParams(), source=train_src, loaded_target=target)
    train_s = time.perf_counter() - t0
    model, _ = load_drafter(run_dir, target)
    steps = model.config.steps or params.ttt_steps
    counts = evaluate_drafter(model, eval_src, target.lm_head.weight.detach(), steps, batch_size=4,
                              precision=params.precision)
    total = counts[0]
    for c in counts[1:]:
        total = total + c
    return {"acc": total.acc, "positions": total.valid[0], "s_per_step": train_s / summary["steps"],
            "loss": summary["final_loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps of every arm")
    ap.add_argument("--train", type=int, default=200, help="training conversations (the default profile's small)")
    ap.add_argument("--eval", type=int, default=48, help="held-out conversations")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=8,
                    help="block positions; the autoregressive arms unroll block_size - 1 TTT steps")
    ap.add_argument("--lr", type=float, default=1e-3, help="the study profile's")
    ap.add_argument("--max-len", type=int, default=384, help="the default profile's features.max_len")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from models.target import load_target

    work = ROOT / "scratch" / "block_fairness"
    target = load_target("embedded", dtype="bfloat16", cache_dir=ROOT / "scratch" / "models")
    train_src, eval_src = caches(target, args.train, args.eval, args.max_len, work)
    precision = "bf16" if native_bf16() else "fp32"
    params = TrainParams(max_steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup_ratio=0.05,
                         ttt_steps=args.block_size - 1,
                         precision=precision, seed=args.seed, checkpoint_every=10**6, log_every=10**6)
    print(f"{args.steps} steps x {args.batch_size} conversations of {len(train_src)}, lr {args.lr}, {precision}, "
          f"{args.block_size - 1} predicted tokens, max_len {args.max_len}; "
          f"held out: {len(eval_src)} conversations", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        for name in args.arms:
            r = results[name] = run_arm(name, target, train_src, eval_src, params, Path(tmp), args.block_size)
            print(f"{name:14s} acc_0 {r['acc'][0]:.3f}  acc_1 {r['acc'][1]:.3f}  acc_6 {r['acc'][-1]:.3f}  "
                  f"({r['positions']} positions, final loss {r['loss']:.3f}, {r['s_per_step']:.2f} s/step)",
                  flush=True)
    print("summary: acc_0 " + ", ".join(f"{n} {r['acc'][0]:.3f}" for n, r in results.items())
          + f" ({args.steps} steps x {args.batch_size}, lr {args.lr}, block {args.block_size}, seed {args.seed})")


if __name__ == "__main__":
    main()
