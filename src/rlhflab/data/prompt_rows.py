"""One prompt as the online stages see it: the text the policy answers, and the row it came from.

Every column of the user's row other than the prompt travels in `columns`, so reward and
verifier functions receive them by name (TRL's `reward_funcs(prompts, completions, **columns)`):

    PromptRow("Add 2 and 3.\n", {"answer": "5"}, where="math.jsonl:4")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PromptRow:
    prompt: str  # rendered prompt text (chat template applied for conversations)
    columns: Mapping[str, Any] = field(default_factory=dict)  # every other column of the row, e.g. "answer"
    where: str = ""  # "file.jsonl:17" or "built-in suite, validation #3": for error messages
    # the prompt as messages when the row is conversational: reward and verifier functions then get these and
    # completions as [{"role": "assistant", "content": ...}], as TRL hands them (rewards/functions.py)
    messages: tuple[dict[str, Any], ...] | None = None

    @property
    def family(self) -> str:
        """The row's `family` column, or "all": pass rates are tabulated per family."""
        value = self.columns.get("family")
        return value if isinstance(value, str) and value else "all"


def column_lists(rows: Sequence[PromptRow]) -> dict[str, list[Any]]:
    """{column: [value of row 0, value of row 1, ...]} over the union of the rows' columns (None where absent)."""
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row.columns))
    return {name: [row.columns.get(name) for row in rows] for name in names}
