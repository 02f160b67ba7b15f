"""The module for a drafter config: `models.block.BlockDrafter` for the block variant, `models.drafter.Drafter` for
the others. Its own module so that neither drafter module imports the other's family."""
from __future__ import annotations

from torch import nn

from models.block import BlockDrafter
from models.drafter import Drafter
from models.drafter_config import DrafterConfig


def build_drafter(cfg: DrafterConfig) -> nn.Module:
    """The module for a config: `BlockDrafter` for variant 'block', else `Drafter`."""
    return BlockDrafter(cfg) if cfg.variant == "block" else Drafter(cfg)
