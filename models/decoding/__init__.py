"""Lossless greedy tree speculative decoding (EAGLE-2 dynamic trees) against a `models.target.Target`."""
from models.decoding.checks import LosslessCheck, exact_match, first_divergence, lossless_at_near_tie
from models.decoding.generate import DecodeResult, greedy_generate, prompt_lookup_generate, speculative_generate
from models.decoding.proposers import (CallableProposer, DraftProposer, OracleProposer, TargetUpdate, chain_length,
                                       lm_log_probs)
from models.decoding.drafter_proposer import DrafterProposer
from models.decoding.lookup import LookupProposer, NgramIndex, graft_chain
from models.decoding.tree import DraftTree, TreeSpec, ancestor_mask, chain_tree, draft_tree, root_only, select_tree
from models.decoding.verify import Verified, accept, compact_cache, prefill, tree_attention_mask, verify

__all__ = [
    "LosslessCheck", "exact_match", "first_divergence", "lossless_at_near_tie",
    "DecodeResult", "greedy_generate", "prompt_lookup_generate", "speculative_generate",
    "DrafterProposer", "CallableProposer", "DraftProposer", "OracleProposer", "TargetUpdate", "chain_length", "lm_log_probs",
    "LookupProposer", "NgramIndex", "graft_chain",
    "DraftTree", "TreeSpec", "ancestor_mask", "chain_tree", "draft_tree", "root_only", "select_tree",
    "Verified", "accept", "compact_cache", "prefill", "tree_attention_mask", "verify",
]
