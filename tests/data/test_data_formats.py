"""TRL's dataset formats x {standard, conversational} x {sft, pairs, prompts}, hand-worked.

Conversations are rendered twice: with the plain fallback (no chat template) and with the
conftest chat template "<role> content <end> ", whose generation prompt is "<assistant> ".
"""

from __future__ import annotations

import pytest

from rlhflab.data import (PairExample, PromptExample, Record, SFTExample, TokenizedSFT, collate_sft, tokenize_sft,
                          validate)
from rlhflab.data.formats import format_name, implicit_prompt_length

SYS = {"role": "system", "content": "be brief"}
USER = {"role": "user", "content": "say hi"}
USER2 = {"role": "user", "content": "say bye"}
GOOD = {"role": "assistant", "content": "good"}
BAD = {"role": "assistant", "content": "bad"}

# (row, rendered without a chat template, rendered with the conftest template)
FALLBACK, TEMPLATE = "fallback", "template"
PROMPT_TEXT = {FALLBACK: "user: say hi\nassistant: ", TEMPLATE: "<user> say hi <end> <assistant> "}
SYS_PROMPT_TEXT = {FALLBACK: "system: be brief\nuser: say hi\nassistant: ",
                   TEMPLATE: "<system> be brief <end> <user> say hi <end> <assistant> "}
ANSWER_TEXT = {FALLBACK: {"good": "good", "bad": "bad"}, TEMPLATE: {"good": "good <end> ", "bad": "bad <end> "}}


def one(row, kind, tokenizer=None):
    """The example or the (category, reason) problem of one row read from rows.jsonl:1."""
    examples, problems = validate([Record("rows.jsonl", 1, 0, row)], kind, tokenizer=tokenizer)
    if problems:
        return problems[0].category, problems[0].reason
    return examples[0]


@pytest.fixture(params=[FALLBACK, TEMPLATE])
def render(request, tok, tok_chat):
    """(name, tokenizer) for each way of rendering conversations."""
    return request.param, {FALLBACK: tok, TEMPLATE: tok_chat}[request.param]


# --- the implicit prompt ------------------------------------------------------------------


@pytest.mark.parametrize("chosen, rejected, n", [
    ("The sky is blue.", "The sky is green.", 10),  # TRL's example: "The sky is" + " blue." / " green."
    ("The sky is blue.", "The sky is black.", 13),  # "bl" is shared: the word is split, as TRL does
    ("Yes.", "No.", 0),  # nothing shared
    ("It is 5", "It is 5.", 5),  # a prefix: stop one short (6), then leave the space to the answers (5)
    ("abc", "abc", 2),
    ([USER, GOOD], [USER, BAD], 1),
    ([SYS, USER, GOOD], [SYS, USER, BAD], 2),
    ([USER, GOOD], [USER, GOOD, USER2, BAD], 1),  # a prefix: both keep at least one message
    ([USER, GOOD], [USER2, BAD], 0),
])
def test_implicit_prompt_length(chosen, rejected, n):
    assert implicit_prompt_length(chosen, rejected) == n


def test_format_names_follow_the_columns():
    assert [format_name(r) for r in [
        {"text": "x"}, {"messages": [USER]}, {"prompt": "x"}, {"prompt": "x", "completion": "y"},
        {"prompt": "x", "chosen": "y", "rejected": "z"}, {"chosen": "y", "rejected": "z"},
        {"prompt": None, "chosen": "y", "rejected": "z", "completion": None}, {"question": "x"},
    ]] == ["language modelling", "conversational language modelling", "prompt-only", "prompt-completion",
           "preference", "implicit-prompt preference", "implicit-prompt preference", None]


# --- sft ------------------------------------------------------------------------------------


def test_sft_standard_formats(tok):
    assert one({"text": "hello world"}, "sft", tok) == SFTExample("", "hello world")
    assert one({"prompt": "say hi", "completion": "good", "family": "greet"}, "sft", tok) == SFTExample(
        "say hi", "good", "greet")


def test_sft_conversational_formats(render):
    name, tokenizer = render
    whole = {FALLBACK: "system: be brief\nuser: say hi\nassistant: good",
             TEMPLATE: "<system> be brief <end> <user> say hi <end> <assistant> good <end> "}[name]
    # language modelling: the whole conversation is trained on (TRL's SFT without assistant-only loss)
    assert one({"messages": [SYS, USER, GOOD]}, "sft", tokenizer) == SFTExample("", whole)
    # prompt-completion: only the answer is trained on, and prompt + answer read as the whole conversation
    example = one({"prompt": [SYS, USER], "completion": [GOOD]}, "sft", tokenizer)
    assert example == SFTExample(SYS_PROMPT_TEXT[name], ANSWER_TEXT[name]["good"])
    assert example.prompt + example.completion == whole


def test_sft_refuses_other_formats_naming_them(tok):
    needs = ("a sft row needs 'prompt' and 'completion' (strings or message lists), one 'messages' list or one "
             "'text' string")
    assert one({"chosen": "The sky is blue.", "rejected": "The sky is green."}, "sft") == (
        "wrong format", f"the row has columns 'chosen', 'rejected' (TRL's implicit-prompt preference format); {needs}")
    assert one({"prompt": "say hi", "chosen": "good", "rejected": "bad"}, "sft") == (
        "missing field", "missing field 'completion'; the row has columns 'prompt', 'chosen', 'rejected' (TRL's "
        f"preference format); {needs}")
    assert one({"text": ""}, "sft") == ("empty field", "empty field 'text'")
    assert one({"text": ["hi"]}, "sft") == ("non-string content", "'text' must be a string, got list")


def test_sft_text_rows_train_on_every_token(make_tok):
    # with a BOS: prompt = [BOS], every text token is a label; without: the first token has no context
    examples = [SFTExample("", "hello world")]
    assert tokenize_sft(examples, make_tok(add_bos=True), 8) == [TokenizedSFT([2], [8, 9, 1])]
    assert collate_sft(tokenize_sft(examples, make_tok(add_bos=True), 8), pad_id=0).num_label_tokens == 3
    assert tokenize_sft(examples, make_tok(), 8) == [TokenizedSFT([], [8, 9, 1])]
    assert collate_sft(tokenize_sft(examples, make_tok(), 8), pad_id=0).num_label_tokens == 2


def test_sft_messages_keep_one_bos_when_the_template_writes_it(make_tok):
    tok = make_tok(add_bos=True, chat_template="<s> {% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} "
                                               "<end> {% endfor %}")
    example = one({"messages": [USER, GOOD]}, "sft", tok)
    assert example == SFTExample("", "<s> <user> say hi <end> <assistant> good <end> ")
    # <s> <user> say hi <end> <assistant> good <end> </s>, and no second BOS in front
    assert tokenize_sft([example], tok, 16) == [TokenizedSFT([], [2, 5, 10, 11, 4, 6, 13, 4, 1])]


# --- pairs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("row, expected", [
    ({"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
     PairExample("The sky is", " blue.", " green.")),
    ({"chosen": "The sky is blue.", "rejected": "The sky is green.", "family": "sky"},
     PairExample("The sky is", " blue.", " green.", "sky")),
    ({"chosen": "The sky is blue.", "rejected": "The sky is black."}, PairExample("The sky is bl", "ue.", "ack.")),
    ({"chosen": "It is 5", "rejected": "It is 5."}, PairExample("It is", " 5", " 5.")),
    # nothing shared: an empty prompt, the reward model reads the whole texts (as TRL's reward trainer)
    ({"chosen": "Yes.", "rejected": "No."}, PairExample("", "Yes.", "No.")),
])
def test_pairs_standard_explicit_and_implicit(row, expected, tok):
    assert one(row, "pairs", tok) == expected


def test_pairs_conversational_explicit_and_implicit(render):
    name, tokenizer = render
    prompt, good, bad = PROMPT_TEXT[name], ANSWER_TEXT[name]["good"], ANSWER_TEXT[name]["bad"]
    assert one({"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]}, "pairs", tokenizer) == PairExample(
        prompt, good, bad)
    # implicit: the longest common message prefix is the prompt
    assert one({"chosen": [USER, GOOD], "rejected": [USER, BAD]}, "pairs", tokenizer) == PairExample(
        prompt, good, bad)
    assert one({"chosen": [SYS, USER, GOOD], "rejected": [SYS, USER, BAD]}, "pairs", tokenizer) == PairExample(
        SYS_PROMPT_TEXT[name], good, bad)
    # a string prompt beside whole conversations is superseded by their shared messages (TRL's
    # maybe_extract_prompt; e.g. HuggingFaceH4/ultrafeedback_binarized)
    assert one({"prompt": "say hi", "chosen": [USER, GOOD], "rejected": [USER, BAD]}, "pairs", tokenizer) == (
        PairExample(prompt, good, bad))


def test_pairs_implicit_prefix_conversation_keeps_an_answer_on_both_sides(tok):
    assert one({"chosen": [USER, GOOD], "rejected": [USER, GOOD, USER2, BAD]}, "pairs", tok) == PairExample(
        "user: say hi\nassistant: ", "good", "good\nuser: say bye\nassistant: bad")


def test_pairs_problems():
    needs = ("a pairs row needs 'chosen' and 'rejected' (strings or message lists), with a 'prompt' or with the "
             "prompt as their shared beginning")
    assert one({"chosen": [USER, GOOD], "rejected": [USER2, BAD]}, "pairs") == (
        "no shared prompt", "'chosen' and 'rejected' share no leading message, so the row has no prompt; start both "
        "with the prompt's messages, or add a 'prompt' column")
    assert one({"prompt": "say hi", "chosen": [GOOD], "rejected": [BAD]}, "pairs") == (
        "mixed formats", "'chosen' is a message list but 'prompt' is a string; use strings for all fields or "
        "message lists for all")
    assert one({"chosen": "good", "rejected": [BAD]}, "pairs") == (
        "mixed formats", "one of 'chosen' and 'rejected' is a string and the other a message list; use strings "
        "for both or message lists for both")
    assert one({"chosen": 1, "rejected": "bad"}, "pairs") == (
        "wrong type", "'chosen' must be a string or a list of messages, got int")
    assert one({"chosen": [USER, GOOD], "rejected": [USER, GOOD]}, "pairs") == (
        "chosen == rejected", "'chosen' and 'rejected' are identical")
    assert one({"messages": [USER, GOOD]}, "pairs") == (
        "wrong format", f"the row has columns 'messages' (TRL's conversational language modelling format); {needs}")
    assert one({"prompt": "say hi", "completion": "good"}, "pairs") == (
        "missing field", "missing fields 'chosen' and 'rejected'; the row has columns 'prompt', 'completion' "
        f"(TRL's prompt-completion format); {needs}")


# --- prompts --------------------------------------------------------------------------------


def test_prompts_standard_formats_carry_every_other_column(tok):
    row = {"prompt": "say hi", "answer": 5, "family": "greet", "tags": ["a", "b"], "reference": "hi"}
    assert one(row, "prompts", tok) == PromptExample(
        "say hi", "greet", "hi", {"answer": 5, "family": "greet", "tags": ["a", "b"], "reference": "hi"},
        "rows.jsonl:1")
    assert one({"prompt": "say hi", "completion": "good"}, "prompts", tok) == PromptExample(
        "say hi", None, None, {"completion": "good"}, "rows.jsonl:1")
    pair = {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    assert one(pair, "prompts", tok) == PromptExample(
        "The sky is", None, None, {"chosen": " blue.", "rejected": " green."}, "rows.jsonl:1")
    implicit = {"chosen": "The sky is blue.", "rejected": "The sky is green.", "id": 7}
    assert one(implicit, "prompts", tok) == PromptExample("The sky is", None, None, implicit, "rows.jsonl:1")


def test_prompts_conversational_formats_carry_every_other_column(render):
    name, tokenizer = render
    # the prompt's messages are kept too: reward functions get them, as in TRL
    expected = lambda prompt, columns, messages: PromptExample(  # noqa: E731
        prompt, None, None, columns, "rows.jsonl:1", messages)
    assert one({"prompt": [SYS, USER], "answer": "hi"}, "prompts", tokenizer) == expected(
        SYS_PROMPT_TEXT[name], {"answer": "hi"}, [SYS, USER])
    assert one({"prompt": [USER], "completion": [GOOD]}, "prompts", tokenizer) == expected(
        PROMPT_TEXT[name], {"completion": [GOOD]}, [USER])
    assert one({"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]}, "prompts", tokenizer) == expected(
        PROMPT_TEXT[name], {"chosen": [GOOD], "rejected": [BAD]}, [USER])
    implicit = {"chosen": [SYS, USER, GOOD], "rejected": [SYS, USER, BAD], "answer": 3}
    assert one(implicit, "prompts", tokenizer) == expected(SYS_PROMPT_TEXT[name], implicit, [SYS, USER])
    # the same row gives the same prompt text to the reward model (pairs) and the policy (prompts)
    assert one(implicit, "pairs", tokenizer).prompt == SYS_PROMPT_TEXT[name]
    superseded = {"prompt": "say hi", "chosen": [USER, GOOD], "rejected": [USER, BAD]}
    assert one(superseded, "prompts", tokenizer) == expected(
        PROMPT_TEXT[name], {"chosen": [USER, GOOD], "rejected": [USER, BAD]}, [USER])


def test_prompts_problems():
    needs = ("a prompts row needs 'prompt' (a string or a message list), one 'messages' list, or 'chosen' and "
             "'rejected' sharing their beginning")
    assert one({"text": "The sky is blue."}, "prompts") == (
        "wrong format", f"the row has columns 'text' (TRL's language modelling format); {needs}")
    assert one({"chosen": "Yes.", "rejected": "No."}, "prompts") == (
        "no shared prompt", "'chosen' and 'rejected' share no beginning, so the row has no prompt")
    assert one({"prompt": "say hi", "family": 3}, "prompts") == (
        "non-string content", "'family' must be a string, got int")
    assert one({"prompt": " ", "answer": "x"}, "prompts") == ("empty field", "empty field 'prompt'")
    assert one({"chosen": "good"}, "prompts") == (
        "missing field", f"missing field 'rejected'; the row has columns 'chosen'; {needs}")
