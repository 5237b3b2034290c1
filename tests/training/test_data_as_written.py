"""Data read as the user wrote it: JSON Lines split on "\n" only and decoded with
an optional byte-order mark, dataset.format honoured, invalid lines named by kind and place, and one huge document
cut into pieces before the train/validation split, with warnings where the data is lopsided."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from gpuscout_data import prepare as dp
from gpuscout_data import sources as data_sources
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuscout.domain.dataset_checks import dataset_problems
from gpuscout.errors import DataPreparationError

# text that str.splitlines() would split inside a JSON string written with ensure_ascii=False
LINE_BREAKERS = ["\u2028", "\u2029", "\u0085", "\x1c", "\x1d", "\x1e", "\x0b", "\x0c", "\r", "\n", "\ufeff"]
TEXTS = st.lists(
    st.text(alphabet=st.one_of(st.characters(blacklist_categories=("Cs",)), st.sampled_from(LINE_BREAKERS))),
    max_size=12,
)


def _config(source: Path, out: Path, **overrides: object) -> dp.PrepareConfig:
    base: dict[str, object] = {
        "input": str(source), "output": str(out), "tokenizer": "bpe", "vocab_size": 300, "sequence_length": 64,
        "validation_fraction": 0.2, "workers": 1, "quiet": True, "min_characters": 1,
    }  # fmt: skip
    base.update(overrides)
    return dp.PrepareConfig(**base)  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=TEXTS, ensure_ascii=st.booleans(), bom=st.booleans(), crlf=st.booleans())
def test_any_strings_written_as_json_lines_read_back_equal(
    tmp_path: Path, texts: list[str], ensure_ascii: bool, bom: bool, crlf: bool
) -> None:
    path = tmp_path / "data.jsonl"
    newline = "\r\n" if crlf else "\n"
    body = newline.join(json.dumps({"text": t}, ensure_ascii=ensure_ascii) for t in texts) + newline
    path.write_bytes(("\ufeff" if bom else "").encode() + body.encode("utf-8"))
    invalid: Counter[str] = Counter()
    assert list(data_sources._json_documents(path, "text", invalid)) == texts
    assert invalid["invalid"] == 0


def test_a_file_with_line_separators_inside_strings_keeps_every_record(tmp_path: Path) -> None:
    """The case seen: 475 records written with ensure_ascii=False, 325 'lost' and the hint blamed text_field."""
    path = tmp_path / "notes.jsonl"
    texts = [f"record {i}: first part\u2028second part\u0085third part of a long enough text" for i in range(475)]
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    summary = dp.prepare(_config(path, tmp_path / "out"))
    assert summary.documents_read == 475 and summary.dropped["invalid"] == 0


def test_a_byte_order_mark_does_not_lose_the_first_record_of_any_format(tmp_path: Path) -> None:
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_bytes(b"\xef\xbb\xbf" + b'{"text": "the first record"}\n{"text": "the second record"}\n')
    assert list(data_sources._json_documents(jsonl, "text", Counter())) == ["the first record", "the second record"]
    txt = tmp_path / "a.txt"
    txt.write_bytes(b"\xef\xbb\xbfthe first paragraph\n\nthe second one\n")
    assert list(data_sources._text_documents(txt)) == ["the first paragraph", "the second one"]


def test_invalid_lines_are_named_by_kind_and_first_place(tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"text": "a good record of text"}\nnot json at all\n{"body": "no text field"}\n{"text": 3}\n')
    dropped: Counter[str] = Counter()
    firsts: dict[str, str] = {}
    docs = list(data_sources.read_documents(str(path), "text", dropped, tmp_path, firsts=firsts))
    assert docs == ["a good record of text"]
    assert (dropped["invalid"], dropped["not_json"], dropped["no_text_field"]) == (3, 1, 2)
    assert firsts == {"not_json": f"{path} line 2", "no_text_field": f"{path} line 3"}
    only_broken = tmp_path / "broken.jsonl"
    only_broken.write_text("not json\n{also not\n")
    with pytest.raises(DataPreparationError) as err:
        dp.prepare(_config(only_broken, tmp_path / "o"))
    assert f"2 lines are not valid JSON, first at {only_broken} line 1" in str(err.value)
    assert "set dataset.text_field" not in str(err.value)  # the old hint blamed the field for broken JSON
    no_field = tmp_path / "fields.jsonl"
    no_field.write_text('{"body": "one"}\n{"body": "two"}\n')
    with pytest.raises(DataPreparationError, match=r"2 records have no string field 'text'.*set dataset.text_field"):
        dp.prepare(_config(no_field, tmp_path / "f"))


def test_dataset_format_is_honoured_and_an_unknown_suffix_is_a_clear_error(tmp_path: Path) -> None:
    notes = tmp_path / "notes.md"
    notes.write_text('{"text": "looks like json"}\n\nsecond paragraph of plain text\n')
    with pytest.raises(DataPreparationError, match=r"cannot tell its format from the suffix '.md'.*dataset.format"):
        list(data_sources.read_documents(str(notes), "text", Counter(), tmp_path))
    docs = list(data_sources.read_documents(str(notes), "text", Counter(), tmp_path, fmt="txt"))
    assert docs == ['{"text": "looks like json"}', "second paragraph of plain text"]
    # a .jsonl file read as txt on request: the format wins over the suffix
    lines = tmp_path / "folder" / "x.jsonl"
    lines.parent.mkdir()
    lines.write_text('{"text": "one"}\n')
    (lines.parent / "README").write_text("an extension-less text file\n")
    (lines.parent / ".hidden").write_text("never read\n")
    as_txt = list(data_sources.read_documents(str(lines.parent), "text", Counter(), tmp_path, fmt="txt"))
    assert as_txt == ["an extension-less text file", '{"text": "one"}']
    summary = dp.prepare(_config(notes, tmp_path / "out", format="txt"))
    assert summary.documents == 2


def test_one_huge_document_is_cut_before_the_split_and_flagged(tmp_path: Path) -> None:
    """The case seen: one 29 MB document among 20 small ones went to validation whole; the benchmark trained on
    0.04 % of the text. Scaled down: ~200 kB among 20 short documents, sequence length 64."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    small = [f"short document number {i} with a few words of its own." for i in range(20)]
    (folder / "small.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in small))
    words = " ".join(f"word{i % 97}" for i in range(40))
    huge = "\n".join(f"line {i}: {words}" for i in range(800))
    (folder / "huge.txt").write_text(huge + "\n")
    out = tmp_path / "out"
    summary = dp.prepare(_config(folder, out))
    assert summary.documents == 21 and summary.documents_cut == 1
    assert summary.max_piece_characters == dp.max_piece_characters(64)
    assert summary.largest_document_fraction > 0.9
    train, validation = summary.splits["train"].tokens, summary.splits["validation"].tokens
    assert train > 2 * validation > 0  # pieces are split like documents: most of the text trains
    warnings = [p.message for p in dataset_problems(json.loads((out / "dataset.json").read_text()))]
    assert any("one document holds" in w and "cut into pieces" in w for w in warnings)


def test_cutting_keeps_every_character_of_text_and_leaves_short_documents_alone() -> None:
    text = "\n".join(f"line {i} " + "x" * (i % 50) for i in range(3000))
    pieces, cut = dp.cut_long_documents(["short one", text], 4096)
    assert cut == 1 and pieces[0] == "short one"
    assert all(len(p) <= 4096 for p in pieces)
    assert "".join(pieces[1:]).replace("\n", "") == text.replace("\n", "")


def test_a_validation_split_larger_than_training_is_flagged() -> None:
    summary = {"splits": {"train": {"blocks": 3, "tokens": 150}, "validation": {"blocks": 10, "tokens": 600}},
               "validation_fraction": 0.05}  # fmt: skip
    [problem] = dataset_problems(summary)
    assert problem.severity == "warn" and "validation split holds more tokens (600)" in problem.message


def test_an_empty_or_all_short_corpus_says_so_in_words(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataPreparationError) as err:
        dp.prepare(_config(empty, tmp_path / "e"))
    assert f"{empty}: no documents left after cleaning (read 0 documents)" in str(err.value)
    assert "{" not in str(err.value)  # not a Python dict of counters
    short = tmp_path / "short.txt"
    short.write_text("ab\n\ncd\n\nab\n")
    with pytest.raises(DataPreparationError) as err:
        dp.prepare(_config(short, tmp_path / "s", min_characters=20))
    assert "(read 3 documents: 3 shorter than dataset.min_characters)" in str(err.value)
    assert "lower it" in str(err.value)
