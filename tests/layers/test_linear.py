"""The thread-split linear equals F.linear, takes the split only where it should, and keeps the
model's cached decoding equal to the uncached forward."""

import importlib

import pytest
import torch
import torch.nn.functional as F

from llm import DynamicCache
from llm.layers.linear import MAX_SPLIT_ROWS, Linear, linear
from tests.conftest import tiny_model


@pytest.fixture
def f_linear_calls(monkeypatch):
    """Count the calls that fell back to F.linear."""
    calls = []
    real = F.linear

    def spy(*args, **kwargs):
        calls.append(args[1].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(importlib.import_module("llm.layers.linear").F, "linear", spy)
    return calls


@pytest.mark.parametrize("threads", [2, 3, 4], indirect=True)
@pytest.mark.parametrize("lead", [(1,), (1, 1), (2, 3), (7,), (4, 16), (MAX_SPLIT_ROWS,)])
@pytest.mark.parametrize("bias", [False, True])
@torch.no_grad()
def test_split_equals_f_linear(threads, lead, bias, f_linear_calls):
    torch.manual_seed(0)
    out_features, in_features = 768, 384  # 768 has the divisors 2, 3 and 4
    weight = torch.randn(out_features, in_features)
    b = torch.randn(out_features) if bias else None
    x = torch.randn(*lead, in_features)
    got = linear(x, weight, b)
    assert not f_linear_calls, "the split was not taken"
    want = x.double() @ weight.double().t() + (b.double() if bias else 0)  # sums of 384 products of ~1
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4)


class Subclass(torch.Tensor):
    """Stands for a tensor subclass (DTensor, quantized weights) whose layout a view may not show."""


@pytest.mark.parametrize("threads", [2], indirect=True)
@pytest.mark.parametrize(
    "case",
    ["too many rows", "small weight", "odd out_features", "gradient wanted", "input gradient wanted", "float64",
     "transposed weight", "tensor subclass", "sparse input", "autocast"],
)
def test_everything_else_is_f_linear(threads, case, f_linear_calls):
    torch.manual_seed(0)
    rows, out_features, in_features, dtype = 3, 768, 384, torch.float32
    if case == "too many rows":
        rows = MAX_SPLIT_ROWS + 1
    elif case == "small weight":
        out_features, in_features = 256, 256
    elif case == "odd out_features":
        out_features = 767
    elif case == "float64":
        dtype = torch.float64
    weight = torch.randn(out_features, in_features, dtype=dtype)
    if case == "transposed weight":
        weight = torch.randn(in_features, out_features).t()
    elif case == "tensor subclass":
        weight = weight.as_subclass(Subclass)
    x = torch.randn(rows, in_features, dtype=dtype)
    if case == "gradient wanted":
        weight.requires_grad_(True)
        linear(x, weight).sum().backward()
        torch.testing.assert_close(weight.grad, x.sum(0).expand(out_features, -1))
    elif case == "input gradient wanted":  # frozen weights, e.g. training adapters
        x.requires_grad_(True)
        linear(x, weight).sum().backward()
        torch.testing.assert_close(x.grad, weight.sum(0).expand(rows, -1), rtol=1e-5, atol=1e-4)
    elif case == "sparse input":
        with torch.no_grad():
            torch.testing.assert_close(linear(x.to_sparse(), weight), x @ weight.t(), rtol=1e-5, atol=1e-4)
    elif case == "autocast":  # the same dtype as F.linear's (bfloat16), whatever the thread count
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert linear(x, weight, torch.zeros(out_features)).dtype == torch.bfloat16
    else:
        with torch.no_grad():
            torch.testing.assert_close(linear(x, weight), x @ weight.t())
    assert len(f_linear_calls) == 1


@pytest.mark.parametrize("threads", [2], indirect=True)
@pytest.mark.parametrize("case", ["float64 bias", "bias of the wrong shape", "x of the wrong width"])
@torch.no_grad()
def test_what_f_linear_rejects_is_rejected_as_f_linear_does(threads, case):
    weight, bias, x = torch.randn(768, 384), torch.randn(768), torch.randn(3, 384)
    if case == "float64 bias":
        bias = bias.double()
    elif case == "bias of the wrong shape":
        bias = torch.randn(4, 1, 768)
    else:
        x = torch.randn(3, 383)
    with pytest.raises(RuntimeError) as ours:
        linear(x, weight, bias)
    with pytest.raises(RuntimeError) as theirs:
        F.linear(x, weight, bias)
    assert str(ours.value) == str(theirs.value)


def test_linear_module_is_an_nn_linear_with_its_state_dict():
    layer = Linear(384, 768)
    assert isinstance(layer, torch.nn.Linear) and set(layer.state_dict()) == {"weight", "bias"}


@pytest.mark.parametrize("threads", [2], indirect=True)
@pytest.mark.parametrize("scheme", ["learned", "llama"])
@torch.no_grad()
def test_cached_decoding_with_split_projections_equals_uncached(threads, scheme, f_linear_calls):
    """A model wide enough for the split: token-by-token and chunked cached forwards equal the full forward."""
    model = tiny_model(scheme, d_model=384, n_heads=6, kv_n_heads=2 if scheme == "llama" else 6, init_std=0.05)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=g)
    full = model(ids).logits
    f_linear_calls.clear()
    cache = DynamicCache()
    logits = [model(ids[:, a:b], past_key_values=cache).logits for a, b in [(0, 5), (5, 6), (6, 9), (9, 10), (10, 12)]]
    # every projection took the split; only the (61 x 384) head, too small to split, did not
    assert f_linear_calls == [torch.Size([model.config.vocab_size, 384])] * 5
    torch.testing.assert_close(torch.cat(logits, dim=1), full, rtol=1e-4, atol=1e-4)
