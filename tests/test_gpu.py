"""The CUDA path: fused attention, the TTT and block unrolls and lossless decoding on the GPU (marked `gpu`).

Skipped without a CUDA device. `KVSHOT_GPU_TEST_DEVICE=cpu` runs the same checks on the CPU (they hold there too),
so the file is exercised before any GPU time is spent; `benchmarks/gpu_check.py` runs it on the GPU.
"""
import os

import pytest
import torch

import models.layers as layers
from models.attention import causal_lse_kernel
from models.block import block_reference, block_unroll
from models.decoding import first_divergence, greedy_generate, speculative_generate
from models.decoding.block_proposer import BlockProposer
from models.decoding.drafter_proposer import DrafterProposer
from models.ttt import ttt_unroll
from tests.drafter_helpers import (BLOCK_GRID, VARIANT_GRID, assert_same_with_grads, capture, make_drafter,
                                   naive_logits, tiny)

pytestmark = pytest.mark.gpu
DEV = torch.device(os.environ.get("KVSHOT_GPU_TEST_DEVICE", "cuda"))
K = 4


def _name(spec):
    return "-".join(f"{v}" for v in spec.values())


def _tol(dtype) -> dict:
    return dict(atol=2e-4, rtol=2e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)


def _leaves(dtype, *shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(DEV, dtype).requires_grad_() for s in shapes]


# -- the fused attention ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("subset", [False, True], ids=["all-queries", "query-rows"])
def test_fused_causal_chain_attention_equals_joint_softmax(dtype, subset):
    """The fused kernel path (causal prefix through a flash / efficient kernel, chain merged by log-sum-exp) equals
    the masked joint softmax, gradients too, over every query or a subset of query rows."""
    B, H, S, J, hd = 2, 4, 67, 5, 64
    k, v = _leaves(dtype, (B, H, S, hd), (B, H, S, hd), seed=1)
    rows = torch.arange(0, B * S, 3, device=DEV) if subset else None
    n = B * S if subset else S
    shape_q = (1, H, n, hd) if subset else (B, H, S, hd)
    shape_c = (1, H, n, J, hd) if subset else (B, H, S, J, hd)
    q, kc, vc = _leaves(dtype, shape_q, shape_c, shape_c, seed=2)
    if subset:
        q, kc, vc = (t.detach()[:, :, rows].requires_grad_() for t in (q, kc, vc))
    assert causal_lse_kernel(q) is not None
    fused = layers.attend(q, [layers.KeyBlock(k, v, causal=True, rows=rows), layers.KeyBlock(kc, vc, diag=True)])
    if subset:      # the reference: each query against its own sequence's prefix, an explicit mask
        b, s = rows // S, rows % S
        mask = (torch.arange(S, device=DEV)[None, :] <= s[:, None])[None, None]
        kk, vv = k[b].transpose(0, 1)[None], v[b].transpose(0, 1)[None]          # [1, H, n, S, hd]
        sc = torch.cat([(q.float().unsqueeze(-2) * kk.float()).sum(-1).masked_fill(~mask, float("-inf")),
                        (q.float().unsqueeze(-2) * kc.float()).sum(-1)], -1) * hd ** -0.5
        p = torch.softmax(sc, -1)
        plain = ((p[..., :S].unsqueeze(-1) * vv.float()).sum(-2)
                 + (p[..., S:].unsqueeze(-1) * vc.float()).sum(-2)).to(dtype)
    else:
        tril = torch.ones(S, S, dtype=torch.bool, device=DEV).tril()
        plain = layers.attend(q, [layers.KeyBlock(k, v, tril), layers.KeyBlock(kc, vc, diag=True)])
    grad = torch.randn(fused.shape, generator=torch.Generator().manual_seed(3)).to(DEV, dtype)
    assert_same_with_grads(fused, plain, (q, k, v, kc, vc), grad, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_attention_over_two_causal_prefixes_equals_joint_softmax(dtype):
    """Two causal prefixes and a chain (a block drafter reading the hidden states and the KV, per block offset):
    the fused path equals the masked joint softmax over the three key sets, gradients too."""
    B, H, S, J, hd = 2, 4, 53, 4, 64
    q, k1, v1, k2, v2 = _leaves(dtype, *[(B, H, S, hd)] * 5, seed=4)
    kc, vc = _leaves(dtype, (B, H, S, J, hd), (B, H, S, J, hd), seed=5)
    assert causal_lse_kernel(q) is not None
    tril = torch.ones(S, S, dtype=torch.bool, device=DEV).tril()
    fused = layers.attend(q, [layers.KeyBlock(k1, v1, causal=True), layers.KeyBlock(k2, v2, causal=True),
                              layers.KeyBlock(kc, vc, diag=True)])
    plain = layers.attend(q, [layers.KeyBlock(k1, v1, tril), layers.KeyBlock(k2, v2, tril),
                              layers.KeyBlock(kc, vc, diag=True)])
    grad = torch.randn(fused.shape, generator=torch.Generator().manual_seed(6)).to(DEV, dtype)
    assert_same_with_grads(fused, plain, (q, k1, v1, k2, v2, kc, vc), grad, **_tol(dtype))


@pytest.mark.skipif(DEV.type != "cuda", reason="peak memory is read from the CUDA allocator")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("prefixes", [1, 2], ids=["ttt", "block-both"])
def test_cuda_ttt_attention_allocates_no_square_scores(dtype, prefixes):
    """Forward and backward of the TTT attention (causal prefix + chain; two prefixes for a block drafter reading
    both context sources) at T = 16384 allocate a small multiple of their inputs, far below the heads' T x T score
    matrix (8 GiB in fp32): the kernel path never builds it."""
    B, H, T, J, hd = 1, 8, 16384, 3, 64
    q, *kv = _leaves(dtype, *[(B, H, T, hd)] * (1 + 2 * prefixes))
    kc, vc = _leaves(dtype, (B, H, T, J, hd), (B, H, T, J, hd), seed=1)
    linear = sum(t.numel() for t in (q, *kv, kc, vc)) * 4           # the inputs, counted in fp32
    squares = B * H * T * T * 4
    assert 6 * linear < squares / 2
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    blocks = [layers.KeyBlock(k, v, causal=True) for k, v in zip(kv[0::2], kv[1::2])]
    out = layers.attend(q, blocks + [layers.KeyBlock(kc, vc, diag=True)])
    out.float().square().sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert causal_lse_kernel(q) == ("cuda_flash" if dtype == torch.bfloat16 else "cuda_efficient")
    assert peak < 6 * linear, f"peak {peak / 2**20:.0f} MiB, inputs {linear / 2**20:.0f} MiB (fp32)"


# -- the unrolls against their step-by-step references ------------------------------------------------------------

@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request):
    tgt = tiny(request.param)
    tgt.model.to(DEV)
    return tgt, capture(tgt, B=2, T=11)


def _autocast(dtype):
    return torch.autocast(DEV.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec", VARIANT_GRID, ids=[_name(s) for s in VARIANT_GRID])
def test_ttt_unroll_equals_step_by_step_reference(setup, spec, dtype):
    """Every drafter variant's parallel unroll on the device equals the decode-style reference on the device (fp32:
    to 1e-4; bf16 autocast on both: to a bf16 tolerance), and its loss and gradients equal the CPU's in fp32."""
    tgt, (ids, feats, kv, logits) = setup
    d = make_drafter(tgt, **spec).to(DEV)
    with torch.no_grad(), _autocast(dtype):
        out = ttt_unroll(d, ids, torch.ones_like(ids), features=feats, target_kv=kv, target_logits=logits,
                         steps=K, return_logits=True)
        ref = naive_logits(d, ids, feats, kv, K)
    par = torch.stack(out.logits).float()
    have = ~torch.isnan(ref)
    assert have.sum() > 0
    err = (par[have] - ref[have]).abs().max().item()
    scale = ref[have].abs().max().item()
    assert err <= (1e-4 if dtype == torch.float32 else 2e-2 * max(scale, 1.0)), (err, scale)
    if dtype == torch.float32:
        _assert_loss_and_grads_match_cpu(d, ids, feats, kv, logits)


def _assert_loss_and_grads_match_cpu(d, ids, feats, kv, logits):
    def run(model, dev):
        model.zero_grad()
        mv = lambda t: None if t is None else t.to(dev)      # noqa: E731
        out = ttt_unroll(model, mv(ids), torch.ones_like(mv(ids)), features=mv(feats),
                         target_kv=[(mv(a), mv(b)) for a, b in kv], target_logits=mv(logits), steps=K)
        out.loss.backward()
        return out.loss.item(), {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}

    import copy
    loss_dev, grads_dev = run(d.train(), DEV)
    loss_cpu, grads_cpu = run(copy.deepcopy(d).cpu(), "cpu")
    assert abs(loss_dev - loss_cpu) <= 1e-4 * max(1.0, abs(loss_cpu))
    assert grads_dev.keys() == grads_cpu.keys()
    for name in grads_cpu:
        torch.testing.assert_close(grads_dev[name], grads_cpu[name], atol=1e-4, rtol=1e-3, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec", BLOCK_GRID, ids=[_name(s) for s in BLOCK_GRID])
def test_block_unroll_equals_reference(setup, spec, dtype):
    """Every block drafter's parallel unroll on the device equals its per-anchor reference on the device."""
    tgt, (ids, feats, kv, logits) = setup
    d = make_drafter(tgt, block_size=4, **spec).to(DEV)
    with torch.no_grad(), _autocast(dtype):
        out = block_unroll(d, ids, torch.ones_like(ids), features=feats, target_kv=kv, target_logits=logits,
                           return_logits=True)
        ref = block_reference(d, ids, feats, kv)
    par = torch.stack(out.logits).float()
    have = ~torch.isnan(ref)
    assert have.sum() > 0
    err = (par[have] - ref[have].float()).abs().max().item()
    scale = ref[have].abs().max().item()
    assert err <= (1e-4 if dtype == torch.float32 else 2e-2 * max(scale, 1.0)), (err, scale)


# -- lossless decoding ---------------------------------------------------------------------------------------------

DECODERS = [dict(variant="eagle3", depth=1), dict(variant="kv_only", depth=2, rope_fix=True),
            dict(variant="kv_only", depth=1, injection="head_concat"), dict(variant="hybrid", depth=1),
            dict(variant="cross_only", depth=1), dict(variant="eagle3", depth=1, fc_norm=True, norm_output=True),
            dict(variant="kv_only", depth=1, no_target=True),
            dict(variant="block", context="hidden", depth=1, block_size=5),
            dict(variant="block", context="kv", depth=2, rope_fix=True, block_size=5),
            dict(variant="block", context="both", depth=1, block_size=5)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("kw", DECODERS, ids=[_name(k) for k in DECODERS])
def test_lossless_fp32_tree_decoding(arch, kw):
    """Speculative decoding with every drafter family, chain and tree, gives the target's own greedy output."""
    tgt = tiny(arch)
    tgt.model.to(DEV)
    drafter = make_drafter(tgt, draft_vocab_size=48, **kw)
    drafter.set_vocab(torch.randperm(64, generator=torch.Generator().manual_seed(2))[:48].sort().values)
    proposer = BlockProposer if kw["variant"] == "block" else DrafterProposer
    prompt = torch.randint(0, 64, (10,), generator=torch.Generator().manual_seed(0))
    ref = greedy_generate(tgt, prompt, 24)
    for spec in ([4, 1, 6], [3, 3, 12]):
        res = speculative_generate(tgt, prompt, 24, proposer(drafter, tgt), spec)
        assert res.tokens == ref.tokens, (kw, spec, first_divergence(ref.tokens, res.tokens))
