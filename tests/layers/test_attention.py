"""The generic attention function against a naive per-head reference."""

import math

import pytest
import torch

from llm import scaled_multihead_dot_product_attention as attention
from llm.layers.attention import COMPILED_MATH_MAX_SEQ


def reference(q, k, v, n_heads, kv_heads, key_mask, causal, bias=None):
    """Per-row, per-head softmax attention written out longhand, in float64."""
    b, sq, _ = q.shape
    sk = k.shape[1]
    d = q.shape[-1] // n_heads
    out = torch.zeros(b, sq, n_heads * d, dtype=torch.float64)
    for bi in range(b):
        for h in range(n_heads):
            kh = h // (n_heads // kv_heads)
            for i in range(sq):
                keys = [j for j in range(sk)
                        if (key_mask is None or key_mask[bi, j]) and (not causal or j <= sk - sq + i)]
                if not keys:
                    continue
                qi = q[bi, i, h * d:(h + 1) * d].double()
                kj = k[bi, keys, kh * d:(kh + 1) * d].double()
                s = kj @ qi / math.sqrt(d)
                if bias is not None:
                    s = s + bias[0, h, 0, keys].double()
                out[bi, i, h * d:(h + 1) * d] = s.softmax(0) @ v[bi, keys, kh * d:(kh + 1) * d].double()
    return out


@pytest.mark.parametrize("impl", ["torch", "sdpa"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_matches_reference_with_cache_shaped_keys_and_padding(impl, kv_heads):
    torch.manual_seed(0)
    b, sq, sk, h, d = 3, 4, 9, 4, 8
    q = torch.randn(b, sq, h * d)
    k, v = torch.randn(b, sk, kv_heads * d), torch.randn(b, sk, kv_heads * d)
    key_mask = torch.ones(b, sk, dtype=torch.bool)
    key_mask[1, :3] = False
    key_mask[2, :6] = False  # row 2: the first query sees only padding
    query_mask = key_mask[:, -sq:]
    bias = torch.randn(1, h, 1, sk)
    out = attention(q, k, v, h, kv_n_heads=kv_heads, key_padding_mask=key_mask, query_padding_mask=query_mask,
                    attn_bias=bias, impl=impl)
    ref = reference(q, k, v, h, kv_heads, key_mask, causal=True, bias=bias)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["torch", "sdpa"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("sq,sk", [(1, 9), (3, 9), (6, 6)])
def test_matches_reference_without_masks(impl, kv_heads, sq, sk):
    """The unmasked paths: one decoded token, a multi-token step over a cache, a square prefill."""
    torch.manual_seed(1)
    b, h, d = 2, 4, 8
    q = torch.randn(b, sq, h * d)
    k, v = torch.randn(b, sk, kv_heads * d), torch.randn(b, sk, kv_heads * d)
    out = attention(q, k, v, h, kv_n_heads=kv_heads, impl=impl)
    torch.testing.assert_close(out.double(), reference(q, k, v, h, kv_heads, None, causal=True), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["torch", "sdpa"])
def test_causal_mask_is_aligned_to_the_end_of_the_keys(impl):
    """The last sq queries over sk keys equal the last sq rows of the full square attention."""
    torch.manual_seed(1)
    x = torch.randn(2, 10, 16)
    full = attention(x, x, x, 2, impl=impl)
    for sq in (1, 3, 7):
        part = attention(x[:, -sq:], x, x, 2, impl=impl)
        torch.testing.assert_close(part, full[:, -sq:], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("impl", ["torch", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_padding_queries_are_zero_and_nothing_is_nan(impl, dtype):
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 6, 16, dtype=dtype) * 10 for _ in range(3))
    key_mask = torch.ones(2, 6, dtype=torch.bool)
    key_mask[0, :4] = False
    key_mask[1, :] = False  # a row with no real key at all
    bias = torch.full((1, 2, 1, 6), -1e4, dtype=dtype)
    out = attention(q, k, v, 2, key_padding_mask=key_mask, query_padding_mask=key_mask, attn_bias=bias, impl=impl)
    assert not torch.isnan(out).any()
    assert (out[0, :4] == 0).all() and (out[1] == 0).all()
    assert (out[0, 4:] != 0).any()
    # without the query mask, rows whose keys are all masked still come out as zeros, not NaN
    out = attention(q, k, v, 2, key_padding_mask=key_mask, impl=impl)
    assert not torch.isnan(out).any() and (out[1] == 0).all()


def test_implementations_agree_and_unknown_impl_is_refused():
    torch.manual_seed(3)
    q, k, v = torch.randn(2, 5, 24), torch.randn(2, 8, 24), torch.randn(2, 8, 24)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8], dtype=torch.bool)
    a = attention(q, k, v, 3, key_padding_mask=mask, impl="torch")
    b = attention(q, k, v, 3, key_padding_mask=mask, impl="sdpa")
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="impl"):
        attention(q, k, v, 3, impl="flash")


@pytest.mark.parametrize("seq,takes_sdpa", [(6, False), (COMPILED_MATH_MAX_SEQ, False), (COMPILED_MATH_MAX_SEQ + 1, True)])
def test_compiled_cpu_training_attention_takes_the_products_up_to_its_length(seq, takes_sdpa):
    """Under torch.compile on a CPU, impl="sdpa" computes a short square causal attention as
    explicit products (which inductor fuses) and a longer one with torch's flash kernel; either
    way the values and gradients are the reference's."""
    torch.manual_seed(2)
    h, d = 2, 8
    q, k, v = (torch.randn(1, seq, h * d, requires_grad=True) for _ in range(3))
    graphs = []

    def record(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes})
        return gm

    fn = torch.compile(lambda q, k, v: attention(q, k, v, h, impl="sdpa"), backend=record, fullgraph=True)
    out = fn(q, k, v)
    out.square().sum().backward()
    sdpa_calls = [t for t in set().union(*graphs) if "scaled_dot_product_attention" in t]
    assert bool(sdpa_calls) == takes_sdpa, sdpa_calls
    grads = [t.grad.clone() for t in (q, k, v)]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = attention(q64, k64, v64, h, impl="torch")
    expected.square().sum().backward()
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, (q64.grad, k64.grad, v64.grad)):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
