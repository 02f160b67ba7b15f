"""A KV-reading drafter (variant kv_only) served inside vLLM: a `custom_class` proposer that hands kvshot's own
drafter the target's KV as vLLM's target computed it.

vLLM (0.32, its CPU build) gives a KV-sharing draft model only to Gemma 4's MTP drafters (`use_gemma4_mtp`: model
type `gemma4_mtp`), whose layers each read one target layer's paged cache and no entries of their own; a kvshot
KV drafter reads three target layers through a learned map and its own chain. The route that carries it is
vLLM's `custom_class` proposer: vLLM builds it from its config, calls `load_model(target_model)` once the target
is loaded, and after every target step calls `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
slot_mappings)` for the next draft tokens, which the target then verifies (so the output stays the target's
greedy output whatever is proposed). It is not handed the KV cache; this proposer collects it itself:

- `load_model` registers a pre-hook on the attention layer of each of the target's `kv_layers`. The hook reads
  the post-RoPE keys and values the layer is about to cache, and places each request's tokens at their positions
  from the step's attention metadata (query_start_loc, seq_lens). This needs eager mode (`enforce_eager`): a
  compiled target would not call Python hooks.
- `propose` hands kvshot's `DrafterProposer` what kvshot's own loop hands it: the tokens that entered the target
  cache since the last round with the target's KV of every accepted position, and the root (the newest token);
  it drafts a chain of `num_speculative_tokens`. Positions the target wrote for rejected drafts lie past the
  accepted length and are overwritten by the next step.

The drafter to serve is named by a JSON file in $KVSHOT_KV_DRAFTER (`write_spec`): the run (or export) directory
and the target's `kv_layers`. The target's embedding comes from the served target itself. Runs in the engine's
environment with the repository on PYTHONPATH (`stages/vllm_generate.py --kv-drafter` sets both).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

ENV_SPEC = "KVSHOT_KV_DRAFTER"
CLASS_PATH = "stages.vllm_kv_proposer.KVDrafterProposer"
SERVED_VARIANTS = ("kv_only",)     # drafters that read the target's KV and no hidden states


def write_spec(path: Path, run_dir: Path, kv_layers: list[int]) -> Path:
    """The file that names the drafter to serve (read by the proposer inside vLLM)."""
    Path(path).write_text(json.dumps({"run_dir": str(Path(run_dir).resolve()), "kv_layers": list(kv_layers)}))
    return Path(path)


@dataclass
class _Row:
    """What the proposer keeps of one request slot: the target's K/V by position, and kvshot's proposer."""

    keys: dict[int, torch.Tensor] = field(default_factory=dict)      # layer -> [capacity, Hkv, hd]
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    proposer: Any = None
    stable: int = 0              # positions the drafter has caught up with
    fresh: bool = True           # a new request started in this slot (its prefill wrote position 0)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = start + k.shape[0]
        old = self.keys.get(layer)
        if old is None or old.shape[0] < end:
            cap = max(end, 2 * (0 if old is None else old.shape[0]), 256)
            grown_k = k.new_zeros((cap, *k.shape[1:]))
            grown_v = v.new_zeros((cap, *v.shape[1:]))
            if old is not None:
                grown_k[:old.shape[0]] = old
                grown_v[:old.shape[0]] = self.values[layer]
            self.keys[layer], self.values[layer] = grown_k, grown_v
        self.keys[layer][start:end] = k
        self.values[layer][start:end] = v

    def cache(self, layers: list[int], length: int) -> SimpleNamespace:
        """The target cache as kvshot's proposer reads it: layers[i].keys/.values `[1, Hkv, length, hd]`."""
        return SimpleNamespace(layers={i: SimpleNamespace(keys=self.keys[i][:length].transpose(0, 1)[None],
                                                          values=self.values[i][:length].transpose(0, 1)[None])
                                       for i in layers})


class KVDrafterProposer:
    """vLLM `custom_class` proposer serving a kvshot KV drafter (see the module docstring)."""

    def __init__(self, vllm_config: Any):
        spec_file = os.environ.get(ENV_SPEC)
        if not spec_file or not Path(spec_file).is_file():
            raise ValueError(f"${ENV_SPEC}={spec_file!r}: not a file naming the drafter to serve")
        spec = json.loads(Path(spec_file).read_text())
        self.run_dir = Path(spec["run_dir"])
        self.kv_layers = [int(i) for i in spec["kv_layers"]]
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        if vllm_config.scheduler_config.max_num_seqs != 1:
            # a request may move to another batch row between steps; the KV kept by row would then be another's
            raise ValueError(f"max_num_seqs={vllm_config.scheduler_config.max_num_seqs}: the KV drafter proposer "
                             "serves one request at a time (max_num_seqs=1)")
        self.rows: dict[int, _Row] = {}
        self.drafter = None
        self.view = None

    # -- vLLM's calls ------------------------------------------------------------------------------------------
    def load_model(self, target_model: torch.nn.Module, *_: Any, **__: Any) -> None:
        """Load the drafter with the served target's embedding, and hook the target's KV layers."""
        from stages.checkpoint import load_drafter

        embed = target_model.model.embed_tokens.weight
        cfg = json.loads((self.run_dir / "config.json").read_text())["drafter"]
        self.view = SimpleNamespace(embed_tokens=SimpleNamespace(weight=embed), vocab_size=cfg["vocab_size"],
                                    hidden_size=embed.shape[1], device=embed.device, dtype=embed.dtype,
                                    feature_layers=[], kv_layers=self.kv_layers)
        self.drafter, _ = load_drafter(self.run_dir, self.view)
        if not self.drafter.config.reads_kv or self.drafter.config.uses_features:
            raise ValueError(f"{self.run_dir}: variant {self.drafter.config.variant!r} is not served by this "
                             f"proposer (it serves {list(SERVED_VARIANTS)}: drafters reading the target KV alone)")
        hooked = set()
        for name, module in target_model.named_modules():
            for i in self.kv_layers:
                if name.endswith(f"layers.{i}.self_attn.attn"):
                    module.register_forward_pre_hook(self._catcher(i, module.layer_name))
                    hooked.add(i)
        missing = sorted(set(self.kv_layers) - hooked)
        if missing:
            raise ValueError(f"target.kv_layers={self.kv_layers}: the served target has no attention layer {missing}")

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec, token_ids_cpu, **_: Any
                ) -> list[list[int]]:
        """A chain of k draft tokens per request that sampled a token this step ([] for the others)."""
        return [self._propose_row(i, int(num_tokens_no_spec[i]), token_ids_cpu[i]) if sampled else []
                for i, sampled in enumerate(sampled_token_ids)]

    # -- pieces ------------------------------------------------------------------------------------------------
    def _catcher(self, layer: int, layer_name: str):
        from vllm.forward_context import get_forward_context, is_forward_context_available

        def hook(module: torch.nn.Module, args: tuple) -> None:
            if not is_forward_context_available():
                return
            meta = get_forward_context().attn_metadata
            if not isinstance(meta, dict) or meta.get(layer_name) is None:
                return                     # a profiling or warm-up pass: nothing to keep
            meta = meta[layer_name]
            key, value = args[1], args[2]
            hkv, hd = module.num_kv_heads, module.head_size
            starts = meta.query_start_loc.tolist()
            seq_lens = meta.seq_lens.tolist()
            for r in range(len(seq_lens)):
                a, b = starts[r], starts[r + 1]
                if b == a:
                    continue
                first = seq_lens[r] - (b - a)        # the absolute position of this request's first new token
                row = self.rows.setdefault(r, _Row())
                if first == 0:
                    row.fresh = True
                row.write(layer, first, key[a:b].reshape(b - a, hkv, hd).detach().clone(),
                          value[a:b].reshape(b - a, hkv, hd).detach().clone())
        return hook

    @torch.no_grad()
    def _propose_row(self, i: int, n_tokens: int, token_ids) -> list[int]:
        from models.decoding.drafter_proposer import DrafterProposer
        from models.decoding.proposers import TargetUpdate
        from models.decoding.tree import TreeSpec

        row = self.rows.get(i)
        if row is None:
            return []
        S = n_tokens - 1                                   # positions with accepted target KV; S is the root's
        if row.fresh or row.proposer is None or S < row.stable:
            row.proposer, row.stable, row.fresh = DrafterProposer(self.drafter, self.view), 0, False
            begin = True
        else:
            begin = False
        tokens = torch.as_tensor(token_ids[row.stable:S].astype("int64"))
        update = TargetUpdate(tokens=tokens, start=row.stable, features=[], last_hidden=None,
                              cache=row.cache(self.kv_layers, S))
        (row.proposer.begin if begin else row.proposer.update)(update)
        tree = row.proposer.propose(int(token_ids[S]), TreeSpec.chain(self.k))
        row.stable = S
        order = tree.depths[1:].argsort()
        return [int(t) for t in tree.tokens[1:][order]]
