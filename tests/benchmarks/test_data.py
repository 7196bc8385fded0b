"""Smoke test of the data benchmark (``python -m benchmarks.data``): a tiny corpus through every
measurement, checking that the figures are computed and agree with each other (never timings
against the goals), and that the preparer's shard writer, whose speed and memory the benchmark
measures, writes exactly what Streaming's ``MDSWriter`` writes."""

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from benchmarks.data import MB, main, write_corpus
from llm.data.prepare import _ShardWriter

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_corpus_is_real_text_of_the_size_asked_and_deterministic(tmp_path):
    a = write_corpus(tmp_path / "a", MB // 2, seed=3)
    b = write_corpus(tmp_path / "b", MB // 2, seed=3)
    c = write_corpus(tmp_path / "c", MB // 2, seed=4)
    texts = [json.loads(line)["text"] for path in a.files for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(texts) == a.documents and sum(len(t.encode("utf-8")) for t in texts) == a.bytes >= MB // 2
    assert all(t.strip() for t in texts) and a.bytes - max(len(t.encode("utf-8")) for t in texts) < MB // 2
    assert [p.read_bytes() for p in a.files] == [p.read_bytes() for p in b.files]
    assert [p.read_bytes() for p in a.files] != [p.read_bytes() for p in c.files]


def test_benchmark_computes_consistent_figures(tmp_path, capsys):
    out = tmp_path / "figures.json"
    work = tmp_path / "work"
    work.mkdir()
    status = main(["--size-mb", "1", "--json", str(out), "--work-dir", str(work), "--loader-seconds", "0.2",
                   "--steps", "1", "--warmup", "0"])
    assert status == 0
    figures = json.loads(out.read_text())
    prepare, raw, corpus = figures["prepare"], figures["raw"], figures["corpus"]
    assert figures["checks"] == {"documents": True, "bytes": True, "tokens": True, "rows": True}
    # Prepare's tokens are exactly the raw encoding's plus one eos per document, over the same text.
    assert prepare["tokens"] == raw["tokens"] + raw["documents"]
    assert prepare["documents"] == raw["documents"] == corpus["documents"]
    assert prepare["bytes"] == corpus["bytes"] >= MB
    assert set(prepare["splits"]) == {"train", "validation"}
    assert raw["threads"] == figures["workers"] >= 1
    for rate in (prepare["mb_per_s"], raw["mb_per_s"], figures["loader"]["tokens_per_s"],
                 figures["step"]["tokens_per_s"]):
        assert rate > 0
    assert figures["prepare_ratio"] == pytest.approx(prepare["mb_per_s"] / raw["mb_per_s"])
    assert figures["loader_ratio"] == pytest.approx(figures["loader"]["tokens_per_s"] / figures["step"]["tokens_per_s"])
    # Encoding runs on threads: the preparing process is the only one, and its peak is measured.
    assert prepare["worker_processes"] == 0 and prepare["peak_rss_workers_sum"] == 0
    assert 0 < prepare["peak_rss_main"] == prepare["peak_rss_total"] <= prepare["ru_maxrss"]
    default = yaml.safe_load((REPO_ROOT / "configs/shakespeare.yaml").read_text())
    assert figures["step"]["batch"] == [default["global_train_batch_size"], default["model"]["max_seq_len"]]
    assert figures["step"]["precision"] == default["precision"] and figures["loader"]["batches"] >= 1
    assert figures["loader"]["direct_batches"] >= 1 and figures["loader"]["direct_tokens_per_s"] > 0
    printed = capsys.readouterr().out
    for row in ("| Prepare / raw |", "| Prepare peak RSS, main + workers |", "| Loader / training step |"):
        assert row in printed
    assert figures["cpu"] in printed
    assert not list(work.iterdir())  # the corpus and the prepared data are removed


@pytest.mark.parametrize("dtype, seq_len, shard_size, rows, pieces", [
    ("uint16", 2048, 1 << 25, 9000, 7),  # several full shards and a partial one
    ("uint16", 16, 1200, 500, 3),
    ("uint32", 32, 5000, 77, 1),
    ("uint16", 8, 1300, 0, 1),  # no rows: an index without shards
])
def test_shard_writer_writes_what_mdswriter_writes(dtype, seq_len, shard_size, rows, pieces, tmp_path):
    from streaming import MDSWriter

    data = np.random.default_rng(0).integers(0, 60000, (rows, seq_len)).astype(dtype)
    encoding = f"ndarray:{dtype}:{seq_len}"
    with MDSWriter(out=str(tmp_path / "mds"), columns={"tokens": encoding}, compression=None,
                   size_limit=shard_size) as writer:
        for row in data:
            writer.write({"tokens": row})
    ours = _ShardWriter(tmp_path / "ours", "tokens", encoding, seq_len * np.dtype(dtype).itemsize, shard_size)
    for piece in np.array_split(data, pieces):
        ours.write(piece.tobytes())
    ours.finish()
    expected = {p.name: p.read_bytes() for p in (tmp_path / "mds").iterdir()}
    assert {p.name: p.read_bytes() for p in (tmp_path / "ours").iterdir()} == expected
    assert len(expected) > (rows > 0)


def test_the_ablation_gives_each_variant_the_batches_that_fill_its_minutes(monkeypatch, capsys):
    from benchmarks import ablation

    calls = []

    def fake_train(config, overrides, folder):
        calls.append(overrides)
        compiled = "compile_config=null" not in overrides
        batches = int(next(o for o in overrides if o.startswith("max_duration="))[13:-2])
        return {"tokens": 1000 * batches, "batches": batches, "tokens_per_s": 2000.0 if compiled else 1000.0,
                "compile_seconds": 30.0 if compiled else 0.0, "train_seconds": 60.0,
                "bits_per_byte": 2.0 if compiled else 2.1}

    monkeypatch.setattr(ablation, "_train", fake_train)
    assert ablation.main(["--minutes", "1", "--probe", "4", "--only", "0", "1"]) == 0
    # the baseline (compiled): 0.5 s a batch after 30 s of compiling, 60 batches; eager: 1 s a batch, 60 batches
    assert [c[-2:] for c in calls[1::2]] == [["max_duration=60ba", "scheduler.t_warmup=0.15dur"]] * 2
    assert calls[0] == ["max_duration=4ba", "scheduler.t_warmup=1ba"]
    table = capsys.readouterr().out
    assert "| eager (compile_config=null) | 1.00 | 60 | 60 (0) | 2.1000 | +0.1000 |" in table.splitlines()
