"""The verifier an export names (`stages.export`): the target as the serving engines see it, i.e. how they load
it (a hub name or a local model directory) and the HF config fields the exported config copies (layers, hidden
size, vocabulary, rope, context length, special tokens). Read from the target's config alone (`load_verifier`,
`local_verifier`), or written as a model directory an engine loads offline (`save_verifier`: the run's target, the
embedded GGUF dequantized, i.e. the weights the drafter was trained against).

Separate from the export itself because it is the one part that reads the target (transformers configs, and for
`save_verifier` its weights), and the e2e stage's engine rows (`stages.engine`) save a verifier of their own.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.run_files import CONFIG_FILE
from stages.common import StageError, TargetParams

# The embedded target is a GGUF build of this hub model; an engine serves the hub model as the verifier.
EMBEDDED_VERIFIER = "HuggingFaceTB/SmolLM2-135M-Instruct"


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
