"""features: template-derived loss masks (Llama-3, ChatML, Qwen3), the sharded cache, nested scales, the reader."""
import copy
import json
import os
from pathlib import Path

import pytest
import torch

from stages.common import Paths, TargetParams
from stages.feature_cache import OfflineFeatures, OnlineFeatures, token_frequencies
from stages.features import FeaturesParams, Item, extract, run, tokenize_conversation, tokenize_rows
from stages.prepare import DataParams

ROOT = Path(__file__).resolve().parent.parent

LLAMA3 = (
    "{{- bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

QWEN3 = """{%- set ns = namespace(last_query_index=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}{%- endif %}{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'user' or message.role == 'system' %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == 'assistant' %}
{%- set content = message.content %}{%- set reasoning_content = '' %}
{%- if '</think>' in content %}
{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + content }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

CHATML_GENERATION = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

CONV = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke"},
        {"role": "assistant", "content": "Why did the chicken cross the road?"}]


def masked_spans(tok, ids, mask) -> list[str]:
    spans, cur = [], []
    for t, m in zip(ids + [None], mask + [0]):
        if m:
            cur.append(t)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    return spans


@pytest.mark.parametrize("name,template,expected", [
    ("chatml", None, ["Hello! How can I help?<|im_end|>", "Why did the chicken cross the road?<|im_end|>"]),
    ("llama3", LLAMA3, ["Hello! How can I help?<|eot_id|>", "Why did the chicken cross the road?<|eot_id|>"]),
    ("qwen3", QWEN3, ["Hello! How can I help?<|im_end|>",
                      "<think>\n\n</think>\n\nWhy did the chicken cross the road?<|im_end|>"]),
])
def test_loss_mask_follows_the_template(embedded_tokenizer, name, template, expected):
    tok = embedded_tokenizer
    if name == "llama3":  # Llama-3's header and turn markers are single special tokens in its own vocabulary
        tok = copy.deepcopy(tok)
        tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>",
                                                               "<|eot_id|>"]})
    ids, mask = tokenize_conversation(tok, CONV, chat_template=template)
    full = tok.apply_chat_template(CONV, tokenize=True, chat_template=template)
    full = full["input_ids"] if hasattr(full, "keys") else full
    assert ids == list(full)                      # the sequence is exactly the template's rendering
    assert masked_spans(tok, ids, mask) == expected
    # truncation keeps the prefix
    ids8, mask8 = tokenize_conversation(tok, CONV, max_len=8, chat_template=template)
    assert ids8 == ids[:8] and mask8 == mask[:8]


def test_generation_tag_templates_agree_with_the_sentinel_method(embedded_tokenizer):
    tok = embedded_tokenizer
    ids_g, mask_g = tokenize_conversation(tok, CONV, chat_template=CHATML_GENERATION)
    from stages.features import assistant_char_spans

    text, spans = assistant_char_spans(tok, CONV, CHATML_GENERATION)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    mask_s = [int(any(s <= a < e for s, e in spans)) for a, _ in enc["offset_mapping"]]
    assert list(enc["input_ids"]) == ids_g and mask_s == mask_g and sum(mask_g) > 0


def _rows(n: int, split: str):
    return [{"id": f"{split}-{i}", "source": "uc", "split": split, "scale_rank": i,
             "messages": [{"role": "user", "content": f"Question number {i}: what is {i} plus {i}?" + " Why?" * (i % 2)},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}." + " Because." * (i % 3)}]}
            for i in range(n)]


def test_offline_and_online_readers_agree_on_a_tiny_target(tmp_path, embedded_tokenizer):
    from models.target import tiny_target

    target = tiny_target(vocab_size=len(embedded_tokenizer), tokenizer=embedded_tokenizer)
    items = tokenize_rows(_rows(5, "train"), embedded_tokenizer, 64, drops=[])
    params = FeaturesParams(max_len=64, shard_size=2, batch_size=3, dtype="float32")
    extract(items, tmp_path / "c", params, target, {"t": 1}, by_rank=True)
    from stages.features import write_index

    write_index(tmp_path / "c", "x", items, [], params, {}, {}, {})  # an index without shards must not break
    records = extract(items, tmp_path / "c", params, target, {"t": 1}, by_rank=True)
    write_index(tmp_path / "c", "x", items, records, params, {"source": "tiny"}, {}, {"t": 1})
    off = OfflineFeatures(tmp_path / "c")
    on = OnlineFeatures.from_cache(tmp_path / "c", target)
    assert len(off) == len(on) == 5 and off.ids == [f"train-{i}" for i in range(5)]
    seen = []
    for a, b in zip(off.batches(2, seed=3), on.batches(2, seed=3)):
        assert a.ids == b.ids
        seen += a.ids
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.attention_mask, b.attention_mask)
        assert a.concat_features.shape == (len(a.ids), a.input_ids.shape[1], 3 * 64)
        for x, y in zip(a.features + [a.last_hidden], b.features + [b.last_hidden]):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
        for (k1, v1), (k2, v2) in zip(a.kv, b.kv):
            assert k1.shape == (len(a.ids), 2, a.input_ids.shape[1], 16)
            torch.testing.assert_close(k1, k2, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-5)
    assert sorted(seen) == sorted(off.ids)
    # the same seed and epoch give the same order; another epoch another one
    order = lambda e: [i for b in off.batches(2, seed=3, epoch=e) for i in b.ids]  # noqa: E731
    assert order(0) == order(0) and sorted(order(1)) == sorted(order(0))
    freq = token_frequencies(tmp_path / "c", len(embedded_tokenizer))
    assert int(freq.sum()) == sum(sum(it.mask) for it in items)


def project_paths(tmp_path) -> Paths:
    """Paths in tmp_path that share the project's cached copy of the embedded target (fast reloads)."""
    (tmp_path / "scratch").mkdir()
    (tmp_path / "scratch" / "models").symlink_to(ROOT / "scratch" / "models", target_is_directory=True)
    return Paths(tmp_path)


def test_features_run_writes_nested_scales_and_eval(tmp_path, embedded_target):
    paths = project_paths(tmp_path)
    rows = _rows(2, "eval") + _rows(5, "train")
    out = paths.regenerated("uc")
    out.parent.mkdir(parents=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataParams(sources={"uc": {"kind": "local", "format": "ultrachat", "path": "x"}}, eval_size=2,
                      scales={"small": 3, "large": 5})
    params = FeaturesParams(max_len=48, shard_size=2, batch_size=4)
    run(params, TargetParams(), data, paths, lambda m, step=None: None)
    large, small, ev = (json.loads((paths.features(s) / "index.json").read_text()) for s in ("large", "small", "eval"))
    assert (large["conversations"], small["conversations"], ev["conversations"]) == (5, 3, 2)
    assert [s["file"] for s in small["shards"]] == ["shard-00000.safetensors", "shard-00001.safetensors"]
    d = embedded_target.hidden_size
    assert large["tensors"]["feature_0"] == {"dtype": "BF16", "shape": [d], "per": "token"}
    assert large["tensors"]["k_0"]["shape"] == [embedded_target.num_kv_heads, embedded_target.head_dim]
    assert 6 * d * 2 < large["bytes_per_token"] < 12 * d * 2
    assert sum(small["token_freq"].values()) == small["loss_tokens"] < large["loss_tokens"]
    # shard 0 is shared, the boundary shard is a slice of large's shard 1
    s0 = paths.features("small") / "shard-00000.safetensors"
    assert os.path.samefile(s0, paths.features("large") / "shard-00000.safetensors")
    a, b = OfflineFeatures(paths.features("small")), OfflineFeatures(paths.features("large"))
    assert a.ids == b.ids[:3]
    ba, bb = next(a.batches(3, shuffle=False)), next(b.batches(3, shuffle=False))
    assert torch.equal(ba.last_hidden, bb.last_hidden) and torch.equal(ba.kv[2][1], bb.kv[2][1])
    # the online features of the embedded target match the cache up to its bf16 storage
    on = OnlineFeatures.from_cache(paths.features("small"), embedded_target)
    bo = next(on.batches(3, shuffle=False))
    torch.testing.assert_close(bo.features[1], ba.features[1], rtol=0.02, atol=0.02)
    # a second run reuses every shard
    before = {p.name: p.stat().st_mtime_ns for p in paths.features("large").glob("*.safetensors")}
    run(params, TargetParams(), data, paths, lambda m, step=None: None)
    assert before == {p.name: p.stat().st_mtime_ns for p in paths.features("large").glob("*.safetensors")}


def tokens_only_cache(tmp_path):
    """The features stage over 1 held-out and 3 training conversations with `offline: false`; returns the paths."""
    paths = project_paths(tmp_path)
    out = paths.regenerated("uc")
    out.parent.mkdir(parents=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in _rows(1, "eval") + _rows(3, "train")))
    data = DataParams(sources={"uc": {"kind": "local", "path": "x"}}, eval_size=1, scales={"small": 3})
    run(FeaturesParams(max_len=48, offline=False), TargetParams(), data, paths, lambda m, step=None: None)
    return paths


def test_online_only_cache_holds_tokens(tmp_path, embedded_target):
    paths = tokens_only_cache(tmp_path)
    idx = json.loads((paths.features("small") / "index.json").read_text())
    assert idx["offline"] is False and set(idx["tensors"]) == {"input_ids", "loss_mask", "offsets", "ranks"}
    on = OnlineFeatures.from_cache(paths.features("small"), embedded_target)
    batch = next(on.batches(3))
    assert batch.last_hidden.shape[:2] == batch.input_ids.shape and len(batch.kv) == 3


def test_each_scale_counts_its_own_dropped_conversations(tmp_path, embedded_target):
    paths = project_paths(tmp_path)
    rows = _rows(1, "eval") + _rows(6, "train")
    for r in rows[1:]:
        if r["scale_rank"] in (1, 4):    # the reply starts beyond max_len: no loss token, dropped
            r["messages"][0]["content"] = "word " * 80
    out = paths.regenerated("uc")
    out.parent.mkdir(parents=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataParams(sources={"uc": {"kind": "local", "path": "x"}}, eval_size=1, scales={"small": 3, "large": 6})
    run(FeaturesParams(max_len=48, shard_size=2), TargetParams(), data, paths, lambda m, step=None: None)
    large, small = (json.loads((paths.features(s) / "index.json").read_text()) for s in ("large", "small"))
    assert (large["conversations"], small["conversations"]) == (4, 2)
    assert large["dropped"] == {"no assistant token within max_len": 2}
    assert small["dropped"] == {"no assistant token within max_len": 1}


def strip_top1(directory: Path) -> None:
    """Rewrite a cache as it was before the target's top-1 was stored (old caches must keep working)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    for shard in sorted(directory.glob("shard-*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("target_top1")}
        save_file(tensors, str(shard), metadata=meta)
    index = json.loads((directory / "index.json").read_text())
    index["tensors"] = {k: v for k, v in index["tensors"].items() if not k.startswith("target_top1")}
    (directory / "index.json").write_text(json.dumps(index))


def test_cache_stores_the_targets_top1_and_old_caches_still_read(tmp_path):
    """target_top1 / target_top1_logit per token: the argmax and max of the target's logits from the stored last
    hidden state; a cache without them reads with top1 None."""
    from models.target import tiny_target
    from stages.features import write_index

    target = tiny_target(vocab_size=96)
    g = torch.Generator().manual_seed(0)
    items = [Item(f"c{i}", "t", i, torch.randint(0, 96, (9 + 2 * i,), generator=g).tolist(), [0] * 4 + [1] * (5 + 2 * i))
             for i in range(3)]
    params = FeaturesParams(shard_size=2, batch_size=2, dtype="float32")
    records = extract(items, tmp_path, params, target, {}, by_rank=True)
    index = write_index(tmp_path, "x", items, records, params, {}, {}, {})
    assert index["tensors"]["target_top1"] == {"dtype": "I32", "shape": [], "per": "token"}
    assert index["tensors"]["target_top1_logit"]["dtype"] == "F32"
    cache = OfflineFeatures(tmp_path)
    assert cache.lengths() == [9, 11, 13]
    batch = cache.batch([2, 0, 1])
    logits = target.logits(batch.last_hidden)
    real = batch.attention_mask.bool()
    assert torch.equal(batch.top1[real], logits.argmax(-1)[real])
    torch.testing.assert_close(batch.top1_logit[real], logits.amax(-1)[real])
    strip_top1(tmp_path)
    old = OfflineFeatures(tmp_path).batch([2, 0, 1])
    assert old.top1 is None and old.top1_logit is None and torch.equal(old.last_hidden, batch.last_hidden)
