"""Plain containers that flow through `rlhflab.data`: raw rows, row problems, examples.

A `Record` is one row as read from disk, with enough provenance (file, line,
row index) that any problem with it can be reported as `file.jsonl:17`.
Validation turns records into typed, text-only examples; tokenisation comes later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union


def location(source: str, line: int | None, index: int) -> str:
    """`file.jsonl:17` for line-based files, `file.parquet row 16` otherwise."""
    return f"{source}:{line}" if line is not None else f"{source} row {index}"


@dataclass(frozen=True)
class Record:
    """One raw row from a JSONL or Parquet file, or a `datasets` dataset (saved folder, data folder, hub)."""

    source: str  # the path or dataset name the row came from (with "[split]" for a split of a dataset)
    line: int | None  # 1-based line number for JSONL; None for Parquet / datasets
    index: int  # 0-based position of the row among the rows read
    row: dict[str, Any]  # the row itself; {} when `error` is set
    error: str | None = None  # set when the line could not be parsed (bad JSON, not an object)

    @property
    def where(self) -> str:
        return location(self.source, self.line, self.index)


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
        return location(self.source, self.line, self.index)

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
    prompt: str  # rendered prompt text (chat template applied for conversations)
    family: str | None = None  # the row's `family` column
    reference: str | None = None  # `reference` column, or a `messages` row's final assistant message
    # every column of the row except the `prompt` / `messages` the prompt was built from, as read
    # (e.g. "answer", "family", "completion", "chosen"): what reward and verifier functions receive
    columns: dict[str, Any] = field(default_factory=dict)
    where: str = ""  # "file.jsonl:17" / "file.parquet row 16", for messages about this prompt
    # the prompt as messages when the row is conversational (TRL hands reward functions these, not the text)
    messages: list[dict[str, Any]] | None = None


Example = Union[SFTExample, PairExample, PromptExample]
