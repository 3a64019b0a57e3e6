import math

import pytest

from rlhflab.eval.rm_diagnosis import diagnosis_summary, point_biserial, roc_auc, worst_cases_text


def test_a_reward_equal_to_the_checker_has_correlation_one_and_auc_one():
    passed = [True, False, True, False, False]
    scores = [1.0 if p else 0.0 for p in passed]
    assert point_biserial(scores, passed) == pytest.approx(1.0)
    assert roc_auc(scores, passed) == 1.0


def test_point_biserial_hand_worked():
    # x = [1, 2, 3, 4], y = [0, 0, 1, 1]: cov = 2, var_x = 5, var_y = 1 -> 2 / sqrt(5)
    assert point_biserial([1, 2, 3, 4], [False, False, True, True]) == pytest.approx(2 / math.sqrt(5))
    assert point_biserial([4, 3, 2, 1], [False, False, True, True]) == pytest.approx(-2 / math.sqrt(5))
    assert math.isnan(point_biserial([1, 2], [True, True]))


def test_roc_auc_counts_pairs_and_ties():
    # passing {3, 1}, failing {2, 1}: pairs (3>2) (3>1) (1<2) (1=1 -> 1/2) = 2.5 / 4
    assert roc_auc([3, 1, 2, 1], [True, True, False, False]) == pytest.approx(0.625)
    assert math.isnan(roc_auc([1, 2], [False, False]))


def test_summary_and_worst_cases():
    rows = [
        {"score": 5.0, "passed": False, "family": "f", "kind": "wrong_case", "prompt": "p1\n", "answer": "A", "reference": "a"},
        {"score": 1.0, "passed": True, "family": "f", "kind": "pass", "prompt": "p2\n", "answer": "b", "reference": "b"},
        {"score": 0.0, "passed": False, "family": "g", "kind": "wrong_content", "prompt": "p3\n", "answer": "x", "reference": "y"},
    ]
    s = diagnosis_summary(rows, worst=1)
    assert s["mean_reward_passing"] == 1.0 and s["mean_reward_failing"] == 2.5 and s["pass_rate"] == pytest.approx(1 / 3)
    assert s["worst_failing"][0]["answer"] == "A" and s["roc_auc"] == 0.5
    text = worst_cases_text(s)
    assert "score 5.00" in text and "'A'" in text and "expected 'a'" in text


def test_worst_cases_say_when_a_side_is_empty():
    rows = [{"score": 1.0, "passed": False, "family": "f", "kind": "wrong_case", "prompt": "p\n", "answer": "A",
             "reference": "a"}]
    text = worst_cases_text(diagnosis_summary(rows, worst=3))
    assert "no answer passed" in text and "'A'" in text


def test_zero_samples_per_prompt_is_refused_up_front():
    from rlhflab.config import RMDiagnoseConfig
    from rlhflab.errors import UserInputError
    from rlhflab.eval.rm_diagnosis import check_diagnose_config

    with pytest.raises(UserInputError, match="samples_per_prompt"):
        check_diagnose_config(RMDiagnoseConfig(reward_model="rm", policy="p", samples_per_prompt=0))
