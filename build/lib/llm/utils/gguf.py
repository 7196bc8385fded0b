"""Reading GGUF files (llama.cpp's format): their metadata and the index of their tensors, with the
``gguf`` package's reader made fast for large metadata arrays (:func:`read_gguf`, :func:`field`).

Below every layer that reads GGUF: the tokenizer (:mod:`llm.data.gguf_tokenizer`) and the model
loader (:mod:`llm.formats.gguf`). Needs numpy and ``gguf``, not torch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

_MISSING = object()


def _reader_class():
    import gguf

    class _Reader(gguf.GGUFReader):
        """``gguf.GGUFReader`` without numpy.memmap's per-slice overhead.

        The stock reader slices a ``numpy.memmap`` for every value of every metadata array; with
        ~100k vocabulary strings and merges that takes seconds (memmap's ``__array_finalize__``).
        Slicing a plain ndarray view of the same mapping gives the same arrays (still lazily paged
        from the file), several times faster.
        """

        _itemsizes: dict = {}

        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(np.ndarray) if isinstance(value, np.memmap) else value

        def _get(self, offset, dtype, count=1, override_order=None):
            count = int(count)
            itemsize = self._itemsizes.get(dtype)
            if itemsize is None:
                itemsize = self._itemsizes[dtype] = int(np.empty([], dtype=dtype).itemsize)
            arr = self._plain[offset:offset + itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _get_field_parts(self, orig_offs, raw_type):
            """The stock reader's parts (one per array element), without its recursion per element:
            an array of scalars is read as one array and cut into views, an array of strings
            walked here."""
            if gguf.GGUFValueType(raw_type) != gguf.GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            offs, count = orig_offs + 12, int(alen[0])
            itype = gguf.GGUFValueType(raw_itype[0])
            scalar = self.gguf_scalar_to_np.get(itype)
            if scalar is not None:  # one view of the whole array, cut into the stock reader's parts
                values = self._get(offs, scalar, count)
                return (12 + int(values.nbytes), [raw_itype, alen, *values.reshape(-1, 1)], list(range(2, 2 + count)),
                        [gguf.GGUFValueType.ARRAY, itype])
            if itype != gguf.GGUFValueType.STRING:
                return super()._get_field_parts(orig_offs, raw_type)
            order = sys.byteorder if self.byte_order == "I" else {"little": "big", "big": "little"}[sys.byteorder]
            length_type = alen.dtype  # uint64 in the file's byte order
            raw, parts = self._plain, [raw_itype, alen]
            for _ in range(count):
                size = raw[offs:offs + 8]
                length = int.from_bytes(size.tobytes(), order)
                parts += (size.view(length_type), raw[offs + 8:offs + 8 + length])
                offs += 8 + length
            return offs - orig_offs, parts, list(range(3, 3 + 2 * count, 2)), [gguf.GGUFValueType.ARRAY, itype]

    return _Reader


def read_gguf(path: str | os.PathLike):
    """Open a GGUF file: a ``gguf.GGUFReader`` (metadata parsed, tensors memory-mapped).

    Raises:
        FileNotFoundError: if there is no such file.
        ValueError: if it is not a readable GGUF file (bad magic, unknown version, truncated or
            corrupt), naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    size = path.stat().st_size
    try:
        reader = _reader_class()(path)
    except Exception as err:  # the reader raises ValueError, IndexError, KeyError... on a bad file
        raise ValueError(f"cannot read GGUF file {path} (truncated or corrupt?): {type(err).__name__}: {err}") from err
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size or tensor.data.nbytes != int(tensor.n_bytes):
            raise ValueError(
                f"GGUF file {path} is truncated or corrupt: tensor {tensor.name!r} needs bytes up to {end}, "
                f"the file has {size}"
            )
    reader.path = path
    return reader


def field(reader, key: str, default: Any = _MISSING) -> Any:
    """The value of metadata ``key`` (``ReaderField.contents()``); ``default`` when absent.

    Raises:
        ValueError: naming the file and key, when it is absent without a default or unreadable.
    """
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF file {reader.path} lacks the metadata key {key!r}")
        return default
    try:
        return field.contents()
    except Exception as err:
        raise ValueError(f"GGUF file {reader.path}: cannot read metadata {key!r}: {err}") from err
