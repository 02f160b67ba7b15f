"""Export a trained drafter to the serving engines' formats (`kvshot export RUN_DIR --format NAME --out DIR`).

Two formats, both for the EAGLE-3 family drafter that serving engines implement (variant `eagle3`):

- `eagle3`: the native EAGLE-3 draft directory that SGLang (`--speculative-algorithm EAGLE3`) and vLLM
  (`"method": "eagle3"`) load, as SpecForge writes it. `config.json` is a Llama config with
  `architectures: ["LlamaForCausalLMEagle3"]`; `model.safetensors` holds `fc.weight`, `midlayer.*` (the one
  decoder layer; q/k/v read 2*d), `norm.weight`, `lm_head.weight`, `d2t` (int64 *offsets*: target id =
  i + d2t[i]) and `t2d` (bool over the target vocabulary). The frozen embedding is left out: both engines share
  the target's.
- `speculators`: vLLM's `speculators` format, which `vllm serve DIR` reads with no other flag (the verifier named
  inside is loaded as the target). `config.json` has `speculators_model_type: "eagle3"`,
  `architectures: ["Eagle3Speculator"]`, `speculators_config` (greedy proposal, the verifier's name and
  architectures), `transformer_layer_config` (the Llama fields) and `norm_before_residual: false` written out,
  because vLLM's reader defaults it to true; tensors are named `layers.N.*`.

Conventions the engines disagree on, and how they are written here:

- Tapped target layers. kvshot indexes them as HF `hidden_states[i]`, the *input* of decoder layer i. vLLM's
  capture hook appends the residual stream *entering* layer idx (`aux_hidden_states.append(hidden_states +
  residual)` before `layer(idx)`, vllm `model_executor/models/llama.py`), so its top-level
  `eagle_aux_hidden_state_layer_ids` are input-of-layer ids: i as is. SGLang adds one
  (`layers_to_capture = [val + 1 for val in layer_ids]`, sglang `srt/models/llama.py`
  `set_eagle3_layers_to_capture`) and SpecForge reads `hidden_states[id + 1]`, so the nested
  `eagle_config.eagle_aux_hidden_state_layer_ids` are output-of-layer ids: i - 1. The `eagle3` format writes
  both; vLLM prefers the top-level field and SGLang/SpecForge read the nested one.
- The draft vocabulary. kvshot keeps `d2t` as target ids; SGLang (`hot_token_id = d2t + arange`), vLLM
  (`targets = arange + draft_id_to_target_id`) and speculators (`input_ids + d2t[input_ids]`) read offsets.
- `tie_word_embeddings` is always false: SGLang's `LlamaForCausalLMEagle3` replaces the draft head by the
  embedding when it is true (a small target such as SmolLM2 ties its own).
- Rotary embedding: `rope_theta`/`rope_scaling` (transformers 4 readers) and `rope_parameters`
  (transformers 5) are both written from the target's config, and checked to reproduce the drafter's frequencies.
- EAGLE-3.1 options. `fc_norm` (one RMSNorm per fused feature before `fc`; tensors `fc_norm.{j}.weight`) and
  `norm_output` (step k+1 reads the post-final-norm hidden) are config flags in both formats: SpecForge's
  `configs/qwen3-30B-A3B-eagle3.1.json`, vLLM's `qwen3_eagle3.py`/`llama_eagle3.py` (`fc_norm` ModuleList,
  `aux_output = hidden_states if self.norm_output else hidden_prenorm`), SGLang's `llama_eagle3.py` and
  speculators' `Eagle3SpeculatorConfig` (`fc_norm`, `norm_output`, since 0.9). Engine versions older than
  that support refuse the `fc_norm.*` tensors or ignore the flags; the card says so.
- Depth. The engines' EAGLE-3 layer 0 is kvshot's layer 0 (`[input_layernorm(emb); hidden_norm(h)]`, residual =
  h, `norm_before_residual: false`). Deeper layers are plain Llama layers in vLLM and speculators
  (`layers.N.input_layernorm` over the full residual stream), but not in SGLang (older releases drop the residual
  stream into `additional_layers`, newer ones call the pre-attention norm `hidden_norm`), so the `eagle3` format
  holds one layer (`midlayer`) and a deeper drafter exports as `speculators` only.

Sources followed: sgl-project/SpecForge `specforge/export/to_sglang.py`, `specforge/export/checkpoint_io.py`
(`apply_legacy_rope_scaling`), `specforge/modeling/draft/llama3_eagle.py`, `configs/*-eagle3*.json`;
vllm-project/speculators `src/speculators/models/eagle3/config.py`, `src/speculators/models/eagle3/core.py`,
`src/speculators/models/eagle3/model_definitions.py`, `src/speculators/config.py`,
`src/speculators/proposals/greedy.py`, `src/speculators/convert/eagle/eagle3_converter.py`; vLLM
`vllm/model_executor/models/llama_eagle3.py`, `qwen3_eagle3.py`, `vllm/transformers_utils/configs/speculators/
algos.py` (`update_eagle3`) and `base.py`; SGLang `python/sglang/srt/models/llama_eagle3.py`.

What an engine needs to serve the export as trained: `torch_dtype` (and the weights) in the target's dtype by
default (SGLang serves the draft in the dtype it reads); the verifier as a local model directory (`--verifier DIR`
is read and named by its absolute path; `save_verifier` writes the run's target there, the embedded GGUF
dequantized) so `vllm serve DIR` of the speculators format loads without the hub; a number of speculative tokens
that the drafter's measured chain acceptance supports (`speculative_tokens`), not the trained horizon; and, for the
EAGLE-3.1 options, the card's per-engine table and a one-line warning (`engine_warnings`) where an engine would load
the drafter wrong without an error (SGLang ignores `fc_norm.*` and `norm_output`; older vLLM builds drop
`norm_output`).

The export is a pure step: it reads a finished run directory and writes the export into a temporary directory
beside `--out`, renamed into place at the end, so a failure leaves nothing in `--out`. `read_export` is the way
back: it rebuilds a kvshot drafter from an exported directory (either format) from the engine fields alone.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from stages.checkpoint import CONFIG_FILE, FROZEN, MODEL_FILE, load_run, load_tensors, save_tensors
from stages.common import StageError, TargetParams

FORMATS = {
    "eagle3": "native EAGLE-3 draft directory (SGLang --speculative-algorithm EAGLE3, vLLM method eagle3)",
    "speculators": "vLLM speculators format (vllm serve DIR)",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EXPORTABLE_VARIANTS = ("eagle3",)
EAGLE3_ARCH = "LlamaForCausalLMEagle3"
SPECULATORS_ARCH = "Eagle3Speculator"
CARD_FILE = "README.md"
RESULT_FILE = "result.json"        # the sweep's result row, written beside a run's config.json
N_FEATURES = 3                     # the engines' fc reads three fused features (e.g. vLLM: target_hidden_size * 3)
# The embedded target is a GGUF build of this hub model; an engine serves the hub model as the verifier.
EMBEDDED_VERIFIER = "HuggingFaceTB/SmolLM2-135M-Instruct"
# The speculators format's number of speculative tokens is the draft length n that maximises the expected tokens per
# verification round, 1 + sum_{k<n} prod_{j<=k} alpha_j (chain acceptance), per unit of cost 1 + DRAFT_STEP_COST*n:
# one draft step plus one more verified token costs about a tenth of a target decoding step (on these CPUs a draft
# step is 1-3 ms and each verified token 0.71 ms against a 26.6 ms step; on a GPU the drafter is one layer of ~30).
DRAFT_STEP_COST = 0.1
# Without a measured acceptance (the run was never evaluated): what the rule above gives for a chain acceptance of
# 0.6 at every step (0.4-0.5 gives 2: the study's small-scale EAGLE-3 measures 0.38 at step 0, rising to 0.69).
FALLBACK_SPECULATIVE_TOKENS = 3
# Why a variant cannot be exported: no engine implements a drafter that reads the target's KV cache.
NOT_LOADABLE = {
    "kv_only": "reads the target's KV cache",
    "hybrid": "reads the target's KV cache (cross-attention branch)",
    "cross_only": "reads the target's KV cache (cross-attention)",
    "block": "is a block drafter",
}


def _formats_line() -> str:
    return ", ".join(FORMATS)


def check_format(fmt: str) -> str:
    """The format name, or a one-line error listing the formats."""
    if fmt not in FORMATS:
        raise StageError(f"--format {fmt!r}: unknown export format; formats: {_formats_line()}")
    return fmt


def check_dtype(dtype: str | None) -> str | None:
    """The dtype name (None: the target's, resolved by `export_dtype`), or a one-line error listing them."""
    if dtype is not None and dtype not in DTYPES:
        raise StageError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    return dtype


def check_out(out: Path, overwrite: bool = False) -> None:
    """`out` must not exist, or be an empty directory, unless it is to be replaced."""
    out = Path(out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not overwrite:
        raise StageError(f"--out {out}: already exists and is not empty (remove it or pass --force)")


def check_run(run_dir: Path, fmt: str, dtype: str | None = None, out: Path | None = None,
              overwrite: bool = False) -> dict:
    """Everything that can be checked before the target's config is read; returns the run's config.json."""
    check_format(fmt)
    check_dtype(dtype)
    config, _ = read_finished_run(run_dir)
    exportable_config(config, run_dir, fmt)
    if out is not None:
        check_out(out, overwrite)
    return config


def run_target(config: dict, run_dir: Path) -> TargetParams:
    """The target section the run was trained with (config.json `params.target`)."""
    target = (config.get("params") or {}).get("target")
    if not isinstance(target, dict):
        raise StageError(f"run directory {run_dir}: {CONFIG_FILE} does not name its target (params.target)")
    try:
        return TargetParams(**target)
    except ValueError as exc:
        raise StageError(f"run directory {run_dir}: params.target is not valid ({str(exc).splitlines()[0]})") \
            from None


def export_dtype(dtype: str | None, config: dict) -> str:
    """The dtype of the exported weights and of `torch_dtype`: `dtype`, else the target's (SGLang serves the draft
    in the `torch_dtype` it reads, and vLLM runs the draft in the target's dtype anyway), float32 if unnamed."""
    if dtype is not None:
        return check_dtype(dtype)
    target = (config.get("params") or {}).get("target") or {}
    named = target.get("dtype")
    return named if named in DTYPES else "float32"


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


# -- the verifier (the target as the engines see it) --------------------------------------------------------------

@dataclass(frozen=True)
class Verifier:
    """What an export needs to know about the target: how engines name it and its HF config fields."""

    name_or_path: str
    architectures: list[str]
    num_layers: int
    hidden_size: int
    vocab_size: int
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    special_tokens: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config, name_or_path: str, architectures: list[str] | None = None) -> "Verifier":
        """From a transformers config of the target (a text config for multimodal targets)."""
        config = getattr(config, "text_config", None) or config
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if not rope:   # transformers 4 configs: rope_theta + rope_scaling
            rope = dict(getattr(config, "rope_scaling", None) or {})
            rope.setdefault("rope_theta", float(getattr(config, "rope_theta", 10000.0)))
        rope.setdefault("rope_type", rope.pop("type", "default"))
        special = {k: getattr(config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        return cls(name_or_path=name_or_path,
                   architectures=list(architectures or getattr(config, "architectures", None) or []),
                   num_layers=int(config.num_hidden_layers), hidden_size=int(config.hidden_size),
                   vocab_size=int(config.vocab_size), rope_parameters=rope,
                   max_position_embeddings=int(getattr(config, "max_position_embeddings", 4096) or 4096),
                   special_tokens={k: v for k, v in special.items() if v is not None})

    @classmethod
    def from_target(cls, target, name_or_path: str | None = None) -> "Verifier":
        """From a loaded `models.target.Target` (its vocabulary from the output embedding, as kvshot counts it)."""
        from models.target import EMBEDDED

        name = name_or_path or (EMBEDDED_VERIFIER if target.name == EMBEDDED else target.name)
        v = cls.from_config(target.config, name, [type(target.model).__name__])
        return cls(**{**v.__dict__, "vocab_size": target.vocab_size})


def local_verifier(directory: Path) -> Verifier:
    """A verifier given as a local Hugging Face model directory: read from its config.json and named by its
    absolute path, so an engine loads it offline."""
    from transformers import AutoConfig

    from models.target import TargetLoadError

    directory = Path(directory)
    if not (directory / CONFIG_FILE).is_file():
        raise TargetLoadError(f"--verifier {directory}: a local directory without {CONFIG_FILE} (not a model)")
    try:
        config = AutoConfig.from_pretrained(directory)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TargetLoadError(f"--verifier {directory}: cannot read its config ({first})") from None
    return Verifier.from_config(config, str(directory.resolve()))


def load_verifier(params: TargetParams, paths, name_or_path: str | None = None) -> Verifier:
    """The verifier an export names: a local model directory given as `name_or_path` (read from its config), else
    the target named by a run's `params.target` (its config alone, no weights), named `name_or_path` if given."""
    from transformers import AutoConfig

    from models.target import EMBEDDED, EMBEDDED_GGUF, TargetLoadError, embedded_model_dir

    if name_or_path and Path(name_or_path).is_dir():
        return local_verifier(Path(name_or_path))
    source = params.source
    try:
        if source == EMBEDDED:
            cached = Path(paths.model_cache) / "smollm2-135m-instruct" if paths is not None else None
            if cached is not None and (cached / "config.json").is_file():
                config = AutoConfig.from_pretrained(cached)
            else:
                config = AutoConfig.from_pretrained(embedded_model_dir(), gguf_file=EMBEDDED_GGUF)
            return Verifier.from_config(config, name_or_path or EMBEDDED_VERIFIER, ["LlamaForCausalLM"])
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
        config = AutoConfig.from_pretrained(source, local_files_only=offline)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TargetLoadError(f"target.source={source!r}: cannot read its config ({first})") from None
    return Verifier.from_config(config, name_or_path or source)


def save_verifier(params: TargetParams, paths, directory: Path) -> Verifier:
    """Write the run's target as a Hugging Face model directory (weights in the target's dtype, tokenizer) that an
    engine loads offline, and return it as the verifier. The embedded target is the GGUF build dequantized, i.e.
    the weights the drafter was trained against, not the hub model's. An existing model directory is reused."""
    from models.target import load_target

    directory = Path(directory)
    if (directory / CONFIG_FILE).is_file():
        return local_verifier(directory)
    if directory.exists() and not (directory.is_dir() and not any(directory.iterdir())):
        raise StageError(f"--save-verifier {directory}: exists and holds no model ({CONFIG_FILE} missing)")
    target = load_target(params.source, params.dtype, "cpu",
                         cache_dir=paths.model_cache if paths is not None else None)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.tmp-"))
    try:
        target.model.save_pretrained(tmp)
        if target.tokenizer is not None:
            target.tokenizer.save_pretrained(tmp)
        os.chmod(tmp, 0o755)
        if directory.exists():          # an empty directory (check_out above)
            directory.rmdir()
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return local_verifier(directory)


# -- reading a run ----------------------------------------------------------------------------------------------

def exported_config(directory: Path) -> tuple[str, dict] | None:
    """(format 'eagle3' / 'speculators', its config.json) of an exported directory, None for anything else."""
    cfg_file = Path(directory) / CONFIG_FILE
    if not cfg_file.is_file():
        return None
    try:
        config = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, OSError):
        return None
    if not isinstance(config, dict) or "drafter" in config:
        return None
    if config.get("speculators_model_type") == "eagle3":
        return "speculators", config
    if EAGLE3_ARCH in (config.get("architectures") or []):
        return "eagle3", config
    return None


def export_format(directory: Path) -> str | None:
    """The format of an exported directory ('eagle3' / 'speculators'), None for anything else."""
    found = exported_config(directory)
    return found[0] if found else None


def read_finished_run(run_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, weights) of a finished kvshot run; every other directory is a one-line StageError."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise StageError(f"run directory {run_dir}: does not exist")
    fmt = export_format(run_dir)
    if fmt is not None:
        raise StageError(f"run directory {run_dir}: is already an export ({fmt} format), not a kvshot run")
    if not (run_dir / CONFIG_FILE).is_file() or not (run_dir / MODEL_FILE).is_file():
        more = " (a run still training or stopped early has only checkpoint/)" if (run_dir / "checkpoint").is_dir() \
            else ""
        raise StageError(f"run directory {run_dir}: not a finished run ({CONFIG_FILE} or {MODEL_FILE} missing){more}")
    config, weights = load_run(run_dir)
    if not isinstance(config.get("drafter"), dict):
        raise StageError(f"run directory {run_dir}: {CONFIG_FILE} has no drafter config")
    if (config.get("summary") or {}).get("finished") is False:
        raise StageError(f"run directory {run_dir}: not a finished run (its summary says finished: false)")
    return config, weights


def exportable_config(config: dict, run_dir: Path, fmt: str):
    """The run's DrafterConfig if `fmt` can express it; otherwise a one-line error naming what cannot be."""
    from models.drafter import DrafterConfig

    drafter = config["drafter"]
    variant = drafter.get("variant")
    if variant not in EXPORTABLE_VARIANTS:
        why = NOT_LOADABLE.get(variant, "is not an EAGLE-3 drafter")
        raise StageError(f"run directory {run_dir}: variant {variant!r} {why}, which no serving engine loads; "
                         f"export takes variant 'eagle3' (formats: {_formats_line()})")
    try:
        cfg = DrafterConfig.from_dict(drafter)
    except (TypeError, ValueError) as exc:
        raise StageError(f"{Path(run_dir) / CONFIG_FILE}: no valid drafter config ({exc})") from None
    if fmt == "eagle3" and cfg.depth != 1:
        raise StageError(f"drafter.depth={cfg.depth} cannot be expressed in format 'eagle3' (one decoder layer, "
                         f"'midlayer'; SGLang's layers beyond it differ from vLLM's); use --format speculators")
    if cfg.n_features != N_FEATURES:
        raise StageError(f"drafter with {cfg.n_features} fused features cannot be expressed in format {fmt!r} "
                         f"(the engines' fc reads {N_FEATURES} target layers)")
    return cfg


def feature_layers(config: dict, verifier: Verifier, fmt: str) -> list[int]:
    """The target layers the run fused (HF `hidden_states` numbering), checked against what engines capture."""
    from models.target import default_feature_layers

    target = (config.get("params") or {}).get("target") or {}
    layers = list(target.get("feature_layers") or default_feature_layers(verifier.num_layers))
    L = verifier.num_layers
    if len(layers) != N_FEATURES:
        raise StageError(f"target.feature_layers={layers}: format {fmt!r} takes {N_FEATURES} layers")
    if len(set(layers)) != len(layers):
        raise StageError(f"target.feature_layers={layers} repeats a layer, which cannot be expressed in format "
                         f"{fmt!r}: the engines capture each layer once")
    if layers != sorted(layers):
        # vLLM and SGLang append the captured states in layer order, whatever the order of the ids
        raise StageError(f"target.feature_layers={layers} is not in ascending order, which cannot be expressed in "
                         f"format {fmt!r}: the engines concatenate the captured layers in layer order")
    bad = [i for i in layers if not 1 <= i <= L - 1]
    if bad:
        raise StageError(f"target.feature_layers={layers}: {bad} cannot be expressed in format {fmt!r}; the "
                         f"engines capture the inputs of decoder layers 1..{L - 1} of a {L}-layer target")
    return layers


# -- the mapping ------------------------------------------------------------------------------------------------

def _rope_fields(verifier: Verifier) -> dict[str, Any]:
    """rope_theta + rope_scaling (transformers 4) and rope_parameters (5), as SpecForge's
    `apply_legacy_rope_scaling` keeps both."""
    params = dict(verifier.rope_parameters)
    theta = float(params.get("rope_theta", 10000.0))
    params["rope_theta"] = theta
    kind = params.get("rope_type", "default")
    scaling = None if kind == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_parameters": params}


def _llama_fields(cfg, verifier: Verifier, num_layers: int) -> dict[str, Any]:
    """The Llama config fields of the drafter's decoder layers (the target's vocabulary, rope and context)."""
    return {"model_type": "llama", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": verifier.max_position_embeddings,
            "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "vocab_size": cfg.vocab_size,
            "tie_word_embeddings": False, **verifier.special_tokens, **_rope_fields(verifier)}


def rope_parameters_of(fields: dict[str, Any]) -> dict[str, Any]:
    """`rope_parameters` of a Llama config dict, or the same built from `rope_theta` + `rope_scaling` (configs
    written for transformers 4, as SpecForge's)."""
    if fields.get("rope_parameters"):
        return dict(fields["rope_parameters"])
    params = dict(fields.get("rope_scaling") or {})
    params["rope_type"] = params.pop("type", params.get("rope_type", "default"))
    params["rope_theta"] = float(fields.get("rope_theta", 10000.0))
    return params


def rotary_of(fields: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """The inverse frequencies and attention scaling transformers computes for these Llama fields."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    keys = ("hidden_size", "num_attention_heads", "head_dim", "max_position_embeddings")
    config = LlamaConfig(**{k: fields[k] for k in keys if k in fields}, rope_parameters=rope_parameters_of(fields))
    rot = LlamaRotaryEmbedding(config)
    return rot.inv_freq.float(), float(rot.attention_scaling)


def _check_rope(cfg, fields: dict[str, Any], fmt: str) -> None:
    """The rope fields written must give the rotary the drafter was trained with (else positions drift)."""
    try:
        inv, scale = rotary_of(fields)
    except (KeyError, ValueError, TypeError) as exc:
        raise StageError(f"the target's rope_parameters {fields['rope_parameters']} cannot be expressed in format "
                         f"{fmt!r} ({exc})") from None
    trained = torch.tensor(cfg.rope_inv_freq, dtype=torch.float32) if cfg.rope_inv_freq else None
    if trained is None:
        trained = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    if inv.shape != trained.shape or not torch.allclose(inv, trained, rtol=1e-6, atol=0) \
            or not math.isclose(scale, cfg.rope_scaling, rel_tol=1e-6):
        raise StageError(f"the drafter's rotary embedding (rope_theta={cfg.rope_theta}) differs from the one the "
                         f"target's rope_parameters {fields['rope_parameters']} give; format {fmt!r} cannot "
                         f"express it (was it trained against another target?)")


def _renames(fmt: str) -> list[tuple[str, str]]:
    """(kvshot prefix, engine prefix): kvshot's per-feature norms are `fc_norms.j`, every engine's `fc_norm.j`; the
    native eagle3 format calls its one decoder layer `midlayer`."""
    return [("fc_norms.", "fc_norm.")] + ([("layers.0.", "midlayer.")] if fmt == "eagle3" else [])


def _rename(name: str, pairs: list[tuple[str, str]]) -> str:
    for old, new in pairs:
        if name.startswith(old):
            name = new + name[len(old):]
    return name


def _engine_name(name: str, fmt: str) -> str:
    return _rename(name, _renames(fmt))


def _kvshot_name(name: str, fmt: str) -> str:
    return _rename(name, [(b, a) for a, b in _renames(fmt)])


def engine_tensors(weights: dict[str, torch.Tensor], fmt: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """kvshot's saved weights in the engines' names: `d2t` as int64 offsets, `t2d` bool, no embedding."""
    from models.vocab import to_eagle3_offsets

    out = {}
    for name, t in weights.items():
        if name in FROZEN:
            continue
        if name == "d2t":
            out["d2t"] = to_eagle3_offsets(t.long()).to(torch.int64)
        elif name == "t2d":
            out["t2d"] = t.to(torch.bool)
        else:
            out[_engine_name(name, fmt)] = t.to(dtype) if t.is_floating_point() else t
    return out


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
              "drafter loads without error and drafts wrong; do not serve it there") if options else             "none used: loads as trained"
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


# -- the export -------------------------------------------------------------------------------------------------

@dataclass
class Export:
    """What an export wrote: the directory, its format and its config.json."""

    out: Path
    format: str
    config: dict[str, Any]
    files: list[str]
    dtype: str = "float32"
    speculative_tokens: int = FALLBACK_SPECULATIVE_TOKENS
    warnings: list[str] = field(default_factory=list)   # one line each: engines that would load it wrong


@dataclass
class Built:
    """An export held in memory: config.json, the tensors, the card, and what was chosen for it."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    card: str
    dtype: str
    speculative_tokens: int
    warnings: list[str]


def build(run_dir: Path, fmt: str, verifier: Verifier, dtype: str | None = None,
          num_speculative_tokens: int | None = None) -> Built:
    """The export of `run_dir` in `fmt`, in memory; nothing is written. `dtype` None: the target's;
    `num_speculative_tokens` None: what the measured acceptance supports (`speculative_tokens`)."""
    check_format(fmt)
    check_dtype(dtype)
    config, weights = read_finished_run(run_dir)
    cfg = exportable_config(config, run_dir, fmt)
    dtype = export_dtype(dtype, config)
    if (verifier.hidden_size, verifier.vocab_size) != (cfg.hidden_size, cfg.vocab_size):
        raise StageError(f"verifier {verifier.name_or_path!r} has hidden size {verifier.hidden_size} and vocabulary "
                         f"{verifier.vocab_size}; the drafter in {run_dir} was trained for {cfg.hidden_size} / "
                         f"{cfg.vocab_size}")
    layers = feature_layers(config, verifier, fmt)
    n_spec, why_n = speculative_tokens(run_dir, config, num_speculative_tokens)
    llama = _llama_fields(cfg, verifier, cfg.depth)
    _check_rope(cfg, llama, fmt)
    provenance = {"run": f"{Path(run_dir).parent.name}/{Path(run_dir).name}", "variant": cfg.variant,
                  "feature_layers": layers, "params": config.get("params"), "data": config.get("data"),
                  "summary": config.get("summary")}
    eagle = {"draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.hidden_size,
             "eagle_aux_hidden_state_layer_ids": layers, "norm_before_residual": False,
             "fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output}
    if fmt == "eagle3":
        # the native format names the EAGLE-3.1 options only when on: a plain EAGLE-3 stays the config every
        # engine release reads (speculators' config class declares them, with the same false defaults)
        eagle = {k: v for k, v in eagle.items() if k not in ("fc_norm", "norm_output") or v}
        out_cfg = {"architectures": [EAGLE3_ARCH], **llama, **eagle,
                   "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers],
                                    "use_aux_hidden_state": True},
                   "torch_dtype": dtype, "kvshot": provenance}
    else:
        out_cfg = {"architectures": [SPECULATORS_ARCH], "speculators_model_type": "eagle3",
                   "speculators_config": {
                       "algorithm": "eagle3",
                       "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": n_spec,
                                             "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                       "default_proposal_method": "greedy",
                       "verifier": {"name_or_path": verifier.name_or_path,
                                    "architectures": verifier.architectures}},
                   "transformer_layer_config": llama, **eagle, "norm_before_fc": False,
                   "embed_requires_grad": False, "tie_word_embeddings": False, "torch_dtype": dtype,
                   "kvshot": provenance}
    tensors = engine_tensors(weights, fmt, DTYPES[dtype])
    warnings = engine_warnings(cfg, fmt)
    text = card(cfg, config, run_dir, fmt, verifier, layers, dtype, n_spec, why_n)
    return Built(out_cfg, tensors, text, dtype, n_spec, warnings)


def _fsync_dir_files(directory: Path) -> None:
    for f in directory.iterdir():   # the rename below must not overtake the data on a crash
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def write_export(out: Path, out_cfg: dict, tensors: dict, card_text: str, overwrite: bool = False) -> list[str]:
    """Fill a temporary directory beside `out` and rename it into place: a failure leaves `out` untouched."""
    out = Path(out)
    check_out(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    old = None
    try:
        save_tensors(tmp / MODEL_FILE, tensors, metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(out_cfg, indent=2) + "\n")
        (tmp / CARD_FILE).write_text(card_text)
        os.chmod(tmp, 0o755)
        _fsync_dir_files(tmp)
        if out.exists():   # an empty directory, or --force: move the old one aside, then drop it
            old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
            os.replace(out, old / "previous")
        os.replace(tmp, out)
    except BaseException:
        if old is not None and not out.exists() and (old / "previous").exists():
            os.replace(old / "previous", out)      # put the previous export back
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return sorted(p.name for p in out.iterdir())


def export(run_dir: Path, fmt: str, out: Path, verifier: Verifier, dtype: str | None = None,
           overwrite: bool = False, num_speculative_tokens: int | None = None) -> Export:
    """Export the finished run in `run_dir` to `out` in format `fmt` (see the module docstring)."""
    built = build(run_dir, fmt, verifier, dtype, num_speculative_tokens)
    files = write_export(out, built.config, built.tensors, built.card, overwrite)
    return Export(out=Path(out), format=fmt, config=built.config, files=files, dtype=built.dtype,
                  speculative_tokens=built.speculative_tokens, warnings=built.warnings)


# -- the way back -----------------------------------------------------------------------------------------------

def read_export(directory: Path) -> tuple[Any, dict[str, torch.Tensor], dict[str, Any]]:
    """(DrafterConfig, kvshot-named weights, run-like config) of an exported directory, from the engine fields.

    The config dict mirrors a run's config.json (`drafter`, and the run's `params`/`data`/`summary` when the
    export carries them), with `export` naming the format and the tapped layers (HF `hidden_states` numbering).
    """
    from models.drafter import DrafterConfig

    directory = Path(directory)
    found = exported_config(directory)
    if found is None:
        raise StageError(f"{directory}: not an exported drafter (no EAGLE-3 or speculators config.json)")
    fmt, raw = found
    fields = raw.get("transformer_layer_config") if fmt == "speculators" else raw
    prov = raw.get("kvshot") or {}         # the provenance kvshot writes; engines ignore it, exports may lack it
    trained_on = ((prov.get("params") or {}).get("target") or {}).get("source", "")
    try:
        if raw.get("eagle_aux_hidden_state_layer_ids"):      # input-of-layer ids (vLLM, speculators)
            layers = [int(i) for i in raw["eagle_aux_hidden_state_layer_ids"]]
        else:                                                # output-of-layer ids (SGLang, SpecForge)
            layers = [int(i) + 1 for i in raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
        inv, scale = rotary_of(fields)
        cfg = DrafterConfig(
            variant="eagle3", hidden_size=int(fields["hidden_size"]), num_heads=int(fields["num_attention_heads"]),
            num_kv_heads=int(fields.get("num_key_value_heads") or fields["num_attention_heads"]),
            head_dim=int(fields["head_dim"]), intermediate_size=int(fields["intermediate_size"]),
            vocab_size=int(fields["vocab_size"]), draft_vocab_size=int(raw.get("draft_vocab_size") or
                                                                       fields["vocab_size"]),
            depth=int(fields.get("num_hidden_layers", 1)), n_features=len(layers),
            rms_norm_eps=float(fields["rms_norm_eps"]),
            rope_theta=float(rope_parameters_of(fields)["rope_theta"]), rope_inv_freq=[float(x) for x in inv],
            rope_scaling=scale, fc_norm=bool(raw.get("fc_norm", False)),
            norm_output=bool(raw.get("norm_output", False)),
            extra={"export": fmt, "target": trained_on})
    except (KeyError, TypeError, ValueError) as exc:
        raise StageError(f"{directory / CONFIG_FILE}: not a readable {fmt} config ({type(exc).__name__}: {exc})") \
            from None
    if raw.get("norm_before_residual", fmt == "speculators"):
        raise StageError(f"{directory / CONFIG_FILE}: norm_before_residual=true (residual = the normed hidden) is "
                         "not the EAGLE-3 layer kvshot's drafter computes")
    tensors = load_tensors(directory / MODEL_FILE)
    weights = {}
    for name, t in tensors.items():
        if name == "d2t":        # offsets back to target ids
            weights["d2t"] = t.long() + torch.arange(t.numel())
        elif name == "t2d":
            weights["t2d"] = t.to(torch.bool)
        elif name not in FROZEN:
            weights[_kvshot_name(name, fmt)] = t.float() if t.is_floating_point() else t
    run_config = {"drafter": cfg.to_dict(), "draft_vocab_size": cfg.draft_vocab_size,
                  **{k: prov[k] for k in ("params", "data", "summary") if prov.get(k) is not None},
                  "export": {"format": fmt, "feature_layers": layers, "run": prov.get("run")}}
    return cfg, weights, run_config
