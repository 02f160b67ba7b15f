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

What an engine needs to serve the export as trained, and where it is made: `torch_dtype` (and the weights) in the
target's dtype by default (`export_dtype`; SGLang serves the draft in the dtype it reads); the verifier as a local
model directory (`--verifier DIR` is read and named by its absolute path; `save_verifier` writes the run's target
there, the embedded GGUF dequantized; both in `stages.export_verifier`) so `vllm serve DIR` of the speculators
format loads without the hub; a number of speculative tokens that the drafter's measured chain acceptance supports
(`speculative_tokens`), not the trained horizon; and, for the EAGLE-3.1 options, the card's per-engine table and a
one-line warning (`engine_warnings`) where an engine would load the drafter wrong without an error (SGLang ignores
`fc_norm.*` and `norm_output`; older vLLM builds drop `norm_output`); these three in `stages.export_card`. The
Llama fields, the rope check and the tensor names, both ways, are `stages.export_mapping`.

The export is a pure step: it reads a finished run directory and writes the export into a temporary directory
beside `--out`, renamed into place at the end, so a failure leaves nothing in `--out`. `read_export` is the way
back: it rebuilds a kvshot drafter from an exported directory (either format) from the engine fields alone.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from stages.run_files import CONFIG_FILE, FROZEN, MODEL_FILE, load_run, load_tensors, save_tensors
from stages.common import StageError, TargetParams
# the verifier, the mapping and the card (their own modules, which never import this one); the tests still read
# RESULT_FILE, speculative_tokens_for, load_verifier and save_verifier from here
from stages.export_card import (CARD_FILE, FALLBACK_SPECULATIVE_TOKENS, RESULT_FILE, card,  # noqa: F401
                                engine_warnings, speculative_tokens, speculative_tokens_for)
from stages.export_mapping import (_check_rope, _kvshot_name, _llama_fields, engine_tensors, rope_parameters_of,
                                   rotary_of)
from stages.export_verifier import Verifier, load_verifier, save_verifier  # noqa: F401

FORMATS = {
    "eagle3": "native EAGLE-3 draft directory (SGLang --speculative-algorithm EAGLE3, vLLM method eagle3)",
    "speculators": "vLLM speculators format (vllm serve DIR)",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EXPORTABLE_VARIANTS = ("eagle3",)
EAGLE3_ARCH = "LlamaForCausalLMEagle3"
SPECULATORS_ARCH = "Eagle3Speculator"
N_FEATURES = 3                     # the engines' fc reads three fused features (e.g. vLLM: target_hidden_size * 3)
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
    from models.drafter_config import DrafterConfig

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
    from models.drafter_config import DrafterConfig

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
