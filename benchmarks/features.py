"""Feature extraction throughput vs a bare target forward over the same batches, and the cache's bytes/token.

Prints one summary line: extraction tokens/s (tokenise + capture + bf16 shard writes), bare-forward tokens/s
(the decoder alone, no hidden states kept), their ratio (target >= 0.8x) and bytes per cached token.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from models.target import load_target
from stages.features import FeaturesParams, extract, tokenize_rows, write_index
from stages.prepare import sample_conversations

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=384)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target("embedded", cache_dir=ROOT / "scratch" / "models")
    rows = [dict(r, messages=r["messages"][:2]) for r in sample_conversations(args.conversations, 1500)]
    params = FeaturesParams(max_len=args.max_len, shard_size=args.conversations, batch_size=args.batch_size)
    items = tokenize_rows(rows, target.tokenizer, args.max_len, Counter())
    tokens = sum(len(it.ids) for it in items)
    # bare forward: the same length-sorted, right-padded batches, no hidden states, no cache
    order = sorted(items, key=lambda it: len(it.ids))
    t0 = time.perf_counter()
    with torch.no_grad():
        for b in range(0, len(order), args.batch_size):
            group = order[b:b + args.batch_size]
            width = max(len(it.ids) for it in group)
            ids = torch.zeros((len(group), width), dtype=torch.long)
            att = torch.zeros_like(ids)
            for r, it in enumerate(group):
                ids[r, :len(it.ids)], att[r, :len(it.ids)] = torch.tensor(it.ids), 1
            target.model.model(input_ids=ids, attention_mask=att, use_cache=False)
    bare = tokens / (time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        items = tokenize_rows(rows, target.tokenizer, args.max_len, Counter())
        records = extract(items, Path(tmp), params, target, {"bench": 1}, by_rank=False)
        stage = tokens / (time.perf_counter() - t0)
        index = write_index(Path(tmp), "bench", items, records, params, {}, {}, {})
    print(f"features: extraction {stage:.0f} tok/s vs bare forward {bare:.0f} tok/s = {stage / bare:.2f}x; "
          f"cache {index['bytes_per_token']:,.0f} B/token ({tokens:,} tokens, {len(items)} conversations, "
          f"{args.threads} threads)")


if __name__ == "__main__":
    main()
