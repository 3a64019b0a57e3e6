"""validate / load_examples: exact per-line problems, strict and lenient modes, chat rendering."""

from __future__ import annotations

import logging

import pytest

from rlhflab.data import (PairExample, PromptExample, Record, RowProblem, SFTExample,
                          load_examples, read_records, validate)
from rlhflab.errors import UserInputError

USER_HI = [{"role": "user", "content": "say hi"}]
ASSISTANT_HI = [{"role": "assistant", "content": "hi"}]

SFT_LINES = [
    {"prompt": "say hi", "completion": "hi"},  # 1
    {"prompt": "say bye", "completion": "bye", "family": "greet", "violation": "none"},  # 2
    '{"prompt": "say hi", ',  # 3 bad JSON
    {"prompt": "say hello", "completion": "hello world"},  # 4
    {"prompt": "say bye"},  # 5 missing completion, no similar column
    {"prompt": "  ", "completion": "bye"},  # 6 empty prompt
    "",  # 7 blank, skipped
    {"prompt": "say hi", "complition": "hi"},  # 8 misspelled column
    {"prompt": 3, "completion": "x"},  # 9 wrong type
    {"prompt": [{"role": "user"}], "completion": ASSISTANT_HI},  # 10 message without content
    {"prompt": USER_HI, "completion": [{"role": "assistant", "content": ["hi"]}]},  # 11
    {"prompt": "a", "completion": "b", "family": 5},  # 12 non-string family
    {"prompt": "say hi", "completion": ASSISTANT_HI},  # 13 mixed formats
]

EXPECTED_SFT_PROBLEMS = [
    ("3", "malformed JSON", "malformed JSON line (Expecting property name enclosed in double "
                            "quotes at column 22)"),
    ("5", "missing field", "missing field 'completion'; the row has columns 'prompt' (TRL's "
                           "prompt-only format); a sft row needs 'prompt' and 'completion' (strings "
                           "or message lists), one 'messages' list or one 'text' string"),
    ("6", "empty field", "empty field 'prompt'"),
    ("8", "missing field", "missing field 'completion' (found column 'complition': did you mean "
                           "'completion'?)"),
    ("9", "wrong type", "'prompt' must be a string or a list of messages, got int"),
    ("10", "malformed message", "message 1 of 'prompt' is not a {'role': ..., 'content': ...} "
                                "object"),
    ("11", "non-string content", "message 1 of 'completion' has list content, expected a string"),
    ("12", "non-string content", "'family' must be a string, got int"),
    ("13", "mixed formats", "'completion' is a message list but 'prompt' is a string; use strings "
                            "for all fields or message lists for all"),
]
GOOD_SFT = [SFTExample("say hi", "hi"), SFTExample("say bye", "bye", "greet", "none"),
            SFTExample("say hello", "hello world")]


def test_sft_problems_have_exact_lines_and_reasons(write_jsonl):
    path = write_jsonl(SFT_LINES)
    examples, problems = validate(read_records(path), "sft")
    assert examples == GOOD_SFT
    assert [(p.where, p.category, p.reason) for p in problems] == [
        (f"{path}:{line}", cat, reason) for line, cat, reason in EXPECTED_SFT_PROBLEMS]


def test_strict_raises_listing_every_problem(write_jsonl):
    path = write_jsonl(SFT_LINES)
    with pytest.raises(UserInputError) as e:
        load_examples(path, "sft", strict=True)
    msg = str(e.value)
    assert msg.startswith(f"{path}: 9 of 12 rows are invalid for kind 'sft':\n")
    for line, _, reason in EXPECTED_SFT_PROBLEMS:
        assert f"  {path}:{line}: {reason}\n" in msg
    assert "-> fix these rows, or pass strict=False to drop them" in msg


def test_default_drops_bad_rows_and_logs_counts(write_jsonl, caplog):
    path = write_jsonl(SFT_LINES)
    with caplog.at_level(logging.WARNING, logger="rlhflab.data"):
        examples = load_examples(path, "sft")
    assert examples == GOOD_SFT
    [record] = [r for r in caplog.records if r.name == "rlhflab.data"]
    lines = record.getMessage().splitlines()
    assert lines[0] == (f"{path}: dropped 9 of 12 rows as invalid sft data: missing field (2), "
                        "non-string content (2), malformed JSON (1), empty field (1), "
                        "wrong type (1), malformed message (1), mixed formats (1)")
    assert lines[1:] == [f"  {path}:{line}: {reason}" for line, _, reason in
                         EXPECTED_SFT_PROBLEMS[:5]] + ["  ... and 4 more"]


def test_strict_lists_twenty_then_counts_the_rest(write_jsonl):
    path = write_jsonl([{"prompt": "say hi"}] * 25)
    with pytest.raises(UserInputError) as e:
        load_examples(path, "sft", strict=True)
    msg = str(e.value)
    assert msg.startswith(f"{path}: no valid sft rows:\n")
    assert f"{path}:20: missing field" in msg and f"{path}:21:" not in msg
    assert "  ... and 5 more\n" in msg


def test_zero_valid_rows_raise_even_when_not_strict(write_jsonl, tmp_path):
    with pytest.raises(UserInputError, match=r"no valid pairs rows:\n.*data.jsonl:1: missing"):
        load_examples(write_jsonl([{"prompt": "say hi", "chosen": "hi"}]), "pairs")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(UserInputError, match="the data file has no rows"):
        load_examples(empty, "sft")
    with pytest.raises(UserInputError, match="unknown data kind 'dpo'"):
        load_examples(empty, "dpo")


def test_pairs_identical_and_missing(write_jsonl):
    path = write_jsonl([
        {"prompt": "say hi", "chosen": "hi", "rejected": "bye", "family": "greet"},
        {"prompt": "say hi", "chosen": "hi", "rejected": "hi"},
        {"prompt": "say hi", "answer": "hi"},
        {"prompt": USER_HI, "chosen": ASSISTANT_HI, "rejected": ASSISTANT_HI},
    ])
    examples, problems = validate(read_records(path), "pairs")
    assert examples == [PairExample("say hi", "hi", "bye", "greet", None)]
    assert [str(p) for p in problems] == [
        f"{path}:2: 'chosen' and 'rejected' are identical",
        f"{path}:3: missing fields 'chosen' and 'rejected'; the row has columns 'prompt', "
        "'answer' (TRL's prompt-only format); a pairs row needs 'chosen' and 'rejected' (strings "
        "or message lists), with a 'prompt' or with the prompt as their shared beginning",
        f"{path}:4: 'chosen' and 'rejected' are identical",
    ]


def test_conversational_rows_use_the_chat_template(tok_chat):
    rows = [
        {"prompt": USER_HI, "completion": ASSISTANT_HI},
        {"messages": [{"role": "system", "content": "be brief"}, *USER_HI, *ASSISTANT_HI]},
    ]
    examples, problems = validate([Record("x", None, i, r) for i, r in enumerate(rows)], "sft",
                                  tokenizer=tok_chat)
    assert problems == []
    assert examples == [  # prompt + completion: loss on the answer; messages: on every turn (as TRL)
        SFTExample("<user> say hi <end> <assistant> ", "hi <end> "),
        SFTExample("", "<system> be brief <end> <user> say hi <end> <assistant> hi <end> "),
    ]
    pair = {"prompt": USER_HI, "chosen": [{"role": "assistant", "content": "good"}],
            "rejected": [{"role": "assistant", "content": "bad"}]}
    examples, _ = validate([Record("x", None, 0, pair)], "pairs", tokenizer=tok_chat)
    assert examples == [PairExample("<user> say hi <end> <assistant> ", "good <end> ", "bad <end> ")]


def test_conversational_fallbacks(tok, make_tok):
    row = {"prompt": USER_HI, "completion": ASSISTANT_HI}
    # no chat template: "role: content" lines ending with "assistant: "
    assert validate([Record("x", None, 0, row)], "sft", tokenizer=tok)[0] == [
        SFTExample("user: say hi\nassistant: ", "hi")]
    # a template whose full rendering does not start with the prompt rendering:
    # the completion is the assistant content
    odd = make_tok(chat_template="{{ messages|length }} {% for m in messages %}"
                                       "{{ m['content'] }} {% endfor %}")
    assert validate([Record("x", None, 0, row)], "sft", tokenizer=odd)[0] == [
        SFTExample("1 say hi ", "hi")]


def test_messages_column_problems_and_prompts_kind():
    rows = [
        {"messages": USER_HI},  # language modelling: any conversation is trained on whole
        {"messages": []},
        {"messages": [{"role": "user", "content": " "}]},
    ]
    examples, problems = validate([Record("m.parquet", None, i, r) for i, r in enumerate(rows)], "sft")
    assert examples == [SFTExample("", "user: say hi")]
    assert [str(p) for p in problems] == [
        "m.parquet row 1: empty field 'messages' (no messages)",
        "m.parquet row 2: empty field 'messages' (all messages are empty)",
    ]
    rows = [{"prompt": "say hi", "reference": "hi", "family": "greet"},
            {"messages": [*USER_HI, *ASSISTANT_HI]}, {"messages": USER_HI}, {"messages": ASSISTANT_HI}]
    examples, problems = validate([Record("p", 1, i, r) for i, r in enumerate(rows)], "prompts")
    assert [str(p) for p in problems] == ["p:1: 'messages' holds only an assistant message, no prompt"]
    assert examples == [
        PromptExample("say hi", "greet", "hi", {"reference": "hi", "family": "greet"}, "p:1"),
        PromptExample("user: say hi\nassistant: ", None, "hi", {}, "p:1", USER_HI),
        PromptExample("user: say hi\nassistant: ", None, None, {}, "p:1", USER_HI)]


def test_prompt_too_long_is_reported(write_jsonl, make_tok):
    path = write_jsonl([{"prompt": "say hi", "completion": "hi"},
                        {"prompt": "say hello world", "completion": "hi"},
                        {"prompt": "", "completion": "hi"}])
    examples, problems = validate(read_records(path), "sft", tokenizer=make_tok(),
                                  max_prompt_tokens=2)
    assert examples == [SFTExample("say hi", "hi")]
    assert problems == [
        RowProblem(str(path), 2, 1, "prompt has 3 tokens, more than max_prompt_tokens=2",
                   "prompt too long"),
        RowProblem(str(path), 3, 2, "empty field 'prompt'", "empty field"),
    ]
    # the BOS a tokenizer always adds counts towards the budget
    _, problems = validate(read_records(path), "sft", tokenizer=make_tok(add_bos=True),
                           max_prompt_tokens=2)
    assert [(p.line, p.reason) for p in problems] == [
        (1, "prompt has 3 tokens, more than max_prompt_tokens=2"),
        (2, "prompt has 4 tokens, more than max_prompt_tokens=2"),
        (3, "empty field 'prompt'")]
    with pytest.raises(UserInputError, match="max_prompt_tokens needs a tokenizer"):
        validate(read_records(path), "sft", max_prompt_tokens=2)


def test_an_online_stage_drops_over_long_prompts_counting_them_and_strict_refuses_them(write_jsonl, make_tok, caplog):
    """The online stages' prompt files (sources.prompt_splits) go through the same length check as SFT / DPO / RM
    rows: dropped and counted in the log by default, every one listed under --strict; the BOS counts."""
    import dataclasses

    from rlhflab import sources
    from rlhflab.config import GRPOConfig

    train = write_jsonl([{"prompt": "say hi"}, {"prompt": "say hello world"}, {"prompt": "hi"}], name="train.jsonl")
    validation = write_jsonl([{"prompt": "hi"}, {"prompt": "hello world hello world"}], name="validation.jsonl")
    cfg = GRPOConfig(model="m", train_file=str(train), validation_file=str(validation), max_prompt_tokens=2)
    with caplog.at_level(logging.WARNING, logger="rlhflab.data"):
        splits = sources.prompt_splits(cfg, make_tok())
    assert [r.prompt for r in splits.train] == ["say hi", "hi"] and [r.prompt for r in splits.validation] == ["hi"]
    logged = [r.getMessage() for r in caplog.records if r.name == "rlhflab.data"]
    assert f"{train}: dropped 1 of 3 rows as invalid prompts data: prompt too long (1)" in logged[0]
    assert f"{train}:2: prompt has 3 tokens, more than max_prompt_tokens=2" in logged[0]
    with pytest.raises(UserInputError, match=rf"{train}:1: prompt has 3 tokens.*\n.*{train}:2: prompt has 4 tokens"):
        sources.prompt_splits(dataclasses.replace(cfg, strict=True), make_tok(add_bos=True))
