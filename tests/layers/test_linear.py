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


@pytest.mark.parametrize("threads", [2], indirect=True)
@pytest.mark.parametrize(
    "case",
    ["too many rows", "small weight", "odd out_features", "gradient wanted", "float64", "transposed weight"],
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
    x = torch.randn(rows, in_features, dtype=dtype)
    if case == "gradient wanted":
        weight.requires_grad_(True)
        linear(x, weight).sum().backward()
        torch.testing.assert_close(weight.grad, x.sum(0).expand(out_features, -1))
    else:
        with torch.no_grad():
            torch.testing.assert_close(linear(x, weight), x @ weight.t())
    assert len(f_linear_calls) == 1


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
