"""Our int4 and int8 CPU kernels (llm/kernels/cpu_quant.cpp): the arithmetic they promise (int8
activations per 32 inputs, integer dot products, float scales), rows independent of their batch,
layouts that unpack to what was packed, state dicts that load on either kernel, torch.compile
calling them, token identity on SmolLM2 for every cache path, and the fallbacks."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llm import MosaicGPT
from llm.formats.gguf.reader import load_gguf
from llm.generation import compiled
from llm.kernels import cpu_quant
from llm.layers.attention import attention_heads
from llm.quant import Int4Linear, Int8Embedding, Int8Linear, quantize
from llm.quant.quantize import check_backend, layer_kernels
from llm.utils.pretrained import pretrained_path
from tests.conftest import tiny_model
from tests.quant.test_quant import int8_activations

ROOT = Path(__file__).resolve().parents[2]
GGUF = pretrained_path("smollm2-135m-instruct")
pytestmark = pytest.mark.usefixtures("cpu_kernels")


def int4_reference(x, codes, scales, mins, group_size):
    """float64: the int8 activations times the dequantized weight q * scale + min."""
    n, k = codes.shape
    groups = codes.double().view(n, k // group_size, group_size)
    weight = (groups * scales.double()[..., None] + mins.double()[..., None]).view(n, k)
    return int8_activations(x).double() @ weight.t()


@pytest.mark.parametrize("n,k,group_size", [(16, 32, 32), (50, 64, 32), (49, 192, 64), (33, 256, 128), (20, 512, 256)])
def test_int4_kernel_computes_its_stated_arithmetic(n, k, group_size):
    g = torch.Generator().manual_seed(n)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // group_size, generator=g) * 0.02).half()
    mins = (-torch.rand(n, k // group_size, generator=g) * 0.1).half()
    packed = cpu_quant.pack_int4(codes, scales, mins)
    assert all(torch.equal(a, b) for a, b in zip(cpu_quant.unpack_int4(*packed, n), (codes, scales, mins)))
    for rows in (1, 3, 8, 19):  # tiles of 8 tokens and their remainders
        x = torch.randn(rows, k, generator=g) * 3
        x[0, :32] = 0  # an all-zero group
        out = cpu_quant.int4_linear(x, *packed, group_size, n)
        reference = int4_reference(x, codes, scales, mins, group_size)
        assert out.dtype == torch.float32 and out.shape == (rows, n)
        torch.testing.assert_close(out.double(), reference, atol=1e-5 * float(reference.abs().max()), rtol=0)
    # bfloat16 activations are taken as their float32 values
    xb = torch.randn(2, k, generator=g).bfloat16()
    assert torch.equal(cpu_quant.int4_linear(xb, *packed, group_size, n), cpu_quant.int4_linear(xb.float(), *packed,
                                                                                                group_size, n))


def test_int4_without_mins_is_minus_eight_scales_to_the_bit():
    # GGUF Q4_0's symmetric blocks: no mins stored or read, the products of stored mins -8 d
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (50, 96), dtype=torch.uint8, generator=g)
    scales = (torch.rand(50, 3, generator=g) * 0.02).half()
    symmetric, explicit = cpu_quant.pack_int4(codes, scales, None), cpu_quant.pack_int4(codes, scales, -8 * scales)
    assert symmetric[2] is None
    assert all(torch.equal(a, b) for a, b in zip(cpu_quant.unpack_int4(*symmetric, 50), (codes, scales, -8 * scales)))
    x = torch.randn(11, 96, generator=g)
    assert torch.equal(cpu_quant.int4_linear(x, *symmetric, 32, 50), cpu_quant.int4_linear(x, *explicit, 32, 50))
    layer = Int4Linear(codes, scales.float(), torch.zeros(50, 3), None, 32, torch.bfloat16, "llm")
    assert layer.kernel_mins is None and torch.equal(layer(x), cpu_quant.int4_linear(x, *explicit, 32, 50))


@pytest.mark.parametrize("n,k", [(16, 32), (61, 96), (130, 576)])
def test_int8_kernel_computes_its_stated_arithmetic(n, k):
    g = torch.Generator().manual_seed(k)
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, generator=g) * 0.01
    packed = cpu_quant.pack_int8(codes)
    assert torch.equal(cpu_quant.unpack_int8(packed, n), codes)
    ids = torch.randint(0, n, (3, 4), generator=g)
    assert torch.equal(cpu_quant.gather_int8_rows(packed, ids), codes[ids])
    for rows in (1, 5, 17):
        x = torch.randn(rows, k, generator=g)
        out = cpu_quant.int8_linear(x, packed, cpu_quant.lane_scales(scales), n)
        reference = int8_activations(x).double() @ (codes.double() * scales.double()[:, None]).t()
        torch.testing.assert_close(out.double(), reference, atol=1e-5 * float(reference.abs().max()), rtol=0)


@pytest.mark.parametrize("n,k,group_size", [(16, 32, 32), (61, 96, 32), (130, 576, 32), (33, 256, 64), (20, 512, 256)])
def test_int8_kernel_in_groups_computes_its_stated_arithmetic(n, k, group_size):
    # GGUF Q8_0's form: an fp16 scale per 32 inputs of a row, applied with the activations' scale
    g = torch.Generator().manual_seed(n + k)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scales = (torch.rand(n, k // group_size, generator=g) * 0.01).half().float()
    packed, kernel_scales = cpu_quant.pack_int8(codes), cpu_quant.lane_scales(scales)
    assert kernel_scales.dtype == torch.float16 and kernel_scales.shape == (-(-n // 16), k // group_size, 16)
    weight = (codes.double().view(n, -1, group_size) * scales.double()[..., None]).view(n, k)
    for rows in (1, 3, 8, 19):
        x = torch.randn(rows, k, generator=g) * 2
        x[0, :32] = 0
        out = cpu_quant.int8_linear(x, packed, kernel_scales, n)
        reference = int8_activations(x).double() @ weight.t()
        assert out.dtype == torch.float32 and out.shape == (rows, n)
        torch.testing.assert_close(out.double(), reference, atol=1e-5 * float(reference.abs().max()), rtol=0)
        # each row alone gives its bits in the batch
        assert all(torch.equal(out[i], cpu_quant.int8_linear(x[i:i + 1], packed, kernel_scales, n)[0])
                   for i in range(rows))
    ids = torch.tensor([[0, n - 1], [n // 2, 1]])
    assert torch.equal(cpu_quant.int8_embedding(packed, scales, ids), weight.float()[ids])
    # the same rows from the scales as the kernel holds them (float16 lanes, the fp16 values exactly)
    assert torch.equal(cpu_quant.int8_embedding(packed, kernel_scales, ids), weight.float()[ids])
    assert torch.equal(cpu_quant.unlane_scales(kernel_scales, n), scales)
    with pytest.raises(RuntimeError, match="float16 scales .* group_size a multiple of 32 dividing"):
        cpu_quant.int8_linear(torch.randn(1, k), packed, kernel_scales[:, :1].repeat(1, 5, 1).contiguous(), n)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_each_row_is_computed_alone(method):
    # what makes a cached step equal the full forward: a row's result does not depend on the others
    torch.manual_seed(0)
    layer = (Int8Linear.from_float(torch.randn(70, 128), None, torch.bfloat16) if method == "int8"
             else Int4Linear.from_float(torch.randn(70, 128), None, 32, torch.bfloat16))
    assert layer.kernel == "llm"
    x = torch.randn(21, 128)
    batch = layer(x)
    assert all(torch.equal(batch[i], layer(x[i:i + 1])[0]) for i in range(21))
    assert torch.equal(layer(x[3:12]), batch[3:12])


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores")
def test_the_kernels_run_on_torchs_threads():
    # built without OpenMP, at::parallel_for runs every task on the calling thread
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.ops.llm.parallel_threads(64) == 2
    finally:
        torch.set_num_threads(before)


def test_kernels_raise_clear_errors_on_bad_layouts():
    codes = cpu_quant.pack_int8(torch.zeros(16, 64, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="in_features a positive multiple of 32"):
        cpu_quant.int8_linear(torch.randn(2, 48), codes, torch.ones(16), 16)
    with pytest.raises(RuntimeError, match="in_features a positive multiple of 32"):  # 0 once divided by zero
        cpu_quant.int8_linear(torch.randn(2, 0), codes, torch.ones(16), 16)
    with pytest.raises(RuntimeError, match="do not match 16 outputs of 96 inputs"):
        cpu_quant.int8_linear(torch.randn(2, 96), codes, torch.ones(16), 16)
    int4 = cpu_quant.pack_int4(torch.zeros(16, 96, dtype=torch.uint8), torch.ones(16, 3), torch.ones(16, 3))
    for group_size in (48, 0, -32):  # 0 once divided by zero (SIGFPE)
        with pytest.raises(RuntimeError, match=f"group_size {group_size} must be a multiple of 32"):
            cpu_quant.int4_linear(torch.randn(2, 96), *int4, group_size, 16)
    with pytest.raises(RuntimeError, match=r"scales and mins must be .* \(1, 1, 16\) for group_size 96, got \[1, 3, 16\]"):
        cpu_quant.int4_linear(torch.randn(2, 96), *int4, 96, 16)
    with pytest.raises(RuntimeError, match=r"x must be \(rows, in_features\), got \[96\]"):
        cpu_quant.int4_linear(torch.randn(96), *int4, 32, 16)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_input_reaches_the_output(bad):
    # a max over the group drops NaN: without a check the row came out finite and wrong
    x = torch.randn(3, 64)
    x[1, 5] = bad
    int4 = cpu_quant.pack_int4(torch.randint(0, 16, (16, 64), dtype=torch.uint8), torch.rand(16, 2), torch.rand(16, 2))
    int8 = cpu_quant.pack_int8(torch.randint(-127, 128, (16, 64), dtype=torch.int8))
    for out in (cpu_quant.int4_linear(x, *int4, 32, 16), cpu_quant.int8_linear(x, int8, torch.ones(16), 16)):
        assert not torch.isfinite(out[1]).any() and torch.isfinite(out[[0, 2]]).all()


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("scheme", ["learned", "llama"])  # tied and untied output layers
def test_state_dicts_load_on_either_kernel(tmp_path, method, scheme):
    ours = quantize(tiny_model(scheme), method)
    theirs = quantize(tiny_model(scheme), method, backend="torch")
    assert {m.kernel for m in ours.modules() if hasattr(m, "kernel")} == {"llm"}
    assert {m.kernel for m in theirs.modules() if hasattr(m, "kernel")} == {"torch"}
    ours.save_pretrained(tmp_path / "ours")
    loaded = MosaicGPT.from_pretrained(tmp_path / "ours", backend="torch")
    assert {m.kernel for m in loaded.modules() if hasattr(m, "kernel")} == {"torch"}
    # the same codes and scales behind both (the int4 scales as float16 d, zero - 8 d on our side)
    for name, module in ours.named_modules():
        if isinstance(module, (Int8Linear, Int4Linear, Int8Embedding)):
            other = loaded.get_submodule(name)
            assert torch.equal(module.codes(), other.codes())
    ids = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        ours_logits, loaded_logits = ours(ids).logits, loaded(ids).logits
        torch.testing.assert_close(loaded_logits, ours_logits, atol=0.1 * float(ours_logits.abs().max()), rtol=0)
        again = MosaicGPT.from_pretrained(tmp_path / "ours")
        assert torch.equal(again(ids).logits, ours_logits)


@torch.no_grad()
def test_tied_embedding_shares_the_packed_table():
    model = quantize(tiny_model("learned"), "int8")
    assert model.wte.packed and model.lm_head.weight is model.wte.weight
    ids = torch.randint(0, 61, (2, 5))
    codes = model.wte.codes()
    assert torch.equal(model.wte(ids), codes[ids].float() * model.wte.scales[ids][..., None])


@torch.no_grad()
def test_torch_compile_calls_the_kernels_in_a_graph(monkeypatch, tmp_path):
    from torch._dynamo.testing import CompileCounterWithBackend

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = tiny_model("llama", n_layers=1, quantization="int4")
    embeds = model.get_input_embeddings()(torch.randint(0, 61, (2, 7)))
    eager = model(inputs_embeds=embeds).logits
    # dynamo's graph run eagerly is the eager arithmetic; inductor fuses the float32 ops around the
    # kernels (norms, rotary), whose last-bit changes can move an activation to its next int8 code
    for backend, atol in ((CompileCounterWithBackend("eager"), 0.0), ("inductor", 0.02 * float(eager.abs().max()))):
        torch._dynamo.reset()
        step = torch.compile(lambda e: model(inputs_embeds=e).logits, backend=backend, fullgraph=True)
        torch.testing.assert_close(step(embeds), eager, atol=atol, rtol=0)
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def smollm2():
    if not GGUF.is_file():
        pytest.skip(f"{GGUF} missing: run `make data`")
    model = load_gguf(GGUF)
    assert model.blocks[0].attn.Wqkv.kernel == "llm" and model.lm_head.kernel == "llm"
    return model


PROMPT = torch.tensor([[1, 504, 2660, 314, 253, 1953, 28, 2055, 2012, 3260, 30, 378, 1953, 314]])


def assert_greedy(model, sequences, prompt_length):
    """Every generated token is the argmax of the uncached forward over the sequence before it:
    our kernels compute each token's logits to the same bits in any call."""
    logits = model(sequences).logits[0, prompt_length - 1:-1]
    assert torch.equal(logits.argmax(-1), sequences[0, prompt_length:])


@torch.no_grad()
def test_smollm2_cached_reference_draft_and_compiled_decoding_are_greedy(smollm2, monkeypatch):
    n = PROMPT.shape[1]
    plain = smollm2.generate(PROMPT, max_new_tokens=24, do_sample=False)
    assert_greedy(smollm2, plain, n)
    lookup = smollm2.generate(PROMPT, max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=4,
                              reference_ids=[plain[0, n:]], return_dict_in_generate=True)
    assert torch.equal(lookup.sequences, plain)
    assert lookup.stats["forward_passes"] < 24  # the reference was taken
    assert torch.equal(smollm2.generate(PROMPT, max_new_tokens=24, do_sample=False, assistant_model=smollm2), plain)
    torch._dynamo.reset()
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", "eager")  # dynamo's graphs, run eagerly: fast to build
    assert torch.equal(smollm2.generate(PROMPT, max_new_tokens=24, do_sample=False, compile=True), plain)
    torch._dynamo.reset()


def test_a_source_that_does_not_build_warns_once_and_says_why(tmp_path):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    with pytest.warns(UserWarning, match="llm's CPU kernels are not used: building broken.cpp failed"):
        reason = cpu_quant.build((broken,))
    assert reason.startswith("building broken.cpp failed (") and "ninja" not in reason  # the compiler's line


def test_no_compiler_and_a_killed_builds_lock(tmp_path):
    script = "from llm.kernels import cpu_quant; print(cpu_quant.unavailable())"
    env = dict(os.environ, LLM_HOME=str(tmp_path / "a"), CXX="/nonexistent/g++")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=ROOT)
    assert "/nonexistent/g++: not found" in out.stdout and out.stderr.count("llm's CPU kernels are not used") == 1
    # a build killed with SIGKILL leaves torch's lock behind, which it would wait on forever
    name = next(p.name for p in (tmp_path / "a" / "kernels").iterdir())
    env = dict(os.environ, LLM_HOME=str(tmp_path / "a"))
    lock = tmp_path / "a" / "kernels" / name / "lock"
    lock.write_text("")
    old = lock.stat().st_mtime - cpu_quant.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.stdout.strip() == "None" and "left by a build that was killed" in out.stderr


def test_a_finished_build_loads_without_the_build_tools():
    # the build of these sources (made by `make install`) loads in a fresh process without
    # importing torch.utils.cpp_extension, which costs a second
    script = ("import sys; from llm.kernels import cpu_quant; print(cpu_quant.isa()); "
              "print('torch.utils.cpp_extension' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.stdout.split() == [cpu_quant.isa(), "False"], out.stderr
    assert (cpu_quant.build_directory(cpu_quant.extension_name()) / f"{cpu_quant.extension_name()}.so").is_file()


def test_the_backend_selects_the_kernels_and_auto_takes_ours_here():
    assert cpu_quant.isa() in ("avx2", "avx512")
    weight = torch.randn(32, 64)
    for backend, kernel in (("auto", "llm"), ("llm", "llm"), ("torch", "torch")):
        assert Int4Linear.from_float(weight, None, 32, torch.bfloat16, backend).kernel == kernel
        model = quantize(tiny_model("llama", d_model=64), "int8", backend=backend)
        assert set(layer_kernels(model).values()) == {kernel}
        assert model.blocks[0].attn.decode_kernel == (kernel == "llm")
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'llm', 'torch'\), got 'fast'"):
        quantize(tiny_model("llama"), "int8", backend="fast")
    with pytest.raises(ValueError, match='backend "llm" runs on the CPU, not on meta'):
        check_backend("llm", "meta")


@pytest.mark.parametrize("batch,n_heads,kv_n_heads,seq_q,seq_k,head_dim",
                         [(1, 9, 3, 1, 256, 64), (2, 4, 4, 3, 37, 32), (3, 8, 2, 1, 17, 128), (1, 2, 1, 8, 300, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_decode_attention_is_the_torch_paths_attention(batch, n_heads, kv_n_heads, seq_q, seq_k, head_dim, bias):
    g = torch.Generator().manual_seed(seq_k)
    q = torch.randn(batch, n_heads, seq_q, head_dim, generator=g)
    k, v = (torch.randn(batch, kv_n_heads, seq_k, head_dim, generator=g) for _ in range(2))
    mask = torch.rand(batch, seq_q, seq_k, generator=g) < 0.6
    mask[-1, 0] = False  # a query that sees no key: zeros
    alibi = torch.randn(batch, n_heads, seq_q, seq_k, generator=g) if bias else None
    reference = attention_heads(q, k, v, attn_mask=mask[:, None], attn_bias=alibi, impl="torch")
    k[~mask.any(1)[:, None].expand_as(k[..., 0])] = float("nan")  # keys no query sees are never read
    out = cpu_quant.decode_attention(q, k, v, mask, head_dim ** -0.5, alibi)
    torch.testing.assert_close(out, reference, atol=2e-6, rtol=1e-5)
    assert torch.equal(out[-1, :, 0], torch.zeros_like(out[-1, :, 0]))
    q[0, 1, 0, 3] = float("nan")
    assert torch.isnan(cpu_quant.decode_attention(q, k, v, mask, 0.1, alibi)[0, 1, 0]).all() or not mask[0, 0].any()
    with pytest.raises(RuntimeError, match=r"mask must be bool \(batch, seq_q, seq_k\)"):
        cpu_quant.decode_attention(q, k, v, mask[:, :, :-1], 0.1, None)
    with pytest.raises(RuntimeError, match="a multiple of 16"):
        cpu_quant.decode_attention(q[..., :8], k[..., :8], v[..., :8], mask, 0.1, None)


def test_decode_attention_extremes_and_gradients():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 1, 16, generator=g)
    k, v = (torch.randn(1, 2, 16, 16, generator=g) for _ in range(2))
    mask = torch.ones(1, 1, 16, dtype=torch.bool)
    bias = torch.zeros(1, 2, 1, 16)
    bias[..., :5] = -1e30  # "-1e30 as a mask": once NaN (exp of a score 1e30 below the top)
    for b, scale in ((bias, 0.25), (None, 1e20), (None, 1e-30)):
        reference = attention_heads(q, k, v, attn_mask=mask[:, None], attn_bias=b, softmax_scale=scale)
        torch.testing.assert_close(cpu_quant.decode_attention(q, k, v, mask, scale, b), reference)
    # a gradient is wanted: the torch path, which has one
    q.requires_grad_()
    out = attention_heads(q, k, v, attn_mask=mask[:, None], decode_kernel=True)
    out.sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0


def test_a_direct_first_call_builds_the_kernels_or_says_why(tmp_path):
    script = ("import torch; from llm.kernels import cpu_quant\n"
              "q = torch.randn(1, 1, 1, 16)\n"
              "try: print(tuple(cpu_quant.decode_attention(q, q, q, torch.ones(1, 1, 1, dtype=torch.bool), 1.0).shape))\n"
              "except RuntimeError as err: print(err)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.stdout.strip() == "(1, 1, 1, 16)", out.stderr
    env = dict(os.environ, LLM_HOME=str(tmp_path), CXX="/nonexistent/g++")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert "llm's CPU kernels cannot run here: building cpu_quant.cpp failed" in out.stdout, out.stdout + out.stderr


@torch.no_grad()
def test_cache_steps_of_a_model_on_our_kernels_take_the_attention_kernel(monkeypatch):
    # ALiBi blocks are not fused: their attention alone takes our kernel, in prefill and steps alike
    model = tiny_model("alibi", d_model=64, quantization="int8", kernels="llm")  # head_dim 16
    ids = torch.randint(0, 61, (2, 9))
    mask = torch.ones(2, 9 + 6, dtype=torch.bool)
    mask[1, :3] = False
    sequences = torch.cat([ids, torch.randint(0, 61, (2, 6))], dim=1)
    calls = []
    kernel = cpu_quant.decode_attention
    monkeypatch.setattr(cpu_quant, "decode_attention", lambda *a: calls.append(a[0].shape) or kernel(*a))
    decoder = compiled.StaticDecoder(model, mask, sequences.shape[1], None, compile=False)
    prefill = decoder.prefill(ids, mask, torch.full((2,), 8))
    assert calls == [(2, 4, compiled.PREFILL_CHUNK, 16)] * model.config.n_layers
    steps = [decoder.forward(sequences[:, step:step + 1])[:, 0] for step in range(9, sequences.shape[1])]
    assert calls[model.config.n_layers:] == [(2, 4, 1, 16)] * (6 * model.config.n_layers)
    reference = model(sequences, attention_mask=mask).logits
    torch.testing.assert_close(prefill, reference[:, 8], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.stack(steps, 1), reference[:, 9:], atol=1e-4, rtol=1e-4)
    calls.clear()
    model = tiny_model("alibi", d_model=64, quantization="int8", kernels="torch")
    decoder = compiled.StaticDecoder(model, mask, sequences.shape[1], None, compile=False)
    decoder.prefill(ids, mask, torch.full((2,), 8))
    decoder.forward(sequences[:, 9:10])
    assert not calls
