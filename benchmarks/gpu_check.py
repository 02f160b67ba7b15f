"""The CUDA check: every `gpu` test, then one TTT optimizer step per drafter at the paper's shapes, on one GPU.

Needs only what a stock CUDA PyTorch image has (torch, transformers, safetensors, pytest, numpy); it imports
`models/` and `tests/`, never the pipeline. In order:
  1. `pytest -m gpu tests/test_gpu.py`: the fused TTT attention against the masked joint softmax (fp32 and bf16,
     gradients too), its peak memory at T = 16384 (no T x T scores), every drafter variant's TTT unroll and every
     block drafter's unroll against the step-by-step references (fp32 and bf16 autocast; fp32 loss and gradients
     equal to the CPU's), and lossless fp32 chain and tree decoding on small random Llama and Qwen3 targets for
     every drafter family;
  2. the step benchmark: Qwen3-8B drafter shapes (hidden 4096, 32 heads / 8 KV heads, head_dim 128, SwiGLU 12288,
     vocabulary 151,936, draft vocabulary 32k), seq 2048, K = 7, batch 1, every position scored; random target
     features, KV (3 layers), last hidden state with the cached top-1; bf16 autocast, fp32 weights, AdamW. Per
     drafter (eagle3, kv_only depth 1 and 4, hybrid) the median step time (forward, backward, clip, AdamW), loss
     tokens per second and the peak memory the step allocates above the model, its optimizer state and the batch;
     beside each, the same step with the TTT attention through the masked joint softmax (the T x T scores), which
     is what CUDA ran before the fused kernels served it (`--no-masked` skips it).

    python benchmarks/gpu_check.py [--out DIR] [--seq 2048] [--repeats 5] [--skip-tests] [--no-masked]

Writes DIR/gpu_check.json (device, versions, the tests' outcome, the step figures) and DIR/gpu_tests.log.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import models.layers  # noqa: E402
from models.drafter import Drafter  # noqa: E402
from models.drafter_config import DrafterConfig  # noqa: E402
from models.ttt import ttt_unroll  # noqa: E402

QWEN3_8B = dict(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=12288,
                vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0)
DRAFTERS = {
    "eagle3": dict(variant="eagle3", depth=1),
    "kv_only-d1": dict(variant="kv_only", depth=1),
    "kv_only-d4": dict(variant="kv_only", depth=4),
    "hybrid": dict(variant="hybrid", depth=1),
}


def run_tests(out: Path) -> dict:
    """`pytest -m gpu` over tests/test_gpu.py; its log to out/gpu_tests.log; the counts from its summary line."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           "tests/test_gpu.py"], cwd=ROOT, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    (out / "gpu_tests.log").write_text(log)
    summary = [line for line in log.splitlines() if " in " in line and ("passed" in line or "failed" in line)]
    print("\n".join(log.splitlines()[-25:]), flush=True)
    return dict(returncode=proc.returncode, summary=summary[-1] if summary else "no summary line",
                seconds=round(time.perf_counter() - t0, 1))


def paper_batch(T: int, draft_vocab: int, dev: torch.device, seed: int = 0) -> dict:
    """Random target tensors at Qwen3-8B's shapes, bf16 as the feature cache stores them; the head's draft rows
    scaled up so the target's argmax lands in the draft vocabulary (as a frequency-chosen vocabulary does)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    d, V, Hkv, hd = QWEN3_8B["hidden_size"], QWEN3_8B["vocab_size"], QWEN3_8B["num_kv_heads"], QWEN3_8B["head_dim"]
    bf = torch.bfloat16

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(bf)

    head = torch.randn(V, d, generator=g, device=dev) * d ** -0.5
    head[:draft_vocab] *= 3
    head = head.to(bf)
    hidden = randn(1, T, d)
    top = torch.nn.functional.linear(hidden, head).max(-1)
    return dict(input_ids=torch.randint(0, V, (1, T), generator=g, device=dev),
                loss_mask=torch.ones(1, T, device=dev), features=randn(1, T, 3 * d),
                target_kv=[(randn(1, Hkv, T, hd), randn(1, Hkv, T, hd)) for _ in range(3)],
                target_hidden=hidden, lm_head_weight=head, target_top1=top.indices,
                target_top1_logit=top.values.float())


@contextmanager
def attention_path(masked: bool):
    """The TTT attention through the fused kernels (the default) or, masked=True, through the masked joint softmax
    that builds the T x T scores (what CUDA ran before the fused path served it)."""
    real = models.layers.causal_lse_kernel
    if masked:
        models.layers.causal_lse_kernel = lambda q: None
    try:
        yield
    finally:
        models.layers.causal_lse_kernel = real


def step_figures(name: str, spec: dict, data: dict, steps: int, repeats: int, draft_vocab: int,
                 masked: bool = False) -> dict:
    """Median time of one TTT optimizer step and the peak memory it allocates above what it starts with."""
    dev = data["input_ids"].device
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig(draft_vocab_size=draft_vocab, **spec, **QWEN3_8B)).to(dev).train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)

    def one_step():
        with torch.autocast("cuda", dtype=torch.bfloat16), attention_path(masked):
            out = ttt_unroll(drafter, steps=steps, **data)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        return out

    one_step()                                   # allocates the optimizer state; warms up the kernels
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = one_step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    peak = torch.cuda.max_memory_allocated() - base
    t = statistics.median(times)
    loss_tokens = sum(out.counts.valid)          # scored (position, step) pairs: what one step trains
    row = dict(drafter=name, attention="masked" if masked else "fused",
               params_M=round(sum(p.numel() for p in params) / 1e6, 1), step_s=round(t, 4),
               step_s_all=[round(x, 4) for x in times], peak_step_GiB=round(peak / 2**30, 2),
               resident_GiB=round(base / 2**30, 2), loss_tokens=loss_tokens, loss_tokens_per_s=round(loss_tokens / t))
    del drafter, opt, out
    torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "scratch" / "gpu_check")))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--drafters", nargs="+", default=list(DRAFTERS), choices=list(DRAFTERS))
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--no-masked", action="store_true", help="skip the masked path's step (the comparison)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device on this machine", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    import transformers

    dev = torch.device("cuda")
    result = dict(device=torch.cuda.get_device_name(dev), capability=list(torch.cuda.get_device_capability(dev)),
                  torch=torch.__version__, cuda=torch.version.cuda, transformers=transformers.__version__,
                  shapes=dict(**QWEN3_8B, draft_vocab=args.draft_vocab, seq=args.seq, steps=args.steps, batch=1))
    print(f"gpu_check on {result['device']} (sm {result['capability']}), torch {result['torch']}, "
          f"CUDA {result['cuda']}, transformers {result['transformers']}", flush=True)
    if not args.skip_tests:
        result["tests"] = run_tests(args.out)
        print(f"gpu tests: {result['tests']['summary']} (exit {result['tests']['returncode']})", flush=True)
    data = paper_batch(args.seq, args.draft_vocab, dev)
    rows = []
    print(f"TTT step at Qwen3-8B drafter shapes, seq {args.seq}, K={args.steps}, bf16 autocast, AdamW:", flush=True)
    for name in args.drafters:
        for masked in (False,) if args.no_masked else (False, True):
            try:
                row = step_figures(name, DRAFTERS[name], data, args.steps, args.repeats, args.draft_vocab, masked)
            except Exception as exc:          # one drafter's failure must not hide the others' figures
                row = dict(drafter=name, attention="masked" if masked else "fused",
                           error=f"{type(exc).__name__}: {exc}"[:500])
            rows.append(row)
            print("  " + json.dumps(row), flush=True)
            (args.out / "gpu_check.json").write_text(json.dumps(dict(result, step=rows), indent=1))
    result["step"] = rows
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    print(summary_table(rows))
    failed = result.get("tests", {}).get("returncode", 0) != 0 or any("error" in r for r in rows)
    print("gpu_check: " + ("FAILED" if failed else "all checks passed"), flush=True)
    return 1 if failed else 0


def summary_table(rows: list[dict]) -> str:
    """Per drafter: the fused step's time and peak memory, as multiples of eagle3's, and of the masked path's."""
    got = {(r["drafter"], r["attention"]): r for r in rows if "step_s" in r}
    base = got.get(("eagle3", "fused"))
    lines = [f"{'drafter':<12} {'step s':>7} {'x eagle3':>9} {'peak GiB':>9} {'resident GiB':>13} "
             f"{'loss tok/s':>11} {'time vs masked':>15} {'peak vs masked':>15}"]
    for r in rows:
        if r.get("attention") != "fused":
            continue
        if "step_s" not in r:
            lines.append(f"{r['drafter']:<12} FAILED {r['error']}")
            continue
        m = got.get((r["drafter"], "masked"))
        vs_t = f"{r['step_s'] / m['step_s']:.2f}" if m else "-"
        vs_m = f"{r['peak_step_GiB'] / m['peak_step_GiB']:.2f}" if m else "-"
        x = f"{r['step_s'] / base['step_s']:.2f}" if base else "-"
        lines.append(f"{r['drafter']:<12} {r['step_s']:>7.3f} {x:>9} {r['peak_step_GiB']:>9.2f} "
                     f"{r['resident_GiB']:>13.2f} {r['loss_tokens_per_s']:>11} {vs_t:>15} {vs_m:>15}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
