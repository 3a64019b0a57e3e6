"""DPO's pieces that need no model (trainers/dpo.py): each loss type's number on hand-made summed log-probs (which
ones read means, which read the reference), the run's length in steps and pairs, and the refusals (issue 36)."""

import math
from types import SimpleNamespace

import pytest
import torch

from rlhflab.config import DPOConfig
from rlhflab.errors import UserInputError
from rlhflab.trainers import dpo
from rlhflab.trainers.dpo_logps import SequenceLogps


def dpo_cfg(**fields) -> DPOConfig:
    return DPOConfig(**{"model": "unused", **fields})


# two pairs: summed log-probs over (chosen, rejected) lengths (2, 4) and (1, 1)
POLICY = SequenceLogps(torch.tensor([-2.0, -1.0]), torch.tensor([-8.0, -3.0]), torch.tensor([2.0, 1.0]),
                       torch.tensor([4.0, 1.0]))
REFERENCE = SequenceLogps(torch.tensor([-3.0, -1.5]), torch.tensor([-6.0, -2.0]), torch.tensor([2.0, 1.0]),
                          torch.tensor([4.0, 1.0]))


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def test_sigmoid_reads_summed_log_probs_against_the_reference_with_label_smoothing():
    loss, stats = dpo.preference_loss(dpo_cfg(loss_type="sigmoid", beta=0.5, label_smoothing=0.2), POLICY, REFERENCE)
    # h = beta ((pc - rc) - (pr - rr)): pair 1: 0.5 (1 - (-2)) = 1.5; pair 2: 0.5 (0.5 - (-1)) = 0.75
    expected = sum(-0.8 * log_sigmoid(h) - 0.2 * log_sigmoid(-h) for h in (1.5, 0.75)) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6) and stats["loss"] == pytest.approx(expected, abs=1e-6)
    assert stats["rewards/chosen"] == pytest.approx(0.5 * (1.0 + 0.5) / 2)
    assert stats["rewards/rejected"] == pytest.approx(0.5 * (-2.0 - 1.0) / 2)
    assert stats["rewards/accuracies"] == 1.0 and stats["rewards/margins"] == pytest.approx((1.5 + 0.75) / 2)
    assert stats["logps/chosen"] == -1.5 and stats["logps/rejected"] == -5.5  # summed, as the loss read them


def test_ipo_reads_means_per_token_against_the_reference():
    loss, stats = dpo.preference_loss(dpo_cfg(loss_type="ipo", beta=0.25), POLICY, REFERENCE)
    # per-token means: pair 1: chosen -1 vs ref -1.5, rejected -2 vs ref -1.5: h = 0.5 - (-0.5) = 1.0
    # pair 2: chosen -1 vs -1.5, rejected -3 vs -2: h = 0.5 + 1 = 1.5; 1 / (2 beta) = 2
    assert loss.item() == pytest.approx(((1.0 - 2) ** 2 + (1.5 - 2) ** 2) / 2, abs=1e-6)
    assert stats["logps/chosen"] == -1.0 and stats["logps/rejected"] == -2.5  # the means the loss read


def test_simpo_reads_means_and_no_reference():
    loss, stats = dpo.preference_loss(dpo_cfg(loss_type="simpo", beta=2.0, simpo_gamma=0.5), POLICY, None)
    # -log sigma(beta (mean_c - mean_r) - gamma): pair 1: 2 (-1 + 2) - 0.5 = 1.5; pair 2: 2 (-1 + 3) - 0.5 = 3.5
    assert loss.item() == pytest.approx(-(log_sigmoid(1.5) + log_sigmoid(3.5)) / 2, abs=1e-6)
    assert dpo.LOSS_TYPES["simpo"].reference is False and dpo.LOSS_TYPES["sigmoid"].reference is True
    assert dpo.LOSS_TYPES["ipo"].averaged and dpo.LOSS_TYPES["simpo"].averaged and not dpo.LOSS_TYPES["sigmoid"].averaged
    assert stats["logps/rejected"] == -2.5


@pytest.mark.parametrize("fields, pairs, expected", [
    ({"num_epochs": 2, "batch_size": 4}, 10, (5, 20)),  # 2 epochs of 10 pairs in steps of 4
    ({"num_epochs": 2, "batch_size": 4, "max_pairs": 7}, 10, (2, 7)),  # the pair budget ends inside step 2
    ({"num_epochs": 2, "batch_size": 4, "max_steps": 3}, 10, (3, 12)),  # max_steps set: epochs not read
    ({"num_epochs": 0, "batch_size": 4, "max_steps": 3, "max_pairs": 6}, 10, (2, 6)),
    ({"num_epochs": 0, "batch_size": 4, "max_steps": 2, "max_pairs": 50}, 10, (2, 8)),
    ({"num_epochs": 1, "batch_size": 3}, 10, (4, 10)),  # the last step takes what is left
    ({"num_epochs": 2, "batch_size": 4, "max_pairs": 1}, 10, (1, 1)),
    ({"num_epochs": 1, "batch_size": 4, "max_steps": 1}, 2, (1, 4)),  # max_steps set: the one epoch is not read
    ({"num_epochs": 1, "batch_size": 4, "max_steps": 3}, 2, (3, 12)),
    ({"num_epochs": 0, "batch_size": 4, "max_pairs": 6}, 10, (2, 6)),
    ({"num_epochs": 0, "batch_size": 4, "max_pairs": 8, "max_steps": 1}, 10, (1, 4)),
])
def test_planned_pairs_is_the_smallest_of_steps_epochs_and_pairs(fields, pairs, expected):
    assert dpo.planned_pairs(dpo_cfg(**fields), pairs) == expected


NO_LENGTH = ("no length given: max_steps, num_epochs and max_pairs are all 0", "--num_epochs",
             "set --num_epochs 1 (or --max_steps / --max_pairs)")


@pytest.mark.parametrize("fields, what, where, fix", [
    ({"model": ""}, "no policy given", "--model", "pass the SFT model folder, e.g. runs/demo-.../sft/model"),
    ({"batch_size": 0}, "batch_size must be > 0, got 0", "--batch_size", None),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be > 0, got 0",
     "--gradient_accumulation_steps", None),
    ({"beta": 0.0}, "beta must be > 0, got 0.0", "--beta", None),
    ({"max_steps": 0, "num_epochs": 0, "max_pairs": 0}, *NO_LENGTH),
    ({"batch_size": 4, "gradient_accumulation_steps": 5}, "gradient_accumulation_steps 5 > 4 pairs per process "
     "(batch_size 4): empty micro-batches", "--gradient_accumulation_steps", None),
    ({"label_smoothing": 0.5}, "label_smoothing must be in [0, 0.5), got 0.5", "--label_smoothing", None),
    ({"label_smoothing": -0.1}, "label_smoothing must be in [0, 0.5), got -0.1", "--label_smoothing", None),
    ({"label_smoothing": 0.1, "loss_type": "ipo"}, "label_smoothing is conservative DPO's: loss_type ipo has none",
     "--label_smoothing", "use --loss_type sigmoid, or drop --label_smoothing"),
])
def test_what_dpo_refuses_names_the_flag_and_the_fix(fields, what, where, fix):
    with pytest.raises(UserInputError) as refused:
        dpo.check_dpo_config(dpo_cfg(**fields))
    assert (refused.value.what, refused.value.where, refused.value.fix) == (what, where, fix)


def test_a_negative_reward_timeout_or_an_unknown_error_mode_of_the_verifier_is_refused():
    with pytest.raises(UserInputError, match="reward_timeout"):
        dpo.check_dpo_config(dpo_cfg(reward_timeout=-1.0))
    with pytest.raises(UserInputError, match="reward_errors"):
        dpo.check_dpo_config(dpo_cfg(reward_errors="ignore"))


def test_the_accumulation_bound_is_each_process_s_share_of_the_batch():
    two = SimpleNamespace(world_size=2, rank=0, distributed=True)
    with pytest.raises(UserInputError, match="gradient_accumulation_steps 3 > 2 pairs per process"):
        dpo.check_dpo_config(dpo_cfg(batch_size=4, gradient_accumulation_steps=3), two)
    dpo.check_dpo_config(dpo_cfg(batch_size=4, gradient_accumulation_steps=3))


def test_what_dpo_accepts_at_the_edges(caplog):
    dpo.check_dpo_config(dpo_cfg(batch_size=4, gradient_accumulation_steps=4, label_smoothing=0.0, num_epochs=0,
                                 max_pairs=1))
    dpo.check_dpo_config(dpo_cfg(label_smoothing=0.49, num_epochs=0, max_steps=1))
    dpo.check_dpo_config(dpo_cfg(num_epochs=1, max_steps=0, max_pairs=0))
    dpo.check_dpo_config(dpo_cfg(num_epochs=0, max_steps=0, max_pairs=1))
    with caplog.at_level("WARNING", logger="rlhflab"):
        dpo.check_dpo_config(dpo_cfg(loss_type="simpo", reference="ref-folder"))
    assert [r.getMessage() for r in caplog.records] == ["loss_type simpo needs no reference: --reference ref-folder is "
                                                        "not used"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="rlhflab"):
        dpo.check_dpo_config(dpo_cfg(loss_type="ipo", reference="ref-folder"))
    assert caplog.text == ""
