"""read_records: JSONL line numbers, Parquet, save_to_disk and data folders, datasets names, path errors."""

from __future__ import annotations

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhflab.data import PairExample, Record, SFTExample, load_examples, read_records
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


def conversation(answer: str) -> list[dict]:
    return [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": answer}]


PAIRS = {  # implicit-prompt conversational pairs (every file of a datasets folder has one schema)
    "train": [{"chosen": conversation("hi"), "rejected": conversation("bye")},
              {"chosen": conversation("hello"), "rejected": conversation("hi hi")}],
    "test": [{"chosen": conversation("good"), "rejected": conversation("bad")}],
}


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """datasets.load_dataset writes Arrow copies of what it reads: keep them in the test's folder."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


@pytest.fixture
def data_folder(tmp_path, write_jsonl):
    """A folder of data files (not a save_to_disk folder): one JSONL file per split."""
    folder = tmp_path / "prefs"
    folder.mkdir()
    for split, rows in PAIRS.items():
        write_jsonl(rows, name=f"prefs/{split}.jsonl")
    return folder


def test_folder_of_data_files_is_read_by_datasets_per_split(data_folder):
    records = read_records(data_folder, split="train")
    assert [r.row for r in records] == PAIRS["train"]
    assert [(r.source, r.line, r.index) for r in records] == [(f"{data_folder}[train]", None, 0),
                                                              (f"{data_folder}[train]", None, 1)]
    # NAME:SPLIT picks the split of that one dataset, over `split`
    assert [r.row for r in read_records(f"{data_folder}:test", split="train")] == PAIRS["test"]
    examples = load_examples(f"{data_folder}:test", "pairs")
    assert examples == [PairExample("user: say hi\nassistant: ", "good", "bad")]
    assert load_examples(data_folder, "pairs", split="train[1:]") == [
        PairExample("user: say hi\nassistant: ", "hello", "hi hi")]


def test_folder_of_data_files_split_errors(data_folder):
    with pytest.raises(UserInputError, match=r"the dataset has several splits; available splits: 'train', 'test'"):
        read_records(data_folder)
    with pytest.raises(UserInputError) as e:
        read_records(f"{data_folder}:validation")
    assert f"datasets could not load {str(data_folder)!r} with config 'default' and split 'validation'" in str(e.value)
    assert "Should be one of ['train', 'test']" in str(e.value)
    with pytest.raises(UserInputError, match="BuilderConfig 'nope' not found"):
        read_records(data_folder, split="train", config="nope")


def test_folder_whose_files_disagree_on_a_column_type(data_folder, write_jsonl):
    write_jsonl([{"chosen": "The sky is blue.", "rejected": "The sky is green."}], name="prefs/test.jsonl")
    with pytest.raises(UserInputError) as e:
        read_records(data_folder, split="train")
    assert f"datasets could not build {str(data_folder)!r}: Couldn't cast array of type" in str(e.value)
    assert "-> give every file of the dataset the same columns, each of one type" in str(e.value)


def test_a_dataset_with_one_split_needs_no_split_name(tmp_path, write_jsonl):
    (tmp_path / "only").mkdir()
    write_jsonl(ROWS[:2], name="only/rows.jsonl")  # datasets calls a lone file's split "train"
    assert [r.row for r in read_records(tmp_path / "only")] == [{**r, "family": r["family"]} for r in ROWS[:2]]
    datasets.DatasetDict({"valid": datasets.Dataset.from_list(ROWS[:1])}).save_to_disk(str(tmp_path / "dd"))
    [record] = read_records(tmp_path / "dd")
    assert record.source == f"{tmp_path / 'dd'}[valid]" and record.row == ROWS[0]


def test_unreachable_hub_name_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # no network retries in the test
    with pytest.raises(UserInputError) as e:
        read_records("someone/no-such-dataset", split="train")
    msg = str(e.value)
    assert msg.startswith("no local file or folder 'someone/no-such-dataset' exists, and datasets could not load it "
                          "from the Hugging Face Hub (the Hub could not be reached, or has no such dataset; "
                          "ConnectionError: ")
    assert "-> check the path (relative to the current directory) or the dataset id" in msg


def test_path_like_names_and_splits_of_files(tmp_path, write_jsonl):
    with pytest.raises(UserInputError, match="data file or folder not found: 'data/missing.parquet'"):
        read_records("data/missing.parquet")
    path = write_jsonl(ROWS[:1])
    with pytest.raises(UserInputError, match=f"a single file has no splits, but '{path}:test' names split 'test'"):
        read_records(f"{path}:test")
    assert [r.row for r in read_records(path, split="train")] == ROWS[:1]  # a default split is no error


def test_datasets_fill_absent_columns_with_none_and_rows_keep_their_own_format(tmp_path, write_jsonl):
    (tmp_path / "mixed").mkdir()
    write_jsonl([{"text": "hello world"}, {"prompt": "say hi", "completion": "hi"}], name="mixed/train.jsonl")
    records = read_records(tmp_path / "mixed", split="train")
    assert [r.row for r in records] == [{"text": "hello world", "prompt": None, "completion": None},
                                        {"text": None, "prompt": "say hi", "completion": "hi"}]
    assert load_examples(tmp_path / "mixed", "sft", split="train") == [SFTExample("", "hello world"),
                                                                        SFTExample("say hi", "hi")]
