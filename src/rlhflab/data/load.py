"""Read user data into `Record`s, and `load_examples`: read + validate in one call.

What `path` may name:
  * JSONL (`.jsonl`, `.json` with one object per line): `line` is the 1-based line
    number; blank lines are skipped; a line that is not valid JSON or not an object
    becomes a `Record` with `error` set, reported later like any other bad row.
    A `.json` file holding one JSON array of objects is also accepted (`line` None).
  * Parquet (`.parquet`): `index` is the row index.
  * A folder written by `datasets.Dataset.save_to_disk` / `DatasetDict.save_to_disk`.
  * Anything else `datasets.load_dataset(path, config, split=split)` resolves: a folder of
    data files (e.g. train.jsonl + test.jsonl, one split per file) or, when no such local
    path exists, a dataset on the Hugging Face Hub ("trl-lib/ultrafeedback_binarized").

Splits: `NAME:SPLIT` in `path` picks the split of that one dataset (slices too:
"trl-lib/tldr:validation[:200]"); otherwise `split` does; with neither, a dataset with one
split uses it and one with several is an error listing them. A plain file has no splits.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

from rlhflab.data.records import Example, Record, RowProblem
from rlhflab.data.validate import KINDS, validate
from rlhflab.errors import UserInputError

logger = logging.getLogger("rlhflab.data")

MAX_LISTED_PROBLEMS = 20  # strict mode lists this many rows, then "... and N more"
LOGGED_PROBLEMS = 5  # default mode logs this many example rows
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
# a missing name ending like this, or starting like a path, was meant as a local file, not a hub id
PATH_LOOKING = (*FILE_SUFFIXES, ".csv", ".arrow", ".txt")


def read_records(path: str | Path, split: str | None = None, config: str | None = None) -> list[Record]:
    """Every row of the file, folder or `datasets` name `path` (see the module docstring).

    `split` and `config` matter only for `datasets` folders and names; `NAME:SPLIT` in `path`
    overrides `split`.
    """
    name, named_split = _name_and_split(str(path))
    split = named_split or split
    p = Path(name)
    if p.is_file():
        if named_split:
            raise UserInputError(f"a single file has no splits, but {str(path)!r} names split {named_split!r}",
                                 fix=f"pass {name!r} alone")
        return _read_file(p)
    if p.is_dir() and _is_saved_dataset(p):
        return _read_saved_dataset(p, split)
    if not p.is_dir() and _looks_like_a_path(name):
        raise UserInputError(
            f"data file or folder not found: {name!r}",
            fix="check the path (relative paths are resolved from the current directory "
            f"{str(Path.cwd())!r}); expected a .jsonl / .parquet file, a folder, or a datasets name",
        )
    return _load_dataset(name, config, split, local=p.is_dir())


def _name_and_split(text: str) -> tuple[str, str | None]:
    """Split `trl-lib/tldr:validation` into name and split; an existing path is kept whole."""
    if Path(text).exists() or ":" not in text:
        return text, None
    name, _, split = text.partition(":")
    return (name, split) if name and split else (text, None)


def _looks_like_a_path(name: str) -> bool:
    return name.lower().endswith(PATH_LOOKING) or name.startswith((".", "/", "~")) or "\\" in name


def _read_file(path: Path) -> list[Record]:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return _read_json(path)
    if suffix == ".parquet":
        return _read_parquet(path)
    raise UserInputError(
        f"unsupported data file type {suffix or '(no extension)'!r}",
        where=str(path),
        fix="use a .jsonl, .json (one object per line) or .parquet file, a folder of data files, "
        "or a folder saved with datasets' save_to_disk",
    )


def _read_json(path: Path) -> list[Record]:
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        return _read_json_array(path, text)
    records: list[Record] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        row, error = {}, None
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as e:
            error = f"malformed JSON line ({e.msg} at column {e.colno})"
        else:
            if isinstance(value, dict):
                row = value
            else:
                error = f"JSON line is a {type(value).__name__}, not an object"
        records.append(Record(str(path), lineno, len(records), row, error))
    return records


def _read_json_array(path: Path, text: str) -> list[Record]:
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserInputError(
            f"malformed JSON ({e.msg})", where=f"{path}:{e.lineno}",
            fix="fix the JSON, or write one object per line (JSONL)",
        ) from None
    return [
        Record(str(path), None, i, v if isinstance(v, dict) else {},
               None if isinstance(v, dict) else f"array item is a {type(v).__name__}, not an object")
        for i, v in enumerate(values)
    ]


def _read_parquet(path: Path) -> list[Record]:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for a broken file
        raise UserInputError(
            f"could not read Parquet file ({type(e).__name__}: {e})", where=str(path),
            fix="check that the file is a complete Parquet file",
        ) from e
    return [Record(str(path), None, i, row) for i, row in enumerate(rows)]


def _is_saved_dataset(path: Path) -> bool:
    """A folder written by save_to_disk (what `datasets.load_from_disk` reads)."""
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _read_saved_dataset(path: Path, split: str | None) -> list[Record]:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        return _records_of_split(ds, split, str(path))
    return [Record(str(path), None, i, dict(row)) for i, row in enumerate(ds)]


def _load_dataset(name: str, config: str | None, split: str | None, local: bool) -> list[Record]:
    """`datasets.load_dataset(name, config, split=split)`, its failures turned into our errors."""
    import datasets

    try:
        ds = datasets.load_dataset(name, config or None, split=split)
    except (ConnectionError, FileNotFoundError) as e:  # offline, not on the Hub, a folder without data files
        raise _not_loadable(name, local, e) from e
    except datasets.exceptions.DatasetGenerationError as e:  # e.g. a column's type differs between files
        raise UserInputError(
            f"datasets could not build {name!r}: {' '.join(str(e.__cause__ or e).split())}",
            fix="give every file of the dataset the same columns, each of one type (a column holds strings in "
            "every row, or message lists in every row)",
        ) from e
    except ValueError as e:  # an unknown split or config: datasets names the ones it has
        raise UserInputError(
            f"datasets could not load {name!r} with config {config or 'default'!r} and split {split!r}: {e}",
            fix="pick a split with NAME:SPLIT (or dataset_split) and a config with dataset_config",
        ) from e
    if isinstance(ds, datasets.DatasetDict):
        return _records_of_split(ds, None, name)
    return [Record(f"{name}[{split}]", None, i, dict(row)) for i, row in enumerate(ds)]


def _not_loadable(name: str, local: bool, error: Exception) -> UserInputError:
    detail = f"{type(error).__name__}: {error}"
    if local:
        return UserInputError(
            f"folder is neither a saved Hugging Face dataset nor a folder of data files datasets can read ({detail})",
            where=name, fix="pass a .jsonl / .parquet file, a folder holding such files (one per split, e.g. "
            "train.jsonl), or a folder written by Dataset.save_to_disk / DatasetDict.save_to_disk")
    return UserInputError(
        f"no local file or folder {name!r} exists, and datasets could not load it from the Hugging Face Hub "
        f"(the Hub could not be reached, or has no such dataset; {detail})",
        fix="check the path (relative to the current directory) or the dataset id; offline, download the dataset "
        "beforehand (it is then read from the datasets cache; HF_HUB_OFFLINE=1 skips the network retries) or "
        "export it to JSONL / Parquet",
    )


def _records_of_split(ds, split: str | None, source: str) -> list[Record]:
    """Rows of one split of a DatasetDict: `split`, or its only split when none is named."""
    if split is None and len(ds) == 1:
        split = next(iter(ds))
    if split is None or split not in ds:
        available = ", ".join(repr(s) for s in ds)
        what = "the dataset has several splits" if split is None else f"no split {split!r}"
        raise UserInputError(f"{what}; available splits: {available}", where=source,
                             fix="choose one with NAME:SPLIT or split=... (e.g. split='train')")
    return [Record(f"{source}[{split}]", None, i, dict(row)) for i, row in enumerate(ds[split])]


def load_examples(
    path: str | Path,
    kind: str,
    *,
    tokenizer=None,
    max_prompt_tokens: int | None = None,
    strict: bool = False,
    split: str | None = None,
    config: str | None = None,
) -> list[Example]:
    """Read `path` (with `split` / `config` for datasets, see `read_records`) and validate it as
    `kind` ("sft", "pairs" or "prompts"; formats in `rlhflab.data.validate`).

    Bad rows are dropped and logged (count per reason plus the first few), or, with
    `strict=True`, raise `UserInputError` listing them. No valid row always raises.
    """
    if kind not in KINDS:
        raise UserInputError(f"unknown data kind {kind!r}", fix=f"use one of {sorted(KINDS)}")
    records = read_records(path, split=split, config=config)
    if not records:
        raise UserInputError("the data file has no rows", where=str(path),
                             fix="add at least one row, or point to the right file")
    examples, problems = validate(records, kind, tokenizer=tokenizer,
                                  max_prompt_tokens=max_prompt_tokens)
    if problems and (strict or not examples):
        what = (f"no valid {kind} rows" if not examples else
                f"{len(problems)} of {len(records)} rows are invalid for kind {kind!r}")
        fix = ("fix these rows" + ("" if not examples else ", or pass strict=False to drop them")
               + f"; a {kind} row needs {KINDS[kind]}")
        raise UserInputError(f"{what}:\n{_list_problems(problems, MAX_LISTED_PROBLEMS)}\n",
                             where=str(path), fix=fix)
    if problems:
        counts = Counter(p.category for p in problems)
        summary = ", ".join(f"{c} ({n})" for c, n in counts.most_common())
        logger.warning("%s: dropped %d of %d rows as invalid %s data: %s\n%s",
                       path, len(problems), len(records), kind, summary,
                       _list_problems(problems, LOGGED_PROBLEMS))
    return examples


def _list_problems(problems: list[RowProblem], limit: int) -> str:
    lines = [f"  {p}" for p in problems[:limit]]
    if len(problems) > limit:
        lines.append(f"  ... and {len(problems) - limit} more")
    return "\n".join(lines)
