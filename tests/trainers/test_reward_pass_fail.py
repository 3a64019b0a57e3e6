"""The reward model's pass / fail term (RMConfig.pass_fail_coef) is added to the step's loss."""

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
