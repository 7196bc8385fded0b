"""Shared fixtures: tiny models of every position scheme and attention implementation."""

import resource

import pytest
import torch
from streaming.base import dataset as streaming_dataset
from streaming.base.shared import prefix as streaming_prefix

from llm import MosaicGPT, MosaicGPTConfig
from llm.quant import Int4Linear, Int8Linear, quantize
from llm.quant.quantize import projections
from llm.utils.home import use_inductor_cache

# The test models are tiny: one thread is faster than two, and immune to a busy second core
# (two spinning OpenMP threads on a shared core made small forwards 30x slower here).
torch.set_num_threads(1)

# Every worker and the processes it starts compile into the one inductor cache of this CPU model,
# whichever test compiles first (generation and training both point there, and a test may do either).
use_inductor_cache()

# Every Streaming dataset attaches the shared memory of every earlier dataset's prefix and keeps it
# open for the life of the process: over a whole suite that outgrows a default limit of 1024 files.
_soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (_hard, _hard))


def _probe_without_atexit(name=None, create=None, size=0, auto_cleanup=True):
    """Streaming's prefix search (and resume lookup) attaches shared memory only to read it,
    and registers each attachment for cleanup at exit, which keeps its file open until then: the
    attachments grow as the square of the datasets a process makes. Its own creations keep their
    cleanup; what it merely attaches closes when the search lets go of it."""
    return _StreamingSharedMemory(name, create, size, auto_cleanup=auto_cleanup and create is not False)


_StreamingSharedMemory = streaming_prefix.SharedMemory
streaming_prefix.SharedMemory = _probe_without_atexit
streaming_dataset.SharedMemory = _probe_without_atexit  # its resume-state lookup, at every epoch

@pytest.fixture(scope="session")
def cpu_kernels():
    """Our CPU kernels, built (once, at the first test that needs them, not at collection) or the
    test skipped with the reason they cannot run here (shown in the summary: ``-rs``)."""
    from llm.kernels import cpu_quant

    reason = cpu_quant.unavailable()
    if reason is not None:
        pytest.skip(f"llm CPU kernels cannot run here: {reason}")
    return cpu_quant


POSITION_SCHEMES = {
    "learned": dict(learned_pos_emb=True),
    "alibi": dict(learned_pos_emb=False, alibi=True),
    "rope": dict(learned_pos_emb=False, rope=True),
    # Llama-style: rotary, grouped-query attention, SwiGLU, RMSNorm, no biases, untied head.
    "llama": dict(learned_pos_emb=False, rope=True, kv_n_heads=2, ffn_type="glu", ffn_act="silu",
                  norm_type="rmsnorm", no_bias=True, tie_word_embeddings=False),
    # modded-nanogpt's recipe: rotary, QK-norm, a ReLU^2 MLP, RMSNorm, untied head, soft-capped logits
    "recipe": dict(learned_pos_emb=False, rope=True, qk_norm=True, ffn_type="mlp", ffn_act="relu2",
                   norm_type="rmsnorm", no_bias=True, tie_word_embeddings=False, logit_softcap=15.0),
}


#: Weight modes every cache path is tested in: float, and the weight-only quantized ones (llm.quant).
QUANTIZATIONS = [None, "int8", "int4"]


def tiny_model(scheme: str = "learned", attn_impl: str = "torch", seed: int = 0, quantization: str | None = None,
               kernels: str = "auto", **overrides) -> MosaicGPT:
    """A randomly initialised 2-layer model in eval mode (weights scaled up so logits vary),
    quantized by ``llm.quant.quantize`` when ``quantization`` is "int8" or "int4", with
    ``kernels`` as its ``backend``: ``"auto"`` (ours where they run), ``"torch"`` or ``"llm"``;
    "q8_0": "int8" with the projections in groups of 32 with float16 scales (GGUF Q8_0's blocks,
    as a Q8_0 file loads); "q4_0": "int4" with symmetric groups of 32 (Q4_0's ``(q - 8) d``).

    On our kernels a Llama model's forwards are bit-identical whatever the cache, chunking or
    batch (tests/quant/test_invariance.py); the other schemes run their attention through torch's
    paths, whose cached and uncached arithmetic differ in the last bits, which int8 activations can
    round to the next code: their tests of token identity take torch's kernels."""
    torch.manual_seed(seed)
    options = dict(vocab_size=61, max_seq_len=96, d_model=32, n_heads=4, n_layers=2, attn_impl=attn_impl,
                   init_std=0.2)
    options.update(POSITION_SCHEMES[scheme])
    options.update(overrides)
    model = MosaicGPT(MosaicGPTConfig(**options)).eval()
    if quantization is None:
        return model
    if quantization not in ("q8_0", "q4_0"):
        return quantize(model, quantization, backend=kernels)
    weights = {name: model.get_submodule(name).weight.detach().clone() for name in projections(model)}
    quantize(model, "int8" if quantization == "q8_0" else "int4", backend=kernels)
    for name, weight in weights.items():  # llama.cpp's quantize_row_q8_0 / q4_0: d = max |w| / 127 or 8 per 32
        layer, groups = model.get_submodule(name), weight.view(weight.shape[0], -1, 32)
        scales = (groups.abs().amax(-1) / (127 if quantization == "q8_0" else 8)).half().float()
        codes = torch.round(groups / torch.where(scales == 0, 1, scales)[..., None]).view(weight.shape)
        if quantization == "q8_0":
            module = Int8Linear(codes.to(torch.int8), scales, layer.bias, layer.activation_dtype, backend=kernels)
        else:
            module = Int4Linear((codes + 8).clamp(0, 15).to(torch.uint8), scales, torch.zeros_like(scales), layer.bias,
                                32, layer.activation_dtype, kernels)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, module)
    return model


@pytest.fixture(params=[(s, i) for s in POSITION_SCHEMES for i in ("torch", "sdpa")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def model(request):
    scheme, impl = request.param
    return tiny_model(scheme, impl)


@pytest.fixture
def threads(request):
    """Run a test with ``request.param`` torch threads (parametrize with indirect=True), then one again.

    Decoding-sized products of wide weights are split across threads (``llm.layers.linear``), a
    path the single-threaded suite would otherwise never take.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """Tiny Shakespeare (three training plays, the four validation plays, cut short) prepared into
    char-level token shards of 64-token rows; shared by the training tests."""
    from tests.train_helpers import make_tiny_data

    return make_tiny_data(tmp_path_factory.mktemp("tiny-data"))
