"""A user's reward and verifier functions, unit by unit (issue 36): what they are handed (their own prompts, the
column they name, TRL's extra arguments), what they may return, how a batch that fails is searched row by row,
and the messages that name the function, the row and its prompt. Timeouts are stood in for by a function that
raises `CallTimedOut` itself (limit 0: no watchdog), so nothing here waits."""

from __future__ import annotations

import functools
import logging
import math
import textwrap

import numpy as np
import pytest
import torch

from rlhflab import rewards
from rlhflab.data.prompt_rows import PromptRow
from rlhflab.errors import UserInputError
from rlhflab.rewards import functions
from rlhflab.rewards.base import Check, ScoreContext
from rlhflab.rewards.deadline import CallTimedOut
from rlhflab.rewards.functions import CallLimits, FunctionReward, FunctionVerifier, UserFunctionCall

ROWS = [PromptRow(p, {"answer": a}, where=f"p.jsonl:{i + 1}") for i, (p, a) in enumerate([("a", "1"), ("b", "2"),
                                                                                          ("c", "3")])]
PROMPTS = [r.prompt for r in ROWS]
INVALID = CallLimits(timeout=0, errors="invalid")  # no watchdog: a "hang" is a CallTimedOut the function raises
STOP = CallLimits(timeout=0)


# --- what a function is handed -------------------------------------------------------------------------------------

def echoes_its_prompt(prompts, completions, **kwargs):
    """1 where the completion repeats its own prompt upper-cased: wrong if handed no prompts, or other ones."""
    return [1.0 if c == p.upper() else 0.0 for p, c in zip(prompts, completions)]


def test_a_function_is_handed_each_row_s_own_prompt():
    out = FunctionReward(echoes_its_prompt)(PROMPTS, ["A", "X", "Z"], ROWS)
    # the completions handed as prompts would give [1, 1, 1] (each upper-case completion "repeats" itself); no
    # prompts, an empty list
    assert out.scores.tolist() == [1.0, 0.0, 0.0] and out.valid.tolist() == [True, True, True]
    checks = FunctionVerifier(lambda prompts, completions: [c == p.upper() for p, c in zip(prompts, completions)])(
        PROMPTS, ["A", "B", "B"], ROWS)
    assert [c.passed for c in checks] == [True, True, False]


def test_a_function_gets_the_column_it_names_and_never_a_column_named_like_the_trainer_s_arguments():
    rows = [PromptRow("a", {"answer": "1", "solution": "one", "prompts": "P", "completions": "C", "completion": "D",
                            "completion_ids": "I", "trainer_state": "S"}),
            PromptRow("b", {"answer": "2", "solution": "two", "topic": "t"})]
    seen = {}

    def named(prompts, completions, solution):
        seen["named"] = (prompts, completions, solution)
        return [0.0, 0.0]

    def everything(prompts, completions, **kwargs):
        seen["all"] = (prompts, completions, kwargs)
        return [0.0, 0.0]

    FunctionReward(named)(["a", "b"], ["x", "y"], rows)
    assert seen["named"] == (["a", "b"], ["x", "y"], ["one", "two"])  # the column it names, not `answer`
    FunctionReward(everything)(["a", "b"], ["x", "y"], rows)
    assert seen["all"] == (["a", "b"], ["x", "y"], {"answer": ["1", "2"], "solution": ["one", "two"],
                                                    "topic": [None, "t"]})


def test_trainer_state_without_completion_ids_and_the_ids_of_a_row_called_alone():
    rows = [PromptRow("a"), PromptRow("b")]
    seen = []

    def fn(prompts, completions, **kwargs):
        seen.append(kwargs)
        if len(prompts) > 1:
            raise RuntimeError("batch")
        return [1.0]

    FunctionReward(lambda prompts, completions, **kw: seen.append(kw) or [0.0, 0.0])(
        ["a", "b"], ["x", "y"], rows, ScoreContext(global_step=4))
    assert list(seen[0]) == ["trainer_state"] and seen[0]["trainer_state"].global_step == 4
    seen.clear()
    FunctionReward(fn, limits=INVALID)(["a", "b"], ["x", "y"], rows, ScoreContext([[5, 6], [7]], global_step=2))
    assert [s["completion_ids"] for s in seen] == [[[5, 6], [7]], [[5, 6]], [[7]]]
    assert [s["trainer_state"].global_step for s in seen] == [2, 2, 2]
    seen.clear()

    def slow_in_batches(prompts, completions, **kwargs):  # a batch that times out: the same search
        seen.append(kwargs)
        if len(prompts) > 1:
            raise CallTimedOut(0.5)
        return [1.0]

    FunctionReward(slow_in_batches, limits=INVALID)(["a", "b"], ["x", "y"], rows, ScoreContext([[5, 6], [7]], 2))
    assert [s["completion_ids"] for s in seen] == [[[5, 6], [7]], [[5, 6]], [[7]]]


def test_rows_called_alone_get_their_own_prompt_completion_and_columns():
    calls = []

    def fn(prompts, completions, answer):
        calls.append((prompts, completions, answer))
        if len(prompts) > 1:
            raise RuntimeError("only one at a time")
        return [float(answer[0])]

    out = FunctionReward(fn, limits=INVALID)(PROMPTS, ["x", "y", "z"], ROWS)
    assert out.scores.tolist() == [1.0, 2.0, 3.0] and out.valid.all()
    assert calls == [(PROMPTS, ["x", "y", "z"], ["1", "2", "3"]), (["a"], ["x"], ["1"]), (["b"], ["y"], ["2"]),
                     (["c"], ["z"], ["3"])]


def test_conversational_rows_only_when_every_row_has_messages():
    seen = []
    chat = PromptRow("<user>hi", {}, messages=({"role": "user", "content": "hi"},))
    plain = PromptRow("plain")
    FunctionVerifier(lambda prompts, completions: seen.append((prompts, completions)) or [True, True])(
        ["<user>hi", "plain"], ["x", "y"], [chat, plain])
    assert seen == [(["<user>hi", "plain"], ["x", "y"])]  # one row without messages: strings for all


def test_a_callable_whose_signature_cannot_be_read_gets_every_argument():
    class Opaque:
        __signature__ = "unreadable"  # inspect.signature raises TypeError

        def __call__(self, **kwargs):
            self.kwargs = kwargs
            return [1.0, 1.0, 1.0]

    fn = Opaque()
    FunctionReward(fn)(PROMPTS, ["x", "y", "z"], ROWS)
    assert fn.kwargs == {"prompts": PROMPTS, "completions": ["x", "y", "z"], "answer": ["1", "2", "3"]}


# --- what it may return ---------------------------------------------------------------------------------------------

def test_the_values_a_reward_function_may_return_and_the_rows_they_leave_out():
    values = [True, 2, 0.5, None, math.nan, math.inf, np.float64(1.5), torch.tensor([2.5]), np.int64(3)]
    rows = [PromptRow(str(i)) for i in range(len(values))]
    out = FunctionReward(lambda prompts, completions: values)([r.prompt for r in rows], ["x"] * len(rows), rows)
    assert out.scores.tolist() == [1.0, 2.0, 0.5, 0.0, 0.0, 0.0, 1.5, 2.5, 3.0]
    assert out.valid.tolist() == [True, True, True, False, False, False, True, True, True]
    assert out.scores.dtype == torch.float32
    as_tuple = FunctionReward(lambda prompts, completions: (1.0, 2.0, 3.0))(PROMPTS, ["x", "y", "z"], ROWS)
    assert as_tuple.scores.tolist() == [1.0, 2.0, 3.0]
    as_array = FunctionReward(lambda prompts, completions: np.array([1.0, 0.0, 2.0]))(PROMPTS, ["x", "y", "z"], ROWS)
    assert as_array.scores.tolist() == [1.0, 0.0, 2.0]


@pytest.mark.parametrize("returned, named", [
    ([1.0, 2.0], "reward function wrong returned 2 values for 3 completions"),
    ((1.0, 2.0, 3.0, 4.0), "reward function wrong returned 4 values for 3 completions"),
    ([], "reward function wrong returned 0 values for 3 completions"),
    (None, "reward function wrong returned a NoneType for 3 completions"),
    ({"a": 1.0}, "reward function wrong returned a dict for 3 completions"),
])
@pytest.mark.parametrize("limits", [STOP, INVALID])
def test_a_reward_function_returning_the_wrong_number_of_values_is_rejected(returned, named, limits):
    def wrong(prompts, completions):
        return returned

    with pytest.raises(UserInputError) as err:
        FunctionReward(wrong, name="wrong", limits=limits)(PROMPTS, ["x", "y", "z"], ROWS)
    assert str(err.value) == (f"wrong: {named} -> return a list with one value per completion, in the order given")


def test_a_wrong_count_from_a_row_called_alone_is_refused_not_counted_as_the_row_s_failure():
    def fn(prompts, completions):
        if len(prompts) > 1:
            raise RuntimeError("batch")
        return [1.0, 1.0]

    call = UserFunctionCall(fn, "reward function", name="fn", limits=INVALID)
    with pytest.raises(UserInputError, match="reward function fn returned 2 values for 1 completions"):
        call(PROMPTS, ["x", "y", "z"], ROWS)
    assert call.lost == {"raised": 0, "timed_out": 0}


def test_a_value_that_is_not_a_number_is_shown_cut_at_80_characters():
    def returns(value):
        return lambda prompts, completions: [1.0, value]

    rows = [PromptRow("a"), PromptRow("b" * 81, where="p.jsonl:2")]
    prompts = [r.prompt for r in rows]
    with pytest.raises(UserInputError) as err:
        FunctionReward(returns("x" * 78), name="mine")(prompts, ["x", "y"], rows)  # repr: 80 characters
    assert str(err.value) == ("mine: reward function mine returned '" + "x" * 78 + "' (a str) for row 1 (p.jsonl:2), "
                              "prompt '" + "b" * 80 + "...' -> return one float per completion (or None where it "
                              "cannot score the row), not a nested list or a (B, 1) tensor")
    with pytest.raises(UserInputError, match=r"returned '" + "x" * 79 + r"\.\.\. \(a str\) for row 1"):
        FunctionReward(returns("x" * 79), name="mine")(prompts, ["x", "y"], rows)
    with pytest.raises(UserInputError, match=r"returned array\(\[1\.\]\) \(a ndarray\) for row 1"):
        FunctionReward(returns(np.array([1.0])), name="mine")(prompts, ["x", "y"], rows)
    with pytest.raises(UserInputError, match=r"returned tensor\(\[1\., 2\.\]\) \(a Tensor\) for row 1"):
        FunctionReward(returns(torch.tensor([1.0, 2.0])), name="mine")(prompts, ["x", "y"], rows)
    with pytest.raises(UserInputError, match=r"returned <ufunc 'add'> \(a ufunc\) for row 1"):  # numpy's, no ndim
        FunctionReward(returns(np.add), name="mine")(prompts, ["x", "y"], rows)
    rows[1] = PromptRow("b" * 80)
    with pytest.raises(UserInputError, match="for row 1, prompt '" + "b" * 80 + "' ->"):  # no where: no brackets
        FunctionReward(returns("no"), name="mine")(["a", "b" * 80], ["x", "y"], rows)


def test_a_verifier_s_checks_and_the_values_it_may_not_return():
    values = [True, False, 1, 0.0, None, np.bool_(True)]
    rows = [PromptRow(str(i)) for i in range(len(values))]
    checks = FunctionVerifier(lambda prompts, completions: values, name="v")([r.prompt for r in rows],
                                                                             ["x"] * len(rows), rows)
    assert checks == [Check(True, "pass", ""), Check(False, "fail", "v: fail"), Check(True, "pass", ""),
                      Check(False, "fail", "v: fail"), Check(False, "unverified", "v could not check this row"),
                      Check(True, "pass", "")]
    for bad, shown in [(2, "2"), (0.5, "0.5"), ("yes", "'yes'")]:
        with pytest.raises(UserInputError) as err:
            FunctionVerifier(lambda prompts, completions: [True, bad], name="v")(
                ["a", "b"], ["x", "y"], [PromptRow("a"), PromptRow("b", where="p.jsonl:2")])
        assert str(err.value) == (f"v: verifier v returned {shown} for row 1 (p.jsonl:2), prompt 'b' -> return "
                                  "True / False (or None where it cannot check the row)")


# --- a batch that fails: the rows called alone ----------------------------------------------------------------------

def fails_on(*bad, hang=False):
    """A function that raises (or "hangs": raises CallTimedOut, as the watchdog would) on the prompts in `bad`."""
    def fn(prompts, completions, **kwargs):
        fn.calls.append(list(prompts))
        for p in prompts:
            if p in bad:
                if hang:
                    raise CallTimedOut(0.5, "user.py:3 (fn)")
                raise KeyError(p)
        return [float(p != "a") for p in prompts]
    fn.__qualname__ = "fn"  # named as a module-level function is
    fn.calls = []
    return fn


def test_a_row_that_raises_is_named_with_its_prompt_and_completion_under_stop():
    with pytest.raises(UserInputError) as err:
        FunctionReward(fails_on("b"), limits=STOP)(PROMPTS, ["x", "y" * 81, "z"], ROWS)
    assert str(err.value) == ("fn: reward function fn raised KeyError: 'b' on row 1 (p.jsonl:2), prompt 'b', "
                              "completion '" + "y" * 80 + "...' -> fix the function (it must accept every row of the "
                              "data) or that row, or pass --reward_errors invalid to leave such rows out and count "
                              "them")
    assert isinstance(err.value.__cause__, KeyError)


def test_a_prompt_given_as_messages_is_shown_as_their_text_cut_at_80_characters():
    def raises(prompts, completions):
        raise KeyError("no")

    head = "[{'role': 'user', 'content': '"  # 30 characters of the list's repr
    for messages, shown in [([{"role": "user", "content": "hi"}], '"' + head + "hi'}]\""),
                            ([{"role": "user", "content": "q" * 100}], '"' + head + "q" * 50 + '..."')]:
        with pytest.raises(UserInputError) as err:
            FunctionReward(raises, name="f", limits=STOP)([messages], ["a"], [PromptRow("a")])
        assert f"raised KeyError: 'no' on row 0, prompt {shown}, completion 'a' ->" in str(err.value)


def test_a_row_that_hangs_is_named_with_where_it_was_under_stop():
    fn = fails_on("b", hang=True)
    with pytest.raises(UserInputError) as err:
        FunctionReward(fn, limits=STOP)(PROMPTS, ["x", "y", "z"], ROWS)
    assert str(err.value) == ("fn: reward function fn did not return within 0.5 s on row 1 (p.jsonl:2), prompt 'b', "
                              "completion 'y'; it was at user.py:3 (fn) -> make it faster on such rows or give it its "
                              "own time limit; raise --reward_timeout (0 = no limit), or pass --reward_errors invalid "
                              "to leave such rows out and count them")
    assert fn.calls == [["a", "b", "c"], ["a"], ["b"]]  # stopped at the first failing row

    def hangs_nowhere_known(prompts, completions):
        raise CallTimedOut(2.0)

    with pytest.raises(UserInputError, match=r"within 2 s on row 0 \(p.jsonl:1\), prompt 'a', completion 'x' ->"):
        FunctionReward(hangs_nowhere_known, limits=STOP)(PROMPTS, ["x", "y", "z"], ROWS)


def test_invalid_leaves_out_the_failing_rows_counts_them_by_kind_and_says_so_once(caplog):
    reward = FunctionReward(fails_on("a", "c"), limits=INVALID)
    with caplog.at_level(logging.WARNING, logger="rlhflab"):
        out = reward(PROMPTS, ["x", "y", "z"], ROWS)
    assert out.scores.tolist() == [0.0, 1.0, 0.0] and out.valid.tolist() == [False, True, False]
    assert reward.call.lost == {"raised": 2, "timed_out": 0}
    assert caplog.messages == ["reward function fn raised KeyError: 'a' on row 0 (p.jsonl:1), prompt 'a', completion "
                               "'x'; 1 more of the batch's 3 rows failed too: left out (--reward_errors invalid)"]
    caplog.clear()
    hanging = FunctionReward(fails_on("b", hang=True), limits=INVALID)
    with caplog.at_level(logging.WARNING, logger="rlhflab"):
        out = hanging(PROMPTS, ["x", "y", "z"], ROWS)
    assert out.valid.tolist() == [True, False, True] and out.scores.tolist() == [0.0, 0.0, 1.0]
    assert hanging.call.lost == {"raised": 0, "timed_out": 1}
    assert caplog.messages == [
        "reward function fn: no answer after 0.5 s on a batch of 3 rows; calling each row alone to find the row it "
        "hangs on (each up to 0 s)",
        "reward function fn did not return within 0.5 s on row 1 (p.jsonl:2), prompt 'b', completion 'y'; it was at "
        "user.py:3 (fn): left out (--reward_errors invalid)"]


def test_after_two_rows_time_out_the_rest_of_the_batch_is_lost_without_being_called():
    rows = [PromptRow(p) for p in "abcde"]
    fn = fails_on("a", "b", "c", "d", "e", hang=True)
    reward = FunctionReward(fn, limits=INVALID)
    out = reward([r.prompt for r in rows], ["x"] * 5, rows)
    assert out.valid.tolist() == [False] * 5
    assert fn.calls == [list("abcde"), ["a"], ["b"]]
    assert reward.call.lost == {"raised": 0, "timed_out": 5}
    assert functions.MAX_ROW_TIMEOUTS == 2
    lost = UserFunctionCall(fails_on("a", "b", "d", hang=True), "verifier", limits=INVALID)(
        [r.prompt for r in rows], ["x"] * 5, rows)
    assert [v.kind for v in lost] == ["timed_out"] * 5
    assert [v.reason for v in lost][2:] == ["not called alone after 2 rows timed out"] * 3
    # rows that raise do not count towards the two
    called = []

    def mixed(prompts, completions):
        called.append("".join(prompts))
        if "a" in prompts or "c" in prompts:
            raise KeyError("a or c")
        if "b" in prompts or "d" in prompts:
            raise CallTimedOut(0.5)
        return [1.0] * len(prompts)

    call = UserFunctionCall(mixed, "reward function", limits=INVALID)
    assert [getattr(v, "kind", v) for v in call([r.prompt for r in rows], ["x"] * 5, rows)] == [
        "raised", "timed_out", "raised", "timed_out", "timed_out"]
    assert called == ["abcde", "a", "b", "c", "d"] and call.lost == {"raised": 2, "timed_out": 3}


def test_a_batch_that_fails_while_every_row_alone_passes():
    def only_alone(prompts, completions):
        if len(prompts) > 1:
            raise RuntimeError("too many")
        return [1.5]

    with pytest.raises(UserInputError) as err:
        FunctionReward(only_alone, name="only_alone", limits=STOP)(PROMPTS, ["x", "y", "z"], ROWS)
    assert str(err.value) == ("only_alone: reward function only_alone raised RuntimeError: too many on the batch of 3 "
                              "rows (no single row fails alone)")
    assert isinstance(err.value.__cause__, RuntimeError)

    def slow_in_batches(prompts, completions):
        if len(prompts) > 1:
            raise CallTimedOut(0.5)
        return [1.5]

    with pytest.raises(UserInputError) as err:
        FunctionReward(slow_in_batches, name="slow_in_batches", limits=STOP)(PROMPTS, ["x", "y", "z"], ROWS)
    assert str(err.value) == ("slow_in_batches: reward function slow_in_batches did not return within 0.5 s on the "
                              "batch of 3 rows, though each row alone did -> make it faster, or raise "
                              "--reward_timeout (0 = no limit)")
    logs = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())
    logging.getLogger("rlhflab").addHandler(handler)
    try:
        reward = FunctionReward(only_alone, name="only_alone", limits=INVALID)
        out = reward(PROMPTS, ["x", "y", "z"], ROWS)
    finally:
        logging.getLogger("rlhflab").removeHandler(handler)
    assert out.scores.tolist() == [1.5, 1.5, 1.5] and out.valid.all()  # each row's own value kept, nothing lost
    assert reward.call.lost == {"raised": 0, "timed_out": 0}
    assert logs == ["reward function only_alone raised RuntimeError: too many on the batch of 3 rows (no single row "
                    "fails alone); each row's own value kept"]


def test_a_verifier_s_lost_rows_are_failures_of_kind_error():
    checks = FunctionVerifier(fails_on("b"), name="v", limits=INVALID)(PROMPTS, ["x", "y", "z"], ROWS)
    assert [(c.passed, c.kind) for c in checks] == [(False, "fail"), (False, "error"), (True, "pass")]  # 0., -, 1.
    assert checks[1].reason == "verifier v raised KeyError: 'b' on row 1 (p.jsonl:2), prompt 'b', completion 'y'"


def test_the_call_is_made_under_the_time_limit_named_for_the_last_resort_exit(monkeypatch):
    seen = []
    monkeypatch.setattr(functions, "call_with_deadline", lambda call, seconds, what: seen.append((seconds, what))
                        or call())
    FunctionReward(echoes_its_prompt, name="exact", limits=CallLimits(timeout=7.5))(PROMPTS, ["A", "B", "C"], ROWS)
    FunctionVerifier(echoes_its_prompt, limits=CallLimits(timeout=3))(PROMPTS, ["A", "B", "C"], ROWS)
    assert seen == [(7.5, "reward function exact"), (3, "verifier echoes_its_prompt")]


# --- limits, names, counts ----------------------------------------------------------------------------------------

def test_call_limits_defaults_and_refusals():
    assert (CallLimits().timeout, CallLimits().errors) == (600.0, "stop")
    assert CallLimits(timeout=0).timeout == 0  # no limit
    with pytest.raises(UserInputError) as err:
        CallLimits(errors="skip")
    assert str(err.value) == "--reward_errors: unknown reward error mode 'skip' -> choose one of stop, invalid"
    for bad in (-0.5, math.nan):
        with pytest.raises(UserInputError) as err:
            CallLimits(timeout=bad)
        assert str(err.value).startswith(f"--reward_timeout: reward_timeout must be >= 0 seconds, got {bad} -> give "
                                         "the seconds one call of a reward or verifier function may take, or 0 for "
                                         "no limit")


def test_a_function_s_name_in_messages():
    class Scorer:
        def score(self, prompts, completions):
            return [0.0] * len(prompts)

        def __call__(self, prompts, completions):
            return [0.0] * len(prompts)

    named = Scorer()
    named.__name__ = "given"
    assert functions.function_name(echoes_its_prompt) == "echoes_its_prompt"
    assert functions.function_name(Scorer().score) == (
        "test_a_function_s_name_in_messages.<locals>.Scorer.score")  # the qualified name first
    assert functions.function_name(named) == "given"
    assert functions.function_name(Scorer()) == "Scorer"
    assert functions.function_name(functools.partial(echoes_its_prompt)) == "partial"
    assert FunctionReward(Scorer()).name == "Scorer" and FunctionReward(Scorer(), name="mine").name == "mine"
    assert FunctionVerifier(Scorer()).name == "Scorer" and FunctionVerifier(Scorer(), name="v").name == "v"


def test_lost_rows_of_two_functions_of_one_name_and_of_none(monkeypatch):
    from rlhflab import parallel

    calls = [FunctionReward(fails_on("a"), limits=INVALID) for _ in range(3)]
    for i, reward in enumerate(calls):
        reward(PROMPTS[: i + 1], ["x"] * (i + 1), ROWS[: i + 1])
    verifier = FunctionVerifier(fails_on("b", hang=True), limits=INVALID)
    verifier(PROMPTS, ["x", "y", "z"], ROWS)
    assert rewards.lost_rows(*calls, verifier) == {
        "reward function fn": {"raised": 1, "timed_out": 0}, "reward function fn (2)": {"raised": 1, "timed_out": 0},
        "reward function fn (3)": {"raised": 1, "timed_out": 0}, "verifier fn": {"raised": 0, "timed_out": 1}}
    summed = []
    monkeypatch.setattr(parallel, "all_sum", lambda t, world: summed.append(t.tolist()) or t * world)
    assert rewards.lost_rows(rewards.CheckerReward(), world=2) == {}  # no user function: no collective either
    assert summed == []
    assert rewards.lost_rows(rewards.CombinedReward([(calls[0], 1.0), (rewards.CheckerReward(), 1.0)]), world=2) == {
        "reward function fn": {"raised": 2, "timed_out": 0}}
    assert summed == [[[1, 0]]]
    assert rewards.error_summary(verifier, calls[0]) == {"mode": "invalid", "timeout_s": 0, "lost_rows": {
        "verifier fn": {"raised": 0, "timed_out": 1}, "reward function fn": {"raised": 1, "timed_out": 0}}}
    assert rewards.error_summary(verifier, world=3)["lost_rows"] == {"verifier fn": {"raised": 0, "timed_out": 3}}
    assert rewards.error_summary(FunctionReward(echoes_its_prompt, limits=CallLimits(timeout=9))) == {
        "mode": "stop", "timeout_s": 9, "lost_rows": {"reward function echoes_its_prompt": {"raised": 0,
                                                                                            "timed_out": 0}}}


# --- loading a function --------------------------------------------------------------------------------------------

USER_FILE = '''
import dataclasses
from math import sqrt

LIMIT = 3


@dataclasses.dataclass
class Point:
    x: int


def beta(prompts, completions):
    return [1.0] * len(prompts)


def alpha(prompts, completions):
    return [float(len(pickle_round_trip(Point(len(c))).__dict__)) for c in completions]


def _helper():
    pass


alias = beta.__call__  # a method-wrapper: callable, with no __module__ at all


def pickle_round_trip(value):
    import pickle
    return pickle.loads(pickle.dumps(value))
'''


def test_load_function_from_a_file_whose_path_has_a_colon_and_the_module_it_registers(tmp_path):
    folder = tmp_path / "run:1"
    folder.mkdir()
    (folder / "mine.py").write_text(textwrap.dedent(USER_FILE))
    fn = rewards.load_function(f"  {folder / 'mine.py'}:alpha \n")  # the last colon splits; spaces around ignored
    assert fn.__name__ == "alpha" and fn(["p"], ["xy"]) == [1.0]  # its dataclass pickles: the module is registered
    assert fn.__module__.startswith("rlhflab_user_") and fn.__module__.endswith("_mine")
    other = tmp_path / "other"
    other.mkdir()
    (other / "mine.py").write_text("def alpha(prompts, completions):\n    return [2.0]\n")
    again = rewards.load_function(f"{other / 'mine.py'}:alpha")  # the same file name elsewhere: its own module
    assert again(["p"], ["x"]) == [2.0] and fn(["p"], ["xy"]) == [1.0] and again.__module__ != fn.__module__
    assert rewards.load_function("math:sqrt")(9.0) == 3.0  # package.module:NAME


@pytest.mark.parametrize("spec, message", [
    ("mine.py:missing", "--reward_fn: mine.py has no function 'missing' -> functions defined there: Point, alpha, "
                        "beta, pickle_round_trip"),
    ("empty.py:f", "--reward_fn: empty.py has no function 'f' -> functions defined there: none"),
    ("mine.py:LIMIT", "--reward_fn: mine.py:LIMIT is a int, not a function"),
    ("mine.py:", "--reward_fn: 'mine.py:' does not name a function -> write FILE.py:NAME (e.g. my_rewards.py:exact) or "
                 "package.module:NAME"),
    (":alpha", "--reward_fn: ':alpha' does not name a function"),
    ("mine.py", "--reward_fn: 'mine.py' does not name a function"),
    ("broken.py:f", "--reward_fn: importing broken.py failed: NameError: name 'undefined' is not defined"),
    ("nope.py:f", "--reward_fn: file not found: nope.py -> give a path relative to "),
    ("no_such_module_xyz:f", "--reward_fn: cannot import module 'no_such_module_xyz' (No module named "
                             "'no_such_module_xyz') -> install it, put it on PYTHONPATH, or pass a file path ending in "
                             ".py"),
])
def test_a_bad_function_spec_names_what_is_wrong(tmp_path, monkeypatch, spec, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text(textwrap.dedent(USER_FILE))
    (tmp_path / "empty.py").write_text("import os\n")
    (tmp_path / "broken.py").write_text("undefined + 1\n")
    with pytest.raises(UserInputError) as err:
        rewards.load_function(spec)
    assert str(err.value).startswith(message)
    with pytest.raises(UserInputError, match="^--verifier: "):
        rewards.load_function(spec, "--verifier")


def test_a_missing_file_names_the_folder_it_was_looked_for_in(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserInputError) as err:
        rewards.load_function("nope.py:f")
    assert str(err.value) == f"--reward_fn: file not found: nope.py -> give a path relative to {tmp_path} or an " \
                             "absolute one"


def test_an_import_error_keeps_its_cause(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.py").write_text("undefined + 1\n")
    with pytest.raises(UserInputError) as err:
        rewards.load_function("broken.py:f")
    assert isinstance(err.value.__cause__, NameError)
    with pytest.raises(UserInputError) as err:
        rewards.load_function("no_such_module_xyz:f")
    assert isinstance(err.value.__cause__, ImportError)
