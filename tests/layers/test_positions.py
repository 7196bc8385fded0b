"""Rotary angles: the CPU's table gives the bits of computing them, at any position."""

import math

import pytest
import torch

from llm.layers.positions import RotaryEmbedding


@pytest.mark.parametrize("head_dim,theta", [(64, 10000.0), (16, 500000.0)])
def test_rotary_table_rows_are_the_computed_angles(head_dim, theta):
    rotary = RotaryEmbedding(head_dim, theta)
    g = torch.Generator().manual_seed(0)
    # small positions first (a table of 1024), then past it (it grows), then a negative one (computed)
    for shape, high in (((1, 1), 10), ((3, 7), 1024), ((2, 5), 5000), ((1, 300), 3000)):
        positions = torch.randint(0, high, shape, generator=g)
        rotation = rotary(positions, torch.float32)
        cos, sin = rotary.angles(positions)
        assert torch.equal(rotation.cos[:, 0], cos) and torch.equal(rotation.sin[:, 0], sin)
    assert rotary._table[0].shape[0] >= 5000
    # a negative position is computed, not wrapped round to a row from the table's end
    rotation = rotary(torch.tensor([[-3, 2]]), torch.float32)
    cos, sin = rotary.angles(torch.tensor([[-3, 2]]))
    assert torch.equal(rotation.cos[:, 0], cos) and torch.equal(rotation.sin[:, 0], sin)
    assert not torch.equal(rotation.sin[0, 0, 0], rotary._table[1][-3])
    # the angles themselves: position p, pair i turns by p * theta ** (-2i / head_dim)
    cos, sin = rotary.angles(torch.tensor([7]))
    i = head_dim // 2 - 1
    assert math.isclose(float(cos[0, i]), math.cos(7 * theta ** (-2 * i / head_dim)), rel_tol=1e-5, abs_tol=1e-6)
    assert math.isclose(float(sin[0, -1]), math.sin(7 * theta ** (-2 * i / head_dim)), rel_tol=1e-5, abs_tol=1e-6)
    assert float(sin[0, i]) == -float(sin[0, -1])
