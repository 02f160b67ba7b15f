"""report: paper-style tables, alpha_k figures and findings from the metrics -> reports/README.md."""
from __future__ import annotations

from stages.common import Paths, Report, Section


class ReportParams(Section):
    title: str = "KVShot reproduction"
    figure_width: float = 7.0
    figure_height: float = 4.5
    dpi: int = 110


def run(params: ReportParams, context: dict, paths: Paths, report: Report) -> None:
    raise NotImplementedError("report is not built yet")
