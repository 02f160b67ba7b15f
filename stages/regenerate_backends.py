"""The regenerate stage's generation backends: the target in this process (batched `generate`) or OpenAI-compatible
chat-completions servers, both answering a batch of chat histories with the target's next answer.

Also the stage's params section (the backends read it), the target's tokenizer alone (`load_tokenizer`, which the
features stage tokenises conversations with too) and the prompt-length check the eval split is chosen by. The
turn-by-turn loop that drives a backend is stages/regenerate.py's.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Literal, Protocol

from pydantic import Field

from stages.common import Paths, Section, StageError, TargetParams

OVER_LONG = "prompt over max_prompt_tokens"


class RegenerateParams(Section):
    backend: Literal["transformers", "openai"] = "transformers"
    servers: list[str] = []                # OpenAI-compatible base URLs (backend=openai)
    server_model: str | None = None        # model name sent to the server (default: target.source)
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    batch_size: int = Field(8, ge=1)
    window: int = Field(4, ge=1)           # batches per length-sorted window (the unit a restart recomputes)
    concurrency: int = Field(8, ge=1)      # in-flight requests per server (backend=openai)
    workers: int = Field(1, ge=1)          # Ray actors sharing the work (one per GPU at scale)
    max_prompt_tokens: int = Field(1024, ge=16)
    request_timeout_s: float = Field(600.0, gt=0)
    sampling_seed: int = 0
    original_answers_from: int | None = Field(None, ge=0)  # train rows ranked >= this keep the dataset's answers


@dataclass
class Answer:
    text: str | None             # None: no answer (see reason)
    tokens: int = 0              # generated tokens, eos included
    reason: str | None = None    # why there is no answer
    cut: bool = False            # stopped at max_new_tokens


class Backend(Protocol):
    def answer(self, histories: list[list[dict]]) -> list[Answer]: ...


# -- backends ------------------------------------------------------------------------------------------------------

class TransformersBackend:
    """The target in this process: length-sorted, left-padded batched `generate`."""

    def __init__(self, target, params: RegenerateParams):
        from transformers import GenerationConfig

        self.target, self.params = target, params
        tok = target.tokenizer
        if tok is None:
            raise StageError(f"target {target.name!r}: no tokenizer, cannot regenerate")
        eos = target.model.generation_config.eos_token_id
        eos = eos if eos is not None else tok.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos])
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else min(self.eos)
        sample = params.temperature > 0
        self.gen_config = GenerationConfig(
            max_new_tokens=params.max_new_tokens, do_sample=sample,
            temperature=params.temperature if sample else None, top_p=params.top_p if sample else None,
            top_k=None, pad_token_id=self.pad, eos_token_id=sorted(self.eos))

    def too_long(self, history: list[dict]) -> bool:
        return len(self.target.chat_ids(history, add_generation_prompt=True)) > self.params.max_prompt_tokens

    def answer(self, histories: list[list[dict]]) -> list[Answer]:
        import torch

        prompts = [self.target.chat_ids(h, add_generation_prompt=True) for h in histories]
        out: list[Answer | None] = [None] * len(prompts)
        ok = []
        for i, ids in enumerate(prompts):
            if len(ids) > self.params.max_prompt_tokens:
                out[i] = Answer(None, reason=OVER_LONG)
            else:
                ok.append(i)
        ok.sort(key=lambda i: (len(prompts[i]), i))
        bs = self.params.batch_size
        for b in range(0, len(ok), bs):
            idx = ok[b:b + bs]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.full((len(idx), width), self.pad, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for r, i in enumerate(idx):  # left padding: every prompt ends where generation starts
                ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
                mask[r, width - len(prompts[i]):] = 1
            dev = self.target.device
            with torch.no_grad():
                gen = self.target.model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                                                 generation_config=self.gen_config)
            for r, i in enumerate(idx):
                out[i] = self._decode(gen[r, width:].tolist())
        return out  # type: ignore[return-value]

    def _decode(self, new: list[int]) -> Answer:
        stop = next((k for k, t in enumerate(new) if t in self.eos), None)
        body = new if stop is None else new[:stop]
        text = self.target.tokenizer.decode(body, skip_special_tokens=True).strip()
        tokens = len(new) if stop is None else stop + 1
        if not text:
            return Answer(None, tokens, reason="empty answer")
        return Answer(text, tokens, cut=stop is None)


class OpenAIBackend:
    """An OpenAI-compatible chat-completions server (vLLM, SGLang, ...): concurrent requests over `servers`."""

    def __init__(self, params: RegenerateParams, model: str, tokenizer=None):
        if not params.servers:
            raise StageError("regenerate.backend=openai needs regenerate.servers=[URL, ...]")
        self.params, self.model, self.tokenizer = params, model, tokenizer
        self.urls = [s.rstrip("/") + "/chat/completions" for s in params.servers]
        self.pool = ThreadPoolExecutor(max_workers=params.concurrency * len(self.urls))

    def answer(self, histories: list[list[dict]]) -> list[Answer]:
        jobs = [self.pool.submit(self._one, h, self.urls[i % len(self.urls)]) for i, h in enumerate(histories)]
        return [j.result() for j in jobs]

    def too_long(self, history: list[dict]) -> bool:
        """Over `max_prompt_tokens` by the target's tokenizer; without one the server's own check decides (400)."""
        if self.tokenizer is None:
            return False
        return prompt_tokens(self.tokenizer, history) > self.params.max_prompt_tokens

    def _one(self, history: list[dict], url: str) -> Answer:
        if self.too_long(history):
            return Answer(None, reason=OVER_LONG)
        p = self.params
        body = {"model": self.model, "messages": history, "max_tokens": p.max_new_tokens,
                "temperature": p.temperature, "top_p": p.top_p, "seed": p.sampling_seed}
        data = json.dumps(body).encode()
        last = ""
        for attempt in range(4):
            req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=p.request_timeout_s) as resp:
                    reply = json.loads(resp.read())
                break
            except urllib.error.HTTPError as exc:
                if exc.code == 400:  # the server's own context-length check
                    return Answer(None, reason="prompt rejected by server (400)")
                last = f"HTTP {exc.code}"
            except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError) as exc:
                last = str(getattr(exc, "reason", exc))
            time.sleep(0.5 * 2 ** attempt)
        else:
            raise StageError(f"regenerate server {url}: no answer after 4 tries ({last})")
        try:
            choice = reply["choices"][0]
            text = (choice["message"].get("content") or "").strip()
        except (KeyError, IndexError, TypeError, AttributeError):
            raise StageError(f"regenerate server {url}: reply is not a chat completion: {str(reply)[:120]}") from None
        tokens = int((reply.get("usage") or {}).get("completion_tokens") or 0)
        if not text:
            return Answer(None, tokens, reason="empty answer")
        return Answer(text, tokens, cut=choice.get("finish_reason") == "length")


def prompt_tokens(tokenizer, history: list[dict]) -> int:
    """Tokens of the prompt that asks for the next answer after `history` (the target's chat template)."""
    ids = tokenizer.apply_chat_template(history, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return len(ids)


# -- building a backend --------------------------------------------------------------------------------------------

def load_tokenizer(target: TargetParams, paths: Paths):
    """The target's tokenizer alone (the openai backend checks prompt lengths with it)."""
    from transformers import AutoTokenizer

    from models.target import EMBEDDED, EMBEDDED_GGUF, embedded_model_dir

    try:
        if target.source == EMBEDDED:
            cached = paths.model_cache / "smollm2-135m-instruct"
            if (cached / "tokenizer_config.json").is_file():
                return AutoTokenizer.from_pretrained(cached)
            return AutoTokenizer.from_pretrained(embedded_model_dir(), gguf_file=EMBEDDED_GGUF)
        return AutoTokenizer.from_pretrained(target.source)
    except (OSError, ValueError) as exc:
        raise StageError(f"target.source={target.source!r}: cannot load its tokenizer ({exc})") from None


def make_backend(params: RegenerateParams, target: TargetParams, paths: Paths, loaded_target=None) -> Backend:
    if params.backend == "openai":
        return OpenAIBackend(params, params.server_model or target.source, load_tokenizer(target, paths))
    if loaded_target is None:
        from stages.common import load_target_for

        loaded_target = load_target_for(target, paths)
    return TransformersBackend(loaded_target, params)


def length_check(params: RegenerateParams, target: TargetParams, paths: Paths,
                 backend: Backend | None = None) -> Callable[[list[dict]], bool]:
    """Whether a history's next prompt is over `max_prompt_tokens`: the backend's own check where it has one (the
    same count it refuses by), else the target's tokenizer (Ray workers hold the backends)."""
    check = getattr(backend, "too_long", None)
    if check is not None:
        return check
    tokenizer = load_tokenizer(target, paths)
    return lambda history: prompt_tokens(tokenizer, history) > params.max_prompt_tokens
