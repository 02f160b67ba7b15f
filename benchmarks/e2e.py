"""End-to-end decoding speed on this machine: the embedded SmolLM2 (bf16) on a few ShareGPT prompts.

Prints tokens/s of plain greedy `generate` (the reference), our loop with speculation off, transformers'
prompt-lookup decoding, and tree speculative decoding with a drafter (a trained run dir via --checkpoint, else
an untrained one) at a small CPU tree and at the paper's (8, 10, 60); an oracle drafter (the target's own greedy
continuation) gives the ceiling of each tree. `--lookup N` adds n-gram lookup alone through our loop and the
drafter with a lookup branch of up to N tokens grafted onto its trees. Also the target's verify cost t(n)/t(1).
Ends with one summary line.

    .venv/bin/python benchmarks/e2e.py [--checkpoint runs/scale/<trial>] [--cpu-tree 4,2,8 5,2,10] [--prompts 8]
                                       [--lookup 8]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from models.decoding import (DecodeResult, DrafterProposer, LookupProposer, OracleProposer, TreeSpec,  # noqa: E402
                             greedy_generate, lossless_at_near_tie, prompt_lookup_generate, speculative_generate)
from models.decoding.block_proposer import BlockProposer  # noqa: E402
from models.decoding.generate import device_clock  # noqa: E402
from models.quant import quantize_linears_int8  # noqa: E402
from models.target import Target, load_target  # noqa: E402


def sharegpt_prompts(n: int, max_chars: int = 600, workspace: Path = ROOT) -> list[str]:
    """First n held-out ShareGPT conversations that open with a non-empty human turn of modest length (the
    workspace's prepared data first, when the pipeline has produced it). A held-out conversation with a segment
    among the training rows (prepared files written before prepare dropped those) is skipped."""
    prepared = workspace / "data" / "prepared" / "sharegpt.jsonl"
    out: list[str] = []
    if prepared.is_file():
        import json

        from stages.prepare import conversation_of

        rows = [json.loads(line) for line in prepared.open()]
        trained = {conversation_of(r["id"]) for r in rows if r.get("split") == "train"}
        for row in rows:
            if row.get("split", "eval") != "eval" or conversation_of(row["id"]) in trained:
                continue
            first = next((m["content"] for m in row["messages"] if m["role"] == "user"), "")
            if first.strip() and len(first) <= max_chars:
                out.append(first)
            if len(out) == n:
                return out
    from stages.prepare import sample_conversations

    if prepared.is_file():
        print(f"note: {workspace} has {len(out)} clean held-out prompts; the other {n - len(out)} come from the "
              "packaged ShareGPT sample and may be among its training rows", file=sys.stderr)
    out += [row["messages"][0]["content"] for row in sample_conversations(n - len(out), max_chars)]
    return out


def build_drafter(target: Target, checkpoint: str | None, variant: str):
    if checkpoint:
        from stages.checkpoint import load_drafter

        drafter, config = load_drafter(Path(checkpoint), target)
        return drafter, f"{drafter.config.variant}({Path(checkpoint).name})"
    from models.build import build_drafter as build_module
    from models.drafter_config import DrafterConfig

    torch.manual_seed(0)
    drafter = build_module(DrafterConfig.from_target(target, variant=variant, draft_vocab_size=8192))
    drafter.load_target_weights(target.embed_tokens.weight, target.lm_head.weight)
    return drafter.eval(), f"{variant}(untrained)"


@torch.no_grad()
def verify_cost(target: Target, prefix: int = 300, sizes=(1, 4, 8, 16, 32, 60), repeats: int = 5) -> dict[int, float]:
    """Seconds of one target forward over n new tokens after a `prefix`-token cache (4D mask), median of repeats."""
    from models.decoding.tree import chain_tree
    from models.decoding.verify import cache_length, prefill, tree_attention_mask

    ids = torch.randint(100, 10000, (prefix,), generator=torch.Generator().manual_seed(0))
    cap, _ = prefill(target, ids)
    cache = cap.cache
    out = {}
    for n in sizes:
        tree = chain_tree(1, list(range(2, n + 1)))
        times = []
        clock = device_clock(target.device)
        for _ in range(repeats):
            t0 = clock()
            target.capture(tree.tokens[None], attention_mask=tree_attention_mask(tree, prefix, target.dtype),
                           position_ids=tree.positions(prefix)[None], past_key_values=cache)
            times.append(clock() - t0)
            cache.crop(prefix - cache_length(cache))
        out[n] = statistics.median(times)
    return out


class Tally:
    """Per-method totals over prompts."""

    def __init__(self):
        self.tokens = self.seconds = self.draft = self.verify = 0.0
        self.lengths: list[float] = []
        self.rounds = 0
        self.exact = self.lossless = self.n = 0

    def add(self, res: DecodeResult, ref: DecodeResult, tol: float) -> None:
        self.tokens += len(res.tokens)
        self.seconds += res.seconds
        self.draft += res.draft_seconds
        self.verify += res.verify_seconds
        self.rounds += res.rounds
        self.lengths.append(res.tau * res.rounds)
        check = lossless_at_near_tie(ref.tokens, ref.logits, res.tokens, tol)
        self.exact += check.exact
        self.lossless += check.lossless
        self.n += 1

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tau(self) -> float:
        return sum(self.lengths) / self.rounds if self.rounds else 1.0


def round_cost(t: Tally, greedy_tps: float) -> str:
    """Where a round of our loop goes, in units of one plain greedy step (1 / greedy tok/s): the target's
    verification forward, the proposer, and the rest (prefill, cache compaction, bookkeeping). 2x needs
    τ / round >= 2."""
    if not t.verify or not t.rounds:
        return ""
    step = 1.0 / greedy_tps
    per = lambda x: x / t.rounds / step  # noqa: E731
    return (f"{per(t.seconds):.2f} = {per(t.verify):.2f} + {per(t.draft):.2f} + "
            f"{per(t.seconds - t.verify - t.draft):.2f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--checkpoint", default=None, help="a trained run dir (runs/<study>/<trial>)")
    ap.add_argument("--variant", default="eagle3", help="untrained drafter variant when no --checkpoint")
    ap.add_argument("--cpu-tree", nargs="+", default=["4,2,8"],
                    help="depth,top_k,total_tokens of the small CPU tree(s); each is measured")
    ap.add_argument("--paper-tree", default="8,10,60")
    ap.add_argument("--tie-tolerance", type=float, default=0.25)
    ap.add_argument("--no-oracle", action="store_true")
    ap.add_argument("--lookup", type=int, default=0, help="lookup branch of up to N tokens (0: none)")
    ap.add_argument("--workspace", type=Path, default=ROOT, help="the workspace whose held-out prompts to decode")
    ap.add_argument("--int8", action="store_true",
                    help="also decode the small trees with the drafter's linears in int8 (weight-only)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    target = load_target("embedded", dtype=args.dtype, cache_dir=ROOT / "scratch" / "models")
    tok = target.tokenizer
    eos = tok.eos_token_id
    texts = sharegpt_prompts(args.prompts, workspace=args.workspace)
    prompts = [torch.tensor(target.chat_ids([{"role": "user", "content": t}], add_generation_prompt=True))
               for t in texts]
    drafter, dname = build_drafter(target, args.checkpoint, args.variant)
    drafters = {dname: drafter} | ({f"{dname}/int8": quantize_linears_int8(drafter)} if args.int8 else {})
    cpu_trees = [TreeSpec.of([int(x) for x in t.split(",")]) for t in args.cpu_tree]
    trees = {("cpu" if len(cpu_trees) == 1 else "cpu" + str(tuple(t.as_list())).replace(" ", "")): t
             for t in cpu_trees}
    trees["paper"] = TreeSpec.of([int(x) for x in args.paper_tree.split(",")])
    n_new = args.max_new_tokens

    cost = verify_cost(target)
    print(f"verify cost t(n)/t(1) after a 300-token prefix (t(1) = {cost[1] * 1e3:.1f} ms): "
          + ", ".join(f"n={n}: {c / cost[1]:.2f}" for n, c in cost.items()))

    greedy_generate(target, prompts[0], 8, eos_token_id=eos)   # warm-up
    # every drafted method: (name, drafter, tree, lookup tokens); the paper tree is a GPU setting, decoded by the
    # native drafter alone
    drafted = [(f"{d} {k}", model, spec, 0) for k, spec in trees.items() for d, model in drafters.items()
               if d == dname or k != "paper"]
    if args.lookup:
        drafted += [(f"{d}+lookup {k}", model, spec, args.lookup) for k, spec in trees.items()
                    for d, model in drafters.items() if k != "paper"]
    methods = ["greedy", "spec-off", "prompt-lookup"] + (["lookup (our loop)"] if args.lookup else [])
    methods += [name for name, *_ in drafted]
    if not args.no_oracle:
        methods += [f"oracle {k}" for k in trees]
    tally = {m: Tally() for m in methods}
    for i, prompt in enumerate(prompts):
        ref = greedy_generate(target, prompt, n_new, eos_token_id=eos, keep_logits=True)
        full = prompt.tolist() + ref.tokens
        runs = {"greedy": ref,
                "spec-off": speculative_generate(target, prompt, n_new, eos_token_id=eos),
                "prompt-lookup": prompt_lookup_generate(target, prompt, n_new, eos_token_id=eos)}
        if args.lookup:
            runs["lookup (our loop)"] = speculative_generate(target, prompt, n_new, LookupProposer(None, args.lookup),
                                                             [0, 1, 1], eos_token_id=eos)
        for name, model, spec, lookup in drafted:
            proposer = BlockProposer(model, target) if model.config.variant == "block" else \
                DrafterProposer(model, target)
            runs[name] = speculative_generate(target, prompt, n_new,
                                              LookupProposer(proposer, lookup) if lookup else proposer, spec,
                                              eos_token_id=eos)
        if not args.no_oracle:
            for k, spec in trees.items():
                # bf16 verification can leave plain greedy at a near-tie, after which greedy's text is no oracle:
                # a first pass finds the loop's own output, the timed pass proposes exactly that
                first = speculative_generate(target, prompt, n_new, OracleProposer(full), spec, eos_token_id=eos)
                own = prompt.tolist() + first.tokens
                runs[f"oracle {k}"] = speculative_generate(target, prompt, n_new, OracleProposer(own), spec,
                                                           eos_token_id=eos)
        for m, res in runs.items():
            tally[m].add(res, ref, args.tie_tolerance)
        print(f"prompt {i + 1}/{len(prompts)}: {prompt.numel()} prompt tokens, {len(ref.tokens)} new; "
              + ", ".join(f"{m} {r.tokens_per_s:.1f}" for m, r in runs.items()), flush=True)

    base = tally["greedy"].tps
    print(f"\n{'method':<36} {'tok/s':>7} {'vs greedy':>9} {'tau':>5} {'draft %':>7} {'exact':>6} {'lossless':>8}"
          f"  {'round = verify + draft + rest, in greedy steps':>46}")
    for m, t in tally.items():
        print(f"{m:<36} {t.tps:7.1f} {t.tps / base:8.2f}x {t.tau:5.2f} {100 * t.draft / t.seconds:6.1f}% "
              f"{t.exact:>3}/{t.n:<2} {t.lossless:>5}/{t.n}  {round_cost(t, base)}")
    trees_s = " ".join(f"{k}={v.as_list()}" for k, v in trees.items())
    parts = [f"greedy {base:.1f} tok/s", f"spec-off {tally['spec-off'].tps / base:.2f}x",
             f"prompt-lookup {tally['prompt-lookup'].tps / base:.2f}x (tau {tally['prompt-lookup'].tau:.2f})"]
    for m in methods[3:]:
        t = tally[m]
        parts.append(f"{m} {t.tps / base:.2f}x (tau {t.tau:.2f}, draft {100 * t.draft / t.seconds:.0f}%)")
    lossless = all(t.lossless == t.n for t in tally.values())
    print(f"\nSUMMARY e2e {args.dtype} {len(prompts)} prompts x {n_new} tokens, {trees_s}: " + "; ".join(parts)
          + f"; lossless {'yes' if lossless else 'NO'}")


if __name__ == "__main__":
    main()
