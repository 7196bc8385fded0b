"""The fused decoder blocks (llm::decoder_blocks in llm/kernels/cpu_quant.cpp): Llama blocks'
decoding step in one call equals the same block's layers run one by one (same int8-activation
arithmetic: only the last bits of the norms, rotation and SiLU differ), writes the same keys and
values into the cache, is taken only where it applies, stays one in-place call under
torch.compile, and refuses bad input with a clear error."""

import functools
import re

import pytest
import torch

import llm.model.buffer as model_module
from llm.layers import blocks as blocks_module

from llm.cache import StaticCache
from llm.generation import compiled
from llm.kernels import cpu_quant
from tests.conftest import tiny_model

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def step_inputs(model, batch: int, seq: int, capacity: int = 48, start: int = 20, seed: int = 0):
    """A static cache of random keys and values, x, the buffer positions, the mask (row 1 left-padded
    by 4) and the rotation of a decoding step of ``seq`` tokens after ``start`` cached positions."""
    g = torch.Generator().manual_seed(seed)
    cache = StaticCache(model.config, batch, capacity, dtype=torch.float32)
    for t in (*cache._keys, *cache._values):
        t.copy_(torch.randn(t.shape, generator=g))
    x = torch.randn(batch, seq, model.config.d_model, generator=g) * 3
    positions = torch.arange(start, start + seq)
    key_mask = torch.zeros(batch, capacity, dtype=torch.bool)
    key_mask[:, :start + seq] = True
    key_mask[1:, :4] = False
    allowed = (torch.arange(capacity)[None, :] <= positions[:, None])[None, None] & key_mask[:, None, None, :]
    real_before = key_mask.long().cumsum(-1)[:, positions] - 1
    rotation = model.rotary(real_before, torch.float32) if model.rotary is not None else None
    return cache, x, dict(attn_mask=allowed, rotary=rotation, cache_position=positions)


def copy_cache(cache: StaticCache) -> StaticCache:
    other = StaticCache(None, cache.batch_size_hint, cache.max_cache_len)
    other._keys, other._values = [k.clone() for k in cache._keys], [v.clone() for v in cache._values]
    other._lengths = list(cache._lengths)
    return other


def run_block(block, x, cache, kwargs, fused: bool):
    block.fused_decode = fused
    try:
        with torch.no_grad():
            return block(x, past_key_values=cache, **kwargs)
    finally:
        block.fused_decode = True


@pytest.mark.parametrize("quantization", ["int4", "int8", "q8_0", "q4_0"])
@pytest.mark.parametrize("batch,seq,kv_n_heads", [(1, 1, 2), (2, 1, 1), (2, 3, 4), (3, 8, 2)])
def test_the_fused_block_is_its_layers_one_by_one(quantization, batch, seq, kv_n_heads, monkeypatch):
    model = tiny_model("llama", d_model=64, n_heads=4, kv_n_heads=kv_n_heads, quantization=quantization, kernels="llm")
    block = model.blocks[1]
    calls = []
    kernel = cpu_quant.decoder_blocks
    monkeypatch.setattr(cpu_quant, "decoder_blocks", lambda *a: calls.append(a[0].shape) or kernel(*a))
    cache, x, kwargs = step_inputs(model, batch, seq)
    separate = copy_cache(cache)
    expected = run_block(block, x, separate, kwargs, fused=False)
    assert not calls
    out = run_block(block, x, cache, kwargs, fused=True)
    assert calls == [x.shape]
    scale = float(expected.abs().max())
    torch.testing.assert_close(out, expected, atol=1e-5 * scale, rtol=0)
    # the new keys (rotated) and values written at their positions, and nothing else
    for mine, theirs in ((cache._keys[1], separate._keys[1]), (cache._values[1], separate._values[1])):
        torch.testing.assert_close(mine, theirs, atol=1e-5 * float(theirs.abs().max()), rtol=0)
    assert torch.equal(cache._keys[0], separate._keys[0])


@torch.no_grad()
@pytest.mark.parametrize("quantization", ["int4", "int8", "q8_0", "q4_0"])
def test_decoding_through_the_fused_blocks_follows_the_uncached_forward(quantization):
    model = tiny_model("llama", d_model=64, quantization=quantization, kernels="llm", init_std=0.02)
    ids = torch.randint(0, 61, (2, 9))
    sequences = torch.cat([ids, torch.randint(0, 61, (2, 6))], dim=1)
    mask = torch.ones_like(sequences, dtype=torch.bool)
    mask[1, :3] = False
    reference = model(sequences, attention_mask=mask).logits
    decoder = compiled.StaticDecoder(model, mask, sequences.shape[1], None, compile=False)
    decoder.prefill(ids, mask, torch.full((2,), 8))
    for step in range(9, sequences.shape[1]):
        logits = decoder.forward(sequences[:, step:step + 1])[:, 0]
        torch.testing.assert_close(logits, reference[:, step], atol=0.01 * float(reference.abs().max()), rtol=0)


def test_only_blocks_it_fits_take_it(monkeypatch):
    calls = []
    kernel = cpu_quant.decoder_blocks
    monkeypatch.setattr(cpu_quant, "decoder_blocks", lambda *a: calls.append(1) or kernel(*a))
    cases = {
        "float weights": tiny_model("llama", d_model=64),
        "torch's kernels": tiny_model("llama", d_model=64, quantization="int4", kernels="torch"),
        "LayerNorm, ALiBi, GELU MLP": tiny_model("alibi", d_model=64, quantization="int4", kernels="llm"),
        "head_dim 8": tiny_model("llama", d_model=32, quantization="int4", kernels="llm"),
        "the fused Llama block": tiny_model("llama", d_model=64, quantization="int4", kernels="llm"),
    }
    for name, model in cases.items():
        cache, x, kwargs = step_inputs(model, 2, 1)
        if model.config.alibi:
            kwargs.update(rotary=None, attn_bias=torch.zeros(2, 4, 1, 48))
        run_block(model.blocks[0], x, cache, kwargs, fused=True)
        assert len(calls) == (name == "the fused Llama block"), name
    model = cases["the fused Llama block"]
    cache, x, kwargs = step_inputs(model, 2, 9)  # any number of tokens (a prefill chunk)
    run_block(model.blocks[0], x, cache, kwargs, fused=True)
    assert len(calls) == 2
    x.requires_grad_()
    cache, _, kwargs = step_inputs(model, 2, 1)
    model.blocks[0](x[:, :1], past_key_values=cache, **kwargs)  # a gradient is wanted
    assert len(calls) == 2
    cache, x, kwargs = step_inputs(model, 2, 1)
    out = model.blocks[0](x, past_key_values=cache, **kwargs)  # the norms' weights want one
    assert len(calls) == 2 and out.requires_grad
    with torch.no_grad():
        model.blocks[0](x, past_key_values=cache, **kwargs)
    assert len(calls) == 3


def test_compiled_it_stays_one_call_that_writes_the_caches_in_place(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = tiny_model("llama", d_model=64, n_layers=2, quantization="int4", kernels="llm")
    cache, x, kwargs = step_inputs(model, 2, 1)
    eager_cache, before = copy_cache(cache), [k.clone() for k in cache._keys]
    with torch.no_grad():
        expected = blocks_module.forward_blocks(model.blocks, x, past_key_values=eager_cache, **kwargs)
    graphs, code = [], []

    def backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    step = torch.compile(lambda x, cache, mask, rot, pos: blocks_module.forward_blocks(
        model.blocks, x, past_key_values=cache, attn_mask=mask, rotary=rot, cache_position=pos),
        backend=backend, fullgraph=True)
    from torch._inductor.utils import run_and_get_code
    with torch.no_grad():
        out, code = run_and_get_code(step, x, cache, kwargs["attn_mask"], kwargs["rotary"], kwargs["cache_position"])
    torch._dynamo.reset()
    assert sum("decoder_blocks" in t for t in graphs[0]) == 1
    # inductor calls it on the caches themselves (graph inputs, not buffers): no copy in or out
    body = code[0][code[0].index("def call("):code[0].index("def benchmark_compiled_module")]
    calls = [line for line in body.splitlines() if "torch.ops.llm.decoder_blocks" in line]
    assert len(calls) == 1 and "copy" not in body
    caches = re.findall(r"\[(arg\d+_1), (arg\d+_1)\]", calls[0])
    assert len(caches) == 2  # k_caches and v_caches, each a list of two graph inputs
    torch.testing.assert_close(out, expected, atol=1e-5 * float(expected.abs().max()), rtol=0)
    for layer in range(2):
        torch.testing.assert_close(cache._keys[layer], eager_cache._keys[layer], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache._values[layer], eager_cache._values[layer], atol=1e-5, rtol=1e-5)
        changed = (cache._keys[layer] != before[layer]).any(-1).any(1)  # (batch, capacity): positions written
        assert changed[:, 20].all() and changed.sum() == 2


def test_bad_inputs_are_refused_with_what_was_wrong():
    model = tiny_model("llama", d_model=64, quantization="int4", kernels="llm")
    block = model.blocks[0]
    cache, x, kwargs = step_inputs(model, 2, 1)
    weights, _, shape = block._fused_weights()
    out_features = list(shape[3])
    keys, values = cache.storage(0)
    mask = kwargs["attn_mask"][:, 0]
    rot = kwargs["rotary"]
    norms = [block.norm_1.weight, block.norm_2.weight]
    args = dict(x=x, norms=norms, eps=1e-5, weights=weights, out_features=out_features, cos=rot.cos[:, 0],
                sin=rot.sin[:, 0], k_caches=[keys], v_caches=[values], cache_position=kwargs["cache_position"],
                mask=mask, n_heads=4, scale=0.25)
    cases = [
        (dict(cache_position=torch.tensor([48])), "cache_position 48 is outside the buffer of 48"),
        (dict(weights=weights[:12]), "15 weights each: got 1, 1, 2 and 12"),
        (dict(k_caches=[keys, keys], v_caches=[values, values]), "15 weights each: got 2, 2, 2 and 15"),
        (dict(v_caches=[values[:, :, :-1]]), r"k_cache and v_cache must be contiguous float32 .* for block 0"),
        (dict(norms=[norms[0], norms[1][:-1]]), r"norm weights must be contiguous float32 CPU tensors \(d_model,\)"),
        (dict(x=x.double()), "x must be a float32 CPU tensor"),
        (dict(mask=mask[..., :-1]), r"mask must be bool \(batch, seq, capacity\)"),
        (dict(mask=mask.reshape(2, 48, 1)), r"mask must be bool \(batch, seq, capacity\) = \(2, 1, 48\)"),
        (dict(cache_position=torch.tensor([20.7])), "cache_position must be an integer CPU tensor"),
        # a block whose FFN has no inputs (hidden 0) once divided by zero (SIGFPE)
        (dict(out_features=[128, 64, 0, 0, 64], weights=weights[:6] + [torch.zeros(0, 8, 16, 4, dtype=torch.uint8),
                                                                      torch.zeros(0, 2, 16, dtype=torch.half),
                                                                      torch.zeros(0, 2, 16, dtype=torch.half)] * 2
          + [torch.zeros(4, 0, 16, 4, dtype=torch.uint8), torch.zeros(4, 0, 16, dtype=torch.half),
             torch.zeros(4, 0, 16, dtype=torch.half)]), "gate_proj: out_features 0 must be positive"),
        (dict(n_heads=3), "n_heads 3 must be a multiple of kv_n_heads 2"),
        (dict(out_features=[96, 64, 100, 100, 64]), "do not fit d_model 64"),
        (dict(cos=rot.cos[:, 0, :, :8], sin=rot.sin[:, 0, :, :8]), "cos and sin must be float32"),
    ]
    for change, message in cases:
        with pytest.raises(RuntimeError, match=message):
            cpu_quant.decoder_blocks(**{**args, **change})
    with pytest.raises(ValueError, match="layer 5 has no storage"):
        cache.storage(5)


@torch.no_grad()
@pytest.mark.parametrize("unfused", [None, 1])
def test_a_model_step_runs_its_fused_blocks_in_one_call(unfused, monkeypatch):
    """forward_static sends each run of consecutive blocks the kernel takes in one call, which
    equals those blocks run one call each (same arithmetic, same order); a block that cannot take
    it splits the run and takes its layers."""
    model = tiny_model("llama", d_model=64, n_layers=4, quantization="int4", kernels="llm")
    if unfused is not None:
        model.blocks[unfused].fused_decode = False
    calls = []
    kernel = cpu_quant.decoder_blocks
    monkeypatch.setattr(cpu_quant, "decoder_blocks", lambda *a: calls.append(len(a[7])) or kernel(*a))
    cache, _, _ = step_inputs(model, 2, 1)
    separate = copy_cache(cache)
    ids = torch.randint(0, 61, (2, 1))
    key_mask = torch.zeros(2, 48, dtype=torch.bool)
    key_mask[:, :21] = True
    key_mask[1, :4] = False
    position = torch.tensor([20])
    logits = model.forward_static(ids, cache, position, key_mask)
    assert calls == ([4] if unfused is None else [1, 2])
    calls.clear()
    one_by_one = lambda blocks, x, **kw: functools.reduce(lambda x, b: blocks_module.forward_blocks([b], x, **kw),
                                                          blocks, x)
    monkeypatch.setattr(model_module, "forward_blocks", one_by_one)
    assert torch.equal(model.forward_static(ids, separate, position, key_mask), logits)
    assert calls == ([1] * 4 if unfused is None else [1, 1, 1])
    for mine, theirs in zip((*cache._keys, *cache._values), (*separate._keys, *separate._values)):
        assert torch.equal(mine, theirs)


@torch.no_grad()
def test_what_a_block_keeps_for_the_kernel_follows_every_change_of_its_modules():
    model = tiny_model("llama", d_model=64, n_layers=2, quantization="int4", kernels="llm")
    ids = torch.randint(0, 61, (1, 9))
    before = model(ids).logits
    kept = model.blocks[0]._fused_weights()
    assert model.blocks[0]._fused_weights() is kept  # kept while nothing changes
    # a projection swapped for torch's kernel: the block leaves the fused kernel
    other = tiny_model("llama", d_model=64, n_layers=2, quantization="int4", kernels="torch")
    model.blocks[0].ffn.down_proj = other.blocks[0].ffn.down_proj
    assert model.blocks[0]._fused_weights() is None
    # another model's projection on our kernels: taken, with its weights
    ours = tiny_model("llama", d_model=64, n_layers=2, quantization="int4", kernels="llm", seed=3)
    model.blocks[0].ffn.down_proj = ours.blocks[0].ffn.down_proj
    assert model.blocks[0]._fused_weights()[0][12] is ours.blocks[0].ffn.down_proj.weight
    # a norm weight replaced, and kernel tensors remade by a load: the new ones are read
    model.blocks[1].norm_2.weight = torch.nn.Parameter(torch.full((64,), 2.0), requires_grad=False)
    model.blocks[1].attn.Wqkv.load_state_dict(ours.blocks[1].attn.Wqkv.state_dict())
    fused = model(ids).logits
    fresh = tiny_model("llama", d_model=64, n_layers=2, quantization="int4", kernels="llm", seed=5)
    fresh.load_state_dict(model.state_dict())  # the same weights, never kept by any block before
    assert not torch.equal(fused, before) and torch.equal(fused, fresh(ids).logits)


@torch.no_grad()
def test_on_a_busy_machine_the_blocks_run_on_one_thread_for_a_stretch():
    model = tiny_model("llama", d_model=64, n_layers=2, quantization="int4", kernels="llm")
    ids = torch.randint(0, 61, (2, 9))
    reference = model(ids).logits
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    torch.ops.llm.set_pace(3, 16)  # as if the last call found a thread starved
    try:
        for left in (2, 1, 0):
            assert torch.equal(model(ids).logits, reference)  # only the speed depends on the threads
            assert torch.ops.llm.pace_state()[0] == left
    finally:
        torch.ops.llm.set_pace(0, 16)
        torch.set_num_threads(threads)


@torch.no_grad()
def test_what_the_model_keeps_for_one_call_follows_blocks_swapped_and_modes(monkeypatch):
    """The model keeps its blocks' fused weights between steps; a block replaced in the list,
    train()/eval() and ``fused_decode`` are seen at the next forward."""
    model = tiny_model("llama", d_model=64, n_layers=3, quantization="int4", kernels="llm")
    ids = torch.randint(0, 61, (2, 7))
    calls = []
    kernel = cpu_quant.decoder_blocks
    monkeypatch.setattr(cpu_quant, "decoder_blocks", lambda *a: calls.append(len(a[7])) or kernel(*a))
    fused = model(ids).logits
    assert calls == [3]
    mine = model.blocks[1]
    torch_kernels = tiny_model("llama", d_model=64, n_layers=3, quantization="int4", kernels="torch", seed=2)
    model.blocks[1] = torch_kernels.blocks[1]  # ModuleList's setitem: no block's setattr
    calls.clear()
    assert not torch.equal(model(ids).logits, fused) and calls == []  # not all blocks fuse: the layers run
    model.blocks[1] = mine
    assert torch.equal(model(ids).logits, fused) and calls == [3]
    for change in (lambda: setattr(model.blocks[2], "fused_decode", False), model.train):
        change()
        calls.clear()
        model(ids)
        assert calls == []
        model.eval()
        model.blocks[2].fused_decode = True


def test_the_int8_embedding_op_gives_the_rows_times_their_scales():
    from llm.quant.modules import Int8Embedding

    table = Int8Embedding.from_float(torch.randn(50, 64) * 3, backend="llm")
    assert table.packed
    ids = torch.randint(0, 50, (3, 5))
    assert torch.equal(table(ids), table.codes()[ids].float() * table.scales[ids].unsqueeze(-1))
    assert torch.equal(table(ids.int()), table(ids))  # int32 ids, as nn.Embedding takes them
    with pytest.raises(RuntimeError, match="id 50 is outside the table's 50 rows"):
        table(torch.tensor([50]))
