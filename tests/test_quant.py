"""Weight-only int8 linears: within the quantization bound of the float linear, and a drop-in for drafters."""
import pytest
import torch
from torch import nn

from models.quant import Int8Linear, quantize_linears_int8
from tests.drafter_helpers import make_drafter, tiny


@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_is_within_the_rounding_bound(bias):
    torch.manual_seed(0)
    lin = nn.Linear(40, 24, bias=bias)
    q = Int8Linear(lin)
    x = torch.randn(2, 5, 40)
    with torch.no_grad():
        err = (q(x) - lin(x)).abs()
        bound = x.abs().sum(-1, keepdim=True) * q.scales / 2 + 1e-5    # each weight is off by <= scale / 2
    assert q(x).shape == (2, 5, 24) and q.qweight.dtype == torch.int8
    assert bool((err <= bound).all()) and float(err.max()) > 0        # rounded, and no more than rounding
    assert torch.allclose(q.dequantized(), lin.weight, atol=float(q.scales.max()) / 2 + 1e-7)


def test_int8_kernel_equals_the_dequantized_product_in_bf16():
    torch.manual_seed(1)
    lin = nn.Linear(64, 96, bias=False).to(torch.bfloat16)
    q = Int8Linear(lin)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    ref = x.float() @ q.dequantized().float().T
    assert q(x).dtype == torch.bfloat16
    assert torch.allclose(q(x).float(), ref, rtol=2e-2, atol=2e-2)
    # without the fused kernel (another device or dtype) the product goes through the dequantized weights
    assert torch.allclose(q(x.double()), x.double() @ q.dequantized().double().T)


def test_quantize_linears_replaces_every_linear_of_a_copy():
    drafter = make_drafter(tiny(), variant="hybrid", depth=1)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    q = quantize_linears_int8(drafter)
    assert not any(isinstance(m, nn.Linear) for m in q.modules())
    assert sum(isinstance(m, Int8Linear) for m in q.modules()) == sum(isinstance(m, nn.Linear)
                                                                       for m in drafter.modules())
    assert all(torch.equal(before[k], v) for k, v in drafter.state_dict().items())   # the original is untouched
