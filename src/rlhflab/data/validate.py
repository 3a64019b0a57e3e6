"""Check raw records against a data kind and turn the good ones into typed examples.

Accepted rows (TRL's standard column names):

  kind     standard (strings)               conversational (message lists)
  sft      prompt, completion               prompt + completion, or one `messages` list
                                            (its last message, role "assistant", is the completion)
  pairs    prompt, chosen, rejected         prompt, chosen, rejected
  prompts  prompt [, reference]             prompt, or `messages` (a final assistant
                                            message becomes the reference)

Optional `family` and `violation` strings are carried through. Conversations are
rendered to text by `rlhflab.data.chat`. Each bad row yields one `RowProblem`.
"""

from __future__ import annotations

import difflib
from typing import Any

from rlhflab.data.chat import render_completion, render_prompt
from rlhflab.data.records import Example, PairExample, PromptExample, Record, RowProblem, SFTExample
from rlhflab.data.tokenize import encode_prompts
from rlhflab.errors import UserInputError

KINDS = {  # kind -> what a row needs (used in error messages)
    "sft": "'prompt' and 'completion' (strings or message lists), or one 'messages' list",
    "pairs": "'prompt', 'chosen' and 'rejected' (strings or message lists)",
    "prompts": "'prompt' (a string or a message list), or one 'messages' list",
}
ANSWER_FIELDS = {"sft": ("completion",), "pairs": ("chosen", "rejected"), "prompts": ()}
KNOWN_COLUMNS = ("prompt", "completion", "chosen", "rejected", "messages",
                 "family", "violation", "reference")


class _Bad(Exception):
    def __init__(self, category: str, reason: str):
        super().__init__(reason)
        self.category, self.reason = category, reason


def validate(
    records: list[Record], kind: str, tokenizer=None, max_prompt_tokens: int | None = None
) -> tuple[list[Example], list[RowProblem]]:
    """Split `records` into valid examples of `kind` and one problem per bad row."""
    if kind not in KINDS:
        raise UserInputError(f"unknown data kind {kind!r}", fix=f"use one of {sorted(KINDS)}")
    if max_prompt_tokens is not None and tokenizer is None:
        raise UserInputError("max_prompt_tokens needs a tokenizer to count prompt tokens",
                             fix="pass tokenizer=..., or leave max_prompt_tokens unset")
    outcomes = [_check(rec, kind, tokenizer) for rec in records]
    if max_prompt_tokens is not None:
        outcomes = _check_prompt_lengths(records, outcomes, tokenizer, max_prompt_tokens)
    examples = [o for o in outcomes if not isinstance(o, RowProblem)]
    return examples, [o for o in outcomes if isinstance(o, RowProblem)]


def _check(rec: Record, kind: str, tokenizer) -> Example | RowProblem:
    try:
        if rec.error is not None:
            raise _Bad("malformed JSON", rec.error)
        return _to_example(rec.row, kind, tokenizer)
    except _Bad as bad:
        return RowProblem(rec.source, rec.line, rec.index, bad.reason, bad.category)


def _check_prompt_lengths(
    records: list[Record], outcomes: list[Example | RowProblem], tokenizer, max_prompt_tokens: int
) -> list[Example | RowProblem]:
    """Replace examples whose prompt is over budget by a problem (one batched encode)."""
    positions = [i for i, o in enumerate(outcomes) if not isinstance(o, RowProblem)]
    prompts = encode_prompts(tokenizer, [outcomes[i].prompt for i in positions])
    outcomes = list(outcomes)
    for i, ids in zip(positions, prompts):
        if len(ids) > max_prompt_tokens:
            rec = records[i]
            outcomes[i] = RowProblem(
                rec.source, rec.line, rec.index,
                f"prompt has {len(ids)} tokens, more than max_prompt_tokens={max_prompt_tokens}",
                "prompt too long")
    return outcomes


def _to_example(row: dict[str, Any], kind: str, tokenizer) -> Example:
    extras = {f: _optional_str(row, f) for f in ("family", "violation", "reference")}
    if row.get("prompt") is None and row.get("messages") is not None and kind != "pairs":
        prompt, answers = _split_messages(row["messages"], kind, tokenizer)
    else:
        prompt, answers = _prompt_and_answers(row, kind, tokenizer)
    if kind == "sft":
        return SFTExample(prompt, answers["completion"], extras["family"], extras["violation"])
    if kind == "pairs":
        if answers["chosen"] == answers["rejected"]:
            raise _Bad("chosen == rejected", "'chosen' and 'rejected' are identical")
        return PairExample(prompt, answers["chosen"], answers["rejected"],
                           extras["family"], extras["violation"])
    reference = answers.get("reference", extras["reference"])
    return PromptExample(prompt, extras["family"], reference)


def _prompt_and_answers(row: dict[str, Any], kind: str, tokenizer) -> tuple[str, dict[str, str]]:
    fields = ("prompt", *ANSWER_FIELDS[kind])
    missing = [f for f in fields if row.get(f) is None]
    if missing:
        raise _Bad("missing field", _missing_reason(missing, row, kind))
    prompt = row["prompt"]
    if isinstance(prompt, str):
        for f in fields:
            if isinstance(row[f], list):
                raise _Bad("mixed formats", f"'{f}' is a message list but 'prompt' is a string; "
                           "use strings for all fields or message lists for all")
            _check_text(f, row[f])
        return prompt, {f: row[f] for f in fields[1:]}
    if isinstance(prompt, list):
        for f in fields:
            if isinstance(row[f], str):
                raise _Bad("mixed formats", f"'{f}' is a string but 'prompt' is a message list; "
                           "use strings for all fields or message lists for all")
            _check_messages(f, row[f])
        answers = {f: render_completion(prompt, row[f], tokenizer) for f in fields[1:]}
        for f, text in answers.items():
            if not text.strip():
                raise _Bad("empty field", f"empty field '{f}'")
        return render_prompt(prompt, tokenizer), answers
    raise _Bad("wrong type", f"'prompt' must be a string or a list of messages, "
               f"got {type(prompt).__name__}")


def _split_messages(messages: Any, kind: str, tokenizer) -> tuple[str, dict[str, str]]:
    _check_messages("messages", messages)
    last = messages[-1]
    if kind == "prompts":
        if last["role"] != "assistant":
            return render_prompt(messages, tokenizer), {}
        if len(messages) == 1:
            raise _Bad("empty field", "'messages' holds only an assistant message, no prompt")
        return render_prompt(messages[:-1], tokenizer), {"reference": last["content"]}
    if last["role"] != "assistant":
        raise _Bad("malformed message", f"the last message in 'messages' has role "
                   f"{last['role']!r}; for sft it must be the 'assistant' completion")
    if len(messages) == 1:
        raise _Bad("empty field", "'messages' has no prompt message before the assistant's")
    prompt = messages[:-1]
    completion = render_completion(prompt, [last], tokenizer)
    if not completion.strip():
        raise _Bad("empty field", "empty field 'completion' (last message of 'messages')")
    return render_prompt(prompt, tokenizer), {"completion": completion}


def _check_text(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise _Bad("non-string content", f"'{name}' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise _Bad("empty field", f"empty field '{name}'")


def _check_messages(name: str, value: Any) -> None:
    if not isinstance(value, list):
        raise _Bad("wrong type", f"'{name}' must be a list of messages, got {type(value).__name__}")
    if not value:
        raise _Bad("empty field", f"empty field '{name}' (no messages)")
    for i, m in enumerate(value, start=1):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise _Bad("malformed message", f"message {i} of '{name}' is not a "
                       "{'role': ..., 'content': ...} object")
        if not isinstance(m["role"], str) or not m["role"]:
            raise _Bad("malformed message", f"message {i} of '{name}' has no role string")
        if not isinstance(m["content"], str):
            raise _Bad("non-string content", f"message {i} of '{name}' has "
                       f"{type(m['content']).__name__} content, expected a string")
    if not any(m["content"].strip() for m in value):
        raise _Bad("empty field", f"empty field '{name}' (all messages are empty)")


def _optional_str(row: dict[str, Any], name: str) -> str | None:
    value = row.get(name)
    if value is not None and not isinstance(value, str):
        raise _Bad("non-string content", f"'{name}' must be a string, got {type(value).__name__}")
    return value


def _missing_reason(missing: list[str], row: dict[str, Any], kind: str) -> str:
    names = " and ".join(repr(f) for f in missing)
    reason = f"missing field{'s' if len(missing) > 1 else ''} {names}"
    unknown = [k for k in row if k not in KNOWN_COLUMNS]
    hints = []
    for f in missing:
        close = difflib.get_close_matches(f, unknown, n=1, cutoff=0.6)
        if close:
            hints.append(f"found column {close[0]!r}: did you mean {f!r}?")
    if hints:
        return f"{reason} ({'; '.join(hints)})"
    columns = ", ".join(repr(k) for k in row) or "none"
    return f"{reason}; the row has columns {columns}; a {kind} row needs {KINDS[kind]}"
