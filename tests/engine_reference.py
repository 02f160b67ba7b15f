"""An independent EAGLE-3 draft loader, written from the serving engines' semantics with plain torch.

It reads an exported directory (`eagle3` or `speculators` format) from its files alone and runs the drafter the
way vLLM (`model_executor/models/llama_eagle3.py`), SGLang (`srt/models/llama_eagle3.py`) and speculators
(`models/eagle3/core.py`, `model_definitions.py`) compute it. Nothing here imports kvshot's `models` or
`stages`: a mistake in the export (names, shapes, layer ids, offsets, norms) shows up as a disagreement with
kvshot's own drafter instead of being mirrored.

- Aux hidden states: vLLM appends the residual stream entering decoder layer `idx` for each top-level
  `eagle_aux_hidden_state_layer_ids` id, i.e. HF `hidden_states[idx]`; SGLang captures `val + 1` for each nested
  `eagle_config.eagle_aux_hidden_state_layer_ids` id, i.e. the output of layer `val` = `hidden_states[val + 1]`.
- `combine_hidden_states`: `fc(cat(fc_norm_j(chunk_j)))` (the per-chunk norms only with `fc_norm`).
- Layer 0: `residual = h` (`norm_before_residual: false`; vLLM's speculators reader defaults it to true),
  `x = cat(input_layernorm(embeds), hidden_norm(h))`, attention over 2*d inputs, `h = residual + attn`,
  `h = h + mlp(post_attention_layernorm(h))`. Layers > 0: plain Llama layers on the residual stream.
- `norm(h)` feeds `lm_head`; the next draft step reads `norm(h)` with `norm_output`, else the pre-norm `h`.
- `compute_logits`: the draft logits scattered into the target vocabulary at `i + d2t[i]`, `-inf` elsewhere.
- RoPE: Llama's neox-style rotation, default rope type (the only one these tests use).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rotate(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [n, heads, hd] rotated at integer positions pos [n] (rotate-half over split halves)."""
    freqs = pos.float()[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class EngineDraft:
    """An exported EAGLE-3 drafter as an engine runs it; `step` appends entries to its own KV cache."""

    def __init__(self, directory: Path):
        directory = Path(directory)
        cfg = json.loads((directory / "config.json").read_text())
        self.format = "speculators" if cfg.get("speculators_model_type") == "eagle3" else "eagle3"
        if self.format == "eagle3":
            assert cfg["architectures"] == ["LlamaForCausalLMEagle3"], cfg["architectures"]
            llama = cfg
        else:
            assert cfg["architectures"] == ["Eagle3Speculator"], cfg["architectures"]
            llama = cfg["transformer_layer_config"]
        self.cfg = cfg
        self.d = llama["hidden_size"]
        self.H, self.Hkv, self.hd = llama["num_attention_heads"], llama["num_key_value_heads"], llama["head_dim"]
        self.eps = llama["rms_norm_eps"]
        self.n_layers = llama["num_hidden_layers"]
        self.vocab = llama["vocab_size"]
        rope = llama.get("rope_parameters") or {"rope_type": "default", "rope_theta": llama["rope_theta"]}
        assert rope.get("rope_type", "default") == "default" and llama.get("rope_scaling") is None
        theta = rope["rope_theta"]
        assert theta == llama["rope_theta"]
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        # vLLM's speculators reader: config_dict.get("norm_before_residual", True)
        self.norm_before_residual = cfg.get("norm_before_residual", self.format == "speculators")
        self.fc_norm = bool(cfg.get("fc_norm", False))
        self.norm_output = bool(cfg.get("norm_output", False))
        self.draft_vocab = cfg.get("draft_vocab_size") or self.vocab
        assert not cfg.get("tie_word_embeddings", False) and not llama.get("tie_word_embeddings", False)

        w = load_file(str(directory / "model.safetensors"))
        assert not any("embed_tokens" in k for k in w), "the engines share the target's embedding"
        self.w = {k: v.float() if v.is_floating_point() else v for k, v in w.items()}
        first = "midlayer." if self.format == "eagle3" else "layers.0."
        self.prefixes = [first] + [f"layers.{i}." for i in range(1, self.n_layers)]
        expected = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
        expected |= {f"fc_norm.{j}.weight" for j in range(3)} if self.fc_norm else set()
        for i, p in enumerate(self.prefixes):
            expected |= {p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                         "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                         "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                         "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}
            if i == 0:
                expected.add(p + "hidden_norm.weight")
        assert set(self.w) == expected, sorted(set(self.w) ^ expected)
        assert self.w[first + "self_attn.q_proj.weight"].shape == (self.H * self.hd, 2 * self.d)
        assert self.w["d2t"].dtype == torch.int64 and self.w["t2d"].dtype == torch.bool
        self.targets = torch.arange(self.draft_vocab) + self.w["d2t"]        # draft index -> target id
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(0, self.Hkv, self.hd), torch.zeros(0, self.Hkv, self.hd)) for _ in self.prefixes]

    # -- what the target hands the drafter --------------------------------------------------------------------
    def vllm_layer_ids(self) -> list[int]:
        """vLLM reads the top-level ids (input-of-layer)."""
        return list(self.cfg["eagle_aux_hidden_state_layer_ids"])

    def sglang_capture_ids(self) -> list[int]:
        """SGLang captures before layer val + 1 for each nested id (output-of-layer)."""
        return [v + 1 for v in self.cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]

    @staticmethod
    def aux_hidden(hf_model, input_ids: torch.Tensor, capture_ids: list[int]) -> torch.Tensor:
        """The residual stream entering each captured decoder layer: HF hidden_states[idx] (index 0 = embeddings)."""
        with torch.no_grad():
            hs = hf_model.model(input_ids=input_ids[None], output_hidden_states=True).hidden_states
        return torch.cat([hs[i][0] for i in capture_ids], -1).float()

    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        if self.fc_norm:
            chunks = aux.chunk(3, -1)
            aux = torch.cat([rms(c, self.w[f"fc_norm.{j}.weight"], self.eps) for j, c in enumerate(chunks)], -1)
        return aux @ self.w["fc.weight"].T

    # -- the draft step ----------------------------------------------------------------------------------------
    def crop(self, n: int) -> None:
        self.cache = [(k[:n], v[:n]) for k, v in self.cache]

    def _attend(self, i: int, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        p, w = self.prefixes[i], self.w
        n = x.shape[0]
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(n, self.H, self.hd)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(n, self.Hkv, self.hd)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, self.Hkv, self.hd)
        q, k = rotate(q, pos, self.inv_freq), rotate(k, pos, self.inv_freq)
        K, V = (torch.cat([self.cache[i][0], k]), torch.cat([self.cache[i][1], v]))
        self.cache[i] = (K, V)
        rep = self.H // self.Hkv                                 # GQA: query head h reads KV head h // rep
        K, V = K.repeat_interleave(rep, 1), V.repeat_interleave(rep, 1)
        scores = torch.einsum("nhd,shd->hns", q, K) / self.hd ** 0.5
        scores = scores.masked_fill(~mask[None], float("-inf"))
        out = torch.einsum("hns,shd->nhd", scores.softmax(-1), V).reshape(n, -1)
        return out @ w[p + "self_attn.o_proj.weight"].T

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p, w = self.prefixes[i], self.w
        return (F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor):
        """n new entries: embeds/hidden [n, d], pos [n], mask [n, cached + n] (True = visible).
        Returns (logits over the target vocabulary [n, V], the hidden the next draft step reads [n, d])."""
        w, eps = self.w, self.eps
        h = hidden
        for i, p in enumerate(self.prefixes):
            if i == 0:
                normed = rms(h, w[p + "hidden_norm.weight"], eps)
                residual = normed if self.norm_before_residual else h
                x = torch.cat([rms(embeds, w[p + "input_layernorm.weight"], eps), normed], -1)
            else:
                residual, x = h, rms(h, w[p + "input_layernorm.weight"], eps)
            h = residual + self._attend(i, x, pos, mask)
            h = h + self._mlp(i, rms(h, w[p + "post_attention_layernorm.weight"], eps))
        normed = rms(h, w["norm.weight"], eps)
        draft_logits = normed @ w["lm_head.weight"].T
        logits = draft_logits.new_full((draft_logits.shape[0], self.vocab), float("-inf"))
        logits[:, self.targets] = draft_logits
        return logits, (normed if self.norm_output else h)


@torch.no_grad()
def engine_logits(directory: Path, hf_model, embed_weight: torch.Tensor, seq: torch.Tensor, steps: int,
                  capture_ids: list[int] | None = None) -> torch.Tensor:
    """For every position t of `seq` (1D target ids): the step-0 draft entry (aux hidden of t, token t+1) and a
    chain of `steps - 1` further entries fed with the data tokens t+2.., each attending to the accepted step-0
    entries before it and its own chain (as an engine drafts after accepting t+1). Returns [steps, T, V]
    target-vocabulary logits, NaN where the token does not exist."""
    eng = EngineDraft(directory)
    T = seq.numel()
    ids = capture_ids if capture_ids is not None else eng.vllm_layer_ids()
    fused = eng.combine_hidden_states(eng.aux_hidden(hf_model, seq, ids))
    emb = embed_weight.float()[seq]
    out = torch.full((steps, T, eng.vocab), float("nan"))
    for t in range(T - 1):
        eng.crop(t)                                   # the step-0 entries of positions < t
        h = fused[t:t + 1]
        for k in range(steps):
            j = t + 1 + k                             # input token of entry (t, k); its position is j
            if j > T - 1:
                break
            n_cached = eng.cache[0][0].shape[0]
            mask = torch.ones(1, n_cached + 1, dtype=torch.bool)
            logits, h = eng.step(emb[j:j + 1], h, torch.tensor([j]), mask)
            out[k, t] = logits[0]
    return out
