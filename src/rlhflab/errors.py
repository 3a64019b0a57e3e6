"""The one exception type for user mistakes.

Every bad path, malformed row, unknown config key or oversized prompt raises
`UserInputError` with what was wrong, where, and what to do about it.
"""

from __future__ import annotations


class UserInputError(ValueError):
    """A mistake in something the user supplied (file, row, config key, model)."""

    def __init__(self, what: str, where: str | None = None, fix: str | None = None):
        self.what = what
        self.where = where
        self.fix = fix
        parts = [what if where is None else f"{where}: {what}"]
        if fix:
            parts.append(f"-> {fix}")
        super().__init__(" ".join(parts))
