"""Drafter modules: config, hybrid/eagle3 equivalence, ckpt warm start, RoPE fix, cache, draft vocabulary."""
import pytest
import torch

from models.drafter import DraftCache, Drafter, init_from_eagle3
from models.drafter_config import DrafterConfig
from models.rope import apply_rope, unapply_rope
from models.ttt import ttt_unroll
from models.vocab import build_draft_vocab, count_tokens, coverage, to_eagle3_offsets
from tests.drafter_helpers import capture, make_drafter, naive_logits, tiny


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama():
    tgt = tiny("llama")
    return tgt, capture(tgt, B=2, T=10)


def test_config_from_target_and_json_round_trip(llama):
    tgt, _ = llama
    cfg = DrafterConfig.from_target(tgt, variant="kv_only", depth=2, injection="head_concat", rope_fix=True,
                                    draft_vocab_size=32)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (48, 6, 2, 8)
    assert cfg.draft_vocab_size == 32 and cfg.vocab_size == 64 and cfg.cross_kv_heads == 6
    assert torch.equal(torch.tensor(cfg.rope_inv_freq), tgt.rope_inv_freq.float())
    assert DrafterConfig.from_json(cfg.to_json()) == cfg
    assert DrafterConfig.from_target(tgt, draft_vocab_size=0).draft_vocab_size == 64
    assert DrafterConfig.from_target(tgt, draft_vocab_size=10**6).draft_vocab_size == 64
    with pytest.raises(ValueError, match="drafter.variant='medusa'"):
        DrafterConfig.from_target(tgt, variant="medusa")
    with pytest.raises(ValueError, match="drafter.injection"):
        DrafterConfig.from_target(tgt, injection="sum")
    with pytest.raises(ValueError, match="unknown keys"):
        DrafterConfig.from_dict({**cfg.to_dict(), "bogus": 1})


def test_state_dict_names_per_variant(llama):
    tgt, _ = llama
    names = {v: set(make_drafter(tgt, variant=v).state_dict()) for v in ("eagle3", "kv_only", "hybrid", "cross_only")}
    assert "fc.weight" in names["eagle3"] and "fc.weight" not in names["kv_only"]
    assert not any("cross_attn" in n for n in names["eagle3"])
    assert not any("self_attn" in n for n in names["kv_only"] | names["cross_only"])
    assert {"d2t", "t2d", "embed_tokens.weight", "lm_head.weight", "norm.weight"} <= names["kv_only"]
    assert {"layers.0.gate.weight", "layers.0.gate.bias", "layers.0.delta.weight"} <= names["hybrid"]


@pytest.mark.parametrize("variant", ["hybrid", "cross_only"])
def test_ckpt_init_copies_every_shared_tensor_bit_exactly(llama, variant):
    tgt, _ = llama
    e3 = make_drafter(tgt, seed=1, variant="eagle3")
    with torch.no_grad():
        e3.set_vocab(torch.arange(64).flip(0).sort().values)
        for p in e3.parameters():
            p.add_(torch.randn_like(p))          # "trained": nothing left at its initial value
    d = make_drafter(tgt, seed=2, variant=variant)
    src = e3.state_dict()
    loaded, new = init_from_eagle3(d, src)
    own = d.state_dict()
    shared = sorted(set(src) & set(own))
    assert sorted(loaded) == shared
    for name in shared:
        assert torch.equal(own[name], src[name]), name
    assert sorted(new) == sorted(set(own) - set(src))
    assert all(".cross_attn." in n or ".gate." in n or ".delta." in n for n in new)
    if variant == "cross_only":
        assert not any("self_attn" in n for n in loaded)
    else:
        assert "layers.0.self_attn.q_proj.weight" in loaded
    bad = dict(src, **{"fc.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="fc.weight"):
        init_from_eagle3(d, bad)


def test_hybrid_with_closed_gate_is_eagle3_exactly(llama):
    tgt, (ids, feats, kv, logits) = llama
    e3 = make_drafter(tgt, seed=1, variant="eagle3", depth=2)
    hy = make_drafter(tgt, seed=2, variant="hybrid", depth=2)
    init_from_eagle3(hy, e3.state_dict())
    hy.force_gate(0.0)
    with torch.no_grad():
        a = ttt_unroll(e3, ids, torch.ones_like(ids), features=feats, target_logits=logits, steps=3,
                       return_logits=True)
        b = ttt_unroll(hy, ids, torch.ones_like(ids), features=feats, target_kv=kv, target_logits=logits, steps=3,
                       return_logits=True)
    for x, y in zip(a.logits, b.logits):
        assert torch.equal(x, y)
    assert a.losses == b.losses
    torch.testing.assert_close(naive_logits(e3, ids, feats, kv, 2), naive_logits(hy, ids, feats, kv, 2),
                               rtol=0, atol=0, equal_nan=True)
    hy.force_gate(None)     # an open gate changes the output
    with torch.no_grad():
        c = ttt_unroll(hy, ids, torch.ones_like(ids), features=feats, target_kv=kv, target_logits=logits, steps=1,
                       return_logits=True)
    assert not torch.allclose(c.logits[0], a.logits[0])
    assert 0 < c.gate_means[0] < 1 and set(c.gate_means) == {0, 1}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_rope_fix_unrotates_to_the_targets_own_keys(arch):
    """un-rotate -> identity projection -> re-rotate gives back the target's keys, and un-rotating alone gives
    the target's pre-RoPE keys computed from its layer input."""
    tgt = tiny(arch)
    ids = torch.randint(0, 64, (1, 11))
    cap = tgt.capture(ids)
    with torch.no_grad():
        hs = tgt.model.model(input_ids=ids, output_hidden_states=True).hidden_states
    d = make_drafter(tgt, variant="kv_only", rope_fix=True)
    cos, sin = d.rope_for_target(torch.arange(11)[None])
    for j, layer in enumerate(tgt.kv_layers):
        K = cap.kv[j][0]
        attn = tgt.model.model.layers[layer].self_attn
        x = tgt.model.model.layers[layer].input_layernorm(hs[layer])
        k = attn.k_proj(x).view(1, 11, -1, tgt.head_dim)
        if hasattr(attn, "k_norm"):
            k = attn.k_norm(k)
        torch.testing.assert_close(unapply_rope(K, cos, sin), k.transpose(1, 2), atol=1e-5, rtol=1e-5)
        inj = d.layers[0].cross_attn.inject
        with torch.no_grad():
            sel = torch.zeros_like(inj.k_proj)
            sel[:, j * tgt.head_dim:(j + 1) * tgt.head_dim] = torch.eye(tgt.head_dim)
            inj.k_proj.copy_(sel)
            inj.v_proj.copy_(sel)
        pk, pv = inj(cap.kv, cos, sin)
        torch.testing.assert_close(pk, K, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pv, cap.kv[j][1])
    # a projection that does not commute with the rotation: the fix now matters
    with torch.no_grad():
        inj.k_proj.copy_(torch.randn_like(inj.k_proj))
    fixed = inj(cap.kv, cos, sin)[0]
    inj.rope_fix = False
    plain = inj(cap.kv, cos, sin)[0]
    assert not torch.allclose(fixed, plain, atol=1e-3)
    assert torch.allclose(fixed[:, :, :1], plain[:, :, :1], atol=1e-5)      # position 0: no rotation at all


def test_cache_select_and_incremental_prefix(llama):
    tgt, (ids, feats, kv, logits) = llama
    d = make_drafter(tgt, variant="hybrid", rope_fix=True)
    B = ids.shape[0]
    full = DraftCache()
    fused = d.fuse(feats)
    # one call over 6 positions vs six one-token calls: same logits, same projected prefix
    causal = torch.ones(6, 6, dtype=torch.bool).tril().expand(B, 6, 6)
    tmask = causal
    la, _ = d.step(ids[:, 1:7], fused[:, :6], torch.arange(1, 7).expand(B, 6), full, causal,
                   [(k[:, :, :6], v[:, :, :6]) for k, v in kv], tmask)
    inc = DraftCache()
    outs = []
    for t in range(6):
        lo, _ = d.step(ids[:, t + 1:t + 2], fused[:, t:t + 1], torch.full((B, 1), t + 1), inc,
                       torch.ones(B, 1, t + 1, dtype=torch.bool), [(k[:, :, :t + 1], v[:, :, :t + 1]) for k, v in kv])
        outs.append(lo)
    torch.testing.assert_close(torch.cat(outs, 1), la, atol=1e-5, rtol=1e-5)
    assert inc.prefix_len == 6 and len(inc) == 6
    # the head on the last entry alone (decoding's catch-up) is the last row of the full head
    last, _ = d.step(ids[:, 1:7], fused[:, :6], torch.arange(1, 7).expand(B, 6), DraftCache(), causal,
                     [(k[:, :, :6], v[:, :, :6]) for k, v in kv], tmask, last_only=True)
    assert last.shape == (B, 1, la.shape[-1])
    torch.testing.assert_close(last, la[:, -1:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(inc.prefix[0][0], full.prefix[0][0], atol=1e-6, rtol=1e-6)
    assert d.last_gates and 0 < d.last_gates[0] < 1
    inc.select(torch.tensor([0, 2, 4]))
    assert len(inc) == 3 and inc.positions.tolist() == [[1, 3, 5]] * B
    assert inc.own[(0, "self")][0].shape[2] == 3
    inc.crop(1)
    assert len(inc) == 1
    inc.crop_prefix(4)
    assert inc.prefix_len == 4 and inc.prefix[0][0].shape[2] == 4
    with pytest.raises(ValueError, match="self_mask"):
        d.step(ids[:, :1], fused[:, :1], torch.ones(B, 1, dtype=torch.long), inc, torch.ones(B, 1, 1), kv)


def test_step_errors_name_the_input(llama):
    tgt, (ids, feats, kv, _) = llama
    d = make_drafter(tgt, variant="kv_only")
    with pytest.raises(ValueError, match="target_kv"):
        d.step(ids[:, :1], None, torch.ones(2, 1, dtype=torch.long), DraftCache(), torch.ones(2, 1, 1), None)
    with pytest.raises(ValueError, match="takes no target features"):
        d.fuse(feats)


def test_draft_vocabulary():
    ids = torch.tensor([[5, 5, 5, 1, 1, 2, 9, 9, 9, 9]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0, 0, 0]])
    counts = count_tokens(ids, mask, 12)
    assert counts.tolist() == [0, 2, 1, 0, 0, 3, 0, 0, 0, 0, 0, 0]     # token 9 is not loss-masked
    d2t, t2d = build_draft_vocab(counts, 2)
    assert d2t.tolist() == [1, 5] and t2d.nonzero().squeeze(1).tolist() == [1, 5]
    d2t, _ = build_draft_vocab(counts, 5)                                  # unseen fill: lowest ids
    assert d2t.tolist() == [0, 1, 2, 3, 5]
    assert build_draft_vocab(counts, 0)[0].tolist() == list(range(12))
    assert build_draft_vocab(counts, 99)[1].all()
    assert coverage(counts, torch.tensor([5])) == pytest.approx(0.5)
    assert to_eagle3_offsets(torch.tensor([1, 5])).tolist() == [1, 4]
    counts = count_tokens(ids, torch.ones_like(ids), 12, counts)
    assert int(counts[9]) == 4
    with pytest.raises(ValueError, match="outside"):
        count_tokens(torch.tensor([12]), torch.tensor([1]), 12)


def test_set_vocab_and_head_from_target(llama):
    tgt, _ = llama
    d = make_drafter(tgt, variant="eagle3", draft_vocab_size=8)
    d2t = torch.tensor([3, 4, 9, 10, 20, 33, 40, 63])
    d.set_vocab(d2t)
    assert d.t2d.sum() == 8 and d.target_to_draft()[9] == 2 and d.target_to_draft()[0] == -1
    d.load_target_weights(tgt.embed_tokens.weight, tgt.lm_head.weight)
    assert torch.equal(d.lm_head.weight, tgt.lm_head.weight[d2t])
    with pytest.raises(ValueError, match="d2t"):
        d.set_vocab(torch.arange(5))


@pytest.mark.parametrize("spec", [dict(variant="eagle3"), dict(variant="kv_only", rope_fix=True),
                                  dict(variant="hybrid")], ids=["eagle3", "kv_only_fix", "hybrid"])
def test_bf16_model_and_autocast_stay_close_to_fp32(llama, spec):
    """Decoding casts the drafter to the target's bf16; RoPE frequencies must survive the cast exactly."""
    tgt, (ids, feats, kv, logits) = llama
    d = make_drafter(tgt, **spec)
    ref = naive_logits(d, ids, feats, kv, 2)
    d = d.to(torch.bfloat16)
    d.rope(torch.zeros(1, 1, dtype=torch.long))
    assert d.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(d.rotary.inv_freq, tgt.rope_inv_freq.float())
    kvb = [(k.bfloat16(), v.bfloat16()) for k, v in kv]
    out = naive_logits(d, ids, feats.bfloat16(), kvb, 2)
    have = ~torch.isnan(ref)
    assert (out[have].float() - ref[have]).abs().max() < 0.1
    d = d.float()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        o = ttt_unroll(d, ids, torch.ones_like(ids), features=feats, target_kv=kvb, target_logits=logits, steps=2,
                       return_logits=True)
    assert (o.logits[0][:, :-1].float() - ref[0][:, :-1]).abs().max() < 0.1


def test_eagle31_options_off_are_eagle3_bit_for_bit(llama):
    """fc_norm / norm_output default off: the same weights, the same unroll and the same steps as before."""
    tgt, (ids, feats, kv, logits) = llama
    plain = make_drafter(tgt, seed=3, variant="eagle3", depth=2)
    off = make_drafter(tgt, seed=3, variant="eagle3", depth=2, fc_norm=False, norm_output=False)
    assert plain.state_dict().keys() == off.state_dict().keys()
    for name, t in plain.state_dict().items():
        assert torch.equal(t, off.state_dict()[name]), name
    with torch.no_grad():
        a = ttt_unroll(plain, ids, torch.ones_like(ids), features=feats, target_logits=logits, steps=3,
                       return_logits=True)
        b = ttt_unroll(off, ids, torch.ones_like(ids), features=feats, target_logits=logits, steps=3,
                       return_logits=True)
    assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    on = make_drafter(tgt, seed=3, variant="eagle3", depth=2, fc_norm=True, norm_output=True)
    assert {"fc_norms.0.weight", "fc_norms.2.weight"} <= set(on.state_dict())
    with torch.no_grad():
        c = ttt_unroll(on, ids, torch.ones_like(ids), features=feats, target_logits=logits, steps=3,
                       return_logits=True)
    assert not torch.allclose(c.logits[1], a.logits[1])
    with pytest.raises(ValueError, match="EAGLE-3.1 options"):
        DrafterConfig.from_target(tgt, variant="kv_only", fc_norm=True)


def test_fc_norm_normalises_each_feature_and_norm_output_feeds_the_normed_hidden(llama):
    tgt, (ids, feats, kv, logits) = llama
    d = make_drafter(tgt, variant="eagle3", fc_norm=True, norm_output=True)
    big, bigger = feats.clone(), feats.clone()
    big[..., :48] *= 100.0               # one feature rescaled: its own RMSNorm takes the scale out
    bigger[..., :48] *= 1000.0
    with torch.no_grad():
        torch.testing.assert_close(d.fuse(big), d.fuse(bigger), rtol=1e-4, atol=1e-5)
        assert not torch.allclose(d.fuse(big), make_drafter(tgt, variant="eagle3").fuse(bigger))
        h = torch.randn(1, 2, 48)
        torch.testing.assert_close(d.carry(h), d.norm(h))
    d.config.norm_output = False
    assert torch.equal(d.carry(h), h)


def test_no_target_control_ignores_the_target_kv(llama):
    """The paper's no-target control: replacing the target KV by random tensors changes nothing, in the unroll
    and in incremental decoding steps."""
    tgt, (ids, feats, kv, logits) = llama
    d = make_drafter(tgt, variant="kv_only", depth=2, no_target=True)
    assert not any(".inject." in n for n in d.state_dict())
    noise = [(torch.randn_like(k) * 5, torch.randn_like(v) * 5) for k, v in kv]
    with torch.no_grad():
        a = ttt_unroll(d, ids, torch.ones_like(ids), target_kv=kv, target_logits=logits, steps=3, return_logits=True)
        b = ttt_unroll(d, ids, torch.ones_like(ids), target_kv=noise, target_logits=logits, steps=3,
                       return_logits=True)
    assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    torch.testing.assert_close(naive_logits(d, ids, None, kv, 3), naive_logits(d, ids, None, noise, 3),
                               rtol=0, atol=0, equal_nan=True)
    reader = make_drafter(tgt, variant="kv_only", depth=2)   # the same drafter reading the KV does change
    with torch.no_grad():
        c = ttt_unroll(reader, ids, torch.ones_like(ids), target_kv=noise, target_logits=logits, steps=1,
                       return_logits=True)
        e = ttt_unroll(reader, ids, torch.ones_like(ids), target_kv=kv, target_logits=logits, steps=1,
                       return_logits=True)
    assert not torch.allclose(c.logits[0], e.logits[0])
    with pytest.raises(ValueError, match="no_target"):
        DrafterConfig.from_target(tgt, variant="hybrid", no_target=True)


def test_token_context_control_is_a_causal_lm_without_the_target(llama):
    """The no-target control with context: the KV-only drafter's shape less the injection, no target KV read in the
    unroll or in decoding steps (None, or noise, changes nothing), and a causal language model over the prefix:
    a prediction depends on every earlier token (the bigram control's step 0 on token t+1 alone) and on no later one."""
    tgt, (ids, feats, kv, logits) = llama
    d = make_drafter(tgt, variant="kv_only", depth=2, no_target=True, token_context=True)
    assert not d.config.reads_kv and d.config.uses_features is False
    reader = make_drafter(tgt, variant="kv_only", depth=2)
    assert set(d.state_dict()) == {n for n in reader.state_dict() if ".inject." not in n}
    noise = [(torch.randn_like(k) * 5, torch.randn_like(v) * 5) for k, v in kv]

    def unroll(model, input_ids, target_kv):
        with torch.no_grad():
            return ttt_unroll(model, input_ids, torch.ones_like(input_ids), target_kv=target_kv, target_logits=logits,
                              steps=3, return_logits=True).logits

    a, b = unroll(d, ids, None), unroll(d, ids, noise)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    ref = naive_logits(d, ids, None, None, 3)
    have = ~torch.isnan(ref)
    assert (torch.stack(a)[have] - ref[have]).abs().max() <= 1e-5
    # token 1 (the input of position 0's step 0) changed: every later position's step 0 moves with the context
    # control, none with the bigram control
    other = ids.clone()
    other[:, 1] = (ids[:, 1] + 1) % tgt.vocab_size
    bigram = make_drafter(tgt, variant="kv_only", depth=2, no_target=True)
    for model, moves in ((d, True), (bigram, False)):
        x, y = unroll(model, ids, kv)[0], unroll(model, other, kv)[0]
        assert torch.equal(x[:, 0], y[:, 0]) is False
        assert all((not torch.allclose(x[:, t], y[:, t])) == moves for t in range(1, ids.shape[1] - 1))
    # causal: changing the last token leaves every step-0 prediction before it alone
    late = ids.clone()
    late[:, -1] = (ids[:, -1] + 1) % tgt.vocab_size
    x, y = unroll(d, ids, None)[0], unroll(d, late, None)[0]
    assert torch.equal(x[:, :-2], y[:, :-2]) and not torch.equal(x[:, -2], y[:, -2])


def test_token_context_is_an_option_of_the_no_target_control(llama):
    tgt, _ = llama
    with pytest.raises(ValueError, match="token_context is an option of the no-target control"):
        DrafterConfig.from_target(tgt, variant="kv_only", token_context=True)
    with pytest.raises(ValueError, match="no_target is the kv_only control"):
        DrafterConfig.from_target(tgt, variant="eagle3", no_target=True, token_context=True)
    for bad in (dict(injection="head_concat"), dict(rope_fix=True)):
        with pytest.raises(ValueError, match="does not read"):
            DrafterConfig.from_target(tgt, variant="kv_only", no_target=True, token_context=True, **bad)
    old = DrafterConfig.from_target(tgt, variant="kv_only", no_target=True).to_dict()
    old.pop("token_context")              # a config.json written before the option existed: the bigram control
    assert DrafterConfig.from_dict(old).token_context is False
