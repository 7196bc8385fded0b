"""Long lines and long documents: read in bounded pieces that reassemble to the document, cut where
the tokens of the pieces are the whole document's, and prepared into the same shards."""

import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from llm.data import sources
from llm.data.sources import iter_documents, resolve_inputs
from llm.data.tokenizer import train_tokenizer
from llm.utils.pretrained import pretrained_path

SMOLLM2 = pretrained_path("smollm2-135m-instruct")
# Words, runs of spaces, tabs, line ends (\r\n too), digits, punctuation and characters of 2-4 UTF-8 bytes.
TEXT = st.lists(st.sampled_from(["a", "bc", "word", " ", "  ", "\t", "\n", "\r\n", "\n\n", "7", "42", ".", "'s",
                                 "é", "日本", "😀", "\u3000"]), max_size=60).map("".join)


def reference(text: str, mode: str) -> list[str]:
    """The documents of ``text`` as read whole, by the definitions of ``read_documents``."""
    text = text.removeprefix("\ufeff")
    if mode == "file":
        return [text] if text.strip() else []
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()
    lines = [line.removesuffix("\r") for line in lines]
    if mode == "line":
        return [line for line in lines if line.strip()]
    paragraphs, current = [], []
    for line in lines + [""]:
        if line.strip():
            current.append(line)
        elif current:
            paragraphs.append("\n".join(current))
            current = []
    return paragraphs


def reassembled(path, **options) -> list[str]:
    """Documents read from ``path``, each the join of its pieces, checked to come in order."""
    docs, parts, identity = [], [], None
    for doc in iter_documents(resolve_inputs([path]), **options):
        assert identity in (None, doc.identity)
        parts.append(doc.text)
        identity = doc.identity
        if doc.end:
            docs.append("".join(parts))
            parts, identity = [], None
    assert not parts  # the last piece of every document says it ends
    return docs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT, block=st.integers(4, 12), piece=st.integers(2, 9), bom=st.booleans(),
       mode=st.sampled_from(sources.SPLIT_MODES))
def test_pieces_of_long_lines_and_documents_reassemble_to_the_documents(tmp_path, monkeypatch, text, block, piece,
                                                                         bom, mode):
    monkeypatch.setattr(sources, "_BLOCK_BYTES", block)
    monkeypatch.setattr(sources, "PIECE_CHARS", piece)
    path = tmp_path / "long.txt"
    path.write_bytes(("\ufeff" if bom else "").encode() + text.encode("utf-8"))
    got, want = reassembled(path, split_documents=mode), reference(text, mode)
    assert len(got) == len(want)
    for doc, whole in zip(got, want):
        # A document may lose whitespace before its first text when that whitespace fills whole pieces.
        assert whole.endswith(doc) and not whole[: len(whole) - len(doc)].strip()


def test_a_long_jsonl_record_comes_in_pieces_and_reassembles(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "_BLOCK_BYTES", 16)
    monkeypatch.setattr(sources, "PIECE_CHARS", 8)
    records = ["a long record of many words 日本 😀 " * 5, "short"]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps({"text": r}) + "\n" for r in records))
    assert reassembled(path) == records
    assert len(list(iter_documents(resolve_inputs([path])))) > len(records)


def _tokenizers() -> list:
    found = [train_tokenizer("bpe:300", ["the quick brown fox jumps over the lazy dog 42 times, é 日本 😀\n" * 20])]
    if SMOLLM2.is_file():
        from llm.formats import gguf_tokenizer

        found.append(gguf_tokenizer(SMOLLM2))
    return found


TOKENIZERS = _tokenizers()


@settings(max_examples=200, deadline=None)
@given(text=TEXT, piece=st.integers(4, 12))
def test_pieces_cut_at_a_space_have_the_whole_documents_tokens(text, piece):
    pieces, start, cuts = [], 0, []
    while len(text) - start > piece:
        cut = sources._cut(text, start, piece)
        pieces.append(text[start:cut])
        start = cut
        cuts.append(cut)
    pieces.append(text[start:])
    # a cut at the limit (no space between words in the piece's second half) may split a token
    assume(all(c + 1 < len(text) and text[c] == " " and not text[c - 1].isspace() and not text[c + 1].isspace()
               for c in cuts))
    for tokenizer in TOKENIZERS:
        backend = tokenizer.backend_tokenizer
        whole = backend.encode(text, add_special_tokens=False).ids
        assert [i for p in pieces for i in backend.encode(p, add_special_tokens=False).ids] == whole


def test_a_cut_prefers_a_space_between_words():
    text = "aaaa bbbb  cccc"
    assert sources._cut(text, 0, 8) == 4  # before " bbbb", not inside the double space
    assert sources._cut("x" * 20, 0, 8) == 8  # no space: at the limit


def test_one_long_line_is_prepared_in_the_memory_of_many_short_ones(tmp_path):
    # 6 MB of text on one line and on 2,000-character lines: read whole and tokenized at once, the one
    # line took about 0.9 GB more
    line = ("lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor " * 80_000)[: 6 * 10**6]
    tokenizer = train_tokenizer("bpe:400", [line[:200_000]])
    tokenizer.save_pretrained(tmp_path / "tok")
    peaks = {}
    for name, text in (("lines", "\n".join(line[i : i + 1999] for i in range(0, len(line), 2000))), ("one", line)):
        (tmp_path / f"{name}.txt").write_text(text)
        command = [sys.executable, "-m", "llm", "prepare", str(tmp_path / f"{name}.txt"), "--out",
                   str(tmp_path / name), "--tokenizer", str(tmp_path / "tok"), "--validation-fraction", "0",
                   "--split-documents", "line", "--seq-len", "64", "--quiet"]
        # the child's peak, measured by a small parent of its own (RUSAGE_CHILDREN is the largest child's)
        measure = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
                   "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
        done = subprocess.run([sys.executable, "-c", measure, *command], check=True, capture_output=True, text=True)
        peaks[name] = int(done.stdout.split()[-1]) // 1024
        manifest = json.loads((tmp_path / name / "llm_data.json").read_text())
        assert manifest["splits"]["train"]["documents"] == (1 if name == "one" else 3000)
    assert peaks["one"] - peaks["lines"] < 60, peaks
