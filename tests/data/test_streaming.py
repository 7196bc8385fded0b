"""llm.data.streaming: prepared rows read back as training sequences through MosaicML Streaming, mixed by
proportion, from a local folder or a remote one, with the data checks that refuse what does not fit."""

import gc
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from llm.data import markdown_to_text, play_paths
from llm.data.prepare import prepare
from llm.data.streaming import (
    PreparedDataError,
    build_token_dataset,
    check_tokenizer,
    clean_stale_registrations,
    data_tokenizer,
    resolve_sources,
)
from llm.data.tokenizer import load_prepared_tokenizer

ROW = 64


def _corpus(folder, plays, chars):
    folder.mkdir(parents=True)
    for name in plays:
        (folder / f"{name}.txt").write_text(markdown_to_text(play_paths()[name].read_text())[:chars])
    return folder


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two sources sharing one char tokenizer: a (three plays) and b (two other plays, fewer rows)."""
    root = tmp_path_factory.mktemp("streams")
    a = prepare([_corpus(root / "a-text", ["macbeth", "othello", "pericles"], 12_000)], root / "a", "char",
                seq_len=ROW, validation_fraction=0, workers=1, progress=False)
    b = prepare([_corpus(root / "b-text", ["cymbeline", "coriolanus"], 8_000)], root / "b",
                str(root / "a" / "tokenizer"), seq_len=ROW, validation_fraction=0, workers=1, progress=False)
    assert a["tokenizer"]["hash"] == b["tokenizer"]["hash"]
    return root


def _reference_rows(root, name):
    """The prepared token stream of a source, from its text: each document + eos, cut into rows."""
    tokenizer, info = load_prepared_tokenizer(root / name / "tokenizer")
    stream = []
    for path in sorted((root / f"{name}-text").iterdir()):
        stream += tokenizer(path.read_text(), add_special_tokens=False).input_ids + [info["eos_token_id"]]
    n = len(stream) // ROW
    return torch.tensor(stream[: n * ROW]).view(n, ROW)


def _dataset(sources, cfg, seq_len, batch=4, seed=0):
    gc.collect()  # Streaming refuses a second live dataset over the same folder
    return build_token_dataset(sources, cfg, max_seq_len=seq_len, device_batch_size=batch, seed=seed)


@pytest.mark.parametrize("seq_len", [64, 32, 20])
def test_rows_are_cut_into_training_sequences(corpora, seq_len):
    rows = _reference_rows(corpora, "a")
    sources = resolve_sources({"local": str(corpora / "a")}, "train")
    dataset = _dataset(sources, {"shuffle": False}, seq_len)
    per_row = ROW // seq_len
    assert dataset.num_samples == len(rows) * per_row
    expected = rows[:, : per_row * seq_len].reshape(-1, seq_len)  # the rest of each row is unused
    items = [dataset[i] for i in range(dataset.num_samples)]
    assert torch.equal(torch.stack([item["input_ids"] for item in items]), expected)
    assert all(torch.equal(item["labels"], item["input_ids"]) and item["input_ids"].dtype == torch.int64
               for item in items)
    # Iterated, shuffled: every sequence exactly once per epoch, in another order.
    del dataset
    shuffled = _dataset(sources, {"shuffle": True}, seq_len, seed=3)
    seen = torch.cat([batch["input_ids"] for batch in DataLoader(shuffled, batch_size=4)])
    assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, expected.tolist()))
    assert not torch.equal(seen, expected)


def _source_counts(dataset, first_tokens):
    counts = Counter()
    for batch in DataLoader(dataset, batch_size=4):
        for row in batch["input_ids"]:
            counts[first_tokens[tuple(row.tolist())]] += 1
    return counts


def test_streams_mix_by_proportion_repeat_and_choose(corpora):
    first_tokens = {}
    for name in ("a", "b"):
        for row in _reference_rows(corpora, name).view(-1, 32):
            first_tokens[tuple(row.tolist())] = name
    n_a, n_b = (len(_reference_rows(corpora, name)) * 2 for name in ("a", "b"))
    streams = {"a": {"local": str(corpora / "a")}, "b": {"local": str(corpora / "b")}}

    for weights, expected in [
        ({"a": {"proportion": 0.25}, "b": {"proportion": 0.75}}, None),
        ({"a": {"repeat": 1}, "b": {"repeat": 3}}, {"a": n_a, "b": 3 * n_b}),
        ({"a": {"choose": 10}, "b": {"choose": 30}}, {"a": 10, "b": 30}),
    ]:
        cfg = {"streams": {k: {**v, **weights[k]} for k, v in streams.items()}, "shuffle": True}
        sources = resolve_sources(cfg, "train")
        assert [s.name for s in sources] == ["a", "b"]
        counts = _source_counts(_dataset(sources, cfg, 32), first_tokens)
        if expected is None:  # the epoch is sized from the total; proportions within a sample or so
            total = sum(counts.values())
            assert counts["b"] / total == pytest.approx(0.75, abs=2 / total)
        else:
            assert dict(counts) == expected


def test_remote_folder_is_fetched_into_the_local_cache(corpora, tmp_path):
    cache = tmp_path / "cache"
    sources = resolve_sources({"remote": str(corpora / "a"), "local": str(cache)}, "train")
    assert (cache / "llm_data.json").is_file() and (cache / "tokenizer" / "tokenizer.json").is_file()
    tokenizer, info = data_tokenizer(sources)
    assert info["hash"] == sources[0].manifest["tokenizer"]["hash"]
    dataset = _dataset(sources, {"shuffle": False}, ROW)
    got = torch.stack([dataset[i]["input_ids"] for i in range(dataset.num_samples)])
    assert torch.equal(got, _reference_rows(corpora, "a"))
    with pytest.raises(PreparedDataError, match="needs a `local` cache folder"):
        resolve_sources({"remote": str(corpora / "a")}, "train")
    with pytest.raises(PreparedDataError, match="cannot fetch"):
        resolve_sources({"remote": str(tmp_path / "nowhere"), "local": str(tmp_path / "c2")}, "train")


def test_what_does_not_fit_is_refused(corpora, tmp_path):
    sources = resolve_sources({"local": str(corpora / "a")}, "train")
    with pytest.raises(PreparedDataError, match=r"rows of 64 tokens, shorter than the model's max_seq_len 65"):
        build_token_dataset(sources, {}, max_seq_len=65, device_batch_size=4, seed=0)
    tokenizer, info = data_tokenizer(sources)
    check_tokenizer(sources, tokenizer, vocab_size=info["vocab_size"])
    with pytest.raises(PreparedDataError, match=rf"model.vocab_size {info['vocab_size'] - 1} is smaller"):
        check_tokenizer(sources, tokenizer, vocab_size=info["vocab_size"] - 1)
    other = prepare([corpora / "b-text"], tmp_path / "bpe", "bpe:300", seq_len=ROW, validation_fraction=0, workers=1,
                    progress=False)
    bpe, _ = load_prepared_tokenizer(tmp_path / "bpe" / "tokenizer")
    with pytest.raises(PreparedDataError, match=rf"hash {other['tokenizer']['hash'][:12]}\) is not the tokenizer"):
        check_tokenizer(sources, bpe, what="the run's tokenizer")
    with pytest.raises(PreparedDataError, match="different tokenizers"):
        resolve_sources({"streams": {"a": {"local": str(corpora / "a")}, "bpe": {"local": str(tmp_path / "bpe")}}},
                        "train")
    with pytest.raises(PreparedDataError, match=r"no 'validation' split; it holds \['train'\]"):
        resolve_sources({"local": str(corpora / "a")}, "validation")
    (tmp_path / "half").mkdir()
    with pytest.raises(PreparedDataError, match="not a prepared dataset"):
        resolve_sources({"local": str(tmp_path / "half")}, "train")
    assert np.iinfo(np.uint16).max >= info["vocab_size"]


def test_a_job_killed_whole_is_cleaned_for_its_restart(corpora, tmp_path):
    """A job SIGKILLed whole (its process group, multiprocessing's resource tracker included, as a
    scheduler or the OOM killer does) leaves Streaming's shared memory registering its remote-backed
    cache folder, which Streaming then refuses; clean_stale_registrations removes that registration
    and leaves a live dataset's alone."""
    live = _dataset(resolve_sources({"remote": str(corpora / "a"), "local": str(tmp_path / "other")}, "train"), {}, 32)
    # Streaming's lookup (and ours, which walks the same way) stops at the first free prefix: when
    # another process on the machine (a parallel test worker) frees a lower one after the killed job
    # registered, the registration is out of reach until that gap fills, and Streaming does not
    # refuse. Then a job with a fresh cache folder is killed again, until the refusal is seen.
    for attempt in range(5):
        cfg = {"remote": str(corpora / "b"), "local": str(tmp_path / f"cache-{attempt}")}
        script = (
            "import os\n"
            "from llm.data.streaming import build_token_dataset, resolve_sources\n"
            f"dataset = build_token_dataset(resolve_sources({cfg!r}, 'train'), {{}}, max_seq_len=32, "
            "device_batch_size=4, seed=0)\n"
            "os.killpg(0, 9)\n"
        )
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                              start_new_session=True)
        assert proc.returncode == -9, proc.stderr[-2000:]
        sources = resolve_sources(cfg, "train")
        try:
            _dataset(sources, {}, 32)
        except ValueError as error:
            assert "Reused local directory" in str(error)
            break
    else:
        pytest.fail("Streaming never refused a killed job's cache folder")
    assert len(clean_stale_registrations(sources)) == 1
    assert clean_stale_registrations(resolve_sources({"local": str(corpora / "b")}, "train")) == []
    dataset = _dataset(sources, {}, 32)
    assert sum(1 for _ in DataLoader(dataset, batch_size=4)) == len(dataset) // 4
    assert sum(1 for _ in DataLoader(live, batch_size=4)) == len(live) // 4  # the live one is untouched


def test_a_shared_memory_prefix_taken_by_another_process_meanwhile_is_looked_up_again(corpora, monkeypatch):
    """Streaming finds a free prefix, then creates it; a second job on the machine can create it in
    between (FileExistsError): the dataset is built again on the next free one."""
    from llm.data import streaming

    real, calls = streaming.TokenDataset.__init__, []

    def racing(self, *args, **kwargs):
        calls.append(1)
        real(self, *args, **kwargs)  # as far as a real collision gets: the streams' weights are set
        if len(calls) == 1:
            raise FileExistsError(17, "File exists", "/000001_locals")

    monkeypatch.setattr(streaming.TokenDataset, "__init__", racing)
    dataset = _dataset(resolve_sources({"local": str(corpora / "a")}, "train"), {}, 32)
    assert len(calls) == 2 and len(dataset) > 0


def _lock_is_held() -> bool:
    """Whether some holder (another process, or another open of it in this one) has the machine's
    dataset lock."""
    import tempfile

    from filelock import FileLock, Timeout

    try:
        with FileLock(Path(tempfile.gettempdir()) / f"llm-streaming-register-{os.getuid()}.lock", timeout=0):
            return False
    except Timeout:
        return True


def test_a_dataset_is_built_holding_the_machines_dataset_lock(corpora, monkeypatch):
    """The node's local leader (a process alone is one) builds a dataset holding the machine's
    lock, so that no other job registers Streaming's shared memory meanwhile."""
    from llm.data import streaming

    real, held = streaming.TokenDataset.__init__, []

    def probing(self, *args, **kwargs):
        held.append(_lock_is_held())
        real(self, *args, **kwargs)

    monkeypatch.setattr(streaming.TokenDataset, "__init__", probing)
    assert not _lock_is_held()
    _dataset(resolve_sources({"local": str(corpora / "a")}, "train"), {}, 32)
    assert held == [True] and not _lock_is_held()


@pytest.mark.parametrize("leader", [True, False])
def test_only_the_node_leader_takes_the_machines_dataset_lock(monkeypatch, leader):
    """The node's other ranks take no lock: they meet the leader, which holds it, at Streaming's
    barriers inside the block, and would wait for it for ever."""
    from types import SimpleNamespace

    from streaming.base.world import World

    from llm.data.streaming import _registering

    monkeypatch.setattr(World, "detect", classmethod(lambda cls: SimpleNamespace(is_local_leader=leader)))
    with _registering():
        assert _lock_is_held() == leader
    assert not _lock_is_held()
