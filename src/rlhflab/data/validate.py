"""Check raw records against a data kind and turn the good ones into typed examples.

Rows are in TRL's dataset formats (https://huggingface.co/docs/trl/dataset_formats),
standard (strings) or conversational (lists of {"role", "content"} messages); which format
a row is in follows from its columns (`rlhflab.data.formats`). What each kind accepts:

  kind     format                       columns                   becomes
  sft      prompt-completion            prompt, completion        loss on the completion only
           language modelling           text                      prompt "", completion = text
           conversational LM            messages                  prompt "", completion = the whole
                                                                  rendered conversation (TRL's SFT trains
                                                                  on every turn; for the last answer only,
                                                                  write prompt + completion messages)
  pairs    preference                   prompt, chosen, rejected
           preference, implicit prompt  chosen, rejected          the shared beginning is the prompt
  prompts  prompt-only                  prompt
           prompt-completion            prompt, completion        the prompt; completion is a column
           preference (either)          [prompt,] chosen, rejected  the prompt (explicit or shared);
                                                                  chosen / rejected are columns
           conversational LM            messages                  a final assistant message becomes the
                                                                  reference, the messages before it the prompt

Implicit prompts follow TRL's `extract_prompt`: for message lists the longest common
prefix of messages (at least one); for strings the longest common prefix of characters,
with a space just before the first difference left to the answers ("The sky is" +
" blue." / " green."), possibly empty for `pairs` (the reward model then reads whole
texts, as TRL's reward trainer does). As TRL's `maybe_extract_prompt`, a `prompt` string
next to `chosen` / `rejected` message lists that share their first messages is ignored
and the shared messages are the prompt (e.g. HuggingFaceH4/ultrafeedback_binarized).

Conversations are rendered to text by `rlhflab.data.chat` (the tokenizer's chat template,
or plain "role: content" lines without one). Optional `family` and `violation` strings
are carried through; a prompts row keeps every column except `prompt` / `messages` in
`PromptExample.columns`. Each bad row yields one `RowProblem`.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from rlhflab.data.chat import render_completion, render_conversation, render_prompt
from rlhflab.data.formats import (FORMAT_COLUMNS, BadRow, check_messages, check_text, format_name,
                                  implicit_prompt_length, optional_str, present_columns)
from rlhflab.data.records import Example, PairExample, PromptExample, Record, RowProblem, SFTExample
from rlhflab.data.tokenize import encode_prompts
from rlhflab.errors import UserInputError

KINDS = {  # kind -> what a row needs (used in error messages)
    "sft": "'prompt' and 'completion' (strings or message lists), one 'messages' list or one 'text' string",
    "pairs": "'chosen' and 'rejected' (strings or message lists), with a 'prompt' or with the prompt as "
             "their shared beginning",
    "prompts": "'prompt' (a string or a message list), one 'messages' list, or 'chosen' and 'rejected' "
               "sharing their beginning",
}
KNOWN_COLUMNS = (*FORMAT_COLUMNS, "family", "violation", "reference")
PROMPT_SOURCES = ("prompt", "messages")  # columns a prompts row's prompt is built from; not in `columns`


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
            raise BadRow("malformed JSON", rec.error)
        example = _to_example(rec.row, kind, tokenizer)
    except BadRow as bad:
        return RowProblem(rec.source, rec.line, rec.index, bad.reason, bad.category)
    return replace(example, where=rec.where) if isinstance(example, PromptExample) else example


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
    present = present_columns(row)
    for needed, read in READERS[kind]:
        if needed <= present:
            return read(row, tokenizer)
    raise _no_fitting_format(row, kind)


# --- sft ------------------------------------------------------------------------------


def _sft_prompt_completion(row: dict[str, Any], tokenizer) -> SFTExample:
    prompt, (completion,) = _prompt_and_answers(row, ("completion",), tokenizer)
    return SFTExample(prompt, completion, *_tags(row))


def _sft_messages(row: dict[str, Any], tokenizer) -> SFTExample:
    check_messages("messages", row["messages"])
    return SFTExample("", render_conversation(row["messages"], tokenizer), *_tags(row))


def _sft_text(row: dict[str, Any], tokenizer) -> SFTExample:
    check_text("text", row["text"])
    return SFTExample("", row["text"], *_tags(row))


# --- pairs ----------------------------------------------------------------------------


def _pair_explicit(row: dict[str, Any], tokenizer) -> PairExample:
    if _prompt_is_superseded(row):
        return _pair_implicit(row, tokenizer)
    prompt, (chosen, rejected) = _prompt_and_answers(row, ("chosen", "rejected"), tokenizer)
    return _pair(prompt, chosen, rejected, row)


def _pair_implicit(row: dict[str, Any], tokenizer) -> PairExample:
    return _pair(*_split_implicit(row, tokenizer, allow_empty_prompt=True), row)


def _pair(prompt: str, chosen: str, rejected: str, row: dict[str, Any]) -> PairExample:
    if chosen == rejected:
        raise BadRow("chosen == rejected", "'chosen' and 'rejected' are identical")
    return PairExample(prompt, chosen, rejected, *_tags(row))


# --- prompts --------------------------------------------------------------------------


def _prompt_from_prompt(row: dict[str, Any], tokenizer) -> PromptExample:
    """Prompt-only, prompt-completion or explicit preference: the prompt; the rest are columns."""
    if _prompt_is_superseded(row):
        return _prompt_implicit(row, tokenizer)
    prompt, _ = _prompt_and_answers(row, (), tokenizer)
    return _prompt_example(prompt, row, messages=row["prompt"] if isinstance(row["prompt"], list) else None)


def _prompt_from_messages(row: dict[str, Any], tokenizer) -> PromptExample:
    messages = row["messages"]
    check_messages("messages", messages)
    if messages[-1]["role"] != "assistant":
        return _prompt_example(render_prompt(messages, tokenizer), row, messages=messages)
    if len(messages) == 1:
        raise BadRow("empty field", "'messages' holds only an assistant message, no prompt")
    return _prompt_example(render_prompt(messages[:-1], tokenizer), row, reference=messages[-1]["content"],
                           messages=messages[:-1])


def _prompt_implicit(row: dict[str, Any], tokenizer) -> PromptExample:
    prompt, _, _ = _split_implicit(row, tokenizer, allow_empty_prompt=False)
    chosen, rejected = row["chosen"], row["rejected"]
    conversational = isinstance(chosen, list) and isinstance(rejected, list)
    messages = chosen[: implicit_prompt_length(chosen, rejected)] if conversational else None
    return _prompt_example(prompt, row, messages=messages)


def _prompt_example(prompt: str, row: dict[str, Any], reference: str | None = None,
                    messages: list[dict[str, Any]] | None = None) -> PromptExample:
    """`messages`: the prompt's messages when the row is conversational."""
    family, column_reference = optional_str(row, "family"), optional_str(row, "reference")
    columns = {k: v for k, v in row.items() if k not in PROMPT_SOURCES}
    return PromptExample(prompt, family, column_reference if column_reference is not None else reference, columns,
                         messages=messages)


# kind -> (columns that select a reader, reader); the first whose columns the row has all of
# reads it, so `prompt` + `completion` wins over `messages`, and `messages` over `text`
READERS: dict[str, tuple[tuple[frozenset[str], Callable[[dict[str, Any], Any], Example]], ...]] = {
    "sft": ((frozenset({"prompt", "completion"}), _sft_prompt_completion),
            (frozenset({"messages"}), _sft_messages),
            (frozenset({"text"}), _sft_text)),
    "pairs": ((frozenset({"prompt", "chosen", "rejected"}), _pair_explicit),
              (frozenset({"chosen", "rejected"}), _pair_implicit)),
    "prompts": ((frozenset({"prompt"}), _prompt_from_prompt),
                (frozenset({"messages"}), _prompt_from_messages),
                (frozenset({"chosen", "rejected"}), _prompt_implicit)),
}


# --- shared pieces --------------------------------------------------------------------


def _prompt_and_answers(row: dict[str, Any], answers: tuple[str, ...], tokenizer) -> tuple[str, list[str]]:
    """Rendered `prompt` and `answers` columns, all strings or all message lists."""
    fields = ("prompt", *answers)
    prompt = row["prompt"]
    if isinstance(prompt, str):
        for f in fields:
            if isinstance(row[f], list):
                raise BadRow("mixed formats", f"'{f}' is a message list but 'prompt' is a string; "
                             "use strings for all fields or message lists for all")
            check_text(f, row[f])
        return prompt, [row[f] for f in answers]
    if isinstance(prompt, list):
        for f in fields:
            if isinstance(row[f], str):
                raise BadRow("mixed formats", f"'{f}' is a string but 'prompt' is a message list; "
                             "use strings for all fields or message lists for all")
            check_messages(f, row[f])
        texts = [render_completion(prompt, row[f], tokenizer) for f in answers]
        for f, text in zip(answers, texts):
            if not text.strip():
                raise BadRow("empty field", f"empty field '{f}'")
        return render_prompt(prompt, tokenizer), texts
    raise BadRow("wrong type", f"'prompt' must be a string or a list of messages, got {type(prompt).__name__}")


def _prompt_is_superseded(row: dict[str, Any]) -> bool:
    """TRL's maybe_extract_prompt: a string prompt beside conversations that share a beginning is not used."""
    chosen, rejected = row.get("chosen"), row.get("rejected")
    return (isinstance(row["prompt"], str) and isinstance(chosen, list) and isinstance(rejected, list)
            and implicit_prompt_length(chosen, rejected) > 0)


def _split_implicit(row: dict[str, Any], tokenizer, allow_empty_prompt: bool) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) texts of a preference row whose prompt is their shared beginning."""
    chosen, rejected = row["chosen"], row["rejected"]
    if isinstance(chosen, str) and isinstance(rejected, str):
        check_text("chosen", chosen)
        check_text("rejected", rejected)
        n = implicit_prompt_length(chosen, rejected)
        if n == 0 and not allow_empty_prompt:
            raise BadRow("no shared prompt", "'chosen' and 'rejected' share no beginning, so the row has no prompt")
        parts = chosen[:n], chosen[n:], rejected[n:]
    elif isinstance(chosen, list) and isinstance(rejected, list):
        check_messages("chosen", chosen)
        check_messages("rejected", rejected)
        n = implicit_prompt_length(chosen, rejected)
        if n == 0:
            raise BadRow("no shared prompt", "'chosen' and 'rejected' share no leading message, so the row has "
                         "no prompt; start both with the prompt's messages, or add a 'prompt' column")
        prompt = chosen[:n]
        parts = (render_prompt(prompt, tokenizer), render_completion(prompt, chosen[n:], tokenizer),
                 render_completion(prompt, rejected[n:], tokenizer))
    else:
        for f in ("chosen", "rejected"):
            if not isinstance(row[f], (str, list)):
                raise BadRow("wrong type", f"'{f}' must be a string or a list of messages, "
                             f"got {type(row[f]).__name__}")
        raise BadRow("mixed formats", "one of 'chosen' and 'rejected' is a string and the other a message list; "
                     "use strings for both or message lists for both")
    for f, text in zip(("chosen", "rejected"), parts[1:]):
        if not text.strip():
            raise BadRow("empty field", f"'{f}' is empty after the shared prompt")
    return parts


def _tags(row: dict[str, Any]) -> tuple[str | None, str | None]:
    return optional_str(row, "family"), optional_str(row, "violation")


def _no_fitting_format(row: dict[str, Any], kind: str) -> BadRow:
    """The problem of a row no reader of `kind` takes: the fields it lacks, or the format it is in."""
    present = present_columns(row)
    needed = max((cols for cols, _ in READERS[kind]), key=lambda cols: len(cols & present))  # first on ties
    recognised = format_name(row)
    columns = ", ".join(repr(k) for k in row) or "none"
    described = f"{columns} (TRL's {recognised} format)" if recognised else columns
    needs = f"a {kind} row needs {KINDS[kind]}"
    if recognised and not needed & present:
        return BadRow("wrong format", f"the row has columns {described}; {needs}")
    missing = [c for c in FORMAT_COLUMNS if c in needed - present]
    names = " and ".join(repr(f) for f in missing)
    reason = f"missing field{'s' if len(missing) > 1 else ''} {names}"
    unknown = [k for k in row if k not in KNOWN_COLUMNS]
    hints = []
    for f in missing:
        close = difflib.get_close_matches(f, unknown, n=1, cutoff=0.6)
        if close:
            hints.append(f"found column {close[0]!r}: did you mean {f!r}?")
    if hints:
        return BadRow("missing field", f"{reason} ({'; '.join(hints)})")
    return BadRow("missing field", f"{reason}; the row has columns {described}; {needs}")
