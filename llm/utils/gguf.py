"""Reading GGUF files (llama.cpp's format): their metadata and the index of their tensors, with the
``gguf`` package's reader made fast for large metadata arrays (:func:`read_gguf`, :func:`field`).

Below every layer that reads GGUF: the tokenizer (:mod:`llm.data.gguf_tokenizer`) and the model
loader (:mod:`llm.formats.gguf`). Needs numpy and ``gguf``, not torch.
"""

from __future__ import annotations

import os
import struct
import sys
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

_MISSING = object()


class _Parts(Sequence):
    """A GGUF array field's parts (``ReaderField.parts``: its fixed ``head``, then one part per
    scalar element or a length part and a bytes part per string), made when indexed rather than
    all at load: a vocabulary's ~100k strings and merges would otherwise cost some 40 MB of
    numpy views and a tenth of a second, in a model load that reads none of them."""

    def __init__(self, head: list, *, values=None, raw=None, starts=None, end=None, length_type=None):
        self.head, self.values, self.raw, self.starts, self.end, self.length_type = \
            head, values, raw, starts, end, length_type

    def __len__(self) -> int:
        tail = len(self.values) if self.values is not None else 2 * len(self.starts)
        return len(self.head) + tail

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        if index < len(self.head):
            return self.head[index]
        index -= len(self.head)
        if self.values is not None:
            return self.values[index:index + 1]
        start = int(self.starts[index // 2])
        if index % 2 == 0:
            return self.raw[start:start + 8].view(self.length_type)
        return self.raw[start + 8:self._string_end(index // 2)]

    def _string_end(self, k: int) -> int:
        return int(self.starts[k + 1]) if k + 1 < len(self.starts) else self.end

    def strings(self) -> list[str]:
        """Every string of a string array, decoded as UTF-8.

        An array of short strings (a vocabulary's, its merges) is decoded as one text: the
        array's bytes with each string's 8-byte length dropped and a NUL put before it, split at
        the NULs (SmolLM2's 49,152 tokens in 0.007-0.011 s, against 0.016 s one decode a string).
        Long strings, a string that holds a NUL itself and bytes that are not UTF-8 are decoded
        one by one (an error then gives the position in its string, as the stock reader's)."""
        count = len(self.starts)
        if not count:
            return []
        first = int(self.starts[0])
        if self.end - first <= _SHORT_STRINGS * count:
            block = self.raw[first:self.end]
            prefixes = (self.starts - first)[:, None] + np.arange(8)  # each string's length bytes
            keep = np.ones(len(block), dtype=bool)
            keep[prefixes[:, 1:].ravel()] = False
            joined = block[keep]
            joined[prefixes[:, 0] - 7 * np.arange(count)] = 0
            try:
                texts = str(joined[1:].tobytes(), "utf-8").split("\0")
            except UnicodeDecodeError:
                texts = []
            if len(texts) == count:
                return texts
        raw, ends = self.raw.data, [*self.starts[1:].tolist(), self.end]
        return [str(raw[s + 8:e], "utf-8") for s, e in zip(self.starts.tolist(), ends)]


#: bytes a string (its length included) up to which an array's strings are decoded as one text
#: (:meth:`_Parts.strings`): for 2,000 strings of 5,000 characters that took 0.012 s, against
#: 0.003 s one by one
_SHORT_STRINGS = 64


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
            """The stock reader's parts (one per array element), as a :class:`_Parts` that makes
            an element's part when asked: an array of scalars is read as one array, an array of
            strings walked once for its offsets."""
            if gguf.GGUFValueType(raw_type) != gguf.GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            offs, count = orig_offs + 12, int(alen[0])
            itype = gguf.GGUFValueType(raw_itype[0])
            scalar = self.gguf_scalar_to_np.get(itype)
            if scalar is not None:
                values = self._get(offs, scalar, count)
                return (12 + int(values.nbytes), _Parts([raw_itype, alen], values=values), range(2, 2 + count),
                        [gguf.GGUFValueType.ARRAY, itype])
            if itype != gguf.GGUFValueType.STRING:
                return super()._get_field_parts(orig_offs, raw_type)
            fmt = ("<" if (sys.byteorder == "little") == (self.byte_order == "I") else ">") + "Q"
            buffer, starts = memoryview(self._plain), np.empty(count, dtype=np.int64)
            unpack = struct.Struct(fmt).unpack_from
            for i in range(count):
                starts[i] = offs
                offs += 8 + unpack(buffer, offs)[0]
            parts = _Parts([raw_itype, alen], raw=self._plain, starts=starts, end=offs, length_type=alen.dtype)
            return offs - orig_offs, parts, range(3, 3 + 2 * count, 2), [gguf.GGUFValueType.ARRAY, itype]

        def _build_fields(self, offs, count):
            """The stock reader's loop, keeping an array field's parts lazy (:class:`_Parts`)."""
            for _ in range(count):
                orig_offs = offs
                kv_klen, kv_kdata = self._get_str(offs)
                offs += int(kv_klen.nbytes + kv_kdata.nbytes)
                raw_kv_type = self._get(offs, np.uint32)
                offs += int(raw_kv_type.nbytes)
                head = [kv_klen, kv_kdata, raw_kv_type]
                field_size, field_parts, field_idxs, field_types = self._get_field_parts(offs, raw_kv_type[0])
                if isinstance(field_parts, _Parts):
                    field_parts.head[:0] = head
                    parts = field_parts
                else:
                    parts = head + field_parts
                if isinstance(field_idxs, range):  # an array's: a list as the stock reader's, made at C speed
                    field_idxs = list(range(field_idxs.start + len(head), field_idxs.stop + len(head), field_idxs.step))
                else:
                    field_idxs = [idx + len(head) for idx in field_idxs]
                self._push_field(gguf.ReaderField(orig_offs, str(bytes(kv_kdata), encoding="utf-8"), parts,
                                                  field_idxs, field_types), skip_sum=True)
                offs += field_size
            return offs

    return _Reader


#: readers alive somewhere in the process, by file and last change: opening the same unchanged
#: file again while one is held gives that reader (see :func:`read_gguf`)
_OPEN: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def read_gguf(path: str | os.PathLike):
    """Open a GGUF file: a ``gguf.GGUFReader`` (metadata parsed, tensors memory-mapped).

    While a reader of the same unchanged file (path, device and inode, size, modification and
    change times) is held anywhere in the process, that reader is returned rather than a second
    one: a command that loads a file's tokenizer and then its model parses the file's header
    (SmolLM2's 100,000 vocabulary strings and merges, 0.03 s) once if it holds the reader
    meanwhile. Readers are shared, so only read them.

    Raises:
        FileNotFoundError: if there is no such file.
        ValueError: if it is not a readable GGUF file (bad magic, unknown version, truncated or
            corrupt), naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    stat = path.stat()
    # the file itself (device, inode) and its last change (ctime: set by every write, rename or
    # copy, and by no tool on purpose, as mtime is by cp -p)
    size, key = stat.st_size, (str(path.resolve()), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns,
                               stat.st_ctime_ns)
    reader = _OPEN.get(key)
    if reader is not None:
        reader.path = path  # messages name the file as this caller does
        return reader
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
    _OPEN[key] = reader
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
        if isinstance(field.parts, _Parts):  # the whole array, without a part per element
            return field.parts.strings() if field.parts.values is None else field.parts.values.tolist()
        return field.contents()
    except Exception as err:
        raise ValueError(f"GGUF file {reader.path}: cannot read metadata {key!r}: {err}") from err
