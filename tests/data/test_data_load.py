"""read_records: JSONL line numbers, Parquet and save_to_disk round-trips, path errors."""

from __future__ import annotations

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhflab.data import Record, SFTExample, load_examples, read_records
from rlhflab.errors import UserInputError

ROWS = [
    {"prompt": "say hi", "completion": "hi", "family": "greet"},
    {"prompt": "say bye", "completion": "bye", "family": None},
    {"prompt": "say hello", "completion": "", "family": "greet"},  # empty completion
]


def test_jsonl_line_numbers_skip_blank_lines_and_keep_bad_lines(write_jsonl):
    path = write_jsonl([ROWS[0], "", "{not json", "[1, 2]", ROWS[1]])
    records = read_records(path)
    assert [(r.line, r.index) for r in records] == [(1, 0), (3, 1), (4, 2), (5, 3)]
    assert records[0] == Record(str(path), 1, 0, ROWS[0], None)
    assert records[1].row == {} and records[1].error.startswith("malformed JSON line")
    assert records[2].error == "JSON line is a list, not an object"
    assert records[3].row == ROWS[1] and records[3].error is None


def test_json_array_file(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('[{"prompt": "say hi"}, 3]')
    records = read_records(path)
    assert [(r.line, r.index, r.row, r.error) for r in records] == [
        (None, 0, {"prompt": "say hi"}, None), (None, 1, {}, "array item is a int, not an object")]


def test_parquet_round_trip_reports_row_index(tmp_path):
    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    records = read_records(path)
    assert [r.row for r in records] == ROWS
    assert [(r.line, r.index) for r in records] == [(None, 0), (None, 1), (None, 2)]
    examples = load_examples(path, "sft")
    assert examples == [SFTExample("say hi", "hi", "greet", None), SFTExample("say bye", "bye")]
    with pytest.raises(UserInputError) as e:
        load_examples(path, "sft", strict=True)
    assert f"{path} row 2: empty field 'completion'" in str(e.value)


def test_save_to_disk_dataset_round_trip(tmp_path):
    datasets.Dataset.from_list(ROWS[:2]).save_to_disk(str(tmp_path / "ds"))
    records = read_records(tmp_path / "ds")
    assert [r.row for r in records] == ROWS[:2]
    assert records[1].source == str(tmp_path / "ds") and records[1].index == 1


def test_save_to_disk_dataset_dict_needs_a_split(tmp_path):
    folder = tmp_path / "dd"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list(ROWS[:2]),
        "test": datasets.Dataset.from_list(ROWS[2:]),
    }).save_to_disk(str(folder))
    with pytest.raises(UserInputError, match="available splits: 'train', 'test'"):
        read_records(folder)
    with pytest.raises(UserInputError, match="no split 'valid'; available splits"):
        read_records(folder, split="valid")
    records = read_records(folder, split="test")
    assert [r.row for r in records] == ROWS[2:]
    assert records[0].source == f"{folder}[test]"
    with pytest.raises(UserInputError, match=r"\[test\] row 0: empty field 'completion'"):
        load_examples(folder, "sft", split="test")


def test_missing_path_names_the_path_and_the_fix(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(UserInputError) as e:
        read_records(missing)
    msg = str(e.value)
    assert str(missing) in msg and "not found" in msg and "-> check the path" in msg


def test_unsupported_extension_and_plain_folder(tmp_path):
    (tmp_path / "data.csv").write_text("prompt,completion\n")
    with pytest.raises(UserInputError, match="unsupported data file type '.csv'"):
        read_records(tmp_path / "data.csv")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(UserInputError, match="folder is neither a saved Hugging Face dataset nor a "
                                             "folder of data files datasets can read"):
        read_records(tmp_path / "empty_dir")
