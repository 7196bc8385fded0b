"""Corpus sources: every input form and format read back as written, split modes, and every bad input."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llm.data import markdown_to_text, play_paths
from llm.data.sources import DataError, input_fingerprint, iter_documents, read_documents, resolve_inputs


def paragraphs(play: str, n: int, skip: int = 30) -> list[str]:
    """``n`` real paragraphs (speeches) of a play, as plain text."""
    text = markdown_to_text(play_paths()[play].read_text(encoding="utf-8"))
    return [p for p in text.split("\n\n") if p.strip()][skip : skip + n]


def texts_of(inputs, **options) -> list[str]:
    return [doc.text for doc in iter_documents(resolve_inputs(inputs), **options)]


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
    return path


def test_folder_is_searched_recursively_in_sorted_order(tmp_path, monkeypatch):
    docs = ["\n\n".join(paragraphs(play, 3)) + "\n" for play in ("hamlet", "macbeth", "the-tempest", "othello")]
    root = tmp_path / "corpus"
    write(root / "b" / "z.txt", docs[0])
    write(root / "b" / "a.md", docs[1])
    write(root / "a.txt", docs[2])
    write(root / "c" / "d" / "e.TXT", docs[3])
    write(root / "notes.csv", "ignored: unknown extension in a folder")
    write(root / ".hidden" / "x.txt", "ignored: hidden")
    sources = resolve_inputs([root])
    assert [s.name for s in sources] == ["a.txt", "b/a.md", "b/z.txt", "c/d/e.TXT"]
    assert [s.format for s in sources] == ["text"] * 4
    assert texts_of([root]) == [docs[2], docs[1], docs[0], docs[3]]
    # A file is named by its file name, whatever path reaches it; identities follow.
    ids = [d.identity for d in iter_documents(resolve_inputs([str(root / "b" / "z.txt")]))]
    assert ids == ["z.txt:0"]
    monkeypatch.chdir(tmp_path)
    assert [s.name for s in resolve_inputs(["corpus/b/../b/z.txt", "corpus/b"])] == ["z.txt", "a.md"]


def test_globs(tmp_path):
    docs = paragraphs("hamlet", 4)
    for i, doc in enumerate(docs):
        write(tmp_path / "g" / f"sub{i % 2}" / f"{i}.txt", doc)
    write(tmp_path / "g" / "sub0" / "skip.md", "not matched")
    sources = resolve_inputs([str(tmp_path / "g" / "**" / "*.txt")])
    assert [s.name for s in sources] == ["sub0/0.txt", "sub0/2.txt", "sub1/1.txt", "sub1/3.txt"]
    assert texts_of([str(tmp_path / "g" / "sub*" / "*.txt")]) == [docs[0], docs[2], docs[1], docs[3]]
    # A file given twice (a glob and the file itself) is read once.
    assert len(resolve_inputs([str(tmp_path / "g" / "sub0" / "*.txt"), tmp_path / "g" / "sub0" / "0.txt"])) == 2


def test_split_modes(tmp_path):
    paras = paragraphs("macbeth", 6)
    # Extra blank and whitespace-only lines between paragraphs, CRLF line ends in one file.
    text = "\n\n".join(paras[:3]) + "\n \n\n\t\n" + "\n\n".join(paras[3:]) + "\n\n"
    write(tmp_path / "lf.txt", text)
    write(tmp_path / "crlf.txt", text.replace("\n", "\r\n").encode("utf-8"))
    for name in ("lf.txt", "crlf.txt"):
        path = tmp_path / name
        assert texts_of([path], split_documents="blank-line") == paras
        lines = [line for p in paras for line in p.split("\n") if line.strip()]
        assert texts_of([path], split_documents="line") == lines
    assert texts_of([tmp_path / "lf.txt"]) == [text]
    docs = list(iter_documents(resolve_inputs([tmp_path / "lf.txt"]), split_documents="blank-line"))
    assert len({d.identity for d in docs}) == len(paras)


def test_empty_documents_are_dropped(tmp_path):
    paras = paragraphs("hamlet", 2)
    write(tmp_path / "a.txt", "")
    write(tmp_path / "b.txt", "  \n\n")
    write(tmp_path / "c.txt", paras[0])
    write(tmp_path / "d.jsonl", "\n".join(json.dumps({"text": t}) for t in ["", paras[1], "   "]) + "\n\n")
    assert texts_of([tmp_path]) == paras


def test_jsonl(tmp_path):
    docs = paragraphs("othello", 5)
    lines = [json.dumps({"id": i, "body": doc, "meta": {"play": "othello"}}) for i, doc in enumerate(docs)]
    write(tmp_path / "a.jsonl", "\n".join(lines[:3]) + "\n\n")
    write(tmp_path / "b.json", "\n".join(lines[3:]))  # .json is JSON Lines too; no final newline
    assert texts_of([tmp_path], text_field="body") == docs
    message = r"a\.jsonl, line 1: record lacks the field 'text' \(its keys: \['body', 'id', 'meta'\]\)"
    with pytest.raises(DataError, match=message):
        texts_of([tmp_path])


def test_parquet_is_read_in_batches(tmp_path):
    docs = paragraphs("king-lear", 40, skip=10) * 60  # 2400 rows: several record batches and row groups
    table = pa.table({"content": docs, "n": list(range(len(docs)))})
    pq.write_table(table, tmp_path / "x.parquet", row_group_size=500)
    assert texts_of([tmp_path / "x.parquet"], text_field="content") == docs
    with pytest.raises(DataError, match=r"x\.parquet: no column 'text' \(its columns: \['content', 'n'\]\)"):
        texts_of([tmp_path / "x.parquet"])
    with pytest.raises(DataError, match="column 'n' holds int64, not strings"):
        texts_of([tmp_path / "x.parquet"], text_field="n")


def test_hf_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    docs = paragraphs("twelfth-night", 6)
    datasets.Dataset.from_dict({"text": docs[:4], "label": [0, 1, 0, 1]}).save_to_disk(tmp_path / "ds")
    assert [s.format for s in resolve_inputs([tmp_path / "ds"])] == ["hf"]
    assert texts_of([tmp_path / "ds"]) == docs[:4]
    both = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs[:4]}),
                                 "test": datasets.Dataset.from_dict({"text": docs[4:]})})
    both.save_to_disk(tmp_path / "dd")
    sources = resolve_inputs([tmp_path / "dd"])
    assert [s.name for s in sources] == ["dd/train", "dd/test"]
    assert texts_of([tmp_path / "dd"]) == docs
    # Found inside a searched folder too, next to plain files.
    write(tmp_path / "mix" / "a.txt", docs[5])
    datasets.Dataset.from_dict({"text": docs[:2]}).save_to_disk(tmp_path / "mix" / "b")
    assert texts_of([tmp_path / "mix"]) == [docs[5], *docs[:2]]
    with pytest.raises(DataError, match=r"no column 'body' \(its columns: \['text', 'label'\]\)"):
        texts_of([tmp_path / "ds"], text_field="body")
    fingerprint = input_fingerprint(resolve_inputs([tmp_path / "ds"]))
    assert {Path(row["path"]).name for row in fingerprint} >= {"state.json", "dataset_info.json"}


def test_explicit_format(tmp_path):
    docs = paragraphs("hamlet", 2)
    write(tmp_path / "data.log", json.dumps({"text": docs[0]}) + "\n" + json.dumps({"text": docs[1]}) + "\n")
    assert [d.text for d in iter_documents(resolve_inputs([tmp_path / "data.log"], "jsonl"))] == docs
    assert [d.text for d in iter_documents(resolve_inputs([tmp_path / "data.log"], "text"))] == [
        (tmp_path / "data.log").read_text()]
    with pytest.raises(DataError, match=r"data\.log: unknown extension '\.log'; --format auto knows"):
        resolve_inputs([tmp_path / "data.log"])


def test_not_utf8_names_file_and_offset(tmp_path):
    head = paragraphs("hamlet", 3)
    prefix = ("\n\n".join(head) + "\n\nCafé ").encode("utf-8")
    data = prefix + b"\xff\xfeok\n\n" + b"tail \xc3\n"  # two invalid bytes, then a truncated sequence
    path = write(tmp_path / "bad.txt", data)
    for mode in ("file", "blank-line", "line"):
        with pytest.raises(DataError, match=rf"bad\.txt is not UTF-8: invalid byte 0xff at byte offset {len(prefix)};"):
            texts_of([path], split_documents=mode)
    docs = list(iter_documents(resolve_inputs([path]), split_documents="blank-line", encoding_errors="replace"))
    assert [d.text for d in docs] == [*head, "Café \ufffd\ufffdok", "tail \ufffd"]
    assert [d.replacements for d in docs] == [0, 0, 0, 2, 1]
    # A real U+FFFD in the text is not a replacement.
    write(tmp_path / "fffd.jsonl", json.dumps({"text": "a \ufffd b"}, ensure_ascii=False) + "\n")
    doc, = read_documents(resolve_inputs([tmp_path / "fffd.jsonl"])[0], encoding_errors="replace")
    assert (doc.text, doc.replacements) == ("a \ufffd b", 0)
    whole, = iter_documents(resolve_inputs([path]), encoding_errors="replace")
    assert whole.replacements == 3 and whole.text == data.decode("utf-8", "replace")


def test_bad_jsonl_records(tmp_path):
    good = json.dumps({"text": paragraphs("hamlet", 1)[0]})
    cases = {
        "notjson": (f'{good}\n\n{{"text": "unterminated\n', r"notjson\.jsonl, line 3: not JSON"),
        "array": (f"{good}\n[1, 2]\n", r"array\.jsonl, line 2: a JSON list, not an object"),
        "number": (f'{good}\n{{"text": 3, "id": 1}}\n', r"number\.jsonl, line 2: record has int, not a string, "
                   r"in the field 'text' \(its keys: \['id', 'text'\]\)"),
        "null": (f'{{"text": null}}\n', r"null\.jsonl, line 1: record has NoneType, not a string"),
    }
    for name, (content, message) in cases.items():
        path = write(tmp_path / f"{name}.jsonl", content)
        documents = read_documents(resolve_inputs([path])[0])
        if name in ("array", "number", "notjson"):
            assert next(documents).text  # streamed: the good first record comes before the error
        with pytest.raises(DataError, match=message):
            list(documents)


def test_bad_inputs(tmp_path):
    with pytest.raises(DataError, match=r"input '.*nothing-\*\.txt' matches nothing"):
        resolve_inputs([str(tmp_path / "nothing-*.txt")])
    with pytest.raises(DataError, match=r"input '.*missing\.txt' does not exist"):
        resolve_inputs([tmp_path / "missing.txt"])
    (tmp_path / "empty").mkdir()
    write(tmp_path / "empty" / "x.csv", "a,b")
    with pytest.raises(DataError, match=r"holds nothing to read: no files with extensions \.txt, \.md"):
        resolve_inputs([tmp_path / "empty"])
    with pytest.raises(DataError, match="--format must be one of auto, text, jsonl, parquet, hf"):
        resolve_inputs([tmp_path], "csv")
    with pytest.raises(DataError, match="--format hf takes a folder"):
        resolve_inputs([write(tmp_path / "a.txt", "x")], "hf")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        texts_of([write(tmp_path / "broken.parquet", b"not parquet")])
    with pytest.raises(DataError, match="--split-documents must be one of file, blank-line, line"):
        texts_of([tmp_path / "a.txt"], split_documents="para")


def test_a_byte_order_mark_is_not_text_in_any_split_mode(tmp_path):
    paras = paragraphs("hamlet", 3)
    text = "\n\n".join(paras) + "\n"
    write(tmp_path / "bom.txt", b"\xef\xbb\xbf" + text.encode("utf-8"))
    write(tmp_path / "bom.jsonl", b"\xef\xbb\xbf" + "".join(json.dumps({"text": p}) + "\n" for p in paras).encode())
    assert texts_of([tmp_path / "bom.txt"]) == [text]
    assert texts_of([tmp_path / "bom.txt"], split_documents="blank-line") == paras
    assert texts_of([tmp_path / "bom.txt"], split_documents="line")[0] == paras[0].split("\n")[0]
    assert texts_of([tmp_path / "bom.jsonl"]) == paras
    # a later bad byte is still reported at its offset in the file
    write(tmp_path / "bad.txt", b"\xef\xbb\xbfab\xffc")
    with pytest.raises(DataError, match="byte offset 5"):
        texts_of([tmp_path / "bad.txt"])


def test_a_fifo_is_refused_not_read_forever(tmp_path):
    import os

    os.mkfifo(tmp_path / "pipe.txt")
    write(tmp_path / "corpus" / "a.txt", "some text\n")
    os.mkfifo(tmp_path / "corpus" / "b.txt")
    for spec in (tmp_path / "pipe.txt", tmp_path / "corpus"):
        with pytest.raises(DataError, match=r"is not a regular file \(a FIFO"):
            resolve_inputs([spec])


def test_a_lone_surrogate_in_json_is_named_by_file_and_line(tmp_path):
    write(tmp_path / "s.jsonl", '{"text": "fine"}\n{"text": "x\\ud800y"}\n{"text": "\\ud83d\\ude00 ok"}\n')
    with pytest.raises(DataError, match=r"s.jsonl, line 2: the field 'text' holds a lone UTF-16 surrogate"):
        texts_of([tmp_path / "s.jsonl"])
    write(tmp_path / "ok.jsonl", '{"text": "\\ud83d\\ude00 ok"}\n')
    assert texts_of([tmp_path / "ok.jsonl"]) == ["\U0001F600 ok"]
