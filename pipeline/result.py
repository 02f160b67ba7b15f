"""What a sweep did (`pipeline.sweep.run_sweep` returns it; `pipeline.console` prints it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class SweepResult:
    """What a sweep did: one row per planned trial (plan order) but those a stop cut off (they resume next run),
    and which trials ran, were skipped, failed."""

    study: str
    rows: list[dict]
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed_names: list[str] = field(default_factory=list)
    metrics_path: Path | None = None
    parent_run_id: str | None = None

    @property
    def failed(self) -> int:
        return len(self.failed_names)

    @property
    def exit_code(self) -> int:
        return 1 if self.failed_names else 0
