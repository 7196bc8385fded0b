"""Corpus preparation: shards equal the reference token stream for every tokenizer spec and input
format, validation splits, workers, restarts, and every bad input (through the CLI too)."""

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from streaming import LocalDataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import llm.data.prepare as prepare_module
from llm import MosaicGPT, MosaicGPTConfig
from llm.cli.prepare import main
from llm.data import EOS_TOKEN, markdown_to_text, play_paths, train_bpe_tokenizer
from llm.data.prepare import in_validation, load_manifest, prepare
from llm.data.sources import DataError
from llm.data.tokenizer import tokenizer_hash, train_tokenizer
from llm.utils.pretrained import pretrained_path

SEQ_LEN = 32
FAST = dict(seq_len=SEQ_LEN, workers=1, progress=False)


def paragraphs(play: str, n: int, skip: int = 20) -> list[str]:
    text = markdown_to_text(play_paths()[play].read_text(encoding="utf-8"))
    return [p for p in text.split("\n\n") if p.strip()][skip : skip + n]


def documents(play: str, n: int, per: int = 3) -> list[str]:
    """``n`` documents of ``per`` real paragraphs each (a few hundred bytes)."""
    paras = paragraphs(play, n * per)
    return ["\n\n".join(paras[i * per : (i + 1) * per]) for i in range(n)]


def write_files(folder: Path, docs: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (folder / f"doc{i:03d}.txt").write_text(doc, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A train folder of 12 documents and a validation folder of 4, one document per file."""
    root = tmp_path_factory.mktemp("corpus")
    train, validation = documents("hamlet", 12), documents("the-tempest", 4)
    return write_files(root / "train", train), write_files(root / "validation", validation), train, validation


@pytest.fixture(scope="module")
def bpe(corpus):
    return train_bpe_tokenizer("".join(corpus[2]), vocab_size=300)


def rows(out: Path, split: str) -> np.ndarray:
    dataset = LocalDataset(str(out), split)
    return np.stack([dataset[i]["tokens"] for i in range(len(dataset))])


def reference(tokenizer, docs: list[str], seq_len: int = SEQ_LEN) -> tuple[np.ndarray, dict]:
    """Rows and counts computed directly: encode(doc) + [eos] for each doc, cut into rows."""
    eos = tokenizer.eos_token_id
    stream = [i for doc in docs for i in tokenizer(doc, add_special_tokens=False)["input_ids"] + [eos]]
    n = len(stream) // seq_len
    counts = {"documents": len(docs), "tokens": len(stream), "bytes": sum(len(d.encode("utf-8")) for d in docs),
              "rows": n, "dropped_tokens": len(stream) - n * seq_len, "replacements": 0}
    return np.array(stream[: n * seq_len]).reshape(n, seq_len), counts


def check_split(out: Path, manifest: dict, split: str, tokenizer, docs: list[str]) -> None:
    expected_rows, expected_counts = reference(tokenizer, docs, manifest["seq_len"])
    got = rows(out, split)
    assert got.dtype == np.dtype(manifest["dtype"])
    np.testing.assert_array_equal(got, expected_rows)
    counts = dict(manifest["splits"][split])
    assert counts.pop("seconds") >= 0
    assert counts == expected_counts


def saved_tokenizer(out: Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(str(out / "tokenizer"))


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith(("llm_data", ".llm_prepare", "llm_split"))}


def mtimes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("spec", ["tokenizer.json", "folder", "bundle", "bpe:300", "char"])
def test_every_tokenizer_spec_gives_the_reference_rows(spec, corpus, bpe, tmp_path):
    train_dir, validation_dir, train, validation = corpus
    bpe.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    bpe.save_pretrained(str(tmp_path / "folder"))
    MosaicGPT(MosaicGPTConfig(vocab_size=len(bpe), max_seq_len=32, d_model=16, n_heads=2, n_layers=1)).save_pretrained(
        tmp_path / "bundle", tokenizer=bpe)
    given = spec if ":" in spec or spec == "char" else str(tmp_path / spec)
    out = tmp_path / "out"
    manifest = prepare([train_dir], out, given, validation=[validation_dir], **FAST)
    tokenizer = saved_tokenizer(out)
    if spec in ("bpe:300", "char"):  # trained on the train split, streamed
        assert tokenizer_hash(tokenizer) == tokenizer_hash(train_tokenizer(spec, iter(train)))
    else:
        assert tokenizer.backend_tokenizer.to_str() == bpe.backend_tokenizer.to_str()
    for split, docs in (("train", train), ("validation", validation)):
        check_split(out, manifest, split, tokenizer, docs)
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    assert manifest["tokenizer"] == {"path": "tokenizer", "hash": tokenizer_hash(tokenizer), "spec": given,
                                     "vocab_size": len(tokenizer), "eos_token_id": eos}
    assert (manifest["format"], manifest["seq_len"], manifest["column"], manifest["dtype"]) == (
        "llm-prepared/1", SEQ_LEN, "tokens", "uint16")
    inputs = sorted(train_dir.iterdir()) + sorted(validation_dir.iterdir())
    assert manifest["inputs"] == [{"path": str(p.resolve()), "bytes": p.stat().st_size,
                                   "mtime_ns": p.stat().st_mtime_ns} for p in inputs]
    assert load_manifest(out) == manifest
    assert manifest["options"]["tokenizer"] == given and manifest["options"]["validation_fraction"] is None


def test_registered_and_gguf_tokenizers(corpus, tmp_path):
    gguf = pretrained_path("smollm2-135m-instruct")
    if not gguf.is_file():
        pytest.skip(f"{gguf} is missing (make data)")
    train_dir, _, train, _ = corpus
    registered = prepare([train_dir], tmp_path / "a", "smollm2-135m-instruct", validation_fraction=0, **FAST)
    tokenizer = saved_tokenizer(tmp_path / "a")
    check_split(tmp_path / "a", registered, "train", tokenizer, train)
    from_file = prepare([train_dir], tmp_path / "b", str(gguf), validation_fraction=0, **FAST)
    assert from_file["tokenizer"]["hash"] == registered["tokenizer"]["hash"]
    assert files(tmp_path / "a" / "train") == files(tmp_path / "b" / "train")


def test_every_input_format_gives_the_same_rows(corpus, bpe, tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    train_dir, _, train, _ = corpus
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(train)))
    pq.write_table(pa.table({"body": train}), tmp_path / "data.parquet", row_group_size=5)
    datasets.Dataset.from_dict({"body": train}).save_to_disk(tmp_path / "hf")
    bpe.save_pretrained(str(tmp_path / "tok"))
    reference_rows, _ = reference(bpe, train)
    for name in ("data.jsonl", "data.parquet", "hf", None):
        source = str(tmp_path / name) if name else str(train_dir / "*.txt")
        out = tmp_path / f"out-{name}"
        manifest = prepare([source], out, str(tmp_path / "tok"), validation_fraction=0, text_field="body", **FAST)
        np.testing.assert_array_equal(rows(out, "train"), reference_rows)
        assert list(manifest["splits"]) == ["train"]


def test_large_vocabulary_uses_uint32_and_several_shards(corpus, tmp_path):
    train_dir, _, train, _ = corpus
    words = sorted({w for doc in train for w in doc.split()})
    vocab = {EOS_TOKEN: 0, "[UNK]": 1, **{f"filler{i}": i + 2 for i in range(65_600 - 2 - len(words))}}
    vocab.update({w: len(vocab) + i for i, w in enumerate(words)})  # the real words get ids beyond 65535
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(tmp_path / "big.json"))
    out = tmp_path / "out"
    manifest = prepare([train_dir], out, str(tmp_path / "big.json"), validation_fraction=0, shard_size=1200, **FAST)
    assert manifest["dtype"] == "uint32" and manifest["tokenizer"]["vocab_size"] == 65_600
    assert len(list((out / "train").glob("shard.*.mds"))) > 3
    tokenizer = saved_tokenizer(out)
    check_split(out, manifest, "train", tokenizer, train)
    assert rows(out, "train").max() >= 1 << 16


def line_corpus(tmp_path: Path) -> tuple[Path, list[tuple[str, str]]]:
    """Two files of one real line per document; returns the folder and (identity, text) pairs."""
    folder = tmp_path / "lines"
    folder.mkdir()
    pairs = []
    for name, play in (("a.txt", "macbeth"), ("b.txt", "othello")):
        lines = [line for p in paragraphs(play, 80) for line in p.split("\n") if line.strip()][:150]
        (folder / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
        pairs += [(f"{name}:{i}", line) for i, line in enumerate(lines)]
    return folder, pairs


def test_validation_fraction_is_deterministic_by_seed(bpe, tmp_path):
    folder, pairs = line_corpus(tmp_path)
    bpe.save_pretrained(str(tmp_path / "tok"))
    held_out = {}
    for seed in (0, 0, 1):
        out = tmp_path / f"out-{seed}-{len(held_out)}"
        manifest = prepare([folder], out, str(tmp_path / "tok"), validation_fraction=0.2, seed=seed,
                           split_documents="line", **FAST)
        validation = [text for identity, text in pairs if in_validation(identity, seed, 0.2)]
        train = [text for identity, text in pairs if not in_validation(identity, seed, 0.2)]
        check_split(out, manifest, "train", bpe, train)
        check_split(out, manifest, "validation", bpe, validation)
        # Binomial(300, 0.2): mean 60, sd 6.9.
        assert 60 - 4 * 6.9 < len(validation) < 60 + 4 * 6.9
        held_out.setdefault(seed, []).append(rows(out, "validation"))
    np.testing.assert_array_equal(*held_out[0])
    assert not list(tmp_path.glob("out-*/.tmp-*"))
    assert held_out[0][0].shape != held_out[1][0].shape or (held_out[0][0] != held_out[1][0]).any()


def test_trained_tokenizer_sees_only_the_train_split(corpus, tmp_path):
    train_dir, _, train, validation = corpus
    held_out = write_files(tmp_path / "v", [validation[0] + " §µ¶"])
    out = tmp_path / "out"
    manifest = prepare([train_dir], out, "char", validation=[held_out], **FAST)
    vocab = saved_tokenizer(out).get_vocab()
    assert {"§", "µ", "¶"}.isdisjoint(vocab) and set("".join(train)) <= set(vocab)
    check_split(out, manifest, "validation", saved_tokenizer(out), [validation[0] + " §µ¶"])


def test_workers_give_identical_shards(tmp_path):
    folder, _ = line_corpus(tmp_path)
    outs = [tmp_path / f"w{n}" for n in (1, 2)]
    for n, out in zip((1, 2), outs):
        prepare([folder], out, "bpe:300", seq_len=16, validation_fraction=0.1, split_documents="line", workers=n,
                progress=False)
    for part in ("tokenizer", "train", "validation"):
        assert files(outs[0] / part) and files(outs[0] / part) == files(outs[1] / part)


def test_reprepared_tokenizer_keeps_its_hash(corpus, tmp_path):
    train_dir, validation_dir, _, validation = corpus
    first = prepare([train_dir], tmp_path / "a", "bpe:300", validation_fraction=0, **FAST)
    for spec in (tmp_path / "a" / "tokenizer", tmp_path / "a"):  # the tokenizer folder or the dataset
        out = tmp_path / f"b-{spec.name}"
        second = prepare([validation_dir], out, str(spec), validation_fraction=0, **FAST)
        assert second["tokenizer"]["hash"] == first["tokenizer"]["hash"]
        check_split(out, second, "train", saved_tokenizer(tmp_path / "a"), validation)


def test_rerun_does_no_work_refuses_changes_and_overwrites(corpus, bpe, tmp_path, caplog):
    train_dir, validation_dir, _, _ = corpus
    bpe.save_pretrained(str(tmp_path / "tok"))
    out = tmp_path / "out"
    args = ([train_dir], out, str(tmp_path / "tok"))
    manifest = prepare(*args, validation=[validation_dir], **FAST)
    before = mtimes(out)
    with caplog.at_level(logging.INFO, logger="llm.data.prepare"):
        assert prepare(*args, validation=[validation_dir], **{**FAST, "workers": 2}) == manifest
    assert "already prepared" in caplog.text and mtimes(out) == before
    with pytest.raises(DataError, match=r"holds a different preparation \(differs in --seq-len\); pass --overwrite"):
        prepare(*args, validation=[validation_dir], **{**FAST, "seq_len": 16})
    assert mtimes(out) == before
    changed = prepare(*args, validation=[validation_dir], overwrite=True, **{**FAST, "seq_len": 16})
    assert changed["seq_len"] == 16 and load_manifest(out) == changed
    # An input file that changed (size or mtime) makes it a different preparation.
    copy = write_files(tmp_path / "copy", [p.read_text() for p in sorted(train_dir.iterdir())])
    prepare([copy], tmp_path / "c", str(tmp_path / "tok"), validation_fraction=0, **FAST)
    (copy / "doc000.txt").write_text((copy / "doc000.txt").read_text() + " Amen.")
    with pytest.raises(DataError, match=r"differs in input files \(paths, sizes or times\)"):
        prepare([copy], tmp_path / "c", str(tmp_path / "tok"), validation_fraction=0, **FAST)


@pytest.mark.parametrize("held_out", ["inputs", "fraction"])
def test_killed_runs_never_look_complete_and_resume(held_out, corpus, tmp_path, monkeypatch):
    train_dir, validation_dir, _, _ = corpus
    if held_out == "inputs":
        inputs, options = [train_dir], dict(validation=[validation_dir], **FAST)
    else:
        inputs, options = [line_corpus(tmp_path)[0]], dict(validation_fraction=0.2, split_documents="line", **FAST)
    out, clean = tmp_path / "out", tmp_path / "clean"
    prepare(inputs, clean, "bpe:300", **options)
    write_split = prepare_module._write_split

    def killed(split, *a, **k):
        if split == "validation":
            raise KeyboardInterrupt  # as if killed while writing the validation split
        return write_split(split, *a, **k)

    monkeypatch.setattr(prepare_module, "_write_split", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare(inputs, out, "bpe:300", **options)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".tmp-held-out")) == [
        ".llm_prepare.json", "tokenizer", "train"]
    with pytest.raises(DataError, match="no llm_data.json in .*: not a prepared dataset .* did not finish"):
        load_manifest(out)
    monkeypatch.setattr(prepare_module, "_write_split", write_split)
    kept = mtimes(out)
    (out / ".tmp-validation-leftover").mkdir()  # a temporary folder of a killed run
    (out / ".tmp-validation-leftover" / "shard.00000.mds").write_bytes(b"partial")
    manifest = prepare(inputs, out, "bpe:300", **options)
    # The tokenizer and the train split are kept.
    assert all(mtimes(out)[name] == t for name, t in kept.items() if not name.startswith(".tmp"))
    assert not list(out.glob(".tmp-*"))
    for part in ("tokenizer", "train", "validation"):
        assert files(out / part) == files(clean / part)
    # A run killed after its splits but before the manifest: the rerun only writes the manifest.
    (out / "llm_data.json").unlink()
    kept = mtimes(out)
    assert prepare(inputs, out, "bpe:300", **options) == manifest
    assert all(mtimes(out)[name] == t for name, t in kept.items())


def test_refuses_a_folder_that_is_not_ours(corpus, bpe, tmp_path):
    train_dir, _, _, _ = corpus
    bpe.save_pretrained(str(tmp_path / "tok"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(DataError, match=r"is not empty and holds no preparation .* refusing to touch it"):
        prepare([train_dir], out, str(tmp_path / "tok"), validation_fraction=0, **FAST)
    assert (out / "precious.txt").read_text() == "keep me"
    prepare([train_dir], out, str(tmp_path / "tok"), validation_fraction=0, overwrite=True, **FAST)
    assert not (out / "precious.txt").exists() and load_manifest(out)["splits"]["train"]["documents"] == 12
    with pytest.raises(DataError, match="is inside --out"):
        prepare([train_dir], train_dir.parent, str(tmp_path / "tok"), overwrite=True, **FAST)
    assert train_dir.is_dir()


def test_bad_preparations(corpus, bpe, tmp_path):
    train_dir, _, _, _ = corpus
    bpe.save_pretrained(str(tmp_path / "tok"))
    tok = str(tmp_path / "tok")
    with pytest.raises(DataError, match=r"the train split has \d+ tokens, fewer than one row of --seq-len 1000000: "
                                        "use a smaller --seq-len or more data"):
        prepare([train_dir], tmp_path / "a", tok, validation_fraction=0, **{**FAST, "seq_len": 1_000_000})
    assert not (tmp_path / "a" / "train").exists() and not list((tmp_path / "a").glob(".tmp-*"))
    write_files(tmp_path / "empty", ["", "  \n\n"])
    for spec in (tok, "bpe:300"):
        with pytest.raises(DataError, match="no documents in the inputs: every file is empty"):
            prepare([tmp_path / "empty"], tmp_path / f"b{spec[-3:]}", spec, **FAST)
    one = write_files(tmp_path / "one", [(train_dir / "doc000.txt").read_text()])
    with pytest.raises(DataError, match=r"the (train|validation) split gets none of the 1 documents"):
        prepare([one], tmp_path / "c", tok, validation_fraction=0.5, **FAST)
    for options, message in (({"seq_len": 0}, "--seq-len must be a positive integer"),
                             ({"validation_fraction": 1.0}, r"--validation-fraction must be in \[0, 1\)"),
                             ({"workers": 0}, "--workers must be a positive integer"),
                             ({"shard_size": 100}, r"--shard-size 100 must hold a row of 32 4-byte tokens and "
                                                   r"a shard header \(at least 1152 bytes\)")):
        with pytest.raises(DataError, match=message):
            prepare([train_dir], tmp_path / "d", tok, **{**FAST, **options})
    with pytest.raises(DataError, match="no llm_data.json in"):
        load_manifest(tmp_path)


def test_cli(corpus, bpe, tmp_path, capsys):
    train_dir, validation_dir, train, _ = corpus
    bpe.save_pretrained(str(tmp_path / "tok"))
    out = tmp_path / "out"
    argv = [str(train_dir), "--validation", str(validation_dir), "--out", str(out), "--tokenizer",
            str(tmp_path / "tok"), "--seq-len", "32", "--workers", "1"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    manifest = load_manifest(out)
    split = manifest["splits"]["train"]
    assert (f"train: {len(train)} documents, {split['tokens']:,} tokens, {split['bytes']:,} bytes "
            f"({split['tokens'] / split['bytes']:.4f} tokens/byte), {split['rows']:,} rows of 32") in printed
    assert f"manifest: {out / 'llm_data.json'}" in printed and "MB/s" in printed
    assert printed.startswith(f"tokenizer: {tmp_path / 'tok'}, {len(bpe):,} tokens\n")
    assert main(argv) == 0
    assert "already prepared" in capsys.readouterr().err
    assert main(argv + ["--out", str(tmp_path / "quiet"), "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")  # --quiet: errors and warnings only
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    latin = tmp_path / "latin.txt"
    latin.write_bytes("Adieu, ma chère".encode("latin-1"))
    cases = [
        ([str(bad)], r"bad\.jsonl, line 2: record lacks the field 'text' \(its keys: \['body'\]\)"),
        ([str(latin)], rf"latin\.txt is not UTF-8: invalid byte 0xe8 at byte offset {len('Adieu, ma ch')};"),
        ([str(tmp_path / "nothing*.txt")], "matches nothing"),
        ([str(train_dir), "--tokenizer", "bpe:3"], "bpe needs an integer vocabulary size"),
        ([str(train_dir), "--tokenizer", "gpt-17"], "cannot load tokenizer 'gpt-17'"),
        ([str(train_dir), "--out", str(tmp_path)], "is not empty and holds no preparation"),
        ([str(train_dir), "--seq-len", "0"], "argument --seq-len: must be an integer >= 1, got 0"),
        ([str(train_dir), "--validation-fraction", "2"], r"must be a number in \[0, 1\)"),
    ]
    for i, (extra, message) in enumerate(cases):
        defaults = ["--out", str(tmp_path / f"x{i}"), "--tokenizer", str(tmp_path / "tok"), "--quiet", "--workers", "1"]
        assert main(defaults + extra) == 2, extra
        captured = capsys.readouterr()
        assert captured.out == ""
        lines = captured.err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("prepare_data.py: error: "), captured.err
        assert re.search(message, lines[0]), (message, lines[0])


def test_script_errors_are_one_line_without_traceback(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    script = Path(__file__).resolve().parents[2] / "scripts" / "prepare_data.py"
    command = [sys.executable, str(script), str(bad), "--out", str(tmp_path / "o"), "--tokenizer", "char"]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [f"prepare_data.py: error: {bad}, line 1: not JSON (Expecting value, column "
                                          "1); JSON Lines files (.jsonl, .json) hold one JSON object per line"]


def test_the_summary_says_when_a_trained_bpe_holds_fewer_tokens_than_asked():
    from llm.cli.prepare import summary

    split = {"documents": 2, "tokens": 10, "bytes": 40, "rows": 1, "dropped_tokens": 0, "replacements": 0}
    for spec, size, note in (("bpe:8192", 1763, " (the corpus holds too few distinct pieces for 8,192)"),
                             ("bpe:300", 300, ""), ("char", 70, "")):
        manifest = {"tokenizer": {"spec": spec, "vocab_size": size, "path": "tokenizer"}, "seq_len": 8,
                    "splits": {"train": split}}
        assert summary(manifest, "d")[0] == f"tokenizer: {spec}, {size:,} tokens{note}"
