"""Prepared token shards as training data: MosaicML Streaming datasets, mixed by proportion, resumable.

``scripts/prepare_data.py`` writes a folder of MDS shards (``<dir>/<split>/``), the tokenizer
(``<dir>/tokenizer/``) and a manifest (``<dir>/llm_data.json``: row length, tokenizer hash,
per-split document/token/byte counts). This module reads such folders, locally or from an object
store (``remote``, with ``local`` as the cache), through ``streaming.StreamingDataset``, which
gives deterministic shuffling, mixing of sources by ``proportion`` / ``repeat`` / ``choose``,
disjoint samples per rank and an exact resumption state (``state_dict`` / ``load_state_dict``,
saved in Composer's checkpoints) — the data engine of llm-foundry.

Rows are prepared once at ``seq_len`` tokens and serve any model with ``max_seq_len <=
seq_len``: a row is cut into ``seq_len // max_seq_len`` training sequences (the remainder of
each row is unused), and each such sequence is one sample for Streaming's shuffling, mixing and
resumption (:class:`TokenStream`).
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from llm.utils.extras import require

require("train", "streaming")

from streaming import Stream, StreamingDataset  # noqa: E402
from streaming.base.format.mds.reader import MDSReader  # noqa: E402

MANIFEST = "llm_data.json"
TOKENIZER_DIR = "tokenizer"
# What a prepared tokenizer folder may hold (PreTrainedTokenizerFast.save_pretrained + our info file);
# fetched from a remote next to the manifest. Missing optional files are skipped.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "llm_tokenizer.json")
# StreamingDataset options passed through from a loader's ``dataset`` section (llm-foundry's names).
DATASET_OPTIONS = ("shuffle", "shuffle_seed", "shuffle_algo", "shuffle_block_size", "num_canonical_nodes",
                   "predownload", "cache_limit", "sampling_method", "sampling_granularity", "batching_method")
STREAM_OPTIONS = ("download_retry", "download_timeout", "validate_hash", "keep_zip")


class PreparedDataError(ValueError):
    """A prepared data folder that is missing, incomplete or does not fit the run."""


@dataclass(frozen=True)
class PreparedSplit:
    """One prepared split to read: its stream name, where it is, and its manifest.

    ``weights`` holds at most one of ``proportion`` / ``repeat`` / ``choose`` (Streaming's
    mixing), ``choose`` counted in training sequences.
    """

    name: str
    local: str | None
    remote: str | None
    split: str
    manifest: dict
    weights: tuple[tuple[str, float], ...] = ()

    @property
    def stats(self) -> dict:
        """The split's counts: ``documents``, ``tokens`` (eos separators included), ``bytes``, ``rows``."""
        return self.manifest["splits"][self.split]

    @property
    def tokens_per_byte(self) -> float:
        """Tokens per UTF-8 byte of the split's text: bits per byte = nats/token * this / ln 2."""
        return self.stats["tokens"] / self.stats["bytes"]


def _fetch(remote: str, local: Path, names: tuple[str, ...], *, required: bool, timeout: float) -> None:
    from streaming.base.storage import CloudDownloader

    for name in names:
        if (local / name).is_file():
            continue
        try:
            CloudDownloader.direct_download(os.path.join(remote, name), str(local / name), timeout)
        except Exception as error:  # each object store raises its own errors
            if required:
                raise PreparedDataError(f"cannot fetch {os.path.join(remote, name)}: {error}") from error


def load_manifest(local: str | os.PathLike | None, remote: str | None = None, *, timeout: float = 60) -> dict:
    """The manifest of a prepared folder, fetched with its tokenizer from ``remote`` into ``local`` if needed.

    Raises:
        PreparedDataError: if the folder holds no manifest (not prepared, or a preparation that did
            not finish) and no remote has it, naming the folder and the command that prepares it.
    """
    if local is None:
        raise PreparedDataError(f"a remote dataset ({remote}) needs a `local` cache folder")
    local = Path(local)
    if remote is not None and not (local / MANIFEST).is_file():
        local.mkdir(parents=True, exist_ok=True)
        _fetch(remote, local, (MANIFEST,), required=True, timeout=timeout)
        (local / TOKENIZER_DIR).mkdir(exist_ok=True)
        _fetch(os.path.join(remote, TOKENIZER_DIR), local / TOKENIZER_DIR, TOKENIZER_FILES, required=False,
               timeout=timeout)
        # The split indexes too: a manifest is only complete beside them. Streaming fetches the shards.
        for split in json.loads((local / MANIFEST).read_text()).get("splits", {}):
            (local / split).mkdir(exist_ok=True)
            _fetch(os.path.join(remote, split), local / split, ("index.json",), required=True, timeout=timeout)
    from llm.data.prepare import load_manifest as load_prepared

    try:
        return load_prepared(local)
    except (FileNotFoundError, ValueError) as error:
        raise PreparedDataError(str(error)) from error


def resolve_sources(dataset_cfg: Mapping[str, Any], default_split: str) -> list[PreparedSplit]:
    """The prepared splits a loader's ``dataset`` section names: one, or one per entry of ``streams``.

    ``dataset_cfg`` holds ``local`` / ``remote`` / ``split``, or ``streams: {name: {local, remote,
    split, proportion | repeat | choose}}`` whose unset keys default to the section's own. A
    stream's name is its key; a single source is named after its split.

    Raises:
        PreparedDataError: for a missing or incomplete folder, a split the folder does not hold,
            or streams whose tokenizers differ (naming both streams and hashes).
    """
    streams = dataset_cfg.get("streams") or {None: {}}
    timeout = dataset_cfg.get("download_timeout") or 60
    sources = []
    for name, stream in streams.items():
        local = stream.get("local") or dataset_cfg.get("local")
        remote = stream.get("remote") or dataset_cfg.get("remote")
        split = stream.get("split") or dataset_cfg.get("split") or default_split
        manifest = load_manifest(local, remote, timeout=timeout)
        if split not in manifest["splits"]:
            raise PreparedDataError(
                f"{local} has no {split!r} split; it holds {sorted(manifest['splits'])}"
            )
        weights = tuple((k, stream[k]) for k in ("proportion", "repeat", "choose") if stream.get(k) is not None)
        sources.append(PreparedSplit(name or split, str(local), remote, split, manifest, weights))
    first = sources[0]
    for source in sources[1:]:
        if source.manifest["tokenizer"]["hash"] != first.manifest["tokenizer"]["hash"]:
            raise PreparedDataError(
                f"streams {first.name!r} ({first.local}) and {source.name!r} ({source.local}) were prepared with "
                f"different tokenizers ({first.manifest['tokenizer']['hash'][:12]} vs "
                f"{source.manifest['tokenizer']['hash'][:12]}): prepare every stream with the same "
                f"--tokenizer (e.g. --tokenizer {first.local}/{TOKENIZER_DIR})"
            )
    return sources


def data_tokenizer(sources: list[PreparedSplit]):
    """``(tokenizer, info)`` saved with the sources' shards (``info``: hash, spec, vocab_size, eos_token_id)."""
    from llm.data.tokenizer import load_prepared_tokenizer

    return load_prepared_tokenizer(Path(sources[0].local) / TOKENIZER_DIR)


def check_tokenizer(sources: list[PreparedSplit], tokenizer, *, vocab_size: int | None = None, what: str = "tokenizer") -> None:
    """Refuse a tokenizer or model vocabulary that does not fit the shards.

    Args:
        tokenizer: the run's tokenizer (from its config, a pretrained model, ...), compared by hash
            with the one the shards were prepared with; None to skip.
        vocab_size: the model's vocabulary size; it must hold every id of the shards' tokenizer.
        what: how to name ``tokenizer`` in the message.

    Raises:
        PreparedDataError: naming both tokenizers (spec and hash) or both sizes.
    """
    from llm.data.tokenizer import tokenizer_hash

    info = sources[0].manifest["tokenizer"]
    if tokenizer is not None and (found := tokenizer_hash(tokenizer)) != info["hash"]:
        raise PreparedDataError(
            f"{what} ({len(tokenizer)} tokens, hash {found[:12]}) is not the tokenizer {sources[0].local} was "
            f"prepared with ({info['spec']!r}, {info['vocab_size']} tokens, hash {info['hash'][:12]}): prepare the "
            f"data with --tokenizer set to this tokenizer, or train with the data's own"
        )
    if vocab_size is not None and vocab_size < info["vocab_size"]:
        raise PreparedDataError(
            f"model.vocab_size {vocab_size} is smaller than the vocabulary of the tokenizer {sources[0].local} was "
            f"prepared with ({info['vocab_size']} tokens): leave model.vocab_size unset to take the tokenizer's"
        )


def clean_stale_registrations(splits: list[PreparedSplit]) -> list[int]:
    """Remove Streaming's shared memory that registers these remote-backed cache folders.

    Streaming 0.13 refuses a dataset whose local cache folder (of a stream with a ``remote``) is
    registered in shared memory by another dataset (``Reused local directory``); a job killed with
    SIGKILL never unregisters its own, so it could not restart. Since Streaming never lets two
    live datasets share a cache folder, such a registration is taken as stale and removed, with
    nothing else: ``streaming.base.util.clean_stale_shared_memory`` (what llm-foundry calls at
    start-up) would remove every dataset's, those of other jobs live on the machine included.
    Local-only folders are never refused and need nothing. Walks the prefixes as Streaming's
    lookup does.

    Returns:
        The prefixes whose shared memory was removed.
    """
    from _posixshmem import shm_unlink
    from streaming.base.constant import BARRIER_FILELOCK, CACHE_FILELOCK, LOCALS, SHM_TO_CLEAN
    from streaming.base.shared import SharedMemory
    from streaming.base.shared.prefix import _each_prefix_int, _get_path, _unpack_locals

    ours = {os.path.abspath(os.path.join(s.local, s.split)) for s in splits if s.remote is not None}
    removed = []
    for prefix in _each_prefix_int() if ours else ():
        locks = (Path(tempfile.gettempdir()) / _get_path(prefix, name) for name in (BARRIER_FILELOCK, CACHE_FILELOCK))
        if any(lock.exists() for lock in locks):
            continue  # Streaming's lookup skips these prefixes too
        try:
            registry = SharedMemory(_get_path(prefix, LOCALS), False, auto_cleanup=False)
        except FileNotFoundError:
            break
        theirs, _ = _unpack_locals(bytes(registry.buf))
        registry.cleanup()
        if ours & set(theirs):
            for name in SHM_TO_CLEAN:
                with contextlib.suppress(FileNotFoundError):
                    shm_unlink("/" + _get_path(prefix, name))
            removed.append(prefix)
    return removed


class _RowChunks(MDSReader):
    """An MDS shard of rows of ``row_len`` tokens seen as ``chunks`` samples of ``chunk_len`` tokens per row."""

    chunks: int
    chunk_len: int

    @classmethod
    def wrap(cls, shard: MDSReader, chunks: int, chunk_len: int) -> "_RowChunks":
        wrapped = cls.__new__(cls)
        wrapped.__dict__.update(shard.__dict__)
        wrapped.chunks, wrapped.chunk_len = chunks, chunk_len
        wrapped.samples = shard.samples * chunks
        return wrapped

    def get_item(self, idx: int) -> dict[str, Any]:
        row, part = divmod(idx, self.chunks)
        tokens = super().get_item(row)["tokens"]
        return {"tokens": tokens[part * self.chunk_len : (part + 1) * self.chunk_len]}


class TokenStream(Stream):
    """A Streaming ``Stream`` over prepared rows whose samples are ``max_seq_len``-token sequences.

    Every shard's row of ``row_len`` tokens becomes ``row_len // max_seq_len`` samples, so
    shuffling, mixing proportions, rank partitions and the resumption state all count training
    sequences.
    """

    def __init__(self, *, max_seq_len: int, row_len: int, **kwargs: Any):
        super().__init__(**kwargs)
        self.chunk_len, self.chunks = max_seq_len, row_len // max_seq_len

    def get_shards(self, world, allow_unsafe_types: bool) -> list:
        return [_RowChunks.wrap(shard, self.chunks, self.chunk_len)
                for shard in super().get_shards(world, allow_unsafe_types)]


class TokenDataset(StreamingDataset):
    """``StreamingDataset`` of training sequences: item i is ``{"input_ids", "labels"}``, int64 (max_seq_len,).

    Labels are the input ids, unshifted (the model shifts them). Use :func:`build_token_dataset`.
    """

    def get_item(self, sample_id: int, retry: int = 7) -> dict[str, torch.Tensor]:
        tokens = super().get_item(sample_id, retry)["tokens"]
        ids = torch.from_numpy(tokens.astype(np.int64))
        return {"input_ids": ids, "labels": ids.clone()}


_PREFIX_ATTEMPTS = 5


@contextlib.contextmanager
def _registering():
    """Within the block, this process holds the machine's dataset lock if it is its node's local
    leader (Streaming's ``World``), and takes nothing otherwise.

    Streaming registers a dataset's shared memory at the first free prefix: each rank of a job finds
    that prefix on its own, then the leader creates it, and the other ranks read what is there.
    Another process that took the same prefix in between handed the other ranks its registration:
    "shared memory registered does not match local leader". That was seen with two pytest workers,
    one of them running a two-rank training. The leader holds the lock from before the ranks look
    until its registration is made. The other ranks need no lock: they meet the leader at
    Streaming's barriers inside the block. The lock is a file in the temporary directory, one per
    user (``filelock``, which torch requires), and it is released if the process dies.
    """
    from filelock import FileLock
    from streaming.base.world import World

    if not World.detect().is_local_leader:
        yield
        return
    user = os.getuid() if hasattr(os, "getuid") else getpass.getuser()  # getlogin needs a terminal
    with FileLock(os.path.join(tempfile.gettempdir(), f"llm-streaming-register-{user}.lock")):
        yield


def build_token_dataset(
    sources: list[PreparedSplit],
    dataset_cfg: Mapping[str, Any],
    *,
    max_seq_len: int,
    device_batch_size: int,
    seed: int,
) -> TokenDataset:
    """A :class:`TokenDataset` over ``sources`` (see :func:`resolve_sources`) with a section's options.

    ``dataset_cfg`` may hold Streaming's options (:data:`DATASET_OPTIONS`, :data:`STREAM_OPTIONS`);
    ``shuffle_seed`` defaults to ``seed``. ``device_batch_size`` must be the per-rank batch size
    the loader uses: Streaming partitions samples over ranks and workers by batches, which makes
    the global order independent of the number of ranks and the resumption exact.

    Raises:
        PreparedDataError: if ``max_seq_len`` exceeds a source's prepared row length.
    """
    for source in sources:
        row_len = source.manifest["seq_len"]
        if max_seq_len > row_len:
            raise PreparedDataError(
                f"{source.local} was prepared in rows of {row_len} tokens, shorter than the model's max_seq_len "
                f"{max_seq_len}: prepare it again with --seq-len {max_seq_len} or more"
            )
    stream_options = {k: dataset_cfg[k] for k in STREAM_OPTIONS if dataset_cfg.get(k) is not None}

    def streams() -> list[TokenStream]:
        # new ones for every attempt: Streaming's dataset sets their weights (proportion, repeat,
        # choose) on them, and refuses streams that carry more than one
        return [TokenStream(max_seq_len=max_seq_len, row_len=source.manifest["seq_len"], local=source.local,
                            remote=source.remote, split=source.split, **dict(source.weights), **stream_options)
                for source in sources]

    options = {k: dataset_cfg[k] for k in DATASET_OPTIONS if dataset_cfg.get(k) is not None}
    options.setdefault("shuffle_seed", seed)
    for attempt in range(_PREFIX_ATTEMPTS):
        try:
            with _registering():
                return TokenDataset(streams=streams(), batch_size=device_batch_size, **options)
        except FileExistsError:
            # Streaming finds the first free shared-memory prefix, then creates it: a process of this
            # machine that does not take _registering's lock can create the same one in between.
            # Look again (one process; the ranks of a job would no longer meet at the same barriers).
            if attempt == _PREFIX_ATTEMPTS - 1:
                raise
            time.sleep(0.05 * (attempt + 1))
