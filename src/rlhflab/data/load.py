"""Read user data files into `Record`s, and `load_examples`: read + validate in one call.

Supported inputs:
  * JSONL (`.jsonl`, `.json` with one object per line): `line` is the 1-based line
    number; blank lines are skipped; a line that is not valid JSON or not an object
    becomes a `Record` with `error` set, reported later like any other bad row.
    A `.json` file holding one JSON array of objects is also accepted (`line` None).
  * Parquet (`.parquet`): `index` is the row index.
  * A folder written by `datasets.Dataset.save_to_disk` / `DatasetDict.save_to_disk`;
    a DatasetDict needs `split`.
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


def read_records(path: str | Path, split: str | None = None) -> list[Record]:
    """Read every row of `path` (JSONL, Parquet or a saved `datasets` folder)."""
    p = Path(path)
    if not p.exists():
        raise UserInputError(
            f"data file or folder not found: {str(path)!r}",
            fix="check the path (relative paths are resolved from the current directory "
            f"{str(Path.cwd())!r}); expected a .jsonl / .parquet file or a save_to_disk folder",
        )
    if p.is_dir():
        return _read_saved_dataset(p, split)
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return _read_json(p)
    if suffix == ".parquet":
        return _read_parquet(p)
    raise UserInputError(
        f"unsupported data file type {suffix or '(no extension)'!r}",
        where=str(path),
        fix="use a .jsonl, .json (one object per line) or .parquet file, "
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


def _read_saved_dataset(path: Path, split: str | None) -> list[Record]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise UserInputError(
            "folder is not a saved Hugging Face dataset", where=str(path),
            fix="pass a .jsonl / .parquet file, or a folder written by "
            "Dataset.save_to_disk / DatasetDict.save_to_disk",
        ) from e
    source = str(path)
    if isinstance(ds, datasets.DatasetDict):
        available = ", ".join(repr(s) for s in ds)
        if split is None or split not in ds:
            what = "the dataset has several splits" if split is None else f"no split {split!r}"
            raise UserInputError(
                f"{what}; available splits: {available}", where=source,
                fix="choose one with split=... (e.g. split='train')",
            )
        ds, source = ds[split], f"{path}[{split}]"
    return [Record(source, None, i, dict(row)) for i, row in enumerate(ds)]


def load_examples(
    path: str | Path,
    kind: str,
    *,
    tokenizer=None,
    max_prompt_tokens: int | None = None,
    strict: bool = False,
    split: str | None = None,
) -> list[Example]:
    """Read `path` and validate it as `kind` ("sft", "pairs" or "prompts").

    Bad rows are dropped and logged (count per reason plus the first few), or, with
    `strict=True`, raise `UserInputError` listing them. No valid row always raises.
    """
    if kind not in KINDS:
        raise UserInputError(f"unknown data kind {kind!r}", fix=f"use one of {sorted(KINDS)}")
    records = read_records(path, split=split)
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
