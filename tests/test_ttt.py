"""The parallel TTT unroll against the naive step-by-step reference, its masks, targets and training signal."""
import pytest
import torch

import models.layers as layers
from models.ttt import ttt_unroll
from tests.drafter_helpers import VARIANT_GRID, assert_same_with_grads, capture, make_drafter, naive_logits, tiny

K = 3
# the no-target control with context (a causal LM over the prefix tokens, no target KV) at two depths, beside the
# shared grid
GRID = VARIANT_GRID + [dict(variant="kv_only", depth=1, no_target=True, token_context=True),
                       dict(variant="kv_only", depth=2, no_target=True, token_context=True)]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request):
    tgt = tiny(request.param)
    return tgt, capture(tgt, B=2, T=9)


def _name(spec):
    return "-".join(f"{v}" for v in spec.values())


@pytest.mark.parametrize("spec", GRID, ids=[_name(s) for s in GRID])
def test_parallel_unroll_equals_naive_reference(setup, spec):
    tgt, (ids, feats, kv, logits) = setup
    d = make_drafter(tgt, **spec)
    with torch.no_grad():
        out = ttt_unroll(d, ids, torch.ones_like(ids), features=feats, target_kv=kv, target_logits=logits,
                         steps=K, return_logits=True)
    ref = naive_logits(d, ids, feats, kv, K)
    par = torch.stack(out.logits)
    have = ~torch.isnan(ref)
    assert have.sum() > 0
    assert (par[have] - ref[have]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "full"])
def test_no_dense_unrolled_mask(monkeypatch, compact):
    """Dense score matrices are at most T x T; the same-position keys come as diag blocks of <= K keys each (one
    row per query: every position on the full path, the positions computed at that step on the compact one)."""
    tgt = tiny("llama")
    T = 48
    ids, feats, kv, logits = capture(tgt, B=1, T=T)
    dense, diag = [], []
    real = layers.attend

    def spy(q, blocks, scale=None):
        for b in blocks:
            if b.diag:
                diag.append(tuple(b.k.shape))
            else:
                dense.append((b.k.shape[-2], None if b.mask is None else tuple(b.mask.shape),
                              q.shape[-2], None if b.rows is None else b.rows.numel()))
        return real(q, blocks, scale)

    monkeypatch.setattr("models.drafter.attend", spy)
    for variant in ("eagle3", "hybrid"):
        d = make_drafter(tgt, variant=variant)
        with torch.no_grad():
            ttt_unroll(d, ids, torch.ones_like(ids), features=feats, target_kv=kv, target_logits=logits, steps=7,
                       compact=compact)
    assert dense and diag
    assert max(width for width, *_ in dense) == T
    assert all(mask is None or mask[-2:] == (T, T) for _, mask, *_ in dense)
    assert all(n <= T and (rows is None or rows == n) for *_, n, rows in dense)
    assert all(shape[2] <= T and shape[3] <= 7 for shape in diag)
    assert all(shape[2] == T for shape in diag) == (not compact)
    assert max(shape[3] for shape in diag) == 7           # the cross branch's chain: steps 0..6


def test_right_padding_does_not_change_real_positions():
    tgt = tiny("llama")
    ids, feats, kv, logits = capture(tgt, B=1, T=10)
    d = make_drafter(tgt, variant="hybrid")
    with torch.no_grad():
        short = ttt_unroll(d, ids[:, :7], torch.ones(1, 7), features=feats[:, :7],
                           target_kv=[(k[:, :, :7], v[:, :, :7]) for k, v in kv], target_logits=logits[:, :7],
                           steps=K, return_logits=True)
        am = torch.zeros(1, 10)
        am[:, :7] = 1
        padded = ttt_unroll(d, ids, torch.ones(1, 10), attention_mask=am, features=feats, target_kv=kv,
                            target_logits=logits, steps=K, return_logits=True)
    for k in range(K):
        n = 7 - 1 - k          # positions whose input token exists in the short sequence
        torch.testing.assert_close(padded.logits[k][:, :n], short.logits[k][:, :n], atol=1e-5, rtol=1e-5)
    assert padded.counts.valid == short.counts.valid


def test_target_hidden_path_equals_target_logits_and_vocab_subset_drops_outside():
    tgt = tiny("llama")
    ids, feats, kv, _ = capture(tgt, B=2, T=12)
    cap = tgt.capture(ids)
    d = make_drafter(tgt, variant="eagle3", draft_vocab_size=16)
    d.set_vocab(torch.arange(0, 64, 4))
    with torch.no_grad():
        a = ttt_unroll(d, ids, torch.ones_like(ids), features=feats, target_logits=tgt.logits(cap.last_hidden),
                       steps=K)
        b = ttt_unroll(d, ids, torch.ones_like(ids), features=feats, target_hidden=cap.last_hidden,
                       lm_head_weight=tgt.lm_head.weight, steps=K)
    assert a.losses == pytest.approx(b.losses, abs=1e-6)
    assert a.counts == b.counts
    arg = tgt.logits(cap.last_hidden).argmax(-1)
    inside = (arg % 4 == 0)
    # step 0 scores position t against the target's logits at t+1, for t+2 <= T-1
    assert a.counts.valid[0] == int(inside[:, 1:-1].sum())


def test_loss_mask_and_weights():
    tgt = tiny("llama")
    ids, feats, kv, logits = capture(tgt, B=1, T=12)
    d = make_drafter(tgt, variant="eagle3")
    mask = torch.zeros(1, 12)
    mask[:, 6:] = 1
    with torch.no_grad():
        out = ttt_unroll(d, ids, mask, features=feats, target_logits=logits, steps=K, decay=0.5)
    # step k scores t with loss_mask[t+2+k]: tokens 6..11 -> t = 4-k .. 9-k
    assert out.counts.valid == [6, 6, 6]
    assert float(out.loss) == pytest.approx(sum(0.5 ** k * l for k, l in enumerate(out.losses)), rel=1e-5)


def test_gradients_flow_and_embedding_frozen_bf16():
    tgt = tiny("llama")
    ids, feats, kv, logits = capture(tgt, B=2, T=16)
    d = make_drafter(tgt, variant="hybrid").train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ttt_unroll(d, ids, torch.ones_like(ids), features=feats, target_kv=kv, target_logits=logits, steps=K)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert d.embed_tokens.weight.grad is None
    for name in ("fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.cross_attn.k_proj.weight",
                 "layers.0.cross_attn.inject.k_proj", "layers.0.gate.weight", "layers.0.delta.weight",
                 "lm_head.weight"):
        g = dict(d.named_parameters())[name].grad
        assert g is not None and g.abs().sum() > 0, name
    assert set(out.gate_means) == {0} and 0 < out.gate_means[0] < 1


@pytest.mark.parametrize("spec", [dict(variant="eagle3"), dict(variant="kv_only", depth=2),
                                  dict(variant="hybrid"), dict(variant="cross_only")],
                         ids=["eagle3", "kv_only2", "hybrid", "cross_only"])
def test_each_variant_overfits_a_few_sequences(spec):
    tgt = tiny("llama")
    ids, feats, kv, logits = capture(tgt, B=2, T=12, seed=1)
    logits = logits * 40        # a peaked target: the random tiny target's own softmax is nearly uniform
    d = make_drafter(tgt, **spec).train()
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=2e-2)
    first = None
    for _ in range(50):
        out = ttt_unroll(d, ids, torch.ones_like(ids), features=feats, target_kv=kv, target_logits=logits,
                         steps=2)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        first = first if first is not None else out.losses[0]
    assert out.losses[0] < 0.5 * first
    assert out.acc[0] >= 0.9


def test_soft_cross_entropy_matches_torch():
    from models.ttt import soft_cross_entropy

    g = torch.Generator().manual_seed(0)
    z = torch.randn(7, 13, generator=g, requires_grad=True)
    p = torch.softmax(torch.randn(7, 13, generator=g), -1)
    w = torch.randn(7, generator=g)
    z0 = z.detach().clone()
    (soft_cross_entropy(z, p, block=3) * w).sum().backward()     # several blocks, the last one short
    assert torch.equal(z.detach(), z0)                           # the logits are left as they were
    mine = z.grad.clone()
    z.grad = None
    ref = torch.nn.functional.cross_entropy(z, p, reduction="none")
    (ref * w).sum().backward()
    torch.testing.assert_close(soft_cross_entropy(z, p), ref)
    torch.testing.assert_close(mine, z.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_causal_chain_attention_equals_joint_softmax(dtype):
    """The CPU fast path (flash prefix + log-sum-exp merged chain) matches the masked joint softmax, gradients too."""
    g = torch.Generator().manual_seed(0)
    B, H, n, J, hd = 2, 3, 23, 4, 16

    def leaf(*shape):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    q, k, v, kc, vc = leaf(B, H, n, hd), leaf(B, H, n, hd), leaf(B, H, n, hd), leaf(B, H, n, J, hd), leaf(B, H, n, J, hd)
    tril = torch.ones(n, n, dtype=torch.bool).tril()
    fused = layers.attend(q, [layers.KeyBlock(k, v, causal=True), layers.KeyBlock(kc, vc, diag=True)])
    plain = layers.attend(q, [layers.KeyBlock(k, v, tril), layers.KeyBlock(kc, vc, diag=True)])
    grad = torch.randn(fused.shape, generator=g).to(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    assert_same_with_grads(fused, plain, (q, k, v, kc, vc), grad, **tol)


# -- the compact unroll (only what carries loss) against the full one ----------------------------------------------

def _partial_batch(tgt, B=3, T=13, seed=1, left=False):
    """A batch where some positions carry loss: padded rows of different lengths, loss on parts of each."""
    ids, feats, kv, logits = capture(tgt, B=B, T=T, seed=seed)
    g = torch.Generator().manual_seed(seed)
    loss_mask = (torch.rand(B, T, generator=g) > 0.4).float()
    loss_mask[:, :3] = 0                                   # a prompt
    am = torch.ones(B, T)
    am[1, T - 3:] = 0                                      # right padding
    am[2, 6:] = 0
    if left:
        am[1] = 0
        am[1, 2:] = 1                                      # a left-padded row: the explicit-mask path
    return ids, feats, kv, logits, loss_mask, am


def _run(d, ids, loss_mask, am, feats, kv, **kw):
    out = ttt_unroll(d, ids, loss_mask, attention_mask=am, features=feats, target_kv=kv, steps=4, **kw)
    d.zero_grad(set_to_none=True)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}


def _vocab_drafter(tgt, spec):
    d = make_drafter(tgt, draft_vocab_size=40, **spec).train()
    d.set_vocab(torch.randperm(64, generator=torch.Generator().manual_seed(2))[:40].sort().values)
    return d


@pytest.mark.parametrize("spec", GRID, ids=[_name(s) for s in GRID])
def test_compact_unroll_equals_the_full_unroll(setup, spec):
    """Same losses, counts and gradients as every step at every position, right padding and a vocabulary subset."""
    tgt, _ = setup
    ids, feats, kv, logits, loss_mask, am = _partial_batch(tgt)
    d = _vocab_drafter(tgt, spec)
    full, g_full = _run(d, ids, loss_mask, am, feats, kv, target_logits=logits, compact=False)
    comp, g_comp = _run(d, ids, loss_mask, am, feats, kv, target_logits=logits)
    assert comp.counts == full.counts and sum(full.counts.valid) > 0
    assert comp.losses == pytest.approx(full.losses, abs=1e-5)
    assert float(comp.loss.detach()) == pytest.approx(float(full.loss.detach()), abs=1e-5)
    assert g_comp.keys() == g_full.keys()
    for name in g_full:
        torch.testing.assert_close(g_comp[name], g_full[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("spec", [dict(variant="eagle3", depth=2), dict(variant="hybrid"),
                                  dict(variant="kv_only", injection="head_concat"), dict(variant="cross_only"),
                                  dict(variant="kv_only", no_target=True),
                                  dict(variant="kv_only", depth=2, no_target=True, token_context=True)],
                         ids=["eagle3-2", "hybrid", "kv_only-concat", "cross_only", "no_target", "token_context"])
def test_compact_unroll_with_left_padding(spec):
    """Left padding takes the explicit-mask path (per-sequence attention of the computed rows): still equal."""
    tgt = tiny("llama")
    ids, feats, kv, logits, loss_mask, am = _partial_batch(tgt, left=True)
    d = _vocab_drafter(tgt, spec)
    full, g_full = _run(d, ids, loss_mask, am, feats, kv, target_logits=logits, compact=False)
    comp, g_comp = _run(d, ids, loss_mask, am, feats, kv, target_logits=logits)
    assert comp.counts == full.counts
    assert comp.losses == pytest.approx(full.losses, abs=1e-5)
    for name in g_full:
        torch.testing.assert_close(g_comp[name], g_full[name], atol=1e-5, rtol=1e-5, msg=name)


def test_cached_top1_teacher_equals_the_two_matmul_teacher():
    """With the target's full-vocabulary top-1 the teacher multiplies the draft rows only: same losses, counts and
    gradients as the draft-rows-and-the-rest teacher of the full unroll."""
    tgt = tiny("llama")
    ids, feats, kv, _, loss_mask, am = _partial_batch(tgt)
    hidden = tgt.capture(ids).last_hidden
    W = tgt.lm_head.weight
    top = torch.nn.functional.linear(hidden, W).max(-1)
    d = _vocab_drafter(tgt, dict(variant="eagle3"))
    common = dict(target_hidden=hidden, lm_head_weight=W)
    full, g_full = _run(d, ids, loss_mask, am, feats, kv, compact=False, **common)
    comp, g_comp = _run(d, ids, loss_mask, am, feats, kv, target_top1=top.indices, target_top1_logit=top.values,
                        **common)
    assert comp.counts == full.counts
    assert comp.losses == pytest.approx(full.losses, abs=1e-5)
    for name in g_full:
        torch.testing.assert_close(g_comp[name], g_full[name], atol=1e-5, rtol=1e-5, msg=name)


def test_teacher_rows_keep_the_tie_rule():
    """A draft token tying with the target's top-1 outside the draft vocabulary counts as inside, as the
    two-matmul rule (draft max >= the other rows' max) has it; a plain outside top-1 stays outside."""
    from models.ttt import target_distribution_from_hidden, teacher_rows

    tgt = tiny("llama")
    d = make_drafter(tgt, draft_vocab_size=16)
    d.set_vocab(torch.arange(16, 32))
    g = torch.Generator().manual_seed(0)
    W = torch.randn(64, 48, generator=g)
    W[3] = W[20]                          # token 3 (outside) and 20 (inside) have the same logits everywhere
    h = torch.randn(1, 6, 48, generator=g)
    h[0, 0] = W[20] * 5                   # position 0: tokens 3 and 20 tie at the top; 3 is the lower id
    h[0, 1] = W[40] * 5                   # position 1: top-1 40, outside
    top = torch.nn.functional.linear(h, W).max(-1)
    assert top.indices[0, 0] == 3 and top.indices[0, 1] == 40
    rows = torch.arange(6)
    p_ref, t_ref = target_distribution_from_hidden(h.reshape(6, 48), W, d)
    p, t = teacher_rows(d, rows, target_hidden=h, lm_head_weight=W, target_top1=top.indices,
                        target_top1_logit=top.values)
    assert torch.equal(t, t_ref) and t[0] == 4 and t[1] == -1
    torch.testing.assert_close(p, p_ref)


def test_score_false_returns_the_full_unrolls_top1_where_scored():
    """Evaluation's mode: no target, no loss; per step the drafter's top-1 wherever token t+2+k is scored."""
    tgt = tiny("llama")
    ids, feats, kv, logits, loss_mask, am = _partial_batch(tgt)
    d = _vocab_drafter(tgt, dict(variant="hybrid"))
    with torch.no_grad():
        full = ttt_unroll(d, ids, loss_mask, attention_mask=am, features=feats, target_kv=kv, target_logits=logits,
                          steps=4, return_logits=True)
        fast = ttt_unroll(d, ids, loss_mask, attention_mask=am, features=feats, target_kv=kv, steps=4, score=False)
    assert fast.loss is None and fast.counts is None and len(fast.top1) == 4
    scored = loss_mask.bool() & am.bool()
    for k, (z, top) in enumerate(zip(full.logits, fast.top1)):
        want = torch.cat([scored[:, 2 + k:], torch.zeros_like(scored[:, :2 + k])], 1)
        assert torch.equal(top >= 0, want)
        assert torch.equal(top[want], z.argmax(-1)[want])


def test_weighted_soft_cross_entropy_matches_the_plain_one():
    """Values, argmax and the weighted gradient, with target rows in runs (sliced) and out of order (gathered)."""
    from models.ttt import soft_cross_entropy, weighted_soft_cross_entropy

    g = torch.Generator().manual_seed(0)
    z = torch.randn(11, 13, generator=g, requires_grad=True)
    probs = torch.softmax(torch.randn(6, 13, generator=g), -1)
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 2, 3, 5, 0, 1])
    w = torch.rand(11, generator=g)
    total, ce, arg = weighted_soft_cross_entropy(z, probs, rows, w, block=3)
    total.backward()
    mine = z.grad.clone()
    z.grad = None
    ref = soft_cross_entropy(z, probs, rows)
    (ref * w).sum().backward()
    torch.testing.assert_close(ce, ref.detach())
    torch.testing.assert_close(total.detach(), (ref * w).sum().detach())
    torch.testing.assert_close(mine, z.grad)
    assert torch.equal(arg, z.detach().argmax(-1))


def test_soft_cross_entropies_are_unchanged_by_an_enclosing_autocast():
    """Both losses stay fp32 under bf16 autocast (a custom Function's forward runs under the caller's autocast, which
    would cast vecdot's operands to bf16)."""
    from models.ttt import soft_cross_entropy, weighted_soft_cross_entropy

    g = torch.Generator().manual_seed(0)
    z = torch.randn(11, 13, generator=g).to(torch.bfloat16).requires_grad_()
    probs = torch.softmax(torch.randn(6, 13, generator=g), -1)
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 2, 3, 5, 0, 1])
    w = torch.rand(11, generator=g)
    for loss in (lambda: soft_cross_entropy(z, probs, rows), lambda: weighted_soft_cross_entropy(z, probs, rows, w)[1]):
        plain = loss()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cast = loss()
        assert torch.equal(cast, plain)


@pytest.mark.parametrize("causal", [True, False], ids=["flash", "masked"])
def test_attention_of_query_rows_equals_the_full_layout(causal):
    """Queries at some flat positions of a [B, S] prefix (plus their chains) give the full layout's outputs and
    gradients at those positions (fused CPU path, and the per-sequence masked path)."""
    g = torch.Generator().manual_seed(0)
    B, H, S, J, hd = 2, 3, 9, 3, 8

    def leaf(*shape):
        return torch.randn(*shape, generator=g).requires_grad_()

    q, k, v, kc, vc = leaf(B, H, S, hd), leaf(B, H, S, hd), leaf(B, H, S, hd), leaf(B, H, S, J, hd), leaf(B, H, S, J, hd)
    rows = torch.tensor([2, 3, 4, 8, 9 + 5, 9 + 6, 9 + 7])
    tril = torch.ones(S, S, dtype=torch.bool).tril()
    prefix = dict(causal=True) if causal else dict(mask=tril.expand(B, 1, S, S))
    full = layers.attend(q, [layers.KeyBlock(k, v, **prefix), layers.KeyBlock(kc, vc, diag=True)])
    sub = layers.attend(layers.take_rows(q, rows), [layers.KeyBlock(k, v, rows=rows, **prefix),
                                                    layers.KeyBlock(layers.take_rows(kc, rows),
                                                                    layers.take_rows(vc, rows), diag=True)])
    torch.testing.assert_close(sub, layers.take_rows(full, rows), atol=1e-5, rtol=1e-5)
    grad = torch.randn(sub.shape, generator=g)
    ga = torch.autograd.grad(sub, (q, k, v, kc, vc), grad)
    gb = torch.autograd.grad(layers.take_rows(full, rows), (q, k, v, kc, vc), grad)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tail", [0, 1, 5], ids=["no-loss", "last-token", "short-chains"])
def test_compact_unroll_when_little_or_nothing_is_scored(tail):
    """No scored position (a zero loss that still backpropagates), or chains too short to reach step K-1."""
    tgt = tiny("llama")
    ids, feats, kv, logits = capture(tgt, B=2, T=8)
    loss_mask = torch.zeros(2, 8)
    loss_mask[:, 8 - tail:] = 1
    for spec in (dict(variant="eagle3", depth=2), dict(variant="hybrid"), dict(variant="kv_only", no_target=True),
                 dict(variant="kv_only", depth=2, no_target=True, token_context=True)):
        d = make_drafter(tgt, **spec).train()
        outs = [ttt_unroll(d, ids, loss_mask, features=feats, target_kv=kv, target_logits=logits, steps=7,
                           compact=c) for c in (False, True)]
        for out in outs:
            out.loss.backward()
        assert outs[1].counts == outs[0].counts
        assert float(outs[1].loss.detach()) == pytest.approx(float(outs[0].loss.detach()), abs=1e-5)


def test_fused_kernel_choice_per_device_dtype_and_head_dim():
    """Which PyTorch kernel serves the fused attention: CPU flash for every dtype; on CUDA flash for bf16/fp16 with
    a head dim it supports, the memory-efficient kernel otherwise; none elsewhere (the masked path serves)."""
    from types import SimpleNamespace

    from models.attention import causal_lse_kernel

    def q(device, dtype, hd=128):
        return SimpleNamespace(device=torch.device(device), dtype=dtype, shape=(1, 4, 16, hd))

    assert causal_lse_kernel(q("cpu", torch.float32)) == causal_lse_kernel(q("cpu", torch.bfloat16)) == "cpu_flash"
    assert causal_lse_kernel(q("cuda", torch.bfloat16)) == causal_lse_kernel(q("cuda", torch.float16)) == "cuda_flash"
    assert causal_lse_kernel(q("cuda", torch.float32)) == "cuda_efficient"
    assert causal_lse_kernel(q("cuda", torch.bfloat16, hd=320)) == "cuda_efficient"
    assert causal_lse_kernel(q("cuda", torch.float64)) is None
    assert causal_lse_kernel(q("meta", torch.float32)) is None
