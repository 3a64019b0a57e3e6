"""The reward sources' shared pieces (issue 36): `Scored` and `scored`, `score` handing the trainer's context only
to a source that takes it, the combined reward, and the suite's checker reading a row's `family` / `reference`
columns, as a reward and as a verifier."""

from __future__ import annotations

import math

import pytest
import torch

from rlhflab.data.prompt_rows import PromptRow
from rlhflab.errors import UserInputError
from rlhflab.rewards import (Check, CheckerReward, CheckerVerifier, CombinedReward, ScoreContext, Scored, as_scored,
                             score, task_item)
from rlhflab.rewards.base import check_lengths, scored
from rlhflab.tasks import TaskItem

YES_NO = TaskItem("yes_no", "Is 92 bigger than 734? Reply with yes or no.\n", "no", ("92", "734"))
UPPER = TaskItem("uppercase", "Rewrite fuk in uppercase letters.\n", "FUK", ("fuk",))


# --- base.py ------------------------------------------------------------------------------------------------------

def test_scored_wants_two_tensors_of_shape_b():
    Scored(torch.zeros(2), torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"^scores \(2,\) and valid \(3,\) must be \(B,\)$"):
        Scored(torch.zeros(2), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"^scores \(2, 1\) and valid \(2, 1\) must be \(B,\)$"):
        Scored(torch.zeros(2, 1), torch.ones(2, 1, dtype=torch.bool))
    assert Check(True, "pass").reason == ""


def test_scored_zeroes_and_invalidates_non_finite_rows_on_the_cpu_in_float32():
    raw = torch.tensor([1.5, math.nan, -2.0, math.inf, 3.0], dtype=torch.float64, requires_grad=True)
    out = scored(raw * 1, torch.tensor([1, 1, 1, 1, 0]))
    assert out.scores.tolist() == [1.5, 0.0, -2.0, 0.0, 0.0]
    assert out.valid.tolist() == [True, False, True, False, False]
    assert out.scores.dtype == torch.float32 and out.valid.dtype == torch.bool and not out.scores.requires_grad


def test_as_scored_reads_a_scored_a_tensor_or_a_list_with_none():
    given = Scored(torch.tensor([1.0]), torch.tensor([True]))
    assert as_scored(given) is given
    out = as_scored([1.0, None, math.inf, -math.inf, 2])
    assert out.scores.tolist() == [1.0, 0.0, 0.0, 0.0, 2.0] and out.valid.tolist() == [True, False, False, False, True]
    out = as_scored(torch.tensor([0.5, math.nan]))
    assert out.scores.tolist() == [0.5, 0.0] and out.valid.tolist() == [True, False]
    assert out.scores.dtype == torch.float32
    with pytest.raises(TypeError):  # a (B, 1) head output is refused, not read as B scores
        as_scored(torch.ones(3, 1))


def test_score_hands_the_context_only_to_a_source_that_takes_it():
    context = ScoreContext([[1, 2]], global_step=5)
    seen = []

    def named(prompts, responses, rows, context=None):
        seen.append(("named", context))
        return "named"

    def keywords(prompts, responses, rows, **kwargs):
        seen.append(("keywords", kwargs.get("context")))
        return "keywords"

    def plain(prompts, responses, rows):
        seen.append(("plain", None))
        return "plain"

    class Opaque:
        __signature__ = "unreadable"  # inspect.signature raises TypeError: called without the context

        def __call__(self, prompts, responses, rows, **kwargs):
            seen.append(("opaque", kwargs))
            return "opaque"

    for source in (named, keywords, plain, Opaque()):
        score(source, ["p"], ["r"], [None], context)
    assert seen == [("named", context), ("keywords", context), ("plain", None), ("opaque", {})]
    seen.clear()
    score(named, ["p"], ["r"], [None])  # no context: the source's default
    assert seen == [("named", None)]


def test_score_context_defaults_and_the_rows_of_a_slice():
    assert ScoreContext() == ScoreContext(None, 0)
    context = ScoreContext([[1], [2, 3], [4]], global_step=7)
    assert context.rows(1, 3) == ScoreContext([[2, 3], [4]], 7)
    assert ScoreContext(global_step=2).rows(0, 1) == ScoreContext(None, 2)


def test_check_lengths_returns_b_or_names_the_three_lengths():
    assert check_lengths(["a", "b"], ["x", "y"], [None, None]) == 2
    with pytest.raises(ValueError, match="^got 2 prompts, 2 responses and 1 rows$"):
        check_lengths(["a", "b"], ["x", "y"], [None])
    with pytest.raises(ValueError, match="^got 1 prompts, 2 responses and 2 rows$"):
        check_lengths(["a"], ["x", "y"], [None, None])


# --- combine.py ---------------------------------------------------------------------------------------------------

class Fixed:
    def __init__(self, scores, valid):
        self.out = Scored(torch.tensor(scores), torch.tensor(valid))

    def __call__(self, prompts, responses, rows):
        return self.out


def test_combined_reward_hands_its_parts_the_context_and_checks_the_lengths():
    seen = []

    def with_context(prompts, responses, rows, context=None):
        seen.append(context)
        return Scored(torch.tensor([2.0, 4.0]), torch.tensor([True, True]))

    context = ScoreContext([[1], [2]], global_step=3)
    reward = CombinedReward([(with_context, 0.5), (Fixed([1.0, -1.0], [True, True]), 2.0)])
    out = reward(["a", "b"], ["x", "y"], [None, None], context)
    assert out.scores.tolist() == [3.0, 0.0] and out.valid.tolist() == [True, True] and seen == [context]
    assert reward.sources == [(with_context, 0.5), (reward.sources[1][0], 2.0)]
    with pytest.raises(ValueError, match="got 2 prompts, 1 responses and 2 rows"):
        reward(["a", "b"], ["x"], [None, None])
    with pytest.raises(UserInputError) as err:
        CombinedReward(())
    assert str(err.value) == ("reward sources: a combined reward needs at least one (source, weight) pair -> e.g. "
                              "[(CheckerReward(), 1.0), (ModelReward(...), 0.5)]")


# --- checker.py ---------------------------------------------------------------------------------------------------

def test_task_item_reads_a_row_s_family_reference_and_content():
    row = PromptRow(YES_NO.prompt, {"family": "yes_no", "reference": "no", "content": ["92", "734"]})
    assert task_item(row) == YES_NO
    assert task_item(PromptRow("p", {"family": "uppercase", "reference": "FUK"})) == TaskItem("uppercase", "p", "FUK",
                                                                                                ())
    assert task_item(YES_NO) is YES_NO and task_item(None) is None
    assert task_item(PromptRow("p", {"family": "no_such_family", "reference": "x"})) is None
    assert task_item(PromptRow("p", {"family": "yes_no", "reference": 3})) is None
    assert task_item(PromptRow("p", {"reference": "no"})) is None


def test_checker_reward_from_prompt_rows():
    rows = [PromptRow(YES_NO.prompt, {"family": "yes_no", "reference": "no"}), PromptRow("p", {"answer": "no"}),
            UPPER, UPPER]
    reward = CheckerReward()
    assert (reward.pass_score, reward.fail_score) == (1.0, 0.0)
    out = reward(["p"] * 4, ["no", "no", "fuk", "FUK"], rows)
    assert out.scores.tolist() == [1.0, 0.0, 0.0, 1.0] and out.valid.tolist() == [True, False, True, True]
    out = CheckerReward(pass_score=3.0, fail_score=-1.0)(["p"] * 4, ["no", "no", "fuk", "FUK"], rows)
    assert out.scores.tolist() == [3.0, 0.0, -1.0, 3.0]


def test_checker_verifier_kinds_and_the_eos_it_is_told():
    verifier = CheckerVerifier()
    assert verifier.name == "checker"
    rows = [YES_NO, YES_NO, PromptRow("p"), UPPER]
    answers = ["no", "yes", "no", "FUK"]
    assert verifier(["p"] * 4, answers, rows) == [
        Check(True, "pass", "exact match"), Check(False, "wrong_content", "does not match the reference 'no'"),
        Check(False, "unverified", "no suite family / reference to check against"), Check(True, "pass", "exact match")]
    checks = verifier(["p"] * 4, answers, rows, ended_with_eos=[True, True, True, False])
    assert [c.kind for c in checks] == ["pass", "wrong_content", "unverified", "missing_eos"]
    assert checks[3] == Check(False, "missing_eos", "no EOS: the answer hit the length cap")
    with pytest.raises(ValueError, match="got 4 prompts, 3 responses and 4 rows"):
        verifier(["p"] * 4, answers[:3], rows)
