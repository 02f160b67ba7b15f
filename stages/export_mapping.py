"""How an export writes a kvshot drafter in the engines' terms (`stages.export`), and reads it back: the Llama
config fields of the draft layers (the target's vocabulary, rope and context), the rotary embedding those fields
give (checked against the one the drafter was trained with), and the tensor names (`fc_norms.j` -> `fc_norm.j`,
`layers.0.` -> `midlayer.` in the native eagle3 format; `d2t` as offsets, `t2d` bool, no embedding).

Separate from the export because both directions use it: `stages.export.build` writes with it and
`stages.export.read_export` inverts it (`rotary_of`, `rope_parameters_of`, `_kvshot_name`).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from stages.run_files import FROZEN
from stages.common import StageError
from stages.export_verifier import Verifier


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
