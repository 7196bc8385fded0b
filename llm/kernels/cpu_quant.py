"""Our own int4 and int8 weight-only matmuls, attention and Llama blocks for x86-64 CPUs with AVX2
or AVX512-VNNI (``cpu_quant.cpp``, ``cpu_quant_simd.h``).

The method is llama.cpp's (ggml-cpu's Q4_1 x Q8_0 and Q8_0 x Q8_0 dot products): each token's
activations are quantized to int8 in groups of 32 inputs (scale ``max |x| / 127``), the products
are integer dot products, and the float scales are applied per group of 32 (an int4 group's min
multiplies the sum of the quantized activations, ggml's Q8_1 ``s``). The lanes of a vector
are 16 output features, so the weights are read once per tile of 8 tokens and stream at the
memory bandwidth for one token. Each token's row is computed alone, and attention reduces each
query's keys in an order counted from its first key: results do not depend on the batch, the
prompt length, the cache or the threads, to the bit.

The source is compiled by :func:`build` (``make install`` runs it; otherwise the first use does,
about 30 s) with :func:`torch.utils.cpp_extension.load`, cached on disk under
``$LLM_HOME/kernels`` (default ``~/.cache/llm/kernels``, :func:`build_directory`), for both instruction sets; the
CPU picks one when the operators run (:func:`isa`). It registers ``torch.ops.llm.int4_linear``,
``int8_linear``, ``rms_norm``, ``decode_attention``, ``decoder_blocks`` (Llama blocks over a
cache buffer in one call), ``argmax_rows`` and ``sample_row`` (picking the next token), with fake
implementations, so ``torch.compile`` calls them as they are.
Which layers use them is the model's choice, made when it is quantized (``backend`` of
:func:`llm.quant.quantize`); :func:`unavailable` says why they cannot run here.

Layouts (``N`` outputs padded to blocks of 16, ``K`` inputs, ``G`` the int4 group size):

- int4: codes ``(ceil(N / 16), K / 8, 16, 4)`` uint8 (two 4-bit codes a byte), scales and mins
  ``(ceil(N / 16), K / G, 16)`` float16, ``w = q * scale + min`` (GGUF Q4_1's convention); or
  scales alone for symmetric codes, ``min = -8 * scale`` (GGUF Q4_0's ``w = (q - 8) d``).
- int8: codes ``(ceil(N / 16), K / 4, 16, 4)`` int8, scales ``(16 * ceil(N / 16),)`` float32,
  ``w = q * scale``; or scales in groups of ``G`` inputs, ``(ceil(N / 16), K / G, 16)`` float16
  (GGUF Q8_0's blocks, ``G = 32``, run as the file holds them).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import logging
import math
import mmap
import time
import warnings
from pathlib import Path

import torch

from llm.utils.home import llm_home
from llm.utils.memory import fault_in as _fault_in

LANES = 16
GROUP = 32
_SOURCES = (Path(__file__).with_name("cpu_quant.cpp"), Path(__file__).with_name("cpu_quant_simd.h"))

log = logging.getLogger(__name__)

#: How long a build directory's lock may stand before it counts as left by a killed build (a
#: build takes about 30 s; torch's lock would otherwise be waited on forever).
STALE_LOCK_S = 300


def extension_name(sources: tuple[Path, ...] = _SOURCES) -> str:
    """The extension's name: a hash of its sources and torch's version, so an edit rebuilds it."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources) + torch.__version__.encode()).hexdigest()
    return f"llm_cpu_quant_{digest[:12]}"


def build_directory(name: str) -> Path:
    """Where the extension ``name`` is built: ``$LLM_HOME/kernels/<name>`` (see :mod:`llm.utils.home`)."""
    return llm_home() / "kernels" / name


def build(sources: tuple[Path, ...] = _SOURCES) -> str | None:
    """Load the extension, compiling it first if this machine has no build of these sources
    (cached on disk by their contents); returns why that failed, as a sentence, after one
    warning, or None. A finished build loads without importing ``torch.utils.cpp_extension``
    (a second of imports)."""
    name = extension_name(sources)
    folder = build_directory(name)
    library = folder / f"{name}.so"
    if library.is_file() and not (folder / "lock").exists():
        try:
            torch.ops.load_library(str(library))
            return None
        except OSError:  # a library left half-written by a killed build: build it again
            library.unlink(missing_ok=True)
    with contextlib.redirect_stderr(io.StringIO()):  # its import prints a CUDA_HOME notice
        from torch.utils import cpp_extension

    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = folder / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            log.warning("removing %s, left by a build that was killed %.0f s ago", lock, time.time() - lock.stat().st_mtime)
            lock.unlink(missing_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # -fopenmp: without it at::parallel_for's pragma is ignored and the kernels run on one thread
            cpp_extension.load(name=name, sources=[str(sources[0])], extra_cflags=["-O3", "-fopenmp"],
                               extra_ldflags=["-fopenmp"], build_directory=str(folder), is_python_module=False,
                               verbose=False)
    except (RuntimeError, OSError, ImportError) as err:
        # ninja's last lines only say that it stopped: keep the compiler's own last line
        detail = [line for line in str(err).strip().splitlines()
                  if line.strip() and not line.startswith(("ninja:", "FAILED:", "[", "Error building extension"))]
        reason = f"building {sources[0].name} failed ({detail[-1].strip() if detail else str(err).strip() or type(err).__name__})"
        warnings.warn(f"llm's CPU kernels are not used: {reason}; quantized layers take torch's kernels", stacklevel=2)
        return reason
    return None


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why the kernels cannot run on this machine (a sentence), or None once they are built and
    loaded (the first call builds them if ``make install`` has not)."""
    reason = build()
    if reason is not None:
        return reason
    if not torch.ops.llm.cpu_isa():
        return "this CPU has neither AVX2 (with FMA and F16C) nor AVX512-VNNI"
    _register_fakes()
    return None


def loaded() -> bool:
    """Whether the kernels are built and loaded in this process already (asking starts no build)."""
    return unavailable.cache_info().currsize > 0 and unavailable() is None


def isa() -> str | None:
    """The instruction set the kernels run with here: ``"avx512"`` (AVX512-VNNI) or ``"avx2"``;
    None where they cannot run (:func:`unavailable`)."""
    return None if unavailable() is not None else torch.ops.llm.cpu_isa()


def available(device: torch.device | str = "cpu") -> bool:
    """Whether the kernels run on ``device``: a CPU on which they are built and supported."""
    return torch.device(device).type == "cpu" and unavailable() is None


_changes = 0


def changed() -> None:
    """Note that a module whose tensors the fused blocks read has changed (a submodule or
    parameter set, kernel tensors remade by a load, a move or a cast): what a block keeps for
    :func:`decoder_blocks` is looked up again (:meth:`llm.layers.blocks.MosaicGPTBlock.fused_weights_for`)."""
    global _changes
    _changes += 1


def changes() -> int:
    """How many times :func:`changed` has been called in this process."""
    return _changes


class Watched:
    """A mixin for ``nn.Module`` classes whose attributes the fused blocks read: setting any
    attribute (a submodule swapped, a parameter replaced) calls :func:`changed`."""

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        changed()


def _register_fakes() -> None:
    @torch.library.register_fake("llm::int4_linear")
    def _(x, codes, scales, mins, group_size, n):
        return x.new_empty((x.shape[0], n), dtype=torch.float32)

    @torch.library.register_fake("llm::int8_linear")
    def _(x, codes, scales, n):
        return x.new_empty((x.shape[0], n), dtype=torch.float32)

    @torch.library.register_fake("llm::int8_embedding")
    def _(codes, scales, ids, rows=-1):
        return scales.new_empty((*ids.shape, codes.shape[1] * 4), dtype=torch.float32)

    @torch.library.register_fake("llm::argmax_rows")
    def _(x):
        return x.new_empty(x.shape[:1], dtype=torch.int64)

    @torch.library.register_fake("llm::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("llm::decode_attention")
    def _(q, k, v, mask, scale, bias):
        return q.new_empty(q.shape, dtype=torch.float32)

    @torch.library.register_fake("llm::decoder_blocks")
    def _(x, norms, eps, weights, out_features, cos, sin, k_caches, v_caches, cache_position, mask, n_heads, scale):
        return torch.empty_like(x, memory_format=torch.contiguous_format)


def supports(out_features: int, in_features: int, group_size: int | None = None) -> str | None:
    """Why an (out_features, in_features) weight cannot take these kernels, or None if it can
    (the int4 group size, when given, must be a multiple of 32 dividing ``in_features``)."""
    if in_features % GROUP:
        return f"in_features {in_features} is not a multiple of {GROUP}"
    if group_size is not None and (group_size % GROUP or in_features % group_size):
        return f"group_size {group_size} is not a multiple of {GROUP} dividing in_features {in_features}"
    return None


def _blocks(rows: torch.Tensor) -> torch.Tensor:
    """(N, ...) -> (ceil(N / 16), 16, ...), zero rows appended."""
    n = rows.shape[0]
    pad = -n % LANES
    if pad:
        rows = torch.cat([rows, rows.new_zeros((pad, *rows.shape[1:]))])
    return rows.reshape(-1, LANES, *rows.shape[1:])


def pack_int4(codes: torch.Tensor, scales: torch.Tensor,
              mins: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The int4 layout of the module docstring from codes (N, K) in [0, 15] and per-group
    ``scales``, ``mins`` (N, K / G) of any float dtype (rounded to float16); ``mins`` None for
    symmetric codes (``min = -8 * scale``, GGUF Q4_0's), which the kernel then does not read."""
    k = codes.shape[1]
    q = _blocks(codes.to(torch.uint8)).view(-1, LANES, k // 8, 2, 4).permute(0, 2, 1, 3, 4)
    packed = (q[..., 0, :] | (q[..., 1, :] << 4)).contiguous()
    return packed, _group_lanes(scales), None if mins is None else _group_lanes(mins)


def gguf_q4_pack(blocks: torch.Tensor, in_features: int,
                 pages: HugePages | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GGUF Q4_0 / Q4_1 rows as the file holds them, uint8 (rows, in_features / 32 * 18 or 20),
    straight into the int4 layout: (codes, scales, mins), the mins None for Q4_0 (symmetric). The
    same tensors as :func:`pack_int4` of the unpacked codes, d and (Q4_1) m, in one pass; written
    into ``pages`` (:class:`HugePages`) where they fit.

    Raises:
        RuntimeError: rows that are not whole Q4_0 or Q4_1 blocks, or without the kernels.
    """
    _require()
    rows, q4_1 = blocks.shape[0], blocks.shape[1] == in_features // 32 * 20
    shapes = [(-(-rows // LANES), in_features // 8, LANES, 4), (-(-rows // LANES), in_features // 32, LANES)]
    out = _outputs(pages, [*zip(shapes, (torch.uint8, torch.float16)), *[(shapes[1], torch.float16)] * q4_1])
    if out is None:
        packed = torch.ops.llm.gguf_q4_pack(blocks, in_features)
        return packed[0], packed[1], packed[2] if len(packed) == 3 else None
    torch.ops.llm.gguf_q4_pack_out(blocks, in_features, *out[:2], out[2] if q4_1 else None)
    return out[0], out[1], out[2] if q4_1 else None


def gguf_q8_pack(blocks: torch.Tensor, in_features: int, pages: HugePages | None = None,
                 codes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q8_0 rows as the file holds them, uint8 (rows, in_features / 32 * 34), straight into
    our int8 layout: (codes int8 (ceil(rows / 16), in_features / 4, 16, 4) as :func:`pack_int8`'s,
    scales float32 (rows, in_features / 32), each the file's fp16 d). The codes go into ``codes``
    when given (a slice of blocks of a larger table), else into ``pages`` (:class:`HugePages`) where
    they fit.

    Raises:
        RuntimeError: rows that are not whole Q8_0 blocks, or without the kernels.
    """
    _require()
    rows = blocks.shape[0]
    if codes is None:
        codes = pages.empty((-(-rows // LANES), in_features // 4, LANES, 4), torch.int8) if pages is not None else None
    if codes is None:
        return tuple(torch.ops.llm.gguf_q8_pack(blocks, in_features))
    scales = torch.empty((rows, in_features // 32), dtype=torch.float32)
    torch.ops.llm.gguf_q8_pack_out(blocks, in_features, codes, scales)
    return codes, scales


def _outputs(pages: HugePages | None, specs) -> list[torch.Tensor] | None:
    """Tensors of (shape, dtype) ``specs`` side by side in ``pages``, or None where there are no
    pages or they do not all fit."""
    if pages is None or sum(math.prod(shape) * dtype.itemsize + 64 for shape, dtype in specs) > pages.left():
        return None
    return [pages.empty(shape, dtype) for shape, dtype in specs]


def _group_lanes(values: torch.Tensor) -> torch.Tensor:
    return _blocks(values.to(torch.float16)).transpose(1, 2).contiguous()


def unpack_int4(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_int4`: codes uint8 (n, K), scales and mins float16 (n, K / G)
    (``-8 * scales`` for symmetric codes, ``mins`` None)."""
    blocks, steps = packed.shape[:2]
    q = torch.stack([packed & 0x0F, packed >> 4], dim=3)  # (blocks, K / 8, 16, 2, 4)
    codes = q.permute(0, 2, 1, 3, 4).reshape(blocks * LANES, steps * 8)[:n]

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(blocks * LANES, -1)[:n]

    return codes, rows(scales), rows(-8 * scales if mins is None else mins)


def pack_int8(codes: torch.Tensor) -> torch.Tensor:
    """The int8 layout of codes int8 (N, K)."""
    k = codes.shape[1]
    return _blocks(codes).view(-1, LANES, k // 4, 4).transpose(1, 2).contiguous()


def lane_scales(scales: torch.Tensor) -> torch.Tensor:
    """An int8 weight's ``scales`` as the kernel takes them: per row (N,) as float32
    (16 * ceil(N / 16),); in groups of G inputs (N, K / G) as float16 (ceil(N / 16), K / G, 16)."""
    return _group_lanes(scales) if scales.dim() == 2 else _blocks(scales.float()).reshape(-1).contiguous()


def unlane_scales(lanes: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`lane_scales` for scales in groups: float16 lanes (ceil(N / 16), K / G, 16)
    -> float32 (n, K / G), the values the kernel multiplies by."""
    return lanes.transpose(1, 2).reshape(-1, lanes.shape[1])[:n].float()


def unpack_int8(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_int8` for the codes: int8 (n, K)."""
    blocks, steps = packed.shape[:2]
    return packed.transpose(1, 2).reshape(blocks * LANES, steps * 4)[:n]


def gather_int8_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (any shape, int64) of a packed int8 table: int8 (*ids.shape, K) (an embedding
    lookup that needs no second, unpacked copy of a tied table)."""
    steps = packed.shape[1]
    return packed[ids // LANES, :, ids % LANES].reshape(*ids.shape, steps * 4)


def int8_embedding(packed: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, rows: int = -1) -> torch.Tensor:
    """Rows ``ids`` (any shape, int64) of a packed int8 table times their ``scales``: float32, one
    per row (rows,) or per group of G inputs (rows, K / G), or in groups as the int8 kernel holds
    them (:func:`lane_scales`' float16 (ceil(rows / 16), K / G, 16), with ``rows`` given: lanes pad
    the last 16): float32 (*ids.shape, K), the bits of
    ``gather_int8_rows(packed, ids).float() * scales[ids, None]`` (groups: each scale repeated G
    times) in one call.

    Raises:
        RuntimeError: an id outside the table, or another layout or dtype.
    """
    _require()
    return torch.ops.llm.int8_embedding(packed, scales, ids, rows)


#: Transparent huge pages' size on x86-64: a region aligned to it can be backed by them.
HUGE_PAGE = 2 << 20


class HugePages:
    """A region of ``nbytes`` in transparent huge pages, where tensors are copied side by side.

    A decoding step streams every weight once: in 4 KB pages SmolLM2's 60 MB of blocks are 15,000
    page walks a token, each dearer in a virtual machine (nested paging). The region is an
    anonymous mapping advised for huge pages (``madvise(MADV_HUGEPAGE)``, which Linux's default
    ``madvise`` mode honours) and aligned to them; its pages are taken as tensors are copied in, so
    an unused rest costs no memory. Where the platform has no huge pages the copies are made all
    the same (4 KB pages).

    Each tensor's pages are faulted in when it is placed, by the thread that places it
    (:func:`llm.utils.memory.fault_in`): faulted instead by the threads of the parallel copy that writes them,
    SmolLM2's GGUF load took 0.2-0.28 s rather than 0.15 (median of 8 paired runs on a Zen 4
    guest; the difference is the kernel's page zeroing).
    """

    def __init__(self, nbytes: int, huge: int | None = None):
        """``huge``: the bytes from the start known to be filled (default ``nbytes``): huge pages
        up to the last whole one of them, small pages after it, where a huge page would be taken
        whole for a part of it (1.7 MiB of SmolLM2's Q4_1 file)."""
        self._region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._arena = torch.frombuffer(self._region, dtype=torch.uint8)
        self._used = -self._arena.data_ptr() % HUGE_PAGE  # from the first huge page boundary
        if hasattr(mmap, "MADV_HUGEPAGE"):
            tail = self._used + min(nbytes if huge is None else huge, nbytes) // HUGE_PAGE * HUGE_PAGE
            if tail:
                self._region.madvise(mmap.MADV_HUGEPAGE, 0, tail)
        self._populate = True  # until the platform says it cannot (llm.utils.memory.fault_in)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialized tensor in the region, at a 64-byte boundary (a storage of its own over
        the region's memory, which it keeps mapped), or None if it no longer fits."""
        count = math.prod(shape)
        size = count * dtype.itemsize
        if self._used + size > self._arena.numel():
            return None
        if not size:
            return torch.empty(shape, dtype=dtype)
        # not a view of the region's uint8 storage: torch.save and pickle write each tensor alone,
        # where they refused views of one storage as several dtypes, or wrote the whole region for each
        view = torch.frombuffer(self._region, dtype=dtype, count=count, offset=self._used).view(shape)
        if self._populate:
            start = self._used // mmap.PAGESIZE * mmap.PAGESIZE
            self._populate = _fault_in(self._arena.data_ptr() + start, self._used + size - start)
        self._used += -(-size // 64) * 64
        return view

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies in the region."""
        start = self._arena.data_ptr()
        return start <= tensor.untyped_storage().data_ptr() < start + self._arena.numel()

    def left(self) -> int:
        """Bytes still free in the region."""
        return self._arena.numel() - self._used

    def copy(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """A copy of the CPU ``tensor`` in the region (see :meth:`empty`), or None if it no longer fits."""
        view = self.empty(tuple(tensor.shape), tensor.dtype)
        return None if view is None else view.copy_(tensor)


def _require() -> None:
    """Build and load the kernels before a direct call (a traced call finds them loaded)."""
    if not torch.compiler.is_compiling():
        why = unavailable()
        if why is not None:
            raise RuntimeError(f"llm's CPU kernels cannot run here: {why}")


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                group_size: int, n: int) -> torch.Tensor:
    """``x @ w.T`` for a packed int4 weight: x (rows, K) float32 or bfloat16 -> (rows, n) float32
    (``mins`` None: symmetric codes, see :func:`pack_int4`)."""
    _require()
    return torch.ops.llm.int4_linear(x, packed, scales, mins, group_size, n)


def int8_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """``x @ w.T`` for a packed int8 weight: x (rows, K) float32 or bfloat16 -> (rows, n) float32;
    ``scales`` per row or in groups, as :func:`lane_scales` gives them."""
    _require()
    return torch.ops.llm.int8_linear(x, packed, scales, n)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` of float32 (rows, n) logits on the CPU, the same indices (the first of
    equal largest values, the first NaN of a row that has one) in one pass, several times faster
    than torch's reduction over a vocabulary; torch's own elsewhere (other devices and dtypes, a
    traced call, kernels not loaded yet: this starts no build): (rows,) int64."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or not x.shape[1]
            or torch.compiler.is_compiling() or not loaded()):
        return x.argmax(-1)
    return torch.ops.llm.argmax_rows(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dimension, float32 (..., d) and (d,):
    the fused blocks' norm, each row's mean of squares summed in double (so a row's result does
    not depend on the other rows). Raises RuntimeError on other dtypes or shapes."""
    _require()
    return torch.ops.llm.rms_norm(x, weight, eps)


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of a few queries over a cache buffer, in one pass per query and head.

    Args:
        query: (batch, n_heads, seq_q, head_dim) float32; head_dim a multiple of 16 up to 128.
        key, value: (batch, kv_n_heads, seq_k, head_dim) float32 (query head h reads kv head
            h // (n_heads / kv_n_heads), grouped-query attention).
        mask: (batch, seq_q, seq_k) bool, True for the keys each query may see (a static cache's
            causal and padding mask over its whole buffer).
        scale: the scores' factor (1 / sqrt(head_dim) for the usual attention).
        bias: (batch, n_heads, seq_q, seq_k) additive bias of the scores (ALiBi), or None.

    Returns:
        (batch, n_heads, seq_q, head_dim) float32: ``softmax(q k^T * scale + bias)`` over the
        allowed keys, times v; zeros for a query that may see no key (or whose scores are all
        -inf). Keys masked out are never read. Equals :func:`llm.layers.attention.attention_heads`'s
        float32 path up to rounding (its exp is Cephes' polynomial, about 1 ulp) for finite
        biases. No gradient: inference only.

    Raises:
        RuntimeError: on shapes or dtypes other than these, or without the kernels (:func:`unavailable`).
    """
    _require()
    return torch.ops.llm.decode_attention(query, key, value, mask, scale, bias)



def decoder_blocks(x: torch.Tensor, norms: list[torch.Tensor], eps: float, weights: list[torch.Tensor | None],
                   out_features: list[int], cos: torch.Tensor | None, sin: torch.Tensor | None,
                   k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], cache_position: torch.Tensor,
                   mask: torch.Tensor, n_heads: int, scale: float) -> torch.Tensor:
    """Consecutive pre-norm Llama blocks over a static cache for a few new tokens, in one call.

    Per block, ``h = x + out_proj(attention(rotate(Wqkv(rms_norm(x, norm_1)))))``, then
    ``h + down_proj(silu(gate_proj(g)) * up_proj(g))`` with ``g = rms_norm(h, norm_2)``: the
    arithmetic of :func:`int4_linear` / :func:`int8_linear` and :func:`decode_attention`, in one
    team of threads for all the blocks with a barrier between steps (llama.cpp's graph compute)
    instead of a call, and a wake-up of the threads, per operation and block. Each block's new
    keys and values are written into its caches at ``cache_position`` (as
    :meth:`llm.cache.Cache.update`).

    Args:
        x: (batch, seq, d_model) float32, the residual stream.
        norms: 2 per block, its ``norm_1`` and ``norm_2`` weights, (d_model,) float32 RMSNorm
            weights; ``eps`` their epsilon.
        weights: 15 tensors per block, (codes, scales, mins) of ``Wqkv``, ``out_proj``,
            ``gate_proj``, ``up_proj``, ``down_proj`` in this module's int4 layout, or (codes,
            scales, None) in its int8 layout (``kernel_tensors()`` of :class:`llm.quant.Int4Linear`
            / ``Int8Linear``); ``gate_proj`` and ``up_proj`` quantized alike.
        out_features: the five layers' output sizes, the same in every block:
            ``(n_heads + 2 * kv_n_heads) * head_dim``, d_model, hidden, hidden, d_model.
        cos, sin: (batch or 1, seq, head_dim) float32 rotary angles (:class:`llm.layers.positions.Rotation`,
            sin's first half negated), or both None for no rotation.
        k_caches, v_caches: one per block, (batch, kv_n_heads, capacity, head_dim) float32
            contiguous, written in place.
        cache_position: (seq,) int64 buffer positions of the new tokens.
        mask: (batch, seq, capacity) bool, the keys each new token may see (its own included).
        n_heads: query heads (a multiple of kv_n_heads); head_dim a multiple of 16 up to 128.
        scale: the attention scores' factor (1 / sqrt(head_dim)).

    Returns:
        (batch, seq, d_model) float32: the last block's output.

    Raises:
        RuntimeError: on shapes, dtypes or layouts other than these, a position outside the
            buffer, or without the kernels (:func:`unavailable`).
    """
    _require()
    return torch.ops.llm.decoder_blocks(x, norms, eps, weights, out_features, cos, sin, k_caches, v_caches,
                                        cache_position, mask, n_heads, scale)


def decode_tokens(token: int, steps: int, embedding: tuple[torch.Tensor, torch.Tensor | None, int],
                  norms: list[torch.Tensor], weights: list[torch.Tensor | None], shape: tuple,
                  rotary: tuple[torch.Tensor, torch.Tensor] | None, position: int, k_caches: list[torch.Tensor],
                  v_caches: list[torch.Tensor], past: int, key_mask: torch.Tensor, final_norm: torch.Tensor,
                  final_eps: float, head: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], head_group: int,
                  vocab_size: int, eos: tuple[int, ...], sampling: tuple[float, int, float, float] | None = None,
                  uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """Up to ``steps`` whole decoding steps of one unpadded row in one call, each new token fed back.

    Per token: the embedding row of the token fed, :func:`decoder_blocks` over the cache buffer at
    position ``past + i`` (its ``key_mask`` column set True, rotary row ``position + i``), the final
    :func:`rms_norm`, the output layer (:func:`int8_linear` or :func:`int4_linear`) and the pick:
    :func:`argmax_rows`, or, with ``sampling``, ``llm::sample_row`` with ``uniforms[i]``. These are
    the operators a Python decoding step calls (:class:`llm.model.buffer.FusedSteps`, then
    :meth:`llm.generation.sampling.Sampler.pick`) on the same arguments, so the tokens are the same
    to the bit; without returning to Python between tokens (llama.cpp's decoding loop in C++), the
    step loses the interpreter's 0.3-0.7 ms (a tenth of a SmolLM2 step on 2 cores). Eager only:
    the number of tokens depends on the data.

    Args:
        token: the id fed first (the last token emitted).
        steps: the most tokens to decode; decoding stops after the first id in ``eos``.
        embedding: (table, scales, rows): a packed int8 table with its scales and row count, as
            ``llm::int8_embedding`` takes them, or (float32 (vocab, d_model), None, 0).
        norms, weights, shape: the blocks' fused weights (:class:`llm.model.buffer.FusedRun`);
            ``shape`` is ``(eps, n_heads, head_dim, out_features)``.
        rotary: float32 (positions, head_dim) cos and sin tables (sin's first half negated), or None.
        position: the rotary position of the first token fed.
        k_caches, v_caches: one per block, (1, kv_n_heads, capacity, head_dim) float32, written at
            ``past .. past + n - 1``.
        key_mask: (1, 1, capacity) bool contiguous, the keys seen; set True at each fed position.
        final_norm, final_eps: the final RMSNorm's (d_model,) float32 weight and epsilon.
        head, head_group: the output layer's ``kernel_tensors()`` (int8 codes, or uint8 int4 codes
            with ``head_group`` its group size); ``vocab_size`` its outputs.
        sampling: (temperature > 0, top_k (0: all), top_p (1: all), min_p (0: none)), or None for greedy.
        uniforms: float64 (steps,), one draw from U[0, 1) per token when sampling.

    Returns:
        int64 (n,): the new tokens, n <= ``steps`` (fewer where an eos id came).

    Raises:
        RuntimeError: on arguments other than these (the checks of the operators it runs).
    """
    _require()
    eps, n_heads, head_dim, out_features = shape
    table, table_scales, rows = embedding
    cos, sin = rotary if rotary is not None else (None, None)
    temperature, top_k, top_p, min_p = sampling if sampling is not None else (0.0, 0, 1.0, 0.0)
    return torch.ops.llm.decode_tokens(token, steps, table, table_scales, rows, norms, eps, weights,
                                       list(out_features), cos, sin, position, k_caches, v_caches, past, key_mask,
                                       n_heads, 1.0 / math.sqrt(head_dim), final_norm, final_eps, list(head),
                                       head_group, vocab_size, list(eos), temperature, top_k, top_p, min_p, uniforms)
