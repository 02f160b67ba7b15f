"""A drafter's config (DESIGN §5): the variant, its shape and options, everything needed to rebuild it; saved as
a run's config.json. Plain data: no torch, so anything that reads a run's config loads without it."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

VARIANTS = ("eagle3", "kv_only", "hybrid", "cross_only", "block")
INJECTIONS = ("linear", "head_concat")
EAGLE_FAMILY = ("eagle3", "hybrid", "cross_only")
# what the block drafter's context keys are made of: the fused target features (DFlash), the injected target KV,
# or both key sets under one softmax
CONTEXTS = ("hidden", "kv", "both")
BLOCK_DEFAULTS = {"block_size": 8, "context": "hidden"}


# -- config ---------------------------------------------------------------------------------------------------

@dataclass
class DrafterConfig:
    """Everything needed to rebuild a drafter (saved as the run's config.json)."""

    variant: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int                      # the target's
    draft_vocab_size: int                # resolved: 1..vocab_size
    depth: int = 1
    injection: str = "linear"
    rope_fix: bool = False
    n_features: int = 3
    n_kv_layers: int = 3
    target_num_kv_heads: int | None = None
    target_head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_inv_freq: list[float] | None = None   # copied from the target so rotations agree bit for bit
    rope_scaling: float = 1.0                  # the target rotary's attention_scaling
    fc_norm: bool = False                      # EAGLE-3.1: RMSNorm per fused feature before fc
    norm_output: bool = False                  # EAGLE-3.1: step k+1 reads step k's post-final-norm hidden
    no_target: bool = False                    # kv_only control: the target prefix masked out of the keys
    token_context: bool = False                # no_target control: its own causal keys of the prefix tokens instead
    block_size: int = 8                        # block: positions per pass incl. the root (B-1 tokens predicted)
    context: str = "hidden"                    # block: the context keys, one of CONTEXTS
    extra: dict = field(default_factory=dict)  # free-form notes (e.g. the target's name)

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"drafter.variant={self.variant!r}: expected one of {list(VARIANTS)}")
        if self.injection not in INJECTIONS:
            raise ValueError(f"drafter.injection={self.injection!r}: expected one of {list(INJECTIONS)}")
        if self.depth < 1:
            raise ValueError(f"drafter.depth={self.depth}: must be >= 1")
        if self.variant == "block":
            if self.context not in CONTEXTS:
                raise ValueError(f"drafter.context={self.context!r}: expected one of {list(CONTEXTS)}")
            if self.block_size < 2:
                raise ValueError(f"drafter.block_size={self.block_size}: must be >= 2 (the root and at least one "
                                 "predicted token)")
            if self.norm_output:
                raise ValueError("drafter.norm_output feeds one step's output to the next; the block variant drafts "
                                 "all positions in one pass and does not take it")
            if self.fc_norm and not self.uses_features:
                raise ValueError(f"drafter.fc_norm normalises the fused features; block context={self.context!r} "
                                 "reads none (use context 'hidden' or 'both')")
        elif any(getattr(self, k) != v for k, v in BLOCK_DEFAULTS.items()):
            raise ValueError(f"drafter.block_size / drafter.context are options of the block variant; variant "
                             f"{self.variant!r} does not take them")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"drafter num_heads={self.num_heads} not a multiple of num_kv_heads={self.num_kv_heads}")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"drafter.draft_vocab_size={self.draft_vocab_size}: must be in 1..{self.vocab_size}")
        self.target_num_kv_heads = self.target_num_kv_heads or self.num_kv_heads
        self.target_head_dim = self.target_head_dim or self.head_dim
        if (self.fc_norm or self.norm_output) and not self.uses_features:
            raise ValueError(f"drafter.fc_norm / drafter.norm_output are EAGLE-3.1 options of the EAGLE-3 family "
                             f"{list(EAGLE_FAMILY)}; variant {self.variant!r} has no fused features")
        if self.no_target and self.variant != "kv_only":
            raise ValueError(f"drafter.no_target is the kv_only control; variant {self.variant!r} does not take it")
        if self.token_context and not self.no_target:
            raise ValueError("drafter.token_context is an option of the no-target control: set drafter.no_target "
                             "(with variant kv_only) too")
        if self.token_context and (self.injection != "linear" or self.rope_fix):
            raise ValueError("drafter.injection / drafter.rope_fix shape the target KV injection, which the "
                             "token_context control does not read: leave them at linear / false")
        if self.reads_kv and self.injection == "head_concat" and self.target_head_dim != self.head_dim:
            raise ValueError(f"drafter.injection='head_concat' needs head_dim == target head_dim "
                             f"({self.head_dim} != {self.target_head_dim})")

    @property
    def reads_kv(self) -> bool:
        """The drafter reads the target KV (the trainer passes `target_kv`, decoding the live target cache)."""
        if self.variant == "block":
            return self.context in ("kv", "both")
        return self.variant != "eagle3" and not self.token_context

    @property
    def cross_branch(self) -> bool:
        """The autoregressive drafter's layers have the KV reader's attention branch (`cross_attn`): every variant
        but eagle3, the token_context control too (its prefix keys are its own, not the target's)."""
        return self.variant not in ("eagle3", "block")

    @property
    def uses_features(self) -> bool:
        """The drafter reads the fused target features (the trainer passes `features`)."""
        if self.variant == "block":
            return self.context in ("hidden", "both")
        return self.variant in EAGLE_FAMILY

    @property
    def steps(self) -> int | None:
        """Tokens one block pass predicts (block_size - 1); None for the autoregressive variants (their K is the
        training unroll's choice)."""
        return self.block_size - 1 if self.variant == "block" else None

    @property
    def cross_kv_heads(self) -> int:
        """KV heads of the cross branch: the target's (linear) or all source layers' side by side."""
        if self.injection == "head_concat":
            return self.n_kv_layers * self.target_num_kv_heads
        return self.num_kv_heads

    @classmethod
    def from_target(cls, target, variant: str = "eagle3", depth: int = 1, injection: str = "linear",
                    rope_fix: bool = False, draft_vocab_size: int = 0, fc_norm: bool = False,
                    norm_output: bool = False, no_target: bool = False, token_context: bool = False,
                    block_size: int = 8, context: str = "hidden") -> "DrafterConfig":
        """Drafter dimensions = target dimensions (as EAGLE-3); draft_vocab_size 0 or >= vocab means full."""
        V = target.vocab_size
        n = V if draft_vocab_size <= 0 or draft_vocab_size >= V else draft_vocab_size
        rot = target.rotary_emb
        cfg = target.config
        return cls(variant=variant, depth=depth, injection=injection, rope_fix=rope_fix, fc_norm=fc_norm,
                   norm_output=norm_output, no_target=no_target, token_context=token_context,
                   block_size=block_size, context=context,
                   hidden_size=target.hidden_size, num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
                   head_dim=target.head_dim, intermediate_size=cfg.intermediate_size, vocab_size=V,
                   draft_vocab_size=n, n_features=len(target.feature_layers), n_kv_layers=len(target.kv_layers),
                   target_num_kv_heads=target.num_kv_heads, target_head_dim=target.head_dim,
                   rms_norm_eps=target.rms_norm_eps,
                   rope_theta=float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
                   rope_inv_freq=[float(x) for x in target.rope_inv_freq.float().cpu()],
                   rope_scaling=float(getattr(rot, "attention_scaling", 1.0)),
                   extra={"target": getattr(target, "name", "")})

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"drafter config: unknown keys {unknown}")
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "DrafterConfig":
        return cls.from_dict(json.loads(text))
