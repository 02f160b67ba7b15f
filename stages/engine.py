"""A serving engine beside kvshot's own decoding: vLLM (its CPU build) serves each drafter it can load.

For `e2e.engines: [kvshot, vllm]` the e2e stage hands its measured prompts and drafters here. vLLM serves the target
saved as the weights the drafters were trained against (`export_verifier.save_verifier`) and decodes the prompts
greedily one at a time (batch 1, as kvshot's loop), plainly and with each drafter it can serve at each of
`e2e.engine_draft_tokens`: an EAGLE-3 head (`export.EXPORTABLE_VARIANTS`) exported in the `eagle3` format, and
any other drafter (KV-only, hybrid, cross-only, block) through kvshot's `custom_class` proposer
(`stages/vllm_proposer.py`: eager, compared with a plain run that is eager too). kvshot
decodes the same prompts with the same drafter as a chain of as many draft tokens (`TreeSpec.chain`) and plainly.
Both ignore the end-of-sequence token, so every prompt yields `max_new_tokens` in both engines.

Per drafter and draft length one row (metrics/engine.json): lossless (vLLM's output with the drafter
token-identical to its own plain greedy in fp32; in bf16, departing from it only at a near tie of vLLM's own plain
run, the rule kvshot's e2e rows follow: a second plain run, untimed, keeps every step's top log-probabilities for
that, since keeping them slows vLLM's decoding by a third), the engine's mean acceptance length and per-position
acceptance from its counters beside kvshot's chain acceptance on the same prompts, tokens/s and speedup of each
engine over its own plain decoding, and every prompt's sums for the report's intervals.
"""
from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.common import Paths, StageError, TargetParams, write_json_atomic
from stages.engine_report import ENGINE_METRICS

RUNNER = Path(__file__).resolve().parent / "vllm_generate.py"
ENGINE_TIMEOUT_S = 3600
NOT_SERVED = "no drafter variant recorded in its config.json"
PROPOSER_ROUTE = "kvshot proposer (eager)"
# top log-probabilities the scored plain run keeps per step: the near-tie check of a bf16 departure needs the token
# the speculative run chose among them (a runner-up a gap of at most e2e.tie_tolerance below the top is always
# there). That run is not the timed one: vLLM's plain decoding with them kept measured 26.9 tok/s against 42.4
# without (compiled, bf16, 2 cores), which would inflate every speedup.
TOP_LOGPROBS = 5


def per_position(accept_lengths: list[int], k: int) -> list[int]:
    """Accepted drafts at each of the k positions, from kvshot's accepted lengths (accepted drafts + 1 a round)."""
    return [sum(1 for a in accept_lengths if a - 1 > i) for i in range(k)]


def run_vllm(python: Path, out: Path, prompts_file: Path, model: Path, n_new: int, dtype: str,
             draft: Path | None = None, k: int | None = None, eager: bool = False, kvshot_drafter: Path | None = None,
             no_prefix_caching: bool = False, logprobs: int = 0) -> dict:
    """One vLLM process (stages/vllm_generate.py, batch 1): its JSON output; a StageError with its last words.
    `draft` an eagle3-format export, `kvshot_drafter` a spec file of a drafter for kvshot's proposer
    (stages/vllm_proposer.py)."""
    from stages.engine_env import engine_env

    args = [str(python), str(RUNNER), "--model", str(model), "--prompts", str(prompts_file), "--max-tokens",
            str(n_new), "--dtype", dtype, "--max-model-len", "2048", "--one-by-one", "--out", str(out)]
    if draft is not None:
        args += ["--draft", str(draft), "--num-speculative-tokens", str(k)]
    if kvshot_drafter is not None:
        args += ["--kvshot-drafter", str(kvshot_drafter), "--num-speculative-tokens", str(k)]
    if eager:
        args.append("--enforce-eager")
    if no_prefix_caching:
        args.append("--no-prefix-caching")
    if logprobs:
        args += ["--logprobs", str(logprobs)]
    res = subprocess.run(args, capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S, cwd=out.parent,
                         env=engine_env(python))
    if res.returncode != 0 or not out.is_file():
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        raise StageError(f"e2e.engines=vllm: vLLM failed on {draft or kvshot_drafter or model} "
                         f"(exit {res.returncode}): " + " | ".join(tail))
    return json.loads(out.read_text())


def departure(reference: list[int], scores: list | None, output: list[int],
              tolerance: float) -> tuple[bool, float | None]:
    """(lossless, gap) of one output against the reference greedy one, with the reference run's top
    log-probabilities per step (`scores`: [[token ids], [log-probabilities]], as vllm_generate.py --logprobs writes
    them): identical, or departing first where the output's token is within `tolerance` of the top-1 there
    (log-softmax shifts every logit alike, so that is the logit gap kvshot's e2e rows test). A token outside the
    kept top-n, a length difference, or no scores kept: not lossless."""
    from models.decoding import first_divergence

    d = first_divergence(reference, output)
    if d is None:
        return True, None
    if d >= min(len(reference), len(output)) or not scores:
        return False, None
    step = dict(zip(*scores[d]))
    if output[d] not in step:
        return False, None
    gap = max(step.values()) - step[output[d]]
    return gap <= tolerance, gap


def lossless_fields(plain: dict, spec: dict, tolerance: float, exact_required: bool) -> dict[str, Any]:
    """lossless, exact_match and the largest near-tie gap of vLLM's speculative output against its own plain greedy
    one, judged as kvshot's e2e rows are: exact equality in fp32 (`exact_required`), else every departure at a near
    tie of the plain run's own scores (`departure`)."""
    top = plain.get("top_logprobs") or [None] * len(plain["tokens"])
    exact = [a == b for a, b in zip(plain["tokens"], spec["tokens"])]
    checks = [departure(ref, scores, out, tolerance) for ref, scores, out in zip(plain["tokens"], top, spec["tokens"])]
    return {"lossless": all(exact) if exact_required else all(ok for ok, _ in checks),
            "exact_match": sum(exact) / len(exact), "tie_tolerance": tolerance,
            "max_tie_gap": max((g for _, g in checks if g is not None), default=0.0)}


def engine_row(setting: dict, k: int, plain: dict, spec: dict, chain: list, greedy: list,
               tolerance: float = 0.0, exact_required: bool = True, scored: dict | None = None) -> dict[str, Any]:
    """The row of one drafter at draft length k from vLLM's plain (timed) and speculative outputs and kvshot's chain
    and greedy decodes of the same prompts (DecodeResults); losslessness as `lossless_fields` judges it against
    `scored`, the plain run that kept its scores (default: `plain`)."""
    drafts = [p["counters"]["drafts"] or 0 for p in spec["per_prompt"]]
    accepted = [p["counters"]["accepted_tokens"] or 0 for p in spec["per_prompt"]]
    per_pos = spec["counters"].get("accepted_per_pos") or [0] * k
    rounds = [len(r.accept_lengths) for r in chain]
    lengths = [sum(r.accept_lengths) for r in chain]
    kv_pos = per_position([a for r in chain for a in r.accept_lengths], k)

    def rate(tokens: list, seconds: float) -> float:
        return sum(len(t) for t in tokens) / seconds if seconds else float("nan")

    tps, plain_tps = rate(spec["tokens"], spec["seconds"]), rate(plain["tokens"], plain["seconds"])
    kv_tps = rate([r.tokens for r in chain], sum(r.seconds for r in chain))
    kv_plain = rate([r.tokens for r in greedy], sum(r.seconds for r in greedy))
    # kvshot's proposer inside vLLM reports its own time (hooks copying the target's tensors, drafting); an eagle3
    # export's drafting is inside vLLM's step and not separable
    proposer = [(p["counters"].get("proposer_hook_s"), p["counters"].get("proposer_draft_s"))
                for p in spec["per_prompt"]]
    timed = all(h is not None for h, _ in proposer)
    return {**setting, "engine": "vllm", "engine_version": spec.get("vllm"), "draft_tokens": k,
            "status": "ok", **lossless_fields(scored or plain, spec, tolerance, exact_required),
            "scored_plain_identical": None if scored is None else
            sum(a == b for a, b in zip(scored["tokens"], plain["tokens"])) / len(plain["tokens"]),
            "same_as_kvshot_greedy": sum(a == list(r.tokens) for a, r in zip(plain["tokens"], greedy)) / len(greedy),
            "tau": 1 + sum(accepted) / sum(drafts) if sum(drafts) else 1.0,
            "accepted_per_pos": [a / sum(drafts) for a in per_pos] if sum(drafts) else [0.0] * k,
            "kvshot_tau": sum(lengths) / sum(rounds) if sum(rounds) else 1.0,
            "kvshot_accepted_per_pos": [a / sum(rounds) for a in kv_pos] if sum(rounds) else [0.0] * k,
            "tokens_per_s": tps, "plain_tokens_per_s": plain_tps, "speedup": tps / plain_tps,
            "kvshot_tokens_per_s": kv_tps, "kvshot_greedy_tokens_per_s": kv_plain, "kvshot_speedup": kv_tps / kv_plain,
            "proposer_share": sum(h + d for h, d in proposer) / spec["seconds"] if timed else None,
            "kvshot_draft_share": sum(r.draft_seconds for r in chain) / sum(r.seconds for r in chain),
            "per_prompt": {"drafts": drafts, "accepted": accepted,
                           "seconds": [p["seconds"] for p in spec["per_prompt"]],
                           "plain_seconds": [p["seconds"] for p in plain["per_prompt"]],
                           "tokens": [len(t) for t in spec["tokens"]], "kvshot_rounds": rounds,
                           "kvshot_accepted": [n - r for n, r in zip(lengths, rounds)],
                           "kvshot_seconds": [round(r.seconds, 6) for r in chain],
                           "kvshot_greedy_seconds": [round(r.seconds, 6) for r in greedy],
                           "kvshot_draft_seconds": [round(r.draft_seconds, 6) for r in chain],
                           "kvshot_verify_seconds": [round(r.verify_seconds, 6) for r in chain],
                           **({"proposer_hook_seconds": [round(h, 6) for h, _ in proposer],
                               "proposer_draft_seconds": [round(d, 6) for _, d in proposer]} if timed else {})}}


@dataclass
class VllmRuns:
    """vLLM's runs of one e2e setup (its environment's python, the saved verifier, the prompts file, the length and
    dtype), each written under `work` by its own name"""
    python: Path
    work: Path
    prompts_file: Path
    verifier: Any           # export_verifier.Verifier: what the EAGLE-3 exports are made for, and the model vLLM loads
    n_new: int
    dtype: str
    eager: bool

    def run(self, name: str, **kwargs: Any) -> dict:
        return run_vllm(self.python, self.work / name, self.prompts_file, Path(self.verifier.name_or_path), self.n_new,
                        self.dtype, **kwargs)

    def plain(self, name: str, **kwargs: Any) -> tuple[dict, dict | None]:
        """vLLM's plain greedy run, timed, and in bf16 the same run again keeping its scores (untimed)"""
        timed = self.run(f"{name}.json", **kwargs)
        return timed, None if self.dtype == "float32" else self.run(f"{name}-scored.json", logprobs=TOP_LOGPROBS,
                                                                     **kwargs)

    def served(self, run_dir: Path, trial: str, k: int, own_route: bool, tgt: Any) -> dict:
        """vLLM's speculative run of one drafter at draft length k: through kvshot's proposer (its own route) or
        through its EAGLE-3 export"""
        from stages import export as ex
        from stages.vllm_proposer import write_spec

        if own_route:
            spec_file = write_spec(self.work / f"{trial}-drafter.json", run_dir, tgt.kv_layers, tgt.feature_layers)
            return self.run(f"vllm-{trial}-k{k}.json", k=k, kvshot_drafter=spec_file)
        out = self.work / f"{trial}-eagle3-k{k}"
        ex.export(run_dir, "eagle3", out, self.verifier, dtype=self.dtype, overwrite=True, num_speculative_tokens=k)
        return self.run(f"vllm-{trial}-k{k}.json", draft=out, k=k, eager=self.eager)


def run_engines(draft_tokens: list[int], run_dirs: list[Path], settings: list[dict], prompts: list, tgt: Any,
                target: TargetParams, dtype: str, n_new: int, paths: Paths, bar: Any = None,
                eager: bool = False, keep: list[dict] = (), tie_tolerance: float = 0.25) -> list[dict]:
    """Every drafter in `run_dirs` (with its e2e `settings` row fields) served by vLLM at each draft length and
    decoded by kvshot alike on `prompts` (token-id tensors); writes metrics/engine.json (after the `keep` rows, those
    of other drafters served before) and returns its own rows."""
    from models.decoding import TreeSpec, greedy_generate, speculative_generate
    from stages import checkpoint as ckpt
    from stages import export as ex
    from stages.code_hash import DECODE_CODE, code_hash
    from stages.engine_env import vllm_python
    from stages.export_verifier import save_verifier
    from stages.vllm_proposer import SERVED_VARIANTS, kvshot_proposer

    work = paths.root / "exports"
    work.mkdir(parents=True, exist_ok=True)
    verifier = save_verifier(target.model_copy(update={"dtype": dtype}), paths, work / f"verifier-{dtype}")
    vllm = VllmRuns(vllm_python(), work, work / "engine-prompts.json", verifier, n_new, dtype, eager)
    write_json_atomic(vllm.prompts_file, [p.tolist() for p in prompts])
    plain, scored = vllm.plain(f"vllm-plain-{dtype}", eager=eager)
    greedy = [greedy_generate(tgt, p, n_new) for p in prompts]
    common = {"dtype": dtype, "num_prompts": len(prompts), "max_new_tokens": n_new, "engine_eager": eager,
              "code": code_hash(patterns=DECODE_CODE)}
    plain_eager = scored_eager = None   # the proposer route's own plain runs: eager, no prefix caching, as it decodes
    rows = []
    task = bar.add_task("e2e engine", total=len(run_dirs) * len(draft_tokens), unit="drafters") if bar else None
    advance = (lambda n=1: bar.advance(task, n)) if bar else (lambda n=1: None)
    for run_dir, setting in zip(run_dirs, settings):
        variant = ckpt.variant_of(run_dir)
        if variant not in ex.EXPORTABLE_VARIANTS + SERVED_VARIANTS:
            rows += [{**setting, **common, "engine": "vllm", "draft_tokens": k, "status": f"not served: {NOT_SERVED}"}
                     for k in draft_tokens]
            advance(len(draft_tokens))
            continue
        drafter, _ = ckpt.load_drafter(run_dir, tgt)
        own_route = variant in SERVED_VARIANTS
        if own_route and plain_eager is None:
            plain_eager, scored_eager = vllm.plain(f"vllm-plain-{dtype}-eager", eager=True, no_prefix_caching=True)
        for k in draft_tokens:
            spec = vllm.served(run_dir, setting["trial"], k, own_route, tgt)
            chain = [speculative_generate(tgt, p, n_new, kvshot_proposer(drafter, tgt), TreeSpec.chain(k))
                     for p in prompts]
            route = {"engine_route": PROPOSER_ROUTE, "engine_eager": True} if own_route \
                else {"engine_route": "eagle3 export"}
            row = engine_row(setting, k, plain_eager if own_route else plain, spec, chain, greedy, tie_tolerance,
                             exact_required=dtype == "float32", scored=scored_eager if own_route else scored)
            rows.append({**row, **common, **route})
            advance()
    write_json_atomic(paths.root / ENGINE_METRICS, [*keep, *rows])
    return rows
