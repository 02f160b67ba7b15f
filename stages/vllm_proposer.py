"""kvshot's own drafters served inside vLLM: a `custom_class` proposer that hands a drafter the target's KV and
hidden states as vLLM's target computed them.

vLLM (0.32, its CPU build) loads EAGLE-3 heads natively (`kvshot export --format eagle3`), and gives a KV-sharing
draft model only to Gemma 4's MTP drafters (`use_gemma4_mtp`: model type `gemma4_mtp`), whose layers each read one
target layer's paged cache and no entries of their own (docs/export.md says why that does not carry kvshot's
drafters). What carries every kvshot variant (kv_only, hybrid, cross_only, block) is vLLM's `custom_class`
proposer: vLLM builds it from its config, calls `load_model(target_model)` once the target is loaded, and after
every target step calls `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings)` for the
next draft tokens, which the target then verifies (so the output stays the target's greedy output whatever is
proposed). It is handed neither the KV cache nor hidden states; this proposer collects them itself:

- `load_model` registers pre-hooks on the target: on the attention layer of each of `target.kv_layers` (the
  post-RoPE keys and values the layer is about to cache) and on the decoder layer of each of
  `target.feature_layers` (its input, `hidden_states + residual`: Hugging Face's `hidden_states[i]`, as vLLM's own
  EAGLE-3 capture takes it). Each hook places a request's tokens at their positions from the step's attention
  metadata (query_start_loc, seq_lens). This needs eager mode (`enforce_eager`): a compiled target would not call
  Python hooks.
- `propose` hands kvshot's own proposer (`DrafterProposer`, or `BlockProposer` for a block drafter) what kvshot's
  decoding loop hands it: the tokens that entered the target cache since the last round with their features, the
  target's KV of every accepted position, and the root (the newest token); it drafts a chain of
  `num_speculative_tokens`. Positions the target wrote for rejected drafts lie past the accepted length and are
  overwritten by the next step.

The drafter to serve is named by a JSON file in $KVSHOT_DRAFTER (`write_spec`): the run (or export) directory and
the target's `kv_layers` and `feature_layers`. Where the proposer's time goes is kept in the JSON file
$KVSHOT_PROPOSER_TIMES names, when set (rewritten after every step: vLLM may run the proposer in another process):
seconds in its hooks (copying the target's tensors) and in drafting, and the number of steps. The target's
embedding comes from the served target itself. Runs in the engine's environment with the repository on PYTHONPATH
(`stages/vllm_generate.py --kvshot-drafter` sets both).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

ENV_SPEC = "KVSHOT_DRAFTER"
ENV_TIMES = "KVSHOT_PROPOSER_TIMES"
CLASS_PATH = "stages.vllm_proposer.KvshotProposer"
SERVED_VARIANTS = ("kv_only", "hybrid", "cross_only", "block")   # eagle3 goes through its native export


def write_spec(path: Path, run_dir: Path, kv_layers: list[int], feature_layers: list[int]) -> Path:
    """The file that names the drafter to serve (read by the proposer inside vLLM)."""
    Path(path).write_text(json.dumps({"run_dir": str(Path(run_dir).resolve()), "kv_layers": list(kv_layers),
                                      "feature_layers": list(feature_layers)}))
    return Path(path)


def kvshot_proposer(drafter: Any, target: Any) -> Any:
    """kvshot's proposer for a drafter: the block drafter's, else the autoregressive one."""
    from models.decoding import DrafterProposer
    from models.decoding.block_proposer import BlockProposer

    return BlockProposer(drafter, target) if drafter.config.variant == "block" else DrafterProposer(drafter, target)


@dataclass
class _Row:
    """What the proposer keeps of one request slot: the target's tensors by position, and kvshot's proposer."""

    tensors: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)   # (kind, layer) -> [capacity, ...]
    proposer: Any = None
    stable: int = 0              # positions the drafter has caught up with
    fresh: bool = True           # a new request started in this slot (its prefill wrote position 0)

    def write(self, name: tuple[str, int], start: int, x: torch.Tensor) -> None:
        end = start + x.shape[0]
        old = self.tensors.get(name)
        if old is None or old.shape[0] < end:
            grown = x.new_zeros((max(end, 2 * (0 if old is None else old.shape[0]), 256), *x.shape[1:]))
            if old is not None:
                grown[:old.shape[0]] = old
            self.tensors[name] = old = grown
        old[start:end] = x

    def update(self, kv_layers: list[int], feature_layers: list[int], tokens: torch.Tensor, start: int,
               length: int) -> Any:
        """kvshot's TargetUpdate for positions start..length-1: their features, and the target cache of positions
        0..length-1 as kvshot's proposers read it (layers[i].keys/.values `[1, Hkv, length, hd]`)."""
        from models.decoding.proposers import TargetUpdate

        cache = SimpleNamespace(layers={i: SimpleNamespace(
            keys=self.tensors["k", i][:length].transpose(0, 1)[None],
            values=self.tensors["v", i][:length].transpose(0, 1)[None]) for i in kv_layers})
        features = [self.tensors["f", i][start:length][None] for i in feature_layers]
        return TargetUpdate(tokens=tokens, start=start, features=features, last_hidden=None, cache=cache)


class KvshotProposer:
    """vLLM `custom_class` proposer serving a kvshot drafter (see the module docstring)."""

    def __init__(self, vllm_config: Any):
        spec_file = os.environ.get(ENV_SPEC)
        if not spec_file or not Path(spec_file).is_file():
            raise ValueError(f"${ENV_SPEC}={spec_file!r}: not a file naming the drafter to serve")
        spec = json.loads(Path(spec_file).read_text())
        self.run_dir = Path(spec["run_dir"])
        self.target_kv_layers = [int(i) for i in spec["kv_layers"]]
        self.target_feature_layers = [int(i) for i in spec["feature_layers"]]
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        if vllm_config.scheduler_config.max_num_seqs != 1:
            # a request may move to another batch row between steps; what is kept by row would then be another's
            raise ValueError(f"max_num_seqs={vllm_config.scheduler_config.max_num_seqs}: the kvshot proposer "
                             "serves one request at a time (max_num_seqs=1)")
        self.rows: dict[int, _Row] = {}
        self.drafter = self.view = None
        self.kv_layers: list[int] = []
        self.feature_layers: list[int] = []
        self.times = {"hook_s": 0.0, "draft_s": 0.0, "steps": 0}
        self.times_file = os.environ.get(ENV_TIMES)

    # -- vLLM's calls ------------------------------------------------------------------------------------------
    def load_model(self, target_model: torch.nn.Module, *_: Any, **__: Any) -> None:
        """Load the drafter with the served target's embedding, and hook the target layers it reads."""
        from stages.checkpoint import load_drafter

        embed = target_model.model.embed_tokens.weight
        cfg = json.loads((self.run_dir / "config.json").read_text())["drafter"]
        self.view = SimpleNamespace(embed_tokens=SimpleNamespace(weight=embed), vocab_size=cfg["vocab_size"],
                                    hidden_size=embed.shape[1], device=embed.device, dtype=embed.dtype,
                                    feature_layers=self.target_feature_layers, kv_layers=self.target_kv_layers)
        self.drafter, _ = load_drafter(self.run_dir, self.view)
        dcfg = self.drafter.config
        if dcfg.variant not in SERVED_VARIANTS:
            raise ValueError(f"{self.run_dir}: variant {dcfg.variant!r} goes through its export, not this proposer "
                             f"(it serves {list(SERVED_VARIANTS)})")
        self.kv_layers = self.target_kv_layers if dcfg.reads_kv else []
        self.feature_layers = self.target_feature_layers if dcfg.uses_features else []
        modules = dict(target_model.named_modules())
        for i in sorted(set(self.kv_layers) | set(self.feature_layers)):
            layer = next((m for name, m in modules.items() if name.endswith(f"model.layers.{i}")), None)
            if layer is None:
                raise ValueError(f"target layer {i} (target.kv_layers={self.target_kv_layers}, target.feature_layers="
                                 f"{self.target_feature_layers}): the served target has no such decoder layer")
            attn = layer.self_attn.attn
            if i in self.kv_layers:
                attn.register_forward_pre_hook(self._catch_kv(i, attn.layer_name))
            if i in self.feature_layers:
                layer.register_forward_pre_hook(self._catch_feature(i, attn.layer_name))

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec, token_ids_cpu, **_: Any
                ) -> list[list[int]]:
        """A chain of k draft tokens per request that sampled a token this step ([] for the others)."""
        t0 = time.perf_counter()
        drafts = [self._propose_row(i, int(num_tokens_no_spec[i]), token_ids_cpu[i]) if sampled else []
                  for i, sampled in enumerate(sampled_token_ids)]
        self.times["draft_s"] += time.perf_counter() - t0
        self.times["steps"] += 1
        if self.times_file:
            Path(self.times_file).write_text(json.dumps(self.times))
        return drafts

    # -- pieces ------------------------------------------------------------------------------------------------
    def _place(self, layer_name: str, kind: str, layer: int, x: torch.Tensor) -> None:
        """Write the step's rows of `x` [tokens, ...] at each request's positions (nothing outside a step)."""
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return
        meta = get_forward_context().attn_metadata
        if not isinstance(meta, dict) or meta.get(layer_name) is None:
            return                     # a profiling or warm-up pass: nothing to keep
        starts = meta[layer_name].query_start_loc.tolist()
        seq_lens = meta[layer_name].seq_lens.tolist()
        for r, seq_len in enumerate(seq_lens):
            a, b = starts[r], starts[r + 1]
            if b == a:
                continue
            first = seq_len - (b - a)          # the absolute position of this request's first new token
            row = self.rows.setdefault(r, _Row())
            row.fresh = row.fresh or first == 0
            row.write((kind, layer), first, x[a:b].detach().clone())

    def _catch_kv(self, layer: int, layer_name: str):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            t0 = time.perf_counter()
            hkv, hd = module.num_kv_heads, module.head_size
            self._place(layer_name, "k", layer, args[1].reshape(-1, hkv, hd))
            self._place(layer_name, "v", layer, args[2].reshape(-1, hkv, hd))
            self.times["hook_s"] += time.perf_counter() - t0
        return hook

    def _catch_feature(self, layer: int, layer_name: str):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            t0 = time.perf_counter()
            _, hidden, residual = args[:3]
            self._place(layer_name, "f", layer, hidden if residual is None else hidden + residual)
            self.times["hook_s"] += time.perf_counter() - t0
        return hook

    @torch.no_grad()
    def _propose_row(self, i: int, n_tokens: int, token_ids) -> list[int]:
        from models.decoding.tree import TreeSpec

        row = self.rows.get(i)
        if row is None:
            return []
        S = n_tokens - 1                                   # positions with accepted target KV; S is the root's
        begin = row.fresh or row.proposer is None or S < row.stable
        if begin:
            row.proposer, row.stable, row.fresh = kvshot_proposer(self.drafter, self.view), 0, False
        tokens = torch.as_tensor(token_ids[row.stable:S].astype("int64"))
        update = row.update(self.kv_layers, self.feature_layers, tokens, row.stable, S)
        (row.proposer.begin if begin else row.proposer.update)(update)
        tree = row.proposer.propose(int(token_ids[S]), TreeSpec.chain(self.k))
        row.stable = S
        order = tree.depths[1:].argsort()
        return [int(t) for t in tree.tokens[1:][order]]
