"""Weight-only quantization: the kernels against dequantized references, GGUF's own Q4 blocks kept
exactly, quantized bundles that save and load to the same logits, and clear errors."""

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from llm import MosaicGPT
from llm.kernels import cpu_quant
from llm.formats.gguf.reader import _float, _sources, gguf_config, int4_blocks, load_gguf, q8_0_blocks
from llm.utils.gguf import read_gguf
from llm.quant import Int4Linear, Int8Linear, quantize
from llm.quant.modules import int4_groups, int8_dequantize
from llm.quant.quantize import default_activation_dtype
from llm.utils.pretrained import pretrained_path
from tests.conftest import tiny_model

GGUF = pretrained_path("smollm2-135m-instruct")
needs_file = pytest.mark.skipif(not GGUF.is_file(), reason=f"{GGUF} missing: run `make data`")


def kernel_weight(module: Int4Linear) -> torch.Tensor:
    """The float32 weight an Int4Linear multiplies by, read through its own kernel (the rows of the
    identity are exact in either kernel's activations)."""
    eye = torch.eye(module.in_features, dtype=torch.float32 if module.kernel == "llm" else module.activation_dtype)
    return module(eye).float().t()


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as our CPU kernels see it: int8 per 32 inputs, scale max |x| / 127, round half to even."""
    groups = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    codes = torch.where(amax > 0, torch.round(groups * (127 / amax)), torch.zeros_like(groups))
    return (codes * (amax / 127)).reshape(x.shape)




def fake_q4_0(rows: int, cols: int, seed: int = 0):
    """A Q4_0 tensor as the gguf reader gives one: per block of 32, an fp16 scale and 16 bytes of nibbles."""
    rng = np.random.default_rng(seed)
    d = (rng.random((rows, cols // 32)) * 0.1).astype(np.float16)
    blocks = np.concatenate([d.view(np.uint8).reshape(rows, cols // 32, 2),
                             rng.integers(0, 256, (rows, cols // 32, 16), dtype=np.uint8)], axis=-1)
    return SimpleNamespace(tensor_type=GGMLQuantizationType.Q4_0, data=blocks.reshape(rows, -1),
                           shape=np.array([cols, rows]))


def fake_q4_1(rows: int, cols: int, seed: int = 0):
    """A Q4_1 tensor: per block of 32, an fp16 scale, an fp16 minimum and 16 bytes of nibbles."""
    rng = np.random.default_rng(seed)
    dm = (rng.random((rows, cols // 32, 2)) * 0.1 - 0.05).astype(np.float16)
    blocks = np.concatenate([dm.view(np.uint8).reshape(rows, cols // 32, 4),
                             rng.integers(0, 256, (rows, cols // 32, 16), dtype=np.uint8)], axis=-1)
    return SimpleNamespace(tensor_type=GGMLQuantizationType.Q4_1, data=blocks.reshape(rows, -1),
                           shape=np.array([cols, rows]))


def check_blocks(tensor, rows: int, cols: int) -> None:
    codes, scales, zeros = int4_blocks(tensor)
    reference = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).reshape(rows, cols).astype(np.float32))
    if cpu_quant.unavailable() is None:
        # our kernel keeps the block's float16 d and m themselves: the file's weights, exactly
        ours = Int4Linear(codes, scales, zeros, None, 32, torch.bfloat16, "llm")
        assert ours.kernel == "llm" and torch.equal(ours.codes(), codes)
        assert all(torch.equal(a, b) for a, b in zip(ours.groups(), (scales, zeros)))
        torch.testing.assert_close(kernel_weight(ours), reference, atol=1e-6 * float(reference.abs().max()), rtol=0)
    check_torch_kernel_blocks(codes, scales, zeros, reference, rows, cols)


def check_torch_kernel_blocks(codes, scales, zeros, reference, rows: int, cols: int) -> None:
    exact = Int4Linear(codes, scales, zeros, None, 32, torch.float32, "torch")
    # the file's codes are kept: reading them back gives them unchanged
    assert torch.equal(exact.codes(), codes)
    # with float32 scales the kernel multiplies by the GGUF's own dequantization (up to fp32 rounding
    # of (q - 8) d + (m + 8 d) against q d + m)
    torch.testing.assert_close(kernel_weight(exact), reference, atol=1e-6 * float(reference.abs().max()), rtol=0)
    # with bfloat16 scales (the fast path) the only change is the rounding of d and m + 8d to bfloat16
    fast = Int4Linear(codes, scales, zeros, None, 32, torch.bfloat16, "torch")
    assert torch.equal(fast.scales_and_zeros.float(), torch.stack([scales.t(), zeros.t()], -1).bfloat16().float())
    rounded = Int4Linear(codes, scales.bfloat16().float(), zeros.bfloat16().float(), None, 32, torch.float32, "torch")
    bound = (8 * scales.abs() + zeros.abs()) * 2**-8 + 1e-6  # bfloat16 keeps 8 significant bits
    error = (kernel_weight(rounded) - reference).abs().view(rows, cols // 32, 32).amax(-1)
    assert bool((error <= bound).all())


def test_q4_0_blocks_map_onto_int4_groups_without_requantizing():
    check_blocks(fake_q4_0(64, 96), 64, 96)


def check_direct_pack(tensor, rows: int, cols: int) -> None:
    """The file's rows packed in one pass are what unpacking and packing again gives, and a layer
    made from them on torch's kernel holds the same codes, d and m."""
    codes, scales, zeros = int4_blocks(tensor)
    symmetric = tensor.tensor_type.name == "Q4_0"
    expected = cpu_quant.pack_int4(codes, scales, None if symmetric else zeros - 8 * scales)
    packed = cpu_quant.gguf_q4_pack(torch.from_numpy(np.asarray(tensor.data).reshape(rows, -1).copy()), cols)
    assert (packed[2] is None) == symmetric
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(packed, expected))
    ours = Int4Linear.from_kernel_layout(*packed, rows, None, 32, torch.float32, "llm")
    theirs = Int4Linear.from_kernel_layout(*packed, rows, None, 32, torch.float32, "torch")
    assert (ours.kernel, theirs.kernel) == ("llm", "torch")
    assert torch.equal(ours.codes(), codes) and torch.equal(theirs.codes(), codes)
    assert all(torch.equal(a, b) for a, b in zip(theirs.groups(), (scales.half().float(), zeros)))


@pytest.mark.skipif(cpu_quant.unavailable() is not None, reason="needs our CPU kernels")
def test_q4_blocks_pack_into_the_kernel_layout_in_one_pass():
    check_direct_pack(fake_q4_0(48, 128, seed=3), 48, 128)
    if GGUF.is_file():
        reader = read_gguf(GGUF)
        check_direct_pack(next(t for t in reader.tensors if t.name == "blk.2.ffn_down.weight"), 576, 1536)
    with pytest.raises(RuntimeError, match="are not 3 Q4_0 .* or Q4_1"):
        cpu_quant.gguf_q4_pack(torch.zeros(4, 3 * 19, dtype=torch.uint8), 96)


@pytest.mark.skipif(cpu_quant.unavailable() is not None, reason="needs our CPU kernels")
@pytest.mark.parametrize("make", [fake_q4_0, fake_q4_1])
def test_q4_blocks_packed_into_huge_pages_are_the_same_tensors(make):
    """Packed into a region of huge pages, or into given outputs holding garbage, the file's
    blocks give the tensors a fresh pack gives (the last block's padding lanes zero too)."""
    rows, cols = 37, 64  # not a multiple of 16: the last block has padding lanes
    raw = torch.from_numpy(np.asarray(make(rows, cols, seed=5).data).reshape(rows, -1).copy())
    expected = cpu_quant.gguf_q4_pack(raw, cols)
    pages = cpu_quant.HugePages(1 << 16)
    packed = cpu_quant.gguf_q4_pack(raw, cols, pages)
    assert all(pages.holds(t) for t in packed if t is not None) and not pages.holds(expected[0])
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(packed, expected))
    # no room left: a fresh pack, the same tensors
    packed = cpu_quant.gguf_q4_pack(raw, cols, cpu_quant.HugePages(64))
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(packed, expected))
    garbage = [torch.full_like(t, 0x5A) if t.dtype == torch.uint8 else torch.full_like(t, float("nan"))
               for t in expected if t is not None]
    torch.ops.llm.gguf_q4_pack_out(raw, cols, *garbage[:2], garbage[2] if len(garbage) == 3 else None)
    assert all(torch.equal(a, b) for a, b in zip(garbage, expected))
    with pytest.raises(RuntimeError, match="mins are given for Q4_1 blocks, and only"):
        torch.ops.llm.gguf_q4_pack_out(raw, cols, *expected[:2], None if len(garbage) == 3 else expected[1])


def _smaps_field(address: int, field: str) -> list[str]:
    """The values of ``field`` (``"Rss:"``, ``"VmFlags:"``) of the mapping of this process that
    holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == field:
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _resident_bytes(address: int) -> int:
    """Resident bytes of the mapping of this process that holds ``address``."""
    return int(_smaps_field(address, "Rss:")[0]) * 1024


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="reads Linux's /proc/self/smaps")
def test_huge_pages_fault_in_what_is_placed_and_nothing_more():
    """A tensor placed in the region has its pages in memory at once (faulted in by one thread,
    before a parallel copy writes it), and the region's unused rest costs no memory."""
    pages = cpu_quant.HugePages(64 << 20)
    base = pages._arena.data_ptr()
    assert _resident_bytes(base) == 0
    view = pages.empty((3 << 20,), torch.uint8)
    resident = _resident_bytes(base)
    if not pages._populate:
        pytest.skip("this kernel cannot fault a range in (MADV_POPULATE_WRITE, Linux 5.14+)")
    assert 3 << 20 <= resident <= 8 << 20  # the 3 MB in huge pages (2 MB) or small ones, not 64 MB
    view.fill_(7)
    assert _resident_bytes(base) == resident and pages.copy(torch.ones(5)).sum() == 5


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    return set(_smaps_field(address, "VmFlags:"))


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="reads Linux's /proc/self/smaps")
def test_huge_pages_stop_at_the_last_whole_one_of_what_is_surely_filled():
    """Huge pages are advised up to the last whole huge page of the bytes known to be filled and
    not after it, where one would be taken whole for a part."""
    huge = cpu_quant.HUGE_PAGE
    pages = cpu_quant.HugePages(64 << 20, huge=3 * huge + 4096)
    base = pages._arena.data_ptr() + pages._used  # the first huge page boundary
    assert "hg" in _vm_flags(base) and "hg" in _vm_flags(base + 3 * huge - 1)
    assert "hg" not in _vm_flags(base + 3 * huge) and "hg" not in _vm_flags(base + (60 << 20))
    whole, none = cpu_quant.HugePages(8 << 20), cpu_quant.HugePages(8 << 20, huge=huge - 1)
    assert "hg" in _vm_flags(whole._arena.data_ptr() + whole._used + 3 * huge)  # all of nbytes by default
    assert "hg" not in _vm_flags(none._arena.data_ptr() + none._used)


@pytest.mark.skipif(cpu_quant.unavailable() is not None, reason="needs our CPU kernels")
def test_q8_0_blocks_pack_into_the_int8_layout_in_one_pass():
    """The file's Q8_0 rows packed in one pass (fresh, into huge pages, or into a slice of a larger
    table holding garbage) are pack_int8 of q8_0_blocks' codes, with its scales."""
    rows, cols = 45, 96
    tensor = fake_q8_0(rows, cols, seed=2)
    codes, scales = q8_0_blocks(tensor)
    raw = torch.from_numpy(np.asarray(tensor.data).reshape(rows, -1).copy())
    for packed in (cpu_quant.gguf_q8_pack(raw, cols), cpu_quant.gguf_q8_pack(raw, cols, cpu_quant.HugePages(1 << 16))):
        assert torch.equal(packed[0], cpu_quant.pack_int8(codes)) and torch.equal(packed[1], scales)
    table = torch.full((8, cols // 4, cpu_quant.LANES, 4), 7, dtype=torch.int8)
    part, part_scales = cpu_quant.gguf_q8_pack(raw[16:], cols, codes=table[2:4])
    assert part.data_ptr() == table[2:4].data_ptr() and torch.equal(part_scales, scales[16:])
    assert torch.equal(table[2:4], cpu_quant.pack_int8(codes[16:])) and bool((table[4:] == 7).all())
    with pytest.raises(RuntimeError, match="are not 3 Q8_0"):
        cpu_quant.gguf_q8_pack(torch.zeros(4, 3 * 33, dtype=torch.uint8), 96)


@needs_file
def test_q4_1_blocks_of_the_real_file_map_onto_int4_groups_without_requantizing():
    reader = read_gguf(GGUF)
    tensor = next(t for t in reader.tensors if t.name == "blk.0.attn_k.weight")
    assert tensor.tensor_type.name == "Q4_1"
    check_blocks(tensor, 192, 576)


@needs_file
def test_gguf_native_model_keeps_the_files_projections():
    model = load_gguf(GGUF, quantization="gguf")
    assert model.quantization.source == "gguf" and model.quantization.kept == {}
    reader = read_gguf(GGUF)
    sources = _sources(reader, gguf_config(reader))
    # the fused, unpermuted Wqkv of a layer: its codes are the file's q, k and v codes
    wqkv = model.blocks[3].attn.Wqkv
    assert isinstance(wqkv, Int4Linear) and wqkv.activation_dtype == default_activation_dtype()
    reference = _float(sources["blocks.3.attn.Wqkv.weight"], reader.path)
    exact = Int4Linear(wqkv.codes(), *wqkv.groups(), None, 32, torch.float32, "torch")
    error = float((kernel_weight(exact) - reference).abs().max())
    if wqkv.kernel == "llm":  # float16 d and m: the file's own
        assert error <= 1e-6 * float(reference.abs().max())
    else:  # bfloat16 scales: each weight within the rounding of its block's scale and zero
        assert error < 2**-8 * float(reference.abs().max()) * 9
    assert isinstance(model.lm_head, Int8Linear) and model.lm_head.weight is model.wte.weight
    ids = torch.tensor([[1, 504, 2660, 314, 253, 1953, 28, 2055, 2012, 3260]])
    with torch.no_grad():
        ours = model(ids).logits
        reference_logits = load_gguf(GGUF)(ids).logits
    # the same next tokens as the dequantized float32 model on this text
    assert torch.equal(ours.argmax(-1)[0, 3:], reference_logits.argmax(-1)[0, 3:])


def fake_q8_0(rows: int, cols: int, seed: int = 0):
    """A Q8_0 tensor as the gguf reader gives one: per block of 32, an fp16 scale and 32 int8 codes."""
    rng = np.random.default_rng(seed)
    d = (rng.random((rows, cols // 32)) * 0.01).astype(np.float16)
    blocks = np.concatenate([d.view(np.uint8).reshape(rows, cols // 32, 2),
                             rng.integers(-128, 128, (rows, cols // 32, 32), dtype=np.int8).view(np.uint8)], axis=-1)
    return SimpleNamespace(tensor_type=GGMLQuantizationType.Q8_0, data=blocks.reshape(rows, -1),
                           shape=np.array([cols, rows]))


@pytest.mark.parametrize("kernel", ["llm", "torch"])
def test_q8_0_blocks_map_onto_int8_groups_without_requantizing(kernel):
    if kernel == "llm" and cpu_quant.unavailable():
        pytest.skip(f"llm CPU kernels: {cpu_quant.unavailable()}")
    tensor = fake_q8_0(80, 96)
    codes, scales = q8_0_blocks(tensor)
    reference = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).reshape(80, 96).astype(np.float32))
    # the file's codes and scales: gguf's own dequantization, bit for bit
    assert codes.dtype == torch.int8 and scales.shape == (80, 3)
    assert torch.equal(int8_dequantize(codes, scales, torch.float32), reference)
    assert all(torch.equal(a, b) for a, b in zip(q8_0_blocks(tensor, slice(16, 48)), (codes[16:48], scales[16:48])))
    module = Int8Linear(codes, scales, None, torch.float32, backend=kernel)
    assert module.kernel == kernel and module.group_size == 32 and torch.equal(module.codes(), codes)
    tolerance = 1e-6 * float(reference.abs().max()) if kernel == "llm" else 0  # float32 products on torch's side
    torch.testing.assert_close(kernel_weight(module), reference, atol=tolerance, rtol=0)
    x = torch.randn(3, 96)
    expected = (int8_activations(x) if kernel == "llm" else x) @ reference.t()
    torch.testing.assert_close(module(x), expected, atol=1e-5 * float(expected.abs().max()), rtol=0)


def test_packed_group_scales_are_held_once_and_saved_loaded_moved_as_float32():
    """Q8_0's group scales on our kernel live only in its float16 lanes; the state dict, a load
    (checked like any buffer's), a cast and a move see float32 (rows, groups) as before."""
    from llm.quant.modules import Int8Embedding

    if cpu_quant.unavailable():
        pytest.skip(f"llm CPU kernels: {cpu_quant.unavailable()}")
    codes, scales = q8_0_blocks(fake_q8_0(40, 96))
    layer = Int8Linear(codes, scales, None, torch.float32)
    table = Int8Embedding(codes, scales)
    head = table.tied_head(torch.float32)
    x, ids = torch.randn(2, 96), torch.tensor([0, 39, 17])
    out, rows = layer(x), table(ids)
    for module in (layer, table, head):
        assert module.packed and module.scales_in_lanes and not hasattr(module, "scales")
        assert torch.equal(module.group_scales(), scales) and torch.equal(module.state_dict()["scales"], scales)
    assert head.kernel_scales is table.kernel_scales and torch.equal(head(x), out)
    wide = Int8Embedding(codes, scales.double())  # given in another dtype: saved and looked up in it
    assert wide.scales_in_lanes and wide.state_dict()["scales"].dtype == torch.float64
    assert torch.equal(wide.group_scales(), scales.double()) and wide(ids).dtype == torch.float64
    assert torch.equal(rows, int8_dequantize(codes, scales, torch.float32)[ids])
    with pytest.raises(RuntimeError, match="id 40 is outside the table's 40 rows"):  # lanes pad to 48
        table(torch.tensor([40]))
    # a load into a layer holding other values gives this one's outputs, and its scales only in lanes
    other = Int8Linear(codes.flip(0), scales.flip(0), None, torch.float32)
    other.load_state_dict(layer.state_dict())
    assert other.scales_in_lanes and torch.equal(other(x), out)
    with pytest.raises(RuntimeError, match="size mismatch for scales"):
        other.load_state_dict({**layer.state_dict(), "scales": scales[:, :2]})
    with pytest.raises(RuntimeError, match='Missing key.*"scales"'):
        other.load_state_dict({"weight": codes})
    # a cast there and back keeps the bits and the single copy
    for module, call, expected in ((layer, lambda m: m(x), out), (table, lambda m: m(ids), rows)):
        module.double().float()
        assert module.scales_in_lanes and module.kernel_scales.dtype == torch.float16
        assert torch.equal(call(module), expected)


@pytest.mark.parametrize("kernel", ["llm", "torch"])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_linears_multiply_by_their_dequantized_weights(method, kernel):
    if kernel == "llm" and cpu_quant.unavailable():
        pytest.skip(f"llm CPU kernels: {cpu_quant.unavailable()}")
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 64), torch.randn(96), torch.randn(2, 5, 64)
    module = (Int8Linear.from_float(weight, bias, torch.bfloat16, kernel) if method == "int8"
              else Int4Linear.from_float(weight, bias, 32, torch.bfloat16, kernel))
    assert module.kernel == kernel
    if method == "int8":
        dequantized = module.codes().float() * module.scales[:, None]
    else:
        codes, scales, zeros = int4_groups(weight, 32)
        dequantized = ((codes.float() - 8).view(96, 2, 32) * scales[..., None] + zeros[..., None]).view(96, 64)
        assert torch.equal(module.codes(), codes)
    # round to nearest: within half a step of the float weight
    step = (dequantized - weight).abs().max()
    assert float(step) < (0.5 / 127 if method == "int8" else 0.5 / 15) * float(weight.abs().max()) * 2 + 1e-6
    out = module(x)
    assert out.dtype == torch.float32 and out.shape == (2, 5, 96)
    if kernel == "llm":
        # int8 activations times the weight as the kernel holds it (int4: float16 scale and min)
        if method == "int4":
            held_scales, held_zeros = module.groups()
            assert torch.equal(held_scales, scales.half().float())
            dequantized = ((codes.float() - 8).view(96, 2, 32) * held_scales[..., None]
                           + held_zeros[..., None]).view(96, 64)
        reference = int8_activations(x) @ dequantized.t()
        torch.testing.assert_close(out - bias, reference, atol=1e-5 * float(reference.abs().max()), rtol=0)
    else:
        reference = x.bfloat16().float() @ dequantized.bfloat16().float().t()
        torch.testing.assert_close(out - bias, reference, atol=2**-7 * float(reference.abs().max()), rtol=0)


def test_layers_the_kernel_cannot_take_stay_float_and_are_reported(caplog):
    model = tiny_model("llama", d_model=48, n_heads=4, kv_n_heads=2)  # in_features 48: no int4 group of 32
    with caplog.at_level(logging.WARNING):
        quantize(model, "int4")
    kept = model.quantization.kept
    assert set(kept) == {f"blocks.{i}.{m}" for i in range(2) for m in ("attn.Wqkv", "attn.out_proj", "ffn.gate_proj",
                                                                        "ffn.up_proj")}
    assert all("not a multiple of group_size 32" in why for why in kept.values())
    assert isinstance(model.blocks[0].ffn.down_proj, Int4Linear)  # in_features 192
    assert "stay in floating point" in caplog.text and "blocks.0.attn.Wqkv" in caplog.text
    assert torch.isfinite(model(torch.randint(0, 61, (1, 5))).logits).all()


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("scheme", ["learned", "llama"])  # tied and untied output layers
def test_quantized_bundles_load_back_to_the_same_logits(tmp_path, method, scheme):
    float_model = tiny_model(scheme)
    float_model.save_pretrained(tmp_path / "float")
    model = quantize(tiny_model(scheme), method)
    ids = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        expected = model(ids).logits
        model.save_pretrained(tmp_path / "q")
        loaded = MosaicGPT.from_pretrained(tmp_path / "q")
        assert loaded.quantization.to_dict() == model.quantization.to_dict()
        assert torch.equal(loaded(ids).logits, expected)
        assert loaded.identity() == model.identity()
        # quantizing while loading a float bundle is quantizing after loading it
        assert torch.equal(MosaicGPT.from_pretrained(tmp_path / "float", quantization=method)(ids).logits, expected)
    spec = json.loads((tmp_path / "q" / "quantization.json").read_text())
    assert spec["method"] == method
    # saved again in float, the folder forgets its quantization
    float_model.save_pretrained(tmp_path / "q")
    assert not (tmp_path / "q" / "quantization.json").exists()
    assert MosaicGPT.from_pretrained(tmp_path / "q").quantization is None


def test_quantization_errors_name_the_problem(tmp_path):
    model = tiny_model()
    with pytest.raises(ValueError, match=r"quantization method must be one of \('int8', 'int4'\), got 'int3'"):
        quantize(model, "int3")
    with pytest.raises(ValueError, match="group_size must be one of"):
        quantize(model, "int4", group_size=48)
    quantize(model, "int8")
    with pytest.raises(ValueError, match="already quantized"):
        quantize(model, "int4")
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="holds int8 weights"):
        MosaicGPT.from_pretrained(tmp_path, quantization="int4")
    with pytest.raises(ValueError, match="keeps a GGUF file's own quantization; .* is a bundle: load a .gguf file, "
                                         "or quantize the bundle with \"int8\" or \"int4\""):
        MosaicGPT.from_pretrained(tmp_path, quantization="gguf")
    with pytest.raises(ValueError, match="quantization must be one of"):
        MosaicGPT.from_pretrained(tmp_path, quantization="q4")
    (tmp_path / "quantization.json").write_text('{"method": "int8"')
    with pytest.raises(ValueError, match="cannot read .*quantization.json"):
        MosaicGPT.from_pretrained(tmp_path)
    # a float bundle whose quantization.json claims a layer is int8
    tiny_model().save_pretrained(tmp_path / "plain")
    (tmp_path / "plain" / "quantization.json").write_text(json.dumps(
        {"method": "int8", "group_size": 32, "activation_dtype": "bfloat16", "quantized": ["blocks.0.attn.Wqkv"],
         "kept": {}}))
    with pytest.raises(ValueError, match=r"do not fit its quantization.json: blocks.0.attn.Wqkv.weight: expected "
                                         r"torch.int8"):
        MosaicGPT.from_pretrained(tmp_path / "plain")


@torch.no_grad()
def test_a_quantized_model_casts_and_keeps_working():
    model = quantize(tiny_model("llama"), "int4")
    ids = torch.randint(0, 61, (1, 7))
    before = model(ids).logits
    model.to(torch.float16)
    # the residual stream is cast, the kernel's activations stay bfloat16 (float16 or float32 ones
    # would take a slow path)
    wqkv = model.blocks[0].attn.Wqkv
    kernel_dtype = wqkv.kernel_scales.dtype if wqkv.kernel == "llm" else wqkv.scales_and_zeros.dtype
    assert model.dtype == torch.float16 and kernel_dtype == (torch.float16 if wqkv.kernel == "llm" else torch.bfloat16)
    after = model(ids).logits
    assert after.dtype == torch.float16
    # a float16 residual stream: close to the float32 one, not equal
    torch.testing.assert_close(after.float(), before, atol=0.15 * float(before.abs().max()), rtol=0)


@torch.no_grad()
def test_torchs_int8_kernel_takes_float32_activations_where_bfloat16_would_misread():
    # torch 2.7's CPU int8 kernel with bfloat16 activations and in_features % 16 != 0 gave wrong
    # rows (from 1 row) or a segfault (from 18 rows)
    torch.manual_seed(0)
    for in_features in (40, 100):
        weight, x = torch.randn(96, in_features), torch.randn(18, in_features)
        layer = Int8Linear.from_float(weight, None, torch.bfloat16, "torch")
        assert layer.kernel_scales.dtype == torch.float32
        reference = x @ (layer.codes().float() * layer.scales[:, None]).t()
        torch.testing.assert_close(layer(x), reference, atol=1e-5 * float(reference.abs().max()), rtol=0)


@pytest.mark.parametrize("ours", [False, True])
def test_int8_kernel_scales_follow_loaded_and_cast_scales(ours):
    if ours and cpu_quant.unavailable():
        pytest.skip(f"llm CPU kernels: {cpu_quant.unavailable()}")
    backend = "llm" if ours else "torch"
    layer = Int8Linear.from_float(torch.randn(64, 32), None, torch.bfloat16, backend)
    other = Int8Linear.from_float(4 * torch.randn(64, 32), None, torch.bfloat16, backend)
    x = torch.randn(3, 32)
    layer.load_state_dict(other.state_dict())
    assert "kernel_scales" not in layer.state_dict()  # a cast copy, not saved
    torch.testing.assert_close(layer(x), other(x), atol=0, rtol=0)
    layer.to(torch.float16)  # the kernel's own dtypes stay: torch's bfloat16 activations, our float32 scales
    expected = torch.float32 if layer.kernel == "llm" else torch.bfloat16
    assert layer.kernel_scales.dtype == expected and layer(x.half()).dtype == torch.float16


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("tied", [True, False])
def test_a_quantized_model_counts_the_parameters_it_was_made_from(method, tied):
    """Packed and padded kernel layouts count as the logical (out x in) weights, a tied head once."""
    from tests.conftest import tiny_model

    float_model = tiny_model("llama", vocab_size=29, tie_word_embeddings=tied)
    quantized = tiny_model("llama", vocab_size=29, tie_word_embeddings=tied, quantization=method)
    assert quantized.num_parameters() == float_model.num_parameters()
