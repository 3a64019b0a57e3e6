"""The reward model's extra loss terms: pass / fail on preference pairs (RMConfig.pass_fail_coef) and the
calibration rows of the policy's sampled answers (RMConfig.calibration_coef)."""

import pytest
from tinyhf import save_suite_model
import torch

from rlhflab import models, parallel
from rlhflab.config import RMConfig
from rlhflab.core import bradley_terry_loss, pass_fail_loss
from rlhflab.trainers import reward


def test_the_step_loss_is_bradley_terry_plus_coef_times_the_pass_fail_term(tmp_path):
    folder = save_suite_model(tmp_path / "backbone")
    tokenizer = models.load_tokenizer(folder)
    rm = models.build_reward_model_from_causal(folder, tokenizer)
    rm.config.pad_token_id = tokenizer.pad_token_id
    models.disable_dropout(rm)
    rm.train()
    batch = [reward.TokenizedPair([4, 5, 6, 7], [4, 5, 9], None, None),
             reward.TokenizedPair([4, 8, 10], [4, 8, 11, 12, 13], None, None)]
    with torch.no_grad():
        chosen, rejected = reward.pair_scores(rm, batch, tokenizer.pad_token_id)
    bt = bradley_terry_loss(chosen, rejected)[0].item()
    term = pass_fail_loss(chosen, rejected).item()
    wrapped = parallel.wrap_model(rm, parallel.SINGLE)
    optimizer = torch.optim.SGD(rm.parameters(), lr=0.0)  # the weights stay: both steps see the same scores
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    share = parallel.share_of(len(batch), parallel.SINGLE)
    losses = {}
    for coef in (0.0, 2.5):
        cfg = RMConfig(pass_fail_coef=coef, center_rewards_coef=0.0)
        stats = reward.train_step(wrapped, optimizer, scheduler, batch, share, tokenizer.pad_token_id, cfg, False)
        losses[coef] = stats["loss/rm"]
    assert losses[0.0] == pytest.approx(bt, rel=1e-5)
    assert losses[2.5] == pytest.approx(bt + 2.5 * term, rel=1e-5)


def test_calibration_rows_pair_one_prompts_answers_as_sampled_with_their_verdicts():
    a = type("Item", (), {"prompt": "p", "family": "f"})
    b = object()  # another prompt's item, answered once: left out
    answers = reward.PolicyAnswers(items=[a, a, b], texts=["x", "y", "z"], passed=[True, False, False])
    rows, labels = reward.calibration_pairs(answers)
    assert [(r.prompt, r.chosen, r.rejected, r.violation) for r in rows] == [("p", "x", "y", reward.SAMPLED)]
    assert labels == [(True, False)]


def test_calibration_rows_add_the_checkers_cross_entropy_and_no_bradley_terry():
    chosen, rejected = torch.tensor([1.0, 0.5, -2.0]), torch.tensor([-1.0, 2.0, 0.0])
    batch = [reward.TokenizedPair([1], [2], None, None),  # a preference pair
             reward.TokenizedPair([1], [2], None, reward.SAMPLED, labels=(False, True)),
             reward.TokenizedPair([1], [2], None, reward.SAMPLED, labels=(False, False))]
    cfg = RMConfig(center_rewards_coef=0.0, calibration_coef=2.0)
    loss, stats = reward.batch_loss(chosen, rejected, batch, cfg)
    bt = -torch.nn.functional.logsigmoid(torch.tensor(2.0)).item()  # the one pair, weighted 1 of 3 rows
    softplus = lambda x: torch.nn.functional.softplus(torch.tensor(x)).item()  # noqa: E731  -log(1 - sigmoid(x))
    bce = (softplus(0.5) + softplus(-2.0) + softplus(-2.0) + softplus(0.0)) / 4  # labels 0, 1, 0, 0
    assert loss.item() == pytest.approx(bt / 3 + 2.0 * bce * 2 / 3, rel=1e-5)
    assert stats == {"accuracy": 1.0, "margin": 2.0}  # the preference pair's only
