"""Muon (llm.train.muon) on its properties: the orthogonalized update's singular values near 1,
one step equal to a reference computed here in float64, the AdamW groups equal to torch's AdamW,
the groups it makes for a model, a state dict that resumes bit for bit, and the YAML keys."""

import math

import pytest
import torch

from llm import MosaicGPT, MosaicGPTConfig
from llm.train.composer_model import next_token_loss
from llm.train.config import OptimizerConfig
from llm.train.muon import NS_COEFFICIENTS, Muon, muon_groups, orthogonalize
from llm.utils.config import ConfigError


@pytest.mark.parametrize("shape", [(64, 64), (48, 160), (160, 48), (3, 700)])
def test_orthogonalize_sends_every_singular_value_near_one_along_the_polar_factor(shape):
    torch.manual_seed(0)
    # singular values spread over two orders of magnitude (a gradient's are: its low-rank directions dominate)
    u, _, v = torch.linalg.svd(torch.randn(shape, dtype=torch.float64), full_matrices=False)
    s = torch.logspace(-1, 1, min(shape), dtype=torch.float64)
    matrix = (u * s) @ v
    out = orthogonalize(matrix.float())
    assert out.shape == shape and out.dtype == torch.float32
    singular = torch.linalg.svdvals(out.double())
    assert singular.min() > 0.6 and singular.max() < 1.25, singular
    polar = (u @ v).float()  # U V^T: what the iteration approximates
    assert torch.nn.functional.cosine_similarity(out.flatten(), polar.flatten(), dim=0) > 0.95


def reference_muon(weight, grads, lr, momentum, weight_decay, steps=5):
    """Muon written out in float64, apart from the optimizer: Nesterov momentum, the quintic
    Newton-Schulz iteration on the wide side, the sqrt(max(1, rows / cols)) scale."""
    w, m = weight.double().clone(), torch.zeros_like(weight, dtype=torch.float64)
    a, b, c = NS_COEFFICIENTS
    for g in grads:
        g = g.double()
        m = momentum * m + (1 - momentum) * g
        u = (1 - momentum) * g + momentum * m
        x = u.T if u.shape[0] > u.shape[1] else u
        x = x / (x.norm() + 1e-7)
        for _ in range(steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        x = x.T if u.shape[0] > u.shape[1] else x
        w = w * (1 - lr * weight_decay) - lr * math.sqrt(max(1, u.shape[0] / u.shape[1])) * x
    return w


@pytest.mark.parametrize("shape", [(12, 5), (5, 12)])
def test_three_muon_steps_equal_the_reference(shape):
    torch.manual_seed(1)
    weight = torch.nn.Parameter(torch.randn(shape))
    grads = [torch.randn(shape) for _ in range(3)]
    expected = reference_muon(weight.detach(), grads, lr=0.05, momentum=0.9, weight_decay=0.1)
    optimizer = Muon([weight], lr=0.05, momentum=0.9, weight_decay=0.1)
    for g in grads:
        weight.grad = g.clone()
        optimizer.step()
    torch.testing.assert_close(weight.detach().double(), expected, atol=2e-5, rtol=0)
    assert (weight.detach().double() - reference_muon(weight.detach(), grads[:2], 0.05, 0.9, 0.1)).abs().max() > 1e-2


def test_the_adamw_groups_step_as_torchs_adamw():
    torch.manual_seed(2)
    ours, theirs = (torch.nn.Parameter(torch.randn(7, 3)) for _ in range(2))
    theirs.data.copy_(ours.data)
    muon = Muon([{"params": [ours], "use_muon": False, "lr": 3e-3}], betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    adamw = torch.optim.AdamW([theirs], lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    for _ in range(5):
        g = torch.randn(7, 3)
        ours.grad, theirs.grad = g.clone(), g.clone()
        muon.step()
        adamw.step()
    torch.testing.assert_close(ours.detach(), theirs.detach(), atol=1e-6, rtol=1e-6)


def tiny():
    torch.manual_seed(3)
    return MosaicGPT(MosaicGPTConfig(vocab_size=50, d_model=32, n_heads=4, kv_n_heads=2, n_layers=2, max_seq_len=16,
                                     learned_pos_emb=False, rope=True, ffn_type="glu", ffn_act="silu",
                                     norm_type="rmsnorm", no_bias=True))


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    model = tiny()
    groups = muon_groups(model, lr=0.02, adamw_lr=3e-3, weight_decay=0.01)
    by_param = {p: g for g in groups for p in g["params"]}
    assert len(by_param) == len(list(model.parameters()))  # every parameter, once
    names = {p: n for n, p in model.named_parameters()}
    muon = sorted(names[p] for p, g in by_param.items() if g["use_muon"])
    assert muon == sorted(n for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2)
    assert by_param[model.wte.weight]["lr"] == 3e-3 and not by_param[model.wte.weight]["use_muon"]
    assert all(g["weight_decay"] == 0 for p, g in by_param.items() if p.dim() == 1)
    # the fused query/key/value weight is orthogonalized as its three matrices
    assert by_param[model.blocks[0].attn.Wqkv.weight]["sections"] == [32, 16, 16]
    with pytest.raises(ValueError, match="no transformer blocks"):
        muon_groups(torch.nn.Linear(3, 3), lr=0.02, adamw_lr=3e-3, weight_decay=0)


def train_steps(model, optimizer, batches):
    for ids in batches:
        optimizer.zero_grad()
        next_token_loss(model(ids).logits[:, :-1], ids[:, 1:]).backward()
        optimizer.step()


def test_a_run_resumed_from_the_state_dict_is_bit_identical():
    batches = [torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(i)) for i in range(6)]
    model = tiny()
    optimizer = Muon(muon_groups(model, lr=0.02, adamw_lr=3e-3, weight_decay=0.01))
    train_steps(model, optimizer, batches[:3])
    # as a checkpoint holds them (a state dict's tensors are the live ones)
    saved_model, saved_optimizer = _roundtrip(model.state_dict()), _roundtrip(optimizer.state_dict())
    train_steps(model, optimizer, batches[3:])

    resumed = tiny()
    resumed.load_state_dict(torch.load(saved_model, weights_only=True))
    optimizer = Muon(muon_groups(resumed, lr=0.02, adamw_lr=3e-3, weight_decay=0.01))
    optimizer.load_state_dict(torch.load(saved_optimizer, weights_only=True))
    train_steps(resumed, optimizer, batches[3:])
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def _roundtrip(state):
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def test_the_yaml_keys():
    config = OptimizerConfig(name="muon", lr=0.02)
    assert (config.momentum, config.nesterov, config.ns_steps, config.adamw_lr) == (0.95, True, 5, 3e-3)
    with pytest.raises(ConfigError, match="momentum.*muon only"):
        OptimizerConfig(name="adamw", momentum=0.9)
    with pytest.raises(ConfigError, match="decay"):
        OptimizerConfig(name="muon", decay="all")
    with pytest.raises(ValueError, match="momentum"):
        Muon([torch.nn.Parameter(torch.ones(2, 2))], momentum=1.0)
