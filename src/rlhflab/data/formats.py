"""TRL's dataset formats: which one a row is in, what its cells must be, the implicit prompt.

A row's format follows from the columns it has (TRL, docs/source/dataset_formats.md):

  format                          columns                      standard / conversational
  language modelling              text | messages              `text` a string / `messages` a message list
  prompt-only                     prompt                       strings / message lists
  prompt-completion               prompt, completion           strings / message lists
  preference                      prompt, chosen, rejected     strings / message lists
  preference, implicit prompt     chosen, rejected             strings / message lists

A column whose value is None counts as absent (a Parquet or `datasets` table gives every
row every column, with None where a row has none).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

FORMAT_COLUMNS = ("prompt", "completion", "chosen", "rejected", "messages", "text")

# (columns that must all be present, format name); the first match names the row's format
FORMATS = (
    (frozenset({"prompt", "chosen", "rejected"}), "preference"),
    (frozenset({"chosen", "rejected"}), "implicit-prompt preference"),
    (frozenset({"prompt", "completion"}), "prompt-completion"),
    (frozenset({"messages"}), "conversational language modelling"),
    (frozenset({"text"}), "language modelling"),
    (frozenset({"prompt"}), "prompt-only"),
)


class BadRow(Exception):
    """One row does not fit: `category` counts problems by kind, `reason` is the full sentence."""

    def __init__(self, category: str, reason: str):
        super().__init__(reason)
        self.category, self.reason = category, reason


def present_columns(row: dict[str, Any]) -> frozenset[str]:
    """The format columns a row has, ignoring None values."""
    return frozenset(c for c in FORMAT_COLUMNS if row.get(c) is not None)


def format_name(row: dict[str, Any]) -> str | None:
    """TRL's name for the row's format, or None when its columns fit none."""
    present = present_columns(row)
    return next((name for needed, name in FORMATS if needed <= present), None)


def implicit_prompt_length(chosen: Sequence, rejected: Sequence) -> int:
    """How many leading items (characters or messages) of `chosen` form the shared prompt.

    As TRL's `extract_prompt`: the longest common prefix; for strings, a space just before
    the first difference goes to the answers ("The sky is" + " blue." / " green."). Unlike
    TRL we stop one item short when one answer is a prefix of the other, so that both keep
    something (TRL's loop arrives at the same place there), and never go below 0.
    """
    shortest = min(len(chosen), len(rejected))
    n = next((i for i in range(shortest) if chosen[i] != rejected[i]), shortest)
    n = min(n, shortest - 1)
    if n > 0 and isinstance(chosen, str) and chosen[n - 1] == " ":
        n -= 1
    return max(n, 0)


def check_text(name: str, value: Any) -> None:
    """A standard cell: a non-blank string."""
    if not isinstance(value, str):
        raise BadRow("non-string content", f"'{name}' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise BadRow("empty field", f"empty field '{name}'")


def check_messages(name: str, value: Any) -> None:
    """A conversational cell: a non-empty list of {"role": str, "content": str}, not all blank."""
    if not isinstance(value, list):
        raise BadRow("wrong type", f"'{name}' must be a list of messages, got {type(value).__name__}")
    if not value:
        raise BadRow("empty field", f"empty field '{name}' (no messages)")
    for i, m in enumerate(value, start=1):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise BadRow("malformed message", f"message {i} of '{name}' is not a "
                         "{'role': ..., 'content': ...} object")
        if not isinstance(m["role"], str) or not m["role"]:
            raise BadRow("malformed message", f"message {i} of '{name}' has no role string")
        if not isinstance(m["content"], str):
            raise BadRow("non-string content", f"message {i} of '{name}' has "
                         f"{type(m['content']).__name__} content, expected a string")
    if not any(m["content"].strip() for m in value):
        raise BadRow("empty field", f"empty field '{name}' (all messages are empty)")


def optional_str(row: dict[str, Any], name: str) -> str | None:
    """An optional string column (`family`, `violation`, `reference`)."""
    value = row.get(name)
    if value is not None and not isinstance(value, str):
        raise BadRow("non-string content", f"'{name}' must be a string, got {type(value).__name__}")
    return value
