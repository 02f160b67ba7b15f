"""The parallel TTT unroll against the naive step-by-step reference, its masks, targets and training signal."""
import pytest
import torch

import models.layers as layers
from models.ttt import ttt_unroll
from tests.drafter_helpers import VARIANT_GRID, capture, make_drafter, naive_logits, tiny

K = 3


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request):
    tgt = tiny(request.param)
    return tgt, capture(tgt, B=2, T=9)


def _name(spec):
    return "-".join(f"{v}" for v in spec.values())


@pytest.mark.parametrize("spec", VARIANT_GRID, ids=[_name(s) for s in VARIANT_GRID])
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


def test_no_dense_unrolled_mask(monkeypatch):
    """Dense score matrices are at most T x T; the same-position keys come as diag blocks of <= K keys each."""
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
                dense.append((b.k.shape[-2], None if b.mask is None else tuple(b.mask.shape)))
        return real(q, blocks, scale)

    monkeypatch.setattr("models.drafter.attend", spy)
    for variant in ("eagle3", "hybrid"):
        d = make_drafter(tgt, variant=variant)
        with torch.no_grad():
            ttt_unroll(d, ids, torch.ones_like(ids), features=feats, target_kv=kv, target_logits=logits, steps=7)
    assert dense and diag
    assert max(width for width, _ in dense) == T
    assert all(mask is None or mask[-2:] == (T, T) for _, mask in dense)
    assert all(shape[2] == T and shape[3] <= 7 for shape in diag)
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
    gf = torch.autograd.grad(fused, (q, k, v, kc, vc), grad)
    gp = torch.autograd.grad(plain, (q, k, v, kc, vc), grad)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(fused, plain, **tol)
    for a, b in zip(gf, gp):
        torch.testing.assert_close(a, b, **tol)
