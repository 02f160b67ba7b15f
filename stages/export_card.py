"""What an export says about its drafter (`stages.export`): the number of speculative tokens the drafter's measured
chain acceptance supports (`speculative_tokens`, not the trained horizon), a one-line warning per engine that would
load an EAGLE-3.1 drafter wrong without an error (`engine_warnings`), and the card (`README.md`): what the drafter
is, what it was trained on, its step-wise acceptance (DESIGN §4), which engine loads it and how to serve it.

Separate from the export because it reads more than the run directory (the trial's metrics row, beside the run or
in its workspace's metrics/) and writes prose, not engine fields.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from stages.common import StageError
from stages.export_verifier import Verifier

CARD_FILE = "README.md"
RESULT_FILE = "result.json"        # the sweep's result row, written beside a run's config.json
# The speculators format's number of speculative tokens is the draft length n that maximises the expected tokens per
# verification round, 1 + sum_{k<n} prod_{j<=k} alpha_j (chain acceptance), per unit of cost 1 + DRAFT_STEP_COST*n:
# one draft step plus one more verified token costs about a tenth of a target decoding step (on these CPUs a draft
# step is 1-3 ms and each verified token 0.71 ms against a 26.6 ms step; on a GPU the drafter is one layer of ~30).
DRAFT_STEP_COST = 0.1
# Without a measured acceptance (the run was never evaluated): what the rule above gives for a chain acceptance of
# 0.6 at every step (0.4-0.5 gives 2: the study's small-scale EAGLE-3 measures 0.38 at step 0, rising to 0.69).
FALLBACK_SPECULATIVE_TOKENS = 3


# -- measured acceptance and the draft length it supports ----------------------------------------------------------

def _read_row(path: Path, trial: str | None = None) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if trial is not None and isinstance(data, list):   # metrics/stepwise/<study>.json: one row per trial
        data = next((r for r in data if isinstance(r, dict) and r.get("trial") == trial), None)
    if not isinstance(data, dict) or not (data.get("alpha") or data.get("acc")):
        return None
    return data


def measured_row(run_dir: Path) -> tuple[dict, str] | tuple[None, None]:
    """(the trial's step-wise metrics row, where it was read) for a run: the `result.json` the sweep writes beside
    it, else its row in `metrics/stepwise/<study>.json` of the workspace a `runs/<study>/<trial>` directory is in."""
    run = Path(run_dir).resolve()
    row = _read_row(run / RESULT_FILE)
    if row is not None:
        return row, RESULT_FILE
    if run.parent.parent.name == "runs":
        table = run.parent.parent.parent / "metrics" / "stepwise" / f"{run.parent.name}.json"
        row = _read_row(table, run.name)
        if row is not None:
            return row, f"metrics/stepwise/{run.parent.name}.json"
    return None, None


def speculative_tokens_for(alpha: list, horizon: int, cost: float = DRAFT_STEP_COST) -> int:
    """The draft length n in 1..horizon maximising (1 + sum_{k<n} prod_{j<=k} alpha_j) / (1 + cost*n): expected
    tokens per verification round over its cost (ties: the shorter). A missing alpha_k (no chain reached step k)
    counts as 0."""
    best_n, best_rate, reach, expected = 1, -1.0, 1.0, 1.0
    for n in range(1, max(1, horizon) + 1):
        a = alpha[n - 1] if n - 1 < len(alpha) else None
        reach *= float(a) if isinstance(a, (int, float)) and math.isfinite(a) else 0.0
        expected += reach
        rate = expected / (1.0 + cost * n)
        if rate > best_rate + 1e-12:
            best_n, best_rate = n, rate
    return best_n


def speculative_tokens(run_dir: Path, config: dict, given: int | None = None) -> tuple[int, str]:
    """(number of speculative tokens the export proposes, why): `given`, else what the measured chain acceptance
    supports (`speculative_tokens_for`), else FALLBACK_SPECULATIVE_TOKENS."""
    if given is not None:
        if int(given) < 1:
            raise StageError(f"--speculative-tokens {given}: expected a positive number of draft tokens")
        return int(given), "given to the export"
    row, source = measured_row(run_dir)
    train = (config.get("params") or {}).get("train") or {}
    horizon = int(train.get("ttt_steps") or 0) or len((row or {}).get("alpha") or (row or {}).get("acc") or [])
    if row is not None:
        # chain acceptance is what decoding sees; the unconditional step accuracy is the fallback's fallback
        kind, values = ("chain acceptance α_k", row["alpha"]) if row.get("alpha") else ("step accuracy acc_k",
                                                                                         row["acc"])
        horizon = horizon or len(values)
        n = speculative_tokens_for(values, horizon)
        return n, (f"the draft length that maximises expected tokens per round over its cost (1 + "
                   f"{DRAFT_STEP_COST}·n target steps) for the measured {kind} in `{source}`")
    return FALLBACK_SPECULATIVE_TOKENS, ("no measured acceptance (the run was never evaluated): the fallback "
                                         f"{FALLBACK_SPECULATIVE_TOKENS}, not the trained horizon")


# -- what each engine loads --------------------------------------------------------------------------------------

def engine_warnings(cfg, fmt: str) -> list[str]:
    """One line per (EAGLE-3.1 option, engine) that would load the export wrong without an error."""
    options = [o for o in ("fc_norm", "norm_output") if getattr(cfg, o)]
    if not options:
        return []
    if fmt == "eagle3":
        return [f"{' and '.join(options)} (EAGLE-3.1) in format 'eagle3': SGLang ignores fc_norm.* and norm_output "
                f"silently and would serve this drafter wrong (and older vLLM builds drop norm_output); serve it "
                f"with vLLM (0.32 reads both)"]
    if cfg.norm_output:
        return ["norm_output (EAGLE-3.1) in format 'speculators': older vLLM builds drop it silently and would "
                "serve this drafter wrong; serve it with vLLM 0.32 or later"]
    return []


# -- the card ---------------------------------------------------------------------------------------------------

def _fmt_list(values) -> str:
    return ", ".join("–" if v is None else f"{v:.3f}" for v in values)


def acceptance_lines(run_dir: Path) -> list[str]:
    """Step-wise acceptance from the trial's metrics row (`measured_row`), else 'not evaluated'."""
    row, source = measured_row(run_dir)
    if row is None:
        return ["Not evaluated (the run directory holds no step-wise result; `kvshot evaluate` writes one)."]
    lines = [f"Teacher-forced, on held-out conversations (`kvshot evaluate`; DESIGN §4; from `{source}`):", "",
             "| k | " + " | ".join(str(k) for k in range(len(row.get("acc") or row.get("alpha")))) + " |",
             "| --- |" + " --- |" * len(row.get("acc") or row.get("alpha"))]
    if row.get("acc"):
        lines.append("| step accuracy acc_k | " + " | ".join(_fmt_list([a]) for a in row["acc"]) + " |")
    if row.get("alpha"):
        lines.append("| chain acceptance α_k | " + " | ".join(_fmt_list([a]) for a in row["alpha"]) + " |")
    lines.append("")
    extra = [f"{k} {row[k]:.3f}" for k in ("mat", "retention") if isinstance(row.get(k), (int, float))]
    if row.get("n_positions"):
        extra.append(f"{row['n_positions']} positions")
    if extra:
        lines.append("Step MAT and retention: " + ", ".join(extra) + ".")
    return lines


def engine_lines(cfg, fmt: str) -> list[str]:
    """Per engine: whether it loads this export, and what it does with the EAGLE-3.1 options."""
    options = [o for o in ("fc_norm", "norm_output") if getattr(cfg, o)]
    lines = ["| engine | loads | EAGLE-3.1 options (`fc_norm`, `norm_output`) |", "| --- | --- | --- |"]
    if options:
        vllm = ("read (vLLM 0.32 `llama_eagle3.py`: `fc_norm` ModuleList, `aux_output = hidden_states if "
                "norm_output`); older builds drop `norm_output` silently: the drafter then drafts wrong")
    else:
        vllm = "none used: every EAGLE-3 release"
    how = "`method: eagle3` with this directory" if fmt == "eagle3" else \
        "`vllm serve DIR`, or `method: eagle3` with this directory"
    lines.append(f"| vLLM | {how} | {vllm} |")
    if fmt == "eagle3":
        sg = ("**ignored silently**: the `fc_norm.*` tensors are skipped and `norm_output` is not read, so the "
              "drafter loads without error and drafts wrong; do not serve it there") if options \
            else "none used: loads as trained"
        lines.append(f"| SGLang | `--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR` | {sg} |")
    else:
        lines.append("| SGLang | no (it reads the `eagle3` format) | – |")
    which = "this directory" if fmt == "speculators" else "the speculators format"
    lines.append(f"| speculators | `Eagle3DraftModel.from_pretrained` ({which}) | "
                 f"{'read since 0.9' if options else 'none used'} |")
    return lines


def card(cfg, config: dict, run_dir: Path, fmt: str, verifier: Verifier, layers: list[int], dtype: str,
         speculative_tokens: int, why_tokens: str = "") -> str:
    """The README of an export: what it is, what it was trained on, how well it drafts, how to serve it."""
    run = Path(run_dir)
    params = config.get("params") or {}
    train, data = params.get("train") or {}, config.get("data") or {}
    summary, target = config.get("summary") or {}, params.get("target") or {}
    options = [o for o in ("fc_norm", "norm_output") if getattr(cfg, o)]
    kind = "EAGLE-3.1" if options else "EAGLE-3"
    lines = [f"# {kind} drafter for {verifier.name_or_path} ({fmt} format)", "",
             f"Exported by `kvshot export` from run `{run.parent.name}/{run.name}`: a {cfg.depth}-layer Llama-style "
             f"draft head (hidden {cfg.hidden_size}, {cfg.num_heads} heads / {cfg.num_kv_heads} KV heads, head dim "
             f"{cfg.head_dim}, MLP {cfg.intermediate_size}) over a draft vocabulary of {cfg.draft_vocab_size} of the "
             f"target's {cfg.vocab_size} tokens, weights in {dtype}."
             + (f" EAGLE-3.1 options: {', '.join(options)}." if options else ""), "",
             "## Target and tapped layers", "",
             f"- verifier: `{verifier.name_or_path}` ({', '.join(verifier.architectures) or 'architecture unknown'}, "
             f"{verifier.num_layers} layers); trained against kvshot target `{target.get('source', '?')}` "
             f"in {target.get('dtype', '?')}",
             f"- fused features: HF `hidden_states` {layers} (the inputs of those decoder layers) = "
             f"`eagle_aux_hidden_state_layer_ids` {layers} for vLLM/speculators = outputs of layers "
             f"{[i - 1 for i in layers]} (`eagle_config.eagle_aux_hidden_state_layer_ids`, SGLang/SpecForge)"]
    if target.get("source") == "embedded" and not Path(verifier.name_or_path).is_absolute():
        lines.append("- the embedded kvshot target is the Q4_1 GGUF build of this model, dequantized: the features "
                     "the drafter was trained on differ slightly from the bf16 hub weights an engine serves "
                     "(`kvshot export --save-verifier DIR` writes the dequantized target to serve instead)")
    lines += ["", "## Training data", "",
              f"- data scale `{data.get('scale', train.get('scale', '?'))}`: {data.get('conversations', '?')} "
              f"conversations (target-regenerated answers), {summary.get('tokens', '?')} tokens seen over "
              f"{summary.get('steps', data.get('steps', '?'))} optimizer steps",
              f"- training-time test over {train.get('ttt_steps', '?')} steps (step weight "
              f"{train.get('step_decay', '?')}^k), lr {train.get('lr', '?')}, batch {train.get('batch_size', '?')}, "
              f"{train.get('precision', '?')}, seed {train.get('seed', '?')}",
              "", "## Step-wise acceptance", "", *acceptance_lines(run_dir), "",
              "## Engines", "", *engine_lines(cfg, fmt), "", "## Serving", "",
              f"Speculative tokens per step: {speculative_tokens} ({why_tokens or 'given'}).", ""]
    if fmt == "eagle3":
        n = speculative_tokens
        lines += ["vLLM:", "", "```bash",
                  f"vllm serve {verifier.name_or_path} --speculative-config "
                  f"'{{\"method\": \"eagle3\", \"model\": \"DIR\", \"num_speculative_tokens\": {n}}}'", "```", "",
                  "SGLang:", "", "```bash",
                  f"python -m sglang.launch_server --model-path {verifier.name_or_path} "
                  f"--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR "
                  f"--speculative-num-steps {n} --speculative-eagle-topk 1 --speculative-num-draft-tokens {n + 1}",
                  "```", "", "(DIR is this directory; a chain of that many draft tokens.)"]
    else:
        lines += ["vLLM reads the verifier and the speculative settings from `config.json`:", "", "```bash",
                  "vllm serve DIR", "```", "",
                  f"(DIR is this directory; it proposes {speculative_tokens} tokens a step, greedily. The verifier "
                  f"`{verifier.name_or_path}` is loaded as the target; edit `speculators_config.verifier."
                  f"name_or_path` to serve another copy, or pass `num_speculative_tokens` in "
                  f"`--speculative-config` to change the count.)"]
    if Path(verifier.name_or_path).is_absolute():
        lines += ["", "The verifier is a local directory: engines load it offline, from this machine's path."]
    lines += ["", "## Files", "",
              f"- `config.json`, `model.safetensors` (no embedding: the engines share the target's; `d2t` holds "
              f"offsets, target id = i + d2t[i]; `t2d` marks the draft tokens in the target vocabulary)",
              f"- `{CARD_FILE}`: this card", ""]
    return "\n".join(lines)
