"""Block drafters: the parallel training pass against the anchor-by-anchor reference, the fused attention's
gradients, what the KV context reads, the no-dense-mask property, lossless decoding and training signal."""
import pytest
import torch

import models.layers as layers
from models.block import BlockDrafter, block_reference, block_unroll, sample_anchors
from models.decoding import LookupProposer, TreeSpec, first_divergence, greedy_generate, speculative_generate
from models.decoding.block_proposer import BlockProposer
from models.build import build_drafter
from models.drafter import Drafter
from models.drafter_config import DrafterConfig
from models.quant import quantize_linears_int8
from models.ttt import ttt_unroll
from tests.drafter_helpers import BLOCK_GRID, capture, make_drafter, tiny

pytestmark = pytest.mark.usefixtures("one_thread")

BS = 4          # block size in the comparisons: 3 predicted tokens, every structural case, small tensors


def _name(spec):
    return "-".join(str(v) for k, v in spec.items() if k != "variant")


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request):
    tgt = tiny(request.param)
    return tgt, capture(tgt, B=2, T=9)


def _max_diff(par_logits, ref, where=None):
    par = torch.stack(par_logits)
    have = ~torch.isnan(ref)
    if where is not None:
        have &= where[None, :, :, None]
    assert have.sum() > 0
    return (par[have] - ref[have]).abs().max().item()


# -- config -----------------------------------------------------------------------------------------------------

def test_config_properties_factory_and_validation():
    tgt = tiny("llama")
    make = lambda **kw: DrafterConfig.from_target(tgt, variant="block", **kw)   # noqa: E731
    flags = {c: (make(context=c).uses_features, make(context=c).reads_kv) for c in ("hidden", "kv", "both")}
    assert flags == {"hidden": (True, False), "kv": (False, True), "both": (True, True)}
    cfg = make(context="both", block_size=6, depth=2, fc_norm=True)
    assert cfg.steps == 5 and DrafterConfig.from_json(cfg.to_json()) == cfg
    assert isinstance(build_drafter(cfg), BlockDrafter)
    assert isinstance(build_drafter(DrafterConfig.from_target(tgt, variant="eagle3")), Drafter)
    assert DrafterConfig.from_target(tgt, variant="eagle3").steps is None
    with pytest.raises(ValueError, match="drafter.context='cache'"):
        make(context="cache")
    with pytest.raises(ValueError, match="drafter.block_size=1"):
        make(block_size=1)
    with pytest.raises(ValueError, match="norm_output"):
        make(norm_output=True)
    with pytest.raises(ValueError, match="fc_norm"):
        make(context="kv", fc_norm=True)
    with pytest.raises(ValueError, match="options of the block variant"):
        DrafterConfig.from_target(tgt, variant="eagle3", context="kv")
    with pytest.raises(ValueError, match="build_drafter"):
        Drafter(cfg)
    names = set(make_drafter(tgt, variant="block", context="both").state_dict())
    assert {"mask_embedding", "fc.weight", "hidden_norm.weight", "layers.0.self_attn.inject.k_proj", "d2t", "t2d",
            "layers.0.self_attn.context_k_proj.weight", "layers.0.self_attn.context_v_proj.weight",
            "embed_tokens.weight", "lm_head.weight", "norm.weight"} <= names
    kv_names = set(make_drafter(tgt, variant="block", context="kv").state_dict())
    assert "fc.weight" not in kv_names and not any("context_" in n for n in kv_names)


def test_sample_anchors():
    g = torch.Generator().manual_seed(0)
    loss = torch.zeros(3, 20)
    loss[:, 8:] = 1
    am = torch.ones(3, 20)
    am[2, 15:] = 0
    every = sample_anchors(loss, am)
    cand = torch.zeros(3, 20, dtype=torch.bool)
    cand[:, 6:18] = True
    cand[2, 13:] = False
    assert torch.equal(every, cand) and torch.equal(sample_anchors(loss, am, 0), cand)
    some = sample_anchors(loss, am, 4, g)
    assert (some <= cand).all() and some.sum(1).tolist() == [4, 4, 4]
    assert not torch.equal(some, sample_anchors(loss, am, 4, g))      # the generator advances


# -- the parallel pass against the reference ---------------------------------------------------------------------

@pytest.mark.parametrize("spec", BLOCK_GRID, ids=[_name(s) for s in BLOCK_GRID])
def test_parallel_block_unroll_equals_reference(setup, spec):
    tgt, (ids, feats, kv, logits) = setup
    d = make_drafter(tgt, block_size=BS, **spec)
    sub = sample_anchors(torch.ones_like(ids), None, 3, torch.Generator().manual_seed(1))
    for anchors in (None, sub):
        with torch.no_grad():
            out = block_unroll(d, ids, torch.ones_like(ids), features=feats, target_kv=kv, target_logits=logits,
                               anchors=anchors, return_logits=True)
        ref = block_reference(d, ids, feats, kv, anchors=anchors)
        assert len(out.logits) == BS - 1 and out.counts.steps == BS - 1
        assert _max_diff(out.logits, ref) <= 1e-5
        if anchors is not None:
            assert all(float(l[~anchors].abs().max()) == 0 for l in out.logits)   # zeros off the anchors


def test_default_block_size_equals_reference():
    tgt = tiny("llama")
    ids, feats, kv, logits = capture(tgt, B=1, T=12)
    d = make_drafter(tgt, variant="block", context="both", depth=2)
    assert d.block_size == 8
    with torch.no_grad():
        out = block_unroll(d, ids, torch.ones_like(ids), features=feats, target_kv=kv, target_logits=logits,
                           return_logits=True)
    assert _max_diff(out.logits, block_reference(d, ids, feats, kv)) <= 1e-5
    assert out.counts.valid == [10 - k for k in range(7)]      # step k scores t with t+2+k <= 11


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("context", ["hidden", "kv", "both"])
def test_padding(arch, context):
    """Right padding: real positions as without the padding, counts too, and as the reference at every real
    anchor; left padding (the explicit-mask path): equal to the reference with the padding masked out."""
    tgt = tiny(arch)
    ids, feats, kv, logits = capture(tgt, B=2, T=10)
    d = make_drafter(tgt, variant="block", context=context, block_size=BS, depth=2)
    am = torch.ones(2, 10)
    am[1, 7:] = 0
    with torch.no_grad():
        padded = block_unroll(d, ids, torch.ones(2, 10), attention_mask=am, features=feats, target_kv=kv,
                              target_logits=logits, return_logits=True)
        short = block_unroll(d, ids[1:, :7], torch.ones(1, 7), features=feats[1:, :7],
                             target_kv=[(k[1:, :, :7], v[1:, :, :7]) for k, v in kv], target_logits=logits[1:, :7],
                             return_logits=True)
        full = block_unroll(d, ids[:1], torch.ones(1, 10), features=feats[:1],
                            target_kv=[(k[:1], v[:1]) for k, v in kv], target_logits=logits[:1], return_logits=True)
    for k in range(BS - 1):
        torch.testing.assert_close(padded.logits[k][1:, :6], short.logits[k][:, :6], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(padded.logits[k][:1], full.logits[k], atol=1e-5, rtol=1e-5)
    assert [a + b for a, b in zip(short.counts.valid, full.counts.valid)] == padded.counts.valid
    ref = block_reference(d, ids, feats, kv, attention_mask=am)
    assert _max_diff(padded.logits, ref, where=am.bool()) <= 1e-5
    left = torch.ones(2, 10)
    left[1, :3] = 0
    with torch.no_grad():
        out = block_unroll(d, ids, torch.ones(2, 10), attention_mask=left, features=feats, target_kv=kv,
                           target_logits=logits, return_logits=True)
    ref = block_reference(d, ids, feats, kv, attention_mask=left)
    assert _max_diff(out.logits, ref) <= 1e-5


def test_target_hidden_path_and_scoring_rule():
    tgt = tiny("llama")
    ids, feats, kv, _ = capture(tgt, B=2, T=12)
    cap = tgt.capture(ids)
    d = make_drafter(tgt, variant="block", block_size=BS, draft_vocab_size=16)
    d.set_vocab(torch.arange(0, 64, 4))
    mask = torch.zeros(2, 12)
    mask[:, 5:] = 1
    with torch.no_grad():
        a = block_unroll(d, ids, mask, features=feats, target_logits=tgt.logits(cap.last_hidden), decay=0.5)
        b = block_unroll(d, ids, mask, features=feats, target_hidden=cap.last_hidden,
                         lm_head_weight=tgt.lm_head.weight, decay=0.5)
    assert a.losses == pytest.approx(b.losses, abs=1e-6) and a.counts == b.counts
    inside = tgt.logits(cap.last_hidden).argmax(-1) % 4 == 0
    # step k scores anchor t with loss_mask[t+2+k] and the target's argmax at t+1+k inside the draft vocabulary
    for k in range(BS - 1):
        assert a.counts.valid[k] == int(inside[:, 4:11].sum()), k
    assert float(a.loss) == pytest.approx(sum(0.5 ** k * l for k, l in enumerate(a.losses)), rel=1e-5)


def test_cached_top1_teacher_equals_the_full_logits_teacher():
    """With the target's full-vocabulary top-1 (the feature cache's) the block unroll multiplies only the draft rows
    of the head, at the scored rows only: the same losses, counts and gradients as the teacher from full logits."""
    tgt = tiny("llama")
    ids, feats, kv, _ = capture(tgt, B=2, T=12)
    hidden = tgt.capture(ids).last_hidden
    W = tgt.lm_head.weight
    top = torch.nn.functional.linear(hidden, W).max(-1)
    mask = torch.zeros(2, 12)
    mask[0, 5:], mask[1, 3:9] = 1, 1
    runs = []
    cached = dict(target_hidden=hidden, lm_head_weight=W, target_top1=top.indices, target_top1_logit=top.values)
    for teacher in (dict(target_logits=tgt.logits(hidden)), cached):
        d = make_drafter(tgt, variant="block", block_size=BS, context="both", draft_vocab_size=16)
        d.set_vocab(torch.arange(0, 64, 4))
        out = block_unroll(d, ids, mask, features=feats, target_kv=kv, decay=0.5,
                           anchors=sample_anchors(mask, None, None, span=BS - 1), **teacher)
        out.loss.backward()
        runs.append((out, {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}))
    (full, g_full), (cached, g_cached) = runs
    assert 0 < sum(full.counts.valid) < sum(int(mask[:, 2:].sum()) for _ in range(BS - 1))   # some argmax outside
    assert cached.counts == full.counts and cached.losses == pytest.approx(full.losses, abs=1e-6)
    for n in g_full:
        torch.testing.assert_close(g_cached[n], g_full[n], atol=1e-5, rtol=1e-4, msg=n)


def test_blocks_the_loss_reaches_are_all_that_counts():
    """Anchors restricted to the blocks that hold a loss token (the trainer's and the evaluator's default) give the
    same losses, counts and gradients as every position as an anchor, and the scored logits are the same."""
    tgt = tiny("llama")
    ids, feats, kv, logits = capture(tgt, B=2, T=14)
    mask = torch.zeros(2, 14)
    mask[0, 8:], mask[1, 5:11] = 1, 1
    runs = []
    for anchors in (None, sample_anchors(mask, None, None, span=BS - 1)):
        d = make_drafter(tgt, variant="block", block_size=BS, context="both")
        out = block_unroll(d, ids, mask, features=feats, target_kv=kv, target_logits=logits, anchors=anchors,
                           return_logits=True)
        out.loss.backward()
        runs.append((out, {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}))
    (full, g_full), (few, g_few) = runs
    assert full.counts == few.counts and full.losses == pytest.approx(few.losses, abs=1e-6)
    assert g_full.keys() == g_few.keys()
    for n in g_full:
        torch.testing.assert_close(g_full[n], g_few[n], atol=1e-5, rtol=1e-4, msg=n)
    assert int(sample_anchors(mask, None, None, span=BS - 1).sum()) < 2 * 14


def test_bf16_autocast_pass_is_close_to_fp32():
    tgt = tiny("llama")
    ids, feats, kv, logits = capture(tgt, B=2, T=16)
    d = make_drafter(tgt, variant="block", context="both", depth=2).train()
    anchors = sample_anchors(torch.ones_like(ids), None, 8, torch.Generator().manual_seed(0))
    run = lambda: block_unroll(d, ids, torch.ones_like(ids), features=feats, target_kv=kv,   # noqa: E731
                               target_logits=logits * 5, anchors=anchors)
    fp32 = run()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = run()
    bf16.loss.backward()
    assert torch.isfinite(bf16.loss) and float(bf16.loss.detach()) == pytest.approx(float(fp32.loss.detach()), rel=0.03)
    assert d.mask_embedding.grad is not None and torch.isfinite(d.mask_embedding.grad).all()
    assert bf16.counts.valid == fp32.counts.valid


# -- the fused attention -------------------------------------------------------------------------------------------

def _block_leaves(dtype, prefixes, B=1, H=2, n=6, J=3, hd=4, seed=0):
    g = torch.Generator().manual_seed(seed)

    def leaf(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()

    return leaf(B, H, n, J, hd), leaf(B, H, n, J, hd), leaf(B, H, n, J, hd), [leaf(B, H, n, hd) for _ in range(2 * prefixes)]


def _fused_and_plain(n):
    tril = torch.ones(n, n, dtype=torch.bool).tril()

    def fused(q, kc, vc, *pre):
        blocks = [layers.KeyBlock(pre[i], pre[i + 1], causal=True) for i in range(0, len(pre), 2)]
        return layers.attend_block(q, blocks, kc, vc)

    def plain(q, kc, vc, *pre):        # explicit masks: one generic attend call per block offset
        blocks = [layers.KeyBlock(pre[i], pre[i + 1], tril) for i in range(0, len(pre), 2)]
        return layers.attend_block(q, blocks, kc, vc)

    return fused, plain


@pytest.mark.parametrize("prefixes", [1, 2])
def test_fused_block_attention_gradcheck_float64(prefixes):
    """The CPU fused block attention (causal context blocks + each row's own J keys) in float64:
    autograd.gradcheck, and equal to the generic masked path and to a dense softmax over the flattened keys."""
    q, kc, vc, pre = _block_leaves(torch.float64, prefixes)
    fused, plain = _fused_and_plain(q.shape[2])
    assert torch.autograd.gradcheck(fused, (q, kc, vc, *pre))
    out = fused(q, kc, vc, *pre)
    # the generic path computes its scores in fp32 (`.float()`), hence the fp32 tolerance
    torch.testing.assert_close(out, plain(q, kc, vc, *pre), atol=1e-6, rtol=1e-5)
    B, H, n, J, hd = q.shape
    for i in range(n):                 # row i's queries over context keys 0..i and its own J keys
        keys = torch.cat([pre[p][:, :, :i + 1] for p in range(0, len(pre), 2)] + [kc[:, :, i]], 2)
        vals = torch.cat([pre[p][:, :, :i + 1] for p in range(1, len(pre), 2)] + [vc[:, :, i]], 2)
        ref = torch.softmax(q[:, :, i] @ keys.transpose(-1, -2) * hd ** -0.5, -1) @ vals
        torch.testing.assert_close(out[:, :, i], ref)


@pytest.mark.parametrize("prefixes", [1, 2])
def test_fused_block_attention_bf16_equals_generic_path(prefixes):
    q, kc, vc, pre = _block_leaves(torch.bfloat16, prefixes, B=2, H=3, n=23, J=8, hd=16)
    fused, plain = _fused_and_plain(q.shape[2])
    a, b = fused(q, kc, vc, *pre), plain(q, kc, vc, *pre)
    grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    leaves = (q, kc, vc, *pre)
    for ga, gb in zip(torch.autograd.grad(a, leaves, grad), torch.autograd.grad(b, leaves, grad)):
        torch.testing.assert_close(ga, gb, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("fused_path", ["chain", "block"])
def test_fused_attentions_are_unchanged_by_an_enclosing_autocast(fused_path):
    """The CPU fused attentions keep their fp32 scores under bf16 autocast: a custom Function's forward runs under
    the caller's autocast, which would run fp32 matmuls in bf16 while backward recomputes them in fp32."""
    if fused_path == "block":
        q, kc, vc, pre = _block_leaves(torch.bfloat16, 1, B=2, H=3, n=23, J=8, hd=16)
        leaves = (q, kc, vc, *pre)
        fn = _fused_and_plain(q.shape[2])[0]
    else:
        q, kc, vc, pre = _block_leaves(torch.bfloat16, 1, B=2, H=3, n=23, J=5, hd=16)
        q = q[:, :, :, 0].detach().requires_grad_()
        leaves = (q, kc, vc, *pre)

        def fn(q, kc, vc, k, v):
            return layers.attend(q, [layers.KeyBlock(k, v, causal=True), layers.KeyBlock(kc, vc, diag=True)])
    plain = fn(*leaves)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = fn(*leaves)
    grad = torch.randn(plain.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert torch.equal(cast, plain)
    for a, b in zip(torch.autograd.grad(cast, leaves, grad), torch.autograd.grad(plain, leaves, grad)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("context", ["hidden", "kv", "both"])
def test_block_unroll_gradients_fused_equal_masked_path(monkeypatch, context):
    """Every parameter's gradient of a block_unroll through the fused CPU path equals the plain masked path's."""
    tgt = tiny("llama")
    ids, feats, kv, logits = capture(tgt, B=2, T=10)
    anchors = sample_anchors(torch.ones_like(ids), None, 5, torch.Generator().manual_seed(0))

    def grads():
        d = make_drafter(tgt, variant="block", context=context, block_size=BS, depth=2).train()
        out = block_unroll(d, ids, torch.ones_like(ids), features=feats, target_kv=kv, target_logits=logits * 5,
                           anchors=anchors)
        out.loss.backward()
        return {n: p.grad for n, p in d.named_parameters() if p.requires_grad}

    fused = grads()
    real = layers.attend_block

    def masked(q, blocks, k_own, v_own, scale=None):   # the causal blocks as explicit masks: the generic path
        blocks = [layers.KeyBlock(b.k, b.v, b.dense_mask()) for b in blocks]
        return real(q, blocks, k_own, v_own, scale)

    monkeypatch.setattr("models.block.attend_block", masked)
    plain = grads()
    assert fused.keys() == plain.keys() and "mask_embedding" in fused
    for name in fused:
        assert fused[name] is not None and fused[name].abs().sum() > 0, name
        torch.testing.assert_close(fused[name], plain[name], atol=1e-5, rtol=1e-4, msg=name)


# -- what the context reads ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("context", ["kv", "both", "hidden"])
def test_context_reads_exactly_the_target_info_up_to_the_anchor(context):
    tgt = tiny("llama")
    T, t0 = 12, 6
    ids, feats, kv, logits = capture(tgt, B=1, T=T)
    d = make_drafter(tgt, variant="block", context=context, block_size=BS, rope_fix=context == "kv")

    def run(feats, kv):
        with torch.no_grad():
            out = block_unroll(d, ids, torch.ones_like(ids), features=feats, target_kv=kv, target_logits=logits,
                               return_logits=True)
        return torch.stack(out.logits)[:, 0]                            # [steps, T, V]

    base = run(feats, kv)
    g = torch.Generator().manual_seed(3)

    def perturbed(lo, hi):
        f = feats.clone()
        f[:, lo:hi] += torch.randn(f[:, lo:hi].shape, generator=g)
        kv2 = []
        for k, v in kv:
            k, v = k.clone(), v.clone()
            k[:, :, lo:hi] += torch.randn(k[:, :, lo:hi].shape, generator=g)
            v[:, :, lo:hi] += torch.randn(v[:, :, lo:hi].shape, generator=g)
            kv2.append((k, v))
        return run(f, kv2)

    after = perturbed(t0 + 1, T)              # target info at positions > t0
    assert (after[:, :t0 + 1] - base[:, :t0 + 1]).abs().max() <= 1e-6
    assert (after[:, t0 + 1:T - 1] - base[:, t0 + 1:T - 1]).abs().amax((0, 2)).min() > 1e-4
    at = perturbed(t0, t0 + 1)                # target info at t0 itself
    assert (at[:, :t0] - base[:, :t0]).abs().max() <= 1e-6
    assert (at[:, t0] - base[:, t0]).abs().max() > 1e-4


def test_no_dense_block_mask(monkeypatch):
    """Dense key blocks are at most T x T (the causal context, one per source), the block's own keys come as
    [T, B] per head (B keys private to each anchor's B queries); one attention call per layer and pass."""
    tgt = tiny("llama")
    T = 48
    ids, feats, kv, logits = capture(tgt, B=1, T=T)
    calls, dense = [], []
    real = layers.attend_block

    def spy(q, blocks, k_own, v_own, scale=None):
        calls.append((tuple(q.shape), tuple(k_own.shape)))
        dense.extend((b.k.shape[-2], b.causal, b.mask) for b in blocks)
        return real(q, blocks, k_own, v_own, scale)

    monkeypatch.setattr("models.block.attend_block", spy)
    d = make_drafter(tgt, variant="block", context="both", depth=2)
    anchors = sample_anchors(torch.ones_like(ids), None, 10, torch.Generator().manual_seed(0))
    with torch.no_grad():
        for a in (None, anchors):
            block_unroll(d, ids, torch.ones_like(ids), features=feats, target_kv=kv, target_logits=logits, anchors=a)
    assert len(calls) == 2 * 2
    assert all(q[2:4] == (T, 8) and k == q for q, k in calls)
    assert len(dense) == 2 * len(calls)                    # hidden and kv context: two causal T x T blocks
    assert all(width == T and causal and mask is None for width, causal, mask in dense)


# -- decoding --------------------------------------------------------------------------------------------------------

DECODERS = [dict(context="hidden", depth=1), dict(context="kv", depth=2, rope_fix=True),
            dict(context="kv", depth=1, injection="head_concat"), dict(context="both", depth=1, fc_norm=True)]


def _prompt(n, seed, vocab=64):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("kw", DECODERS, ids=[_name(k) for k in DECODERS])
def test_lossless_fp32_block_drafters(arch, kw):
    tgt = tiny(arch)
    drafter = make_drafter(tgt, variant="block", block_size=5, draft_vocab_size=48, **kw)
    drafter.set_vocab(torch.randperm(64, generator=torch.Generator().manual_seed(2))[:48].sort().values)
    prompt = _prompt(10, 0)
    ref = greedy_generate(tgt, prompt, 24)
    models = (drafter, quantize_linears_int8(drafter)) if kw["context"] == "both" else (drafter,)
    for model in models:
        for spec in ([4, 1, 6], [3, 3, 12], [9, 2, 16]):      # chain, tree, a depth past the block (capped)
            res = speculative_generate(tgt, prompt, 24, BlockProposer(model, tgt), spec)
            assert res.tokens == ref.tokens, (kw, spec, first_divergence(ref.tokens, res.tokens))
    seq = torch.cat([prompt, torch.tensor(ref.tokens)])
    tree = BlockProposer(drafter, tgt)
    cap = tgt.capture(prompt[None], keep_cache=True)
    from models.decoding import TargetUpdate
    tree.begin(TargetUpdate(prompt, 0, cap.features, cap.last_hidden, cap.cache))
    assert int(tree.propose(int(seq[10]), TreeSpec(9, 2, 16)).depths.max()) <= 4     # B-1 levels at most


class _Recording(BlockProposer):
    """Records every round's block log-probs with the target cache length they were drafted at."""

    def __init__(self, drafter, target):
        super().__init__(drafter, target)
        self.rounds = []

    def block_log_probs(self, root):
        logp = super().block_log_probs(root)
        self.rounds.append((self.length, root, logp))
        return logp


@pytest.mark.parametrize("kw", DECODERS, ids=[_name(k) for k in DECODERS])
def test_block_proposer_drafts_what_the_reference_drafts(monkeypatch, kw):
    """Every round's one pass (across rounds with partial and off-tree acceptances: a lookup chain grafted after
    the block tree is often the accepted path, so the target cache is compacted) equals block_reference at the
    anchor t = cache length - 1 over the final sequence: same context, same alignment, same positions."""
    import models.decoding.generate as generate

    tgt = tiny("llama")
    drafter = make_drafter(tgt, variant="block", block_size=5, **kw)
    prompt = torch.tensor([5, 6, 7, 8, 9] * 3)
    rec = _Recording(drafter, tgt)
    paths, compact = [], generate.compact_cache

    def spy(cache, past, path):
        paths.append(path.tolist())
        return compact(cache, past, path)

    monkeypatch.setattr(generate, "compact_cache", spy)
    res = speculative_generate(tgt, prompt, 24, LookupProposer(rec, num_tokens=4), [3, 2, 8])
    assert res.tokens == greedy_generate(tgt, prompt, 24).tokens
    assert any(p != list(range(len(p))) for p in paths)      # some accepted path was moved down in the cache
    seq = torch.cat([prompt, torch.tensor(res.tokens)])
    cap = tgt.capture(seq[None])
    ref = block_reference(drafter, seq[None], torch.cat(cap.features, -1), cap.kv)
    assert len(rec.rounds) == len(res.accept_lengths)
    for length, root, logp in rec.rounds:
        assert int(seq[length]) == root
        torch.testing.assert_close(logp, torch.log_softmax(ref[:, 0, length - 1], -1), atol=1e-4, rtol=1e-4)


# -- training ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("context", ["hidden", "kv", "both"])
def test_training_lowers_the_loss_and_reaches_every_parameter(context):
    tgt = tiny("llama")
    ids, feats, kv, logits = capture(tgt, B=2, T=12, seed=1)
    logits = logits * 40        # a peaked target: the random tiny target's own softmax is nearly uniform
    d = make_drafter(tgt, variant="block", context=context, block_size=BS, depth=2).train()
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=2e-2)
    g = torch.Generator().manual_seed(0)
    first = None
    for step in range(40):
        anchors = sample_anchors(torch.ones_like(ids), None, 6, g)
        out = block_unroll(d, ids, torch.ones_like(ids), features=feats, target_kv=kv, target_logits=logits,
                           anchors=anchors)
        opt.zero_grad()
        out.loss.backward()
        if step == 0:
            first = float(out.loss.detach())
            assert d.embed_tokens.weight.grad is None
            for name, p in d.named_parameters():
                if p.requires_grad:
                    assert p.grad is not None and p.grad.abs().sum() > 0, name
        opt.step()
    with torch.no_grad():
        final = block_unroll(d, ids, torch.ones_like(ids), features=feats, target_kv=kv, target_logits=logits)
    assert float(final.loss) < 0.5 * first


# -- a fair hidden context -------------------------------------------------------------------------------------------

FAIR_STEPS, FAIR_B, FAIR_T = 300, 8, 32


def _fair_batches(tgt, seeds: range) -> list:
    """Random tokens through the tiny target, FAIR_B sequences a seed; the teacher sharpened (the random target's
    own softmax is nearly uniform)."""
    ids = torch.cat([torch.randint(0, tgt.vocab_size, (FAIR_B, FAIR_T), generator=torch.Generator().manual_seed(s))
                     for s in seeds])
    with torch.no_grad():
        cap = tgt.capture(ids, with_logits=True)
    feats, logits = torch.cat(cap.features, -1), cap.logits * 40
    return [(ids[i:i + FAIR_B], feats[i:i + FAIR_B], [(k[i:i + FAIR_B], v[i:i + FAIR_B]) for k, v in cap.kv],
             logits[i:i + FAIR_B]) for i in range(0, ids.shape[0], FAIR_B)]


@pytest.fixture(scope="module")
def fair_data():
    tgt = tiny("llama")
    return tgt, _fair_batches(tgt, range(FAIR_STEPS)), _fair_batches(tgt, range(10_000, 10_004))


def _fair_acc0(fair_data, **kw) -> float:
    """acc_0 on held-out sequences after FAIR_STEPS AdamW steps on the same batches: 3 predicted tokens (a block of
    4, or a 3-step TTT unroll), the same loss decay, learning rate and seed for every drafter."""
    tgt, train, held_out = fair_data
    torch.manual_seed(0)
    d = build_drafter(DrafterConfig.from_target(tgt, **kw))
    d.load_target_weights(tgt.embed_tokens.weight)
    block = d.config.variant == "block"

    def unroll(ids, feats, kv, logits):
        ones = torch.ones_like(ids)
        if block:
            return block_unroll(d, ids, ones, features=feats, target_kv=kv, target_logits=logits)
        return ttt_unroll(d, ids, ones, features=feats, target_kv=kv, target_logits=logits, steps=3)

    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    for batch in train:
        out = unroll(*batch)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    with torch.no_grad():
        counts = [unroll(*batch).counts for batch in held_out]
    total = counts[0]
    for c in counts[1:]:
        total = total + c
    return total.acc[0]


def test_hidden_context_block_reaches_eagle3_step0(fair_data):
    """Step 0 of a block drafter with hidden context has EAGLE-3's step-0 information (the fused target features up
    to t and token t+1): trained alike, it must reach EAGLE-3's step-0 accuracy and beat the no-target control. With
    the context through the block's own k/v projections it stayed at the control's level (0.23 against EAGLE-3's
    0.42 here), as in the study (0.240 against 0.250 and 0.374)."""
    eagle3 = _fair_acc0(fair_data, variant="eagle3")
    control = _fair_acc0(fair_data, variant="kv_only", no_target=True)
    hidden = _fair_acc0(fair_data, variant="block", context="hidden", depth=2, block_size=4)
    assert eagle3 > control + 0.05, (eagle3, control)       # the task rewards the target's information
    assert hidden >= eagle3, (hidden, eagle3, control)
