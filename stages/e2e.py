"""e2e: lossless tree speculative decoding with trained drafters: tau, tokens/s, speedup -> metrics/e2e.json.

For each trained drafter: the fastest of `tree_candidates` (picked on TUNE_PROMPTS prompts set apart from the
measured ones; a single candidate is taken without tuning) and the paper's tree are decoded over every measured
prompt; plain greedy `generate` on the same prompts, in the same run, is the speedup reference.
Methods take turns on each prompt (not one method over all prompts, then the next), so the ratios survive a drift
of the machine's speed.
With `lookup_tokens > 0` each drafter is also decoded with a prompt-lookup branch grafted onto its tree (row kind
`tuned_lookup`, its own fastest candidate), and lookup alone through the same loop is a baseline beside
transformers' prompt lookup.
Every output is checked against plain greedy: in fp32 it must be identical; in bf16 it may leave greedy only at a
near-tie (top-2 logit gap <= tie_tolerance).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import Field, field_validator

from stages.code_hash import DECODE_CODE, code_hash
from stages.common import Paths, Report, Section, StageError, TargetParams, load_target_for, read_jsonl, \
    write_json_atomic

EVAL_SPLIT = "eval"
TUNE_PROMPTS = 2     # prompts the CPU tree is chosen on


class E2EParams(Section):
    prompts: str | None = None            # prompt JSONL (conversation schema); default: held-out regenerated
    num_prompts: int = Field(8, ge=1)
    max_new_tokens: int = Field(96, ge=1)
    paper_tree: list[int] = [8, 10, 60]   # [depth, top_k, total_tokens]
    tree_candidates: list[list[int]] = [[3, 2, 6], [4, 2, 8], [5, 3, 12], [6, 4, 16]]
    # block drafters draft every level in one pass, so deeper, narrower trees pay off: their own candidates
    # (depth is capped at the block's B-1 predicted tokens; top_k 1 is the chain of the block's top-1 tokens)
    block_tree_candidates: list[list[int]] = [[7, 1, 8], [4, 2, 8], [6, 2, 12], [7, 3, 16]]
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    tie_tolerance: float = Field(0.25, ge=0)   # bf16 near-tie: top-2 logit gap at a first divergence
    checkpoints: list[str] = []           # extra run dirs to decode with
    prompt_lookup: bool = True            # also measure transformers' prompt-lookup decoding
    lookup_tokens: int = Field(0, ge=0)   # n-gram lookup branch grafted onto each drafter's tree (0: none)
    lookup_ngram: int = Field(3, ge=1)    # longest n-gram the lookup matches
    drafter_weights: Literal["native", "int8"] = "native"   # int8: the drafters' linears weight-only int8
    # serving engines beside kvshot's own loop: vllm serves every drafter with vLLM's CPU build (EAGLE-3 heads by
    # their export, the others through kvshot's proposer; its own environment, built once in scratch/vllm-env) at
    # each of engine_draft_tokens -> metrics/engine.json
    engines: list[Literal["kvshot", "vllm"]] = ["kvshot"]
    engine_draft_tokens: list[int] = [3]
    engine_eager: bool = False            # skip vLLM's torch.compile: starts in seconds, decodes slower

    @field_validator("engines")
    @classmethod
    def _kvshot_decodes(cls, v: list[str]) -> list[str]:
        if "kvshot" not in v:
            raise ValueError("kvshot decodes every drafter (the engines are compared with it): list it, e.g. "
                             "[kvshot, vllm]")
        return v

    @field_validator("engine_draft_tokens")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if not v or any(k < 1 for k in v):
            raise ValueError("draft lengths of at least 1, e.g. [3]")
        return v


def first_user_turns(rows: list[dict], where: str) -> list[str]:
    """The first user message of each conversation row (rows without one are skipped)."""
    out = []
    for row in rows:
        msgs = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(msgs, list):
            raise StageError(f"{where}: a row has no 'messages' list")
        text = next((m.get("content") for m in msgs if isinstance(m, dict) and m.get("role") == "user"), None)
        if isinstance(text, str) and text.strip():
            out.append(text)
    return out


def load_prompts(params: E2EParams, paths: Paths) -> list[str]:
    """`e2e.prompts`, else the held-out split of the regenerated (or prepared) conversations: up to
    num_prompts + TUNE_PROMPTS of them (`split_prompts` sets the tuning ones apart)."""
    want = params.num_prompts + TUNE_PROMPTS
    if params.prompts:
        texts = first_user_turns(read_jsonl(Path(params.prompts)), f"e2e.prompts={params.prompts}")
        if not texts:
            raise StageError(f"e2e.prompts={params.prompts}: no conversation has a user message")
        return texts[:want]
    for folder in (paths.root / "data" / "regenerated", paths.root / "data" / "prepared"):
        rows = [r for f in sorted(folder.glob("*.jsonl")) for r in read_jsonl(f) if r.get("split") == EVAL_SPLIT]
        texts = first_user_turns(rows, str(folder))
        if texts:
            return texts[:want]
    raise StageError("e2e: no prompts (no held-out rows in data/regenerated or data/prepared; run prepare and "
                     "regenerate, or set e2e.prompts=PATH)")


def split_prompts(texts: list, num_prompts: int) -> tuple[list, list, bool]:
    """(the prompts trees are tuned on, the measured prompts, whether those two are apart). A tree chosen by speed on
    the prompts it is then measured on would flatter it, so the first TUNE_PROMPTS are set apart when there are
    enough for num_prompts beside them; else (a short prompt file) trees are tuned on the first measured ones, and
    the rows say so."""
    if len(texts) >= num_prompts + TUNE_PROMPTS:
        return texts[:TUNE_PROMPTS], texts[TUNE_PROMPTS:TUNE_PROMPTS + num_prompts], True
    return texts[:min(TUNE_PROMPTS, len(texts))], texts[:num_prompts], False


def _tally(results: list, refs: list, tol: float, exact_required: bool) -> dict[str, Any]:
    from models.decoding import lossless_at_near_tie

    tokens = sum(len(r.tokens) for r in results)
    seconds = sum(r.seconds for r in results)
    base_tokens = sum(len(r.tokens) for r in refs)
    base_seconds = sum(r.seconds for r in refs)
    # tokens per verification round over all prompts; transformers' loops give only counts (see DecodeResult.tau)
    lengths = sum(sum(r.accept_lengths) if r.accept_lengths else len(r.tokens) - 1 for r in results)
    rounds = sum(len(r.accept_lengths) if r.accept_lengths else r.rounds for r in results)
    checks = [lossless_at_near_tie(ref.tokens, ref.logits, r.tokens, tol) for r, ref in zip(results, refs)]
    tps, base = tokens / seconds, base_tokens / base_seconds
    # every prompt's sums, which the report resamples for τ and speedup intervals (paired: same prompts, same refs)
    per_prompt = {"accepted": [sum(r.accept_lengths) if r.accept_lengths else len(r.tokens) - 1 for r in results],
                  "rounds": [len(r.accept_lengths) if r.accept_lengths else r.rounds for r in results],
                  "tokens": [len(r.tokens) for r in results], "seconds": [round(r.seconds, 6) for r in results],
                  "greedy_tokens": [len(r.tokens) for r in refs], "greedy_seconds": [round(r.seconds, 6) for r in refs]}
    return {"tau": lengths / rounds if rounds else 1.0, "tokens_per_s": tps, "baseline_tokens_per_s": base,
            "speedup": tps / base, "draft_time_share": sum(r.draft_seconds for r in results) / seconds,
            "exact_match": sum(c.exact for c in checks) / len(checks),
            "lossless": all(c.exact if exact_required else c.lossless for c in checks),
            "max_tie_gap": max((c.gap for c in checks if c.gap is not None), default=0.0), "per_prompt": per_prompt}


def _relative(path: Path, root: Path) -> str:
    """A run dir as written in metrics: relative to the workspace when inside it (metrics travel between clones)."""
    try:
        return str(Path(path).resolve().relative_to(Path(root).resolve()))
    except ValueError:
        return str(path)


def _setting(run_dir: Path, config: dict, root: Path) -> dict[str, Any]:
    d, t, dr = (config.get("params", {}).get("drafter", {}), config.get("params", {}).get("train", {}),
                config.get("drafter", {}))
    return {"trial": Path(run_dir).name, "study": Path(run_dir).parent.name, "variant": dr.get("variant"),
            "depth": dr.get("depth"),
            "injection": d.get("injection", dr.get("injection")), "rope_fix": d.get("rope_fix", dr.get("rope_fix")),
            "init": d.get("init"), "scale": t.get("scale"), "seed": t.get("seed"), "run_dir": _relative(run_dir, root),
            **{k: True for k in ("fc_norm", "norm_output", "no_target", "token_context") if dr.get(k)},
            **({k: dr.get(k) for k in ("block_size", "context")} if dr.get("variant") == "block" else {})}


def run(params: E2EParams, run_dirs, paths: Paths, report: Report, *, target: TargetParams,
        loaded_target: Any = None, keep_others: bool = False, **_: Any) -> list[dict]:
    """Decode with every drafter in `run_dirs`; writes metrics/e2e.json (and metrics/engine.json) and returns its
    own rows. `keep_others` (a run that decodes some drafters: a study, a part) keeps the files' rows of the other
    drafters decoded before (`rows_of_others`), written first, so that an interruption loses none of them.

    Trees are tuned first (on prompts of their own, `split_prompts`); then every method decodes prompt by prompt,
    one method after another on the same prompt, so that a drift of the machine's speed during the run reaches every
    row alike.
    """
    import torch

    from models.decoding import greedy_generate
    from stages import checkpoint as ckpt
    from stages.common import StageProgress

    run_dirs = ckpt.trained_run_dirs(
        run_dirs, "e2e: no trained drafters (train a study marked e2e, or set e2e.checkpoints=[RUN_DIR])")
    tgt = loaded_target or load_target_for(target.model_copy(update={"dtype": params.dtype}), paths)
    eos = tgt.tokenizer.eos_token_id if tgt.tokenizer is not None else None
    tune_texts, texts, apart = split_prompts(load_prompts(params, paths), params.num_prompts)
    tune_prompts, prompts = ([torch.tensor(tgt.chat_ids([{"role": "user", "content": t}], add_generation_prompt=True))
                              for t in group] for group in (tune_texts, texts))
    methods = baseline_methods(tgt, params, eos)
    greedy_generate(tgt, prompts[0], 4, eos_token_id=eos)              # warm-up
    with StageProgress() as bar:
        plan, settings = tune_drafters(run_dirs, tgt, params, eos, tune_prompts, methods, paths.root, bar)
        results: dict[str, list] = {name: [] for name in methods}
        task = bar.add_task("e2e decode", total=len(prompts) * len(methods), unit="decodes")
        for p in prompts:
            for name, decode in methods.items():
                results[name].append(decode(p))
                bar.advance(task)

    tally = {name: _tally(out, results["greedy"], params.tie_tolerance, params.dtype == "float32")
             for name, out in results.items()}
    baselines = baseline_fields(tally, params)
    report({"baseline_tokens_per_s": tally["greedy"]["tokens_per_s"], **baselines})
    rows: list[dict] = []
    for name, setting, kind, spec, lookup in plan:
        row = {**setting, "tree": spec.as_list(), "tree_kind": kind, "lookup_tokens": lookup, **tally[name],
               **baselines, "status": "ok", "dtype": params.dtype, "drafter_weights": params.drafter_weights,
               "num_prompts": len(prompts), "tuned_on": "held-out prompts" if apart else "measured prompts",
               "max_new_tokens": params.max_new_tokens, "tie_tolerance": params.tie_tolerance,
               "code": code_hash(patterns=DECODE_CODE)}
        rows.append(row)
        report({f"{row['trial']}/{kind}/{key}": float(row[key]) for key in   # one MLflow series per drafter
                ("tau", "tokens_per_s", "speedup", "draft_time_share", "exact_match", "lossless")})
    write_json_atomic(paths.e2e_metrics, [*(rows_of_others(paths.e2e_metrics, run_dirs) if keep_others else []), *rows])
    serve_with_engines(params, run_dirs, settings, prompts, tgt, target, paths, report, keep_others)
    return rows


def drafted(tgt, params: E2EParams, eos: int | None, drafter, spec, lookup: int) -> Callable:
    """decode(prompt) with `drafter` proposing `spec`'s tree (and, with `lookup`, an n-gram branch beside it)."""
    from models.decoding import LookupProposer, speculative_generate
    from stages.vllm_proposer import kvshot_proposer

    def decode(p):
        inner = kvshot_proposer(drafter, tgt)
        proposer = LookupProposer(inner, lookup, params.lookup_ngram) if lookup else inner
        return speculative_generate(tgt, p, params.max_new_tokens, proposer, spec, eos_token_id=eos)
    return decode


def baseline_methods(tgt, params: E2EParams, eos: int | None) -> dict[str, Callable]:
    """Every method without a drafter: name -> decode(prompt); plain greedy first (the reference of every other)."""
    from models.decoding import LookupProposer, greedy_generate, prompt_lookup_generate, speculative_generate

    n_new = params.max_new_tokens
    methods = {"greedy": lambda p: greedy_generate(tgt, p, n_new, eos_token_id=eos, keep_logits=True),
               "spec_off": lambda p: speculative_generate(tgt, p, n_new, eos_token_id=eos)}
    if params.prompt_lookup:
        methods["prompt_lookup"] = lambda p: prompt_lookup_generate(tgt, p, n_new, eos_token_id=eos)
    if params.lookup_tokens:
        methods["lookup_loop"] = lambda p: speculative_generate(
            tgt, p, n_new, LookupProposer(None, params.lookup_tokens, params.lookup_ngram), [0, 1, 1],
            eos_token_id=eos)
    return methods


def tune_drafters(run_dirs: list[Path], tgt, params: E2EParams, eos: int | None, tune_prompts: list,
                  methods: dict[str, Callable], root: Path, bar) -> tuple[list[tuple], list[dict]]:
    """Load every drafter, pick its fastest candidate tree on `tune_prompts` and add its methods (tuned, paper's
    tree) to `methods`; returns the plan [(method, setting, tree kind, tree, lookup)] and each drafter's row
    fields."""
    from models.decoding import TreeSpec
    from models.quant import quantize_linears_int8
    from stages import checkpoint as ckpt

    paper = TreeSpec.of(params.paper_tree)
    candidates = [TreeSpec.of(t) for t in params.tree_candidates]
    block_candidates = [TreeSpec.of(t) for t in params.block_tree_candidates]
    lookups = [0] + ([params.lookup_tokens] if params.lookup_tokens else [])
    plan: list[tuple[str, dict, str, Any, int]] = []
    settings: list[dict] = []
    k = len(tune_prompts)
    # a drafter with one candidate tree has nothing to choose between: it is not decoded to be tuned
    tunes = sum(n for n in (len(block_candidates) if ckpt.variant_of(r) == "block" else len(candidates)
                            for r in run_dirs) if n > 1)
    tune = bar.add_task("e2e tune trees", total=tunes * len(lookups) * k, unit="prompts") if tunes else None
    for i, run_dir in enumerate(run_dirs):
        drafter, config = ckpt.load_drafter(run_dir, tgt)
        if params.drafter_weights == "int8":
            drafter = quantize_linears_int8(drafter)
        setting = _setting(run_dir, config, root)
        settings.append(setting)
        own = block_candidates if drafter.config.variant == "block" else candidates
        for lookup in lookups:
            if not own:
                continue
            if len(own) == 1:
                best = own[0]
            else:
                speed = []
                for spec in own:
                    out = [drafted(tgt, params, eos, drafter, spec, lookup)(p) for p in tune_prompts]
                    speed.append(sum(len(r.tokens) for r in out) / sum(r.seconds for r in out))
                    bar.advance(tune, k)
                best = own[max(range(len(own)), key=speed.__getitem__)]
            kind = "tuned_lookup" if lookup else "tuned"
            plan.append((f"{i}:{kind}", setting, kind, best, lookup))
            methods[plan[-1][0]] = drafted(tgt, params, eos, drafter, best, lookup)
        plan.append((f"{i}:paper", setting, "paper", paper, 0))
        methods[plan[-1][0]] = drafted(tgt, params, eos, drafter, paper, 0)
    return plan, settings


def baseline_fields(tally: dict[str, dict], params: E2EParams) -> dict[str, Any]:
    """The baselines' figures every drafter row carries (our loop without speculation, prompt lookup, the lookup
    loop alone)."""
    baselines = {"spec_off_tokens_per_s": tally["spec_off"]["tokens_per_s"]}
    if params.prompt_lookup:
        pl = tally["prompt_lookup"]
        baselines.update(prompt_lookup_tokens_per_s=pl["tokens_per_s"], prompt_lookup_speedup=pl["speedup"],
                         prompt_lookup_tau=pl["tau"])
    if params.lookup_tokens:
        alone = tally["lookup_loop"]
        baselines.update(lookup_loop_speedup=alone["speedup"], lookup_loop_tau=alone["tau"],
                         lookup_loop_lossless=alone["lossless"])
    return baselines


def serve_with_engines(params: E2EParams, run_dirs: list[Path], settings: list[dict], prompts: list, tgt,
                       target: TargetParams, paths: Paths, report: Report, keep_others: bool = False) -> list[dict]:
    """The serving engines of `e2e.engines` beside kvshot's loop (`stages.engine`); without one, the stage's
    engine output holds no rows but the other drafters' (`keep_others`)."""
    from stages.common import StageProgress
    from stages.engine_report import ENGINE_METRICS

    keep = rows_of_others(paths.root / ENGINE_METRICS, run_dirs) if keep_others else []
    engine_rows: list[dict] = []
    if "vllm" in params.engines:
        from stages.engine import run_engines

        with StageProgress() as bar:
            engine_rows = run_engines(params.engine_draft_tokens, run_dirs, settings, prompts, tgt, target,
                                      params.dtype, params.max_new_tokens, paths, bar, eager=params.engine_eager,
                                      keep=keep, tie_tolerance=params.tie_tolerance)
        for row in engine_rows:
            if row["status"] == "ok":
                report({f"{row['trial']}/vllm-k{row['draft_tokens']}/{key}": float(row[key])
                        for key in ("tau", "kvshot_tau", "speedup", "kvshot_speedup", "exact_match")})
    else:
        write_json_atomic(paths.root / ENGINE_METRICS, keep)     # the stage's output: no rows of its own
    return engine_rows


def rows_of_others(path: Path, run_dirs: list) -> list[dict]:
    """The rows in a metrics file (`metrics/e2e.json`, `metrics/engine.json`) of drafters other than those of
    `run_dirs` (by study and trial name); [] when there is no file."""
    try:
        rows = json.loads(path.read_text()) if path.is_file() else []
    except json.JSONDecodeError as e:
        raise StageError(f"{path}: not valid JSON ({e.msg}); move it aside to decode anew") from None
    now = {(Path(d).parent.name, Path(d).name) for d in run_dirs}
    return [r for r in rows if isinstance(r, dict) and (r.get("study"), r.get("trial")) not in now] \
        if isinstance(rows, list) else []
