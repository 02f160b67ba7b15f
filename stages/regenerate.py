"""regenerate: replace every assistant turn with the target's own answer -> data/regenerated/<source>.jsonl."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from stages.common import Paths, Report, Section, TargetParams


class RegenerateParams(Section):
    backend: Literal["transformers", "openai"] = "transformers"
    servers: list[str] = []                # OpenAI-compatible base URLs (backend=openai)
    server_model: str | None = None        # model name sent to the server (default: target.source)
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    batch_size: int = Field(8, ge=1)
    concurrency: int = Field(8, ge=1)      # in-flight requests per server (backend=openai)
    workers: int = Field(1, ge=1)          # Ray actors sharing the work (one per GPU at scale)
    max_prompt_tokens: int = Field(1024, ge=16)
    sampling_seed: int = 0


def run(params: RegenerateParams, target: TargetParams, sources: list[str], paths: Paths, report: Report) -> None:
    raise NotImplementedError("regenerate is not built yet")
