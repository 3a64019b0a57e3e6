"""Reward-model trainer, unit by unit (issue 36's mutation run of trainers/reward.py): the step's loss terms and
metrics against hand-worked numbers, a rank's share of a step, the train split's metric sample, the scorer's
grouping helpers and the policy's sampled answers, with stand-ins instead of a model where the maths is the point."""

import logging
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from rlhflab import parallel
from rlhflab.config import RMConfig
from rlhflab.models.precision import MixedPrecision
from rlhflab.trainers import reward

Pair = reward.TokenizedPair


def bt(x: float) -> float:
    """-log sigmoid(x)."""
    return -F.logsigmoid(torch.tensor(x)).item()


def test_the_loss_of_preference_pairs_is_bradley_terry_with_margin_centring_and_pass_fail_by_hand():
    chosen, rejected = torch.tensor([1.0, -0.5]), torch.tensor([0.0, 0.5])
    batch = [Pair([1], [2], None, None), Pair([1], [3], None, None)]
    cfg = RMConfig(margin=0.3, center_rewards_coef=0.1, pass_fail_coef=2.0)
    loss, stats = reward.batch_loss(chosen, rejected, batch, cfg)
    pair = (bt(1.0 - 0.3) + bt(-1.0 - 0.3)) / 2
    centring = 0.1 * (1.0 ** 2 + 0.0 ** 2) / 2
    softplus = lambda x: F.softplus(torch.tensor(x)).item()  # noqa: E731
    pass_fail = 0.5 * ((softplus(-1.0) + softplus(0.5)) / 2 + (softplus(0.0) + softplus(0.5)) / 2)
    assert loss.item() == pytest.approx(pair + centring + 2.0 * pass_fail, rel=1e-6)
    assert stats == {"accuracy": 0.5, "margin": 0.0}  # the margin is not in the logged one
    plain, _ = reward.batch_loss(chosen, rejected, batch, RMConfig(margin=0.0, center_rewards_coef=0.0))
    assert plain.item() == pytest.approx((bt(1.0) + bt(-1.0)) / 2, rel=1e-6)


def test_a_batch_of_calibration_rows_only_has_no_pair_metrics_and_the_whole_weight_on_its_term():
    chosen, rejected = torch.tensor([0.5, -1.0]), torch.tensor([1.0, 0.0])
    batch = [Pair([1], [2], None, reward.SAMPLED, labels=(True, False)),
             Pair([1], [3], None, reward.SAMPLED, labels=(True, True))]
    loss, stats = reward.batch_loss(chosen, rejected, batch, RMConfig(calibration_coef=3.0, center_rewards_coef=0.0))
    softplus = lambda x: F.softplus(torch.tensor(x)).item()  # noqa: E731  -log sigmoid(-x): label 0
    bce = (softplus(-0.5) + softplus(1.0) + softplus(1.0) + softplus(-0.0)) / 4  # labels 1, 0, 1, 1
    assert loss.item() == pytest.approx(3.0 * bce, rel=1e-6)
    assert math.isnan(stats["accuracy"]) and math.isnan(stats["margin"])


def linear_scores(weights: torch.nn.Parameter):
    """A pair_scores stand-in: a sequence's score is the sum of its tokens' weights."""

    def score(model, batch, pad_id, chunks, shared_prefix):
        chosen = torch.stack([weights[p.chosen].sum() for p in batch])
        rejected = torch.stack([weights[p.rejected].sum() for p in batch])
        return chosen, rejected

    return score


class OneProcess:
    """parallel.Wrapped of one process around a stand-in scorer; records what the step hands it."""

    def __init__(self, weights):
        self.model, self.world, self.calls = SimpleNamespace(parameters=lambda: [weights]), parallel.SINGLE, []

    def __call__(self, fn, *args):
        self.calls.append(args[1:])  # pad_id, chunks, shared_prefix
        return fn(self.model, *args)

    def backward(self, loss_part):
        loss_part.backward()


def test_a_rank_s_step_weighs_its_real_pairs_by_their_share_of_the_global_batch(monkeypatch):
    weights = torch.nn.Parameter(torch.tensor([0.0, 1.0, 0.5, -1.0, 2.0]))
    monkeypatch.setattr(reward, "pair_scores", linear_scores(weights))
    steps = []
    monkeypatch.setattr(reward, "clip_and_step", lambda *a, **k: steps.append((a, k)) or torch.tensor(0.75))
    batch = [Pair([1], [3], None, None), Pair([2], [4], None, None),  # real: differences 2.0 and -1.5
             Pair([1], [2], None, None)]  # a padding row (share.real = 2)
    share = parallel.Share([0, 1, 0], real=2, total=4)  # weight 2 / 4
    wrapped = OneProcess(weights)
    cfg = RMConfig(center_rewards_coef=0.0, length_chunks=0, max_grad_norm=0.7, nonfinite="skip")
    stats = reward.train_step(wrapped, "opt", "sched", batch, share, 9, cfg, True)
    mean = (bt(2.0) + bt(-1.5)) / 2
    assert stats["loss/rm"] == pytest.approx(0.5 * mean, rel=1e-6)
    assert stats["rm/accuracy"] == 0.5 and stats["rm/margin"] == pytest.approx(0.25)
    assert stats["grad_norm"] == 0.75 and stats["skipped"] is False
    # d/dw of 0.5 * mean BT: the padding row's tokens (1 and 2 as in row 0 / 1) add nothing of their own
    s = lambda x: torch.sigmoid(torch.tensor(x)).item()  # noqa: E731
    g_first, g_second = -(1 - s(2.0)) * 0.5 / 2, -(1 - s(-1.5)) * 0.5 / 2
    expected = torch.tensor([0.0, g_first, g_second, -g_first, -g_second])
    assert torch.allclose(weights.grad, expected, atol=1e-7)
    (args, kwargs), = steps
    assert args[0] == "opt" and args[1] == "sched" and list(args[2]) == [weights]
    assert args[3:] == (0.7, stats["loss/rm"], "skip", "reward-model")
    assert kwargs["engine"] is wrapped and isinstance(kwargs["precision"], MixedPrecision)
    assert wrapped.calls == [(9, 1, True)]  # one pass for 3 rows (16 a pass), the packed scorer as asked


def test_calibration_rows_are_not_counted_as_pairs_in_the_step_s_accuracy(monkeypatch):
    weights = torch.nn.Parameter(torch.tensor([0.0, 1.0, 0.5, -1.0]))
    monkeypatch.setattr(reward, "pair_scores", linear_scores(weights))
    monkeypatch.setattr(reward, "clip_and_step", lambda *a, **k: torch.tensor(1.0))
    batch = [Pair([1], [3], None, None), Pair([3], [2], None, reward.SAMPLED, labels=(False, True))]
    stats = reward.train_step(OneProcess(weights), None, None, batch, parallel.share_of(2, parallel.SINGLE), 0,
                              RMConfig(center_rewards_coef=0.0, calibration_coef=1.0), False)
    assert stats["rm/accuracy"] == 1.0 and stats["rm/margin"] == pytest.approx(2.0)  # the one preference pair


def test_a_rank_without_real_pairs_still_runs_backward_and_a_dropped_step_says_so(monkeypatch):
    weights = torch.nn.Parameter(torch.tensor([0.0, 1.0, 0.5]))
    monkeypatch.setattr(reward, "pair_scores", linear_scores(weights))
    monkeypatch.setattr(reward, "clip_and_step", lambda *a, **k: None)  # the step dropped (non-finite)
    batch = [Pair([1], [2], None, None)]
    stats = reward.train_step(OneProcess(weights), None, None, batch, parallel.Share([0], real=0, total=1), 0,
                              RMConfig(), False)
    assert stats["loss/rm"] == 0.0 and math.isnan(stats["rm/accuracy"]) and math.isnan(stats["rm/margin"])
    assert torch.equal(weights.grad, torch.zeros(3))  # a backward ran (every rank must), with zero gradient
    assert math.isnan(stats["grad_norm"]) and stats["skipped"] is True


def test_the_train_split_s_metrics_read_a_fixed_sample_and_no_split_reads_calibration_rows(monkeypatch):
    monkeypatch.setattr(reward, "TRAIN_METRIC_PAIRS", 3)
    pairs = [Pair([i], [i + 1], None, None) for i in range(5)]
    rows = pairs + [Pair([9], [8], None, reward.SAMPLED, labels=(True, False))]
    assert reward.metric_sample(rows, "validation", 0) == pairs
    sample = reward.metric_sample(rows, "train", 4)
    assert len({id(p) for p in sample}) == 3 and all(any(p is q for q in pairs) for p in sample)
    assert sample == reward.metric_sample(rows, "train", 4)  # fixed by the seed
    assert any(reward.metric_sample(rows, "train", s) != sample for s in range(5, 10))
    assert reward.metric_sample(pairs[:3] + rows[5:], "train", 4) == pairs[:3]  # small enough: all, in order


@pytest.mark.parametrize("asked, sharded, packs, used, said", [
    (False, False, True, False, None), (True, True, True, False, "FSDP2 shards"),
    (True, False, False, False, "not a Llama / Qwen2 layout"), (True, False, True, True, None)])
def test_shared_prefix_is_used_where_asked_and_the_model_allows_it(monkeypatch, caplog, asked, sharded, packs,
                                                                   used, said):
    monkeypatch.setattr(reward.parallel, "holds_shards", lambda model: sharded)
    monkeypatch.setattr(reward.models, "can_pack_pairs", lambda model: packs)
    with caplog.at_level(logging.INFO, logger="rlhflab"):
        assert reward.use_shared_prefix(RMConfig(shared_prefix=asked), torch.nn.Linear(1, 1)) is used
    assert (said in caplog.text) if said else "shared_prefix off" not in caplog.text


def test_hard_negatives_are_each_distinct_failing_answer_against_the_reference():
    a = SimpleNamespace(prompt="p", reference="ref-p", family="f")
    b = SimpleNamespace(prompt="q", reference="ref-q", family="g")
    answers = reward.PolicyAnswers([a, a, a, b, b], ["x", "x", "ok", "x", "y"], [False, False, True, False, False])
    pairs = reward.failing_answer_pairs(answers)
    assert [(p.prompt, p.chosen, p.rejected, p.family, p.violation) for p in pairs] == [
        ("p", "ref-p", "x", "f", reward.HARD_NEGATIVE), ("q", "ref-q", "x", "g", reward.HARD_NEGATIVE),
        ("q", "ref-q", "y", "g", reward.HARD_NEGATIVE)]


def test_calibration_rows_take_consecutive_answers_of_one_prompt_and_leave_an_odd_last_one_out():
    a, b = SimpleNamespace(prompt="p", family="f"), SimpleNamespace(prompt="q", family="g")
    answers = reward.PolicyAnswers([a, a, b, b, b], ["1", "2", "3", "4", "5"], [True, False, False, False, True])
    rows, labels = reward.calibration_pairs(answers)
    assert [(r.prompt, r.chosen, r.rejected, r.family) for r in rows] == [("p", "1", "2", "f"), ("q", "3", "4", "g")]
    assert labels == [(True, False), (False, False)]


def test_a_row_s_prompt_key_is_its_prompt_tokens_or_its_own_number():
    assert reward.prompt_key(Pair([5, 6, 7], [5, 6, 8], None, None, prompt_tokens=2), 4) == (5, 6)
    assert reward.prompt_key(Pair([5, 6, 7], [5, 6, 8], None, None), 4) == 4


@pytest.mark.parametrize("chunks, groups", [(0, [[0, 1, 2, 3, 4]]), (1, [[0, 1, 2, 3, 4]]),
                                            (2, [[1, 3, 0], [4, 2]]), (3, [[1, 3], [0, 4], [2]])])
def test_length_groups_sort_by_length_into_near_equal_groups(chunks, groups):
    assert reward.length_groups([3, 1, 9, 2, 5], chunks) == groups


def test_scores_computed_group_by_group_come_back_in_the_batch_s_order():
    groups = [[2, 0], [3, 1]]
    parts = [torch.tensor([20.0, 0.0]), torch.tensor([30.0, 10.0])]
    assert reward.in_batch_order(parts, groups).tolist() == [0.0, 10.0, 20.0, 30.0]


def test_a_padded_forward_pads_on_the_right_with_a_mask_of_the_real_tokens(monkeypatch):
    seen = []

    def scores(model, ids, mask):
        seen.append((ids.tolist(), mask.tolist()))
        return torch.tensor([1.5, 2.5], dtype=torch.bfloat16)

    monkeypatch.setattr(reward.models, "sequence_scores", scores)
    out = reward.padded_scores(torch.nn.Linear(1, 1), [[4, 5, 6], [7]], pad_id=9)
    assert seen == [([[4, 5, 6], [7, 9, 9]], [[1, 1, 1], [1, 0, 0]])]
    assert out.dtype == torch.float32 and out.tolist() == [1.5, 2.5]


def test_pair_scores_cut_into_length_groups_give_the_chosen_then_the_rejected_of_each_row(monkeypatch):
    passes = []

    def scores(model, seqs, pad_id):
        passes.append([len(s) for s in seqs])
        return torch.tensor([float(sum(s)) for s in seqs])

    monkeypatch.setattr(reward, "padded_scores", scores)
    batch = [Pair([1, 1, 1], [2], None, None), Pair([3, 3], [4, 4, 4, 4], None, None)]
    chosen, rejected = reward.pair_scores(None, batch, 0, chunks=2)
    assert chosen.tolist() == [3.0, 6.0] and rejected.tolist() == [2.0, 16.0]
    assert passes == [[1, 2], [3, 4]]  # sorted by length, two passes


def test_held_out_metrics_hold_score_statistics_and_leave_the_model_training(monkeypatch):
    batches = iter([(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])), (torch.tensor([4.0]), torch.tensor([0.0]))])
    seen = []
    monkeypatch.setattr(reward, "pair_scores", lambda model, pairs, pad, chunks, shared_prefix: seen.append(
        (len(pairs), pad, chunks, shared_prefix, model.training)) or next(batches))
    model = torch.nn.Linear(1, 1).train()
    pairs = [Pair([1], [2], "a", "x") for _ in range(3)]
    out = reward.evaluate_pairs(model, pairs, pad_id=7, batch_size=2)
    assert seen == [(2, 7, 2, False, False), (1, 7, 2, False, False)] and model.training
    c, r = torch.tensor([2.0, 0.0, 4.0]), torch.tensor([1.0, 1.0, 0.0])
    assert out["pairs"] == 3 and out["accuracy"] == pytest.approx(2 / 3) and out["margin"] == pytest.approx(4 / 3)
    assert out["chosen_mean"] == pytest.approx(2.0) and out["chosen_std"] == pytest.approx(c.std().item())
    assert out["rejected_mean"] == pytest.approx(2 / 3) and out["rejected_std"] == pytest.approx(r.std().item())
    monkeypatch.setattr(reward, "pair_scores", lambda *a, **k: (torch.tensor([1.0]), torch.tensor([2.0])))
    one = reward.evaluate_pairs(model, pairs[:1], pad_id=0)
    assert one["chosen_std"] == 0.0 and one["rejected_std"] == 0.0 and one["accuracy"] == 0.0


def test_held_out_scores_of_prompt_major_batches_are_put_back_in_the_pairs_order(monkeypatch):
    # rows 0 and 2 share a prompt: with the packed scorer they are scored side by side, then put back
    pairs = [Pair([5, 1], [5, 2], "f", "v", prompt_tokens=1), Pair([6, 1], [6, 2], "f", "v", prompt_tokens=1),
             Pair([5, 3], [5, 4], "f", "v", prompt_tokens=1)]
    seen = []

    def scores(model, batch, pad, chunks, shared_prefix):
        seen.append([p.chosen for p in batch])
        return (torch.tensor([float(p.chosen[1]) for p in batch]), torch.tensor([float(p.rejected[1]) for p in batch]))

    monkeypatch.setattr(reward, "pair_scores", scores)
    out = reward.evaluate_pairs(torch.nn.Linear(1, 1), pairs, pad_id=0, batch_size=2, shared_prefix=True)
    assert seen == [[[5, 1], [5, 3]], [[6, 1]]]
    assert out["chosen_mean"] == pytest.approx(5 / 3) and out["margin"] == pytest.approx(-1.0)


def test_each_answer_batch_draws_from_a_seed_of_its_own_split_and_number():
    seeds = {reward.answer_batch_seed(s, stream, b) for s in (0, 1) for stream in ("train", "test") for b in (0, 1)}
    assert len(seeds) == 8
    assert reward.answer_batch_seed(3, "train", 1) == reward.stream_seed("rlhflab-rm-answers", 3, "train", 1)


def test_a_pass_fail_coefficient_below_one_still_adds_its_term():
    chosen, rejected = torch.tensor([1.0]), torch.tensor([0.0])
    batch = [Pair([1], [2], None, None)]
    loss, _ = reward.batch_loss(chosen, rejected, batch, RMConfig(center_rewards_coef=0.0, pass_fail_coef=0.5))
    softplus = lambda x: F.softplus(torch.tensor(x)).item()  # noqa: E731
    assert loss.item() == pytest.approx(bt(1.0) + 0.5 * 0.5 * (softplus(-1.0) + softplus(0.0)), rel=1e-6)


def test_calibration_rows_of_an_even_count_keep_the_last_two_and_go_on_past_a_prompt_answered_once():
    a, b, c = (SimpleNamespace(prompt=p, family="f") for p in "abc")
    rows, labels = reward.calibration_pairs(reward.PolicyAnswers([a, b, c, c], ["1", "2", "3", "4"],
                                                                 [True, True, False, True]))
    assert [(r.prompt, r.chosen, r.rejected) for r in rows] == [("c", "3", "4")] and labels == [(False, True)]
    rows, _ = reward.calibration_pairs(reward.PolicyAnswers([a, a, b, b], ["1", "2", "3", "4"], [True] * 4))
    assert [r.prompt for r in rows] == ["a", "b"]


def test_prompt_major_moves_pieces_of_at_most_together_rows_and_leaves_policy_rows_and_unknown_prompts_apart():
    def row(prompt, violation="v"):
        return Pair([prompt, 1], [prompt, 2], None, violation, prompt_tokens=1 if prompt else 0)

    pairs = [row(5), row(6), row(5), row(5), row(0), row(5, reward.HARD_NEGATIVE), row(6), row(0), row(5)]
    order = list(range(len(pairs)))
    # together 0: every row of prompt 5 follows its first one; rows of unknown prompt (4, 7) stay on their own
    assert reward.prompt_major(pairs, order) == [0, 2, 3, 5, 8, 1, 6, 4, 7]
    # pieces of 2: prompt 5's rows 0, 2 | 3, 8 (row 5 kept apart), prompt 6's 1, 6
    assert reward.prompt_major(pairs, order, together=2, apart=reward.POLICY_ROWS) == [0, 2, 1, 6, 3, 8, 4, 5, 7]
    assert reward.prompt_major(pairs, [8, 7, 6, 5, 4, 3, 2, 1, 0], together=3) == [8, 5, 3, 7, 6, 1, 4, 2, 0]


def test_a_step_s_passes_are_one_per_16_pairs_rounded_down(monkeypatch):
    weights = torch.nn.Parameter(torch.zeros(3))
    monkeypatch.setattr(reward, "pair_scores", linear_scores(weights))
    monkeypatch.setattr(reward, "clip_and_step", lambda *a, **k: torch.tensor(1.0))
    wrapped = OneProcess(weights)
    batch = [Pair([1], [2], None, None)] * 40
    reward.train_step(wrapped, None, None, batch, parallel.share_of(40, parallel.SINGLE), 0,
                      RMConfig(length_chunks=0), False)
    assert wrapped.calls == [(0, 2, False)] and isinstance(wrapped.calls[0][1], int)


@pytest.mark.parametrize("real, labels", [(0, None), (2, None), (1, (True, False))])
def test_every_rank_hands_the_same_metric_keys_in_the_same_order_to_the_all_reduce(monkeypatch, real, labels):
    weights = torch.nn.Parameter(torch.tensor([0.0, 1.0, 0.5]))
    monkeypatch.setattr(reward, "pair_scores", linear_scores(weights))
    monkeypatch.setattr(reward, "clip_and_step", lambda *a, **k: torch.tensor(1.0))
    reduced = []
    monkeypatch.setattr(reward.parallel, "sum_metrics", lambda parts, world: reduced.append(dict(parts)) or parts)
    batch = [Pair([1], [2], None, None, labels=labels), Pair([2], [1], None, None, labels=labels)]
    reward.train_step(OneProcess(weights), None, None, batch, parallel.Share([0, 1], real=real, total=4), 0,
                      RMConfig(calibration_coef=1.0), False)
    (parts,) = reduced
    assert list(parts) == ["loss/rm", "accuracy_sum", "margin_sum", "pairs"]
    if real == 0:
        assert parts == {"loss/rm": 0.0, "accuracy_sum": 0.0, "margin_sum": 0.0, "pairs": 0.0}
    elif labels is None:  # differences 0.5 and -0.5: one right
        assert parts["pairs"] == 2.0 and parts["accuracy_sum"] == 1.0 and parts["margin_sum"] == pytest.approx(0.0)
    else:  # a calibration row: a loss, no pair
        assert parts["pairs"] == 0.0 and parts["accuracy_sum"] == 0.0 and parts["loss/rm"] > 0


@pytest.mark.parametrize("sharded, packs, message", [
    (True, True, "reward model: FSDP2 shards the weights; chosen and rejected are scored as separate sequences "
                 "(shared_prefix off)"),
    (False, False, "reward model: Linear is not a Llama / Qwen2 layout without dropout; chosen and rejected are "
                   "scored as separate sequences (shared_prefix off)")])
def test_shared_prefix_asks_about_the_model_itself_and_says_why_it_is_off(monkeypatch, caplog, sharded, packs, message):
    model = torch.nn.Linear(1, 1)
    monkeypatch.setattr(reward.parallel, "holds_shards", lambda m: sharded if m is model else not sharded)
    monkeypatch.setattr(reward.models, "can_pack_pairs", lambda m: packs if m is model else not packs)
    with caplog.at_level(logging.INFO, logger="rlhflab"):
        assert reward.use_shared_prefix(RMConfig(shared_prefix=True), model) is False
    assert caplog.messages == [message]
