"""Plain containers that flow through `rlhflab.data`: raw rows, row problems, examples.

A `Record` is one row as read from disk, with enough provenance (file, line,
row index) that any problem with it can be reported as `file.jsonl:17`.
Validation turns records into typed, text-only examples; tokenisation comes later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union


@dataclass(frozen=True)
class Record:
    """One raw row from a JSONL file, a Parquet file or a saved `datasets` folder."""

    source: str  # the path the row came from (with "[split]" for a DatasetDict)
    line: int | None  # 1-based line number for JSONL; None for Parquet / datasets
    index: int  # 0-based position of the row among the rows read
    row: dict[str, Any]  # the row itself; {} when `error` is set
    error: str | None = None  # set when the line could not be parsed (bad JSON, not an object)


@dataclass(frozen=True)
class RowProblem:
    """Why one row was rejected, and where it is."""

    source: str
    line: int | None
    index: int
    reason: str  # full human sentence, e.g. "missing field 'completion'"
    category: str = "invalid row"  # short fixed label used to count problems by kind

    @property
    def where(self) -> str:
        """`file.jsonl:17` for line-based files, `file.parquet row 16` otherwise."""
        if self.line is not None:
            return f"{self.source}:{self.line}"
        return f"{self.source} row {self.index}"

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


@dataclass(frozen=True)
class SFTExample:
    prompt: str  # rendered prompt text (chat template applied for conversations)
    completion: str  # rendered completion text, without EOS (added at tokenisation)
    family: str | None = None
    violation: str | None = None


@dataclass(frozen=True)
class PairExample:
    prompt: str
    chosen: str
    rejected: str
    family: str | None = None
    violation: str | None = None


@dataclass(frozen=True)
class PromptExample:
    prompt: str
    family: str | None = None
    reference: str | None = None  # optional reference answer, e.g. for evaluation


Example = Union[SFTExample, PairExample, PromptExample]
