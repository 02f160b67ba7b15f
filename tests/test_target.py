"""The target adapter's conventions (DESIGN §4): feature indices, post-RoPE KV, LM head, on tiny and real targets."""
import pytest
import torch

from models.rope import apply_rope
from models.target import Target, TargetLoadError, default_feature_layers, load_target, tiny_target


def _recompute_kv(target: Target, hidden: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of decoder layer `layer` by hand from hidden_states[layer]: norm, projections, (k-norm), RoPE."""
    block = target.model.model.layers[layer]
    attn = block.self_attn
    B, T, _ = hidden.shape
    x = block.input_layernorm(hidden)
    k = attn.k_proj(x).view(B, T, target.num_kv_heads, target.head_dim)
    v = attn.v_proj(x).view(B, T, target.num_kv_heads, target.head_dim).transpose(1, 2)
    if hasattr(attn, "k_norm"):
        k = attn.k_norm(k)
    k = k.transpose(1, 2)
    cos, sin = target.rope(torch.arange(T).unsqueeze(0).expand(B, T))
    return apply_rope(k, cos.unsqueeze(1), sin.unsqueeze(1)), v


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_target_conventions(arch):
    target = tiny_target(arch, num_layers=8, kv_layers=[1, 4, 6])
    ids = torch.randint(0, target.vocab_size, (2, 11))
    cap = target.capture(ids, with_logits=True)
    ref = target.model(input_ids=ids, output_hidden_states=True)

    assert target.feature_layers == default_feature_layers(8) == [2, 4, 5]
    for idx, feat in zip(target.feature_layers, cap.features):
        torch.testing.assert_close(feat, ref.hidden_states[idx], rtol=0, atol=0)
    torch.testing.assert_close(target.logits(cap.last_hidden), ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cap.logits, ref.logits, rtol=1e-5, atol=1e-5)

    for layer, (k, v) in zip(target.kv_layers, cap.kv):
        assert k.shape == (2, target.num_kv_heads, 11, target.head_dim)  # GQA heads unexpanded
        k_ref, v_ref = _recompute_kv(target, ref.hidden_states[layer], layer)
        torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-5)


def test_capture_continues_a_cache():
    target = tiny_target("llama")
    ids = torch.randint(0, target.vocab_size, (1, 9))
    full = target.capture(ids, with_logits=True)
    first = target.capture(ids[:, :5], keep_cache=True)
    rest = target.capture(ids[:, 5:], past_key_values=first.cache, with_logits=True)
    torch.testing.assert_close(rest.logits, full.logits[:, 5:], rtol=1e-5, atol=1e-5)
    for (k, v), (k_full, v_full) in zip(rest.kv, full.kv):
        torch.testing.assert_close(k, k_full, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, v_full, rtol=1e-5, atol=1e-5)


def test_bad_layers_and_sources_are_named():
    with pytest.raises(ValueError, match="kv_layers"):
        tiny_target("llama", num_layers=8, kv_layers=[8])
    with pytest.raises(TargetLoadError, match="no such local path"):
        load_target("./no/such/model")
    with pytest.raises(TargetLoadError, match="target.dtype"):
        load_target("embedded", dtype="int3")


def test_hub_loading_path_reads_a_local_folder(tmp_path):
    """The code path the paper profile uses for hub ids, exercised on a saved local model."""
    tiny = tiny_target("qwen3", num_layers=4)
    tiny.model.save_pretrained(tmp_path / "m")
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="[UNK]").save_pretrained(tmp_path / "m")
    loaded = load_target(str(tmp_path / "m"), dtype="float32")
    assert loaded.num_layers == 4 and loaded.feature_layers == [2, 2, 1]
    ids = torch.tensor([[1, 2, 1]])
    torch.testing.assert_close(loaded.capture(ids, with_logits=True).logits,
                               tiny.capture(ids, with_logits=True).logits)


def test_embedded_smollm2_answers_and_shapes(embedded_target):
    target = embedded_target
    assert (target.num_layers, target.hidden_size, target.num_kv_heads, target.head_dim) == (30, 576, 3, 64)
    assert target.feature_layers == [2, 15, 27]
    ids = target.chat_ids([{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    prompt = torch.tensor([ids])
    out = target.model.generate(prompt, max_new_tokens=12, do_sample=False)
    answer = target.tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True)
    assert answer.strip() and sum(c.isascii() and c.isalpha() for c in answer) >= 5, answer
    assert "paris" in answer.lower(), answer

    cap = target.capture(prompt)
    T = prompt.shape[1]
    assert [tuple(f.shape) for f in cap.features] == [(1, T, 576)] * 3
    assert [tuple(k.shape) for k, _ in cap.kv] == [(1, 3, T, 64)] * 3
