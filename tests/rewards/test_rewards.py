"""Reward sources: checker, reward model (shift / scale, batching, EOS), combination, validity."""

from __future__ import annotations

import copy
import random

import pytest
import torch

import rlhflab.rewards.model as model_reward
from rlhflab.errors import UserInputError
from rlhflab.models import build_random_reward_model, build_tokenizer, sequence_scores
from rlhflab.rewards import REWARD_KINDS, CheckerReward, CombinedReward, ModelReward, Scored, random_model_reward
from rlhflab.tasks import sample_items, template_corpus, violations

TINY = dict(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)


@pytest.fixture(scope="module")
def suite_tokenizer():
    return build_tokenizer(template_corpus(), 256)


@pytest.fixture(scope="module")
def reward_model(suite_tokenizer):
    return build_random_reward_model(suite_tokenizer, **TINY, seed=5).eval()


@pytest.fixture(scope="module")
def items():
    return sample_items("validation", 3, seed=0)


class Fixed:
    """A stub source returning fixed scores and validity."""

    def __init__(self, scores, valid):
        self.out = Scored(torch.tensor(scores), torch.tensor(valid))

    def __call__(self, prompts, responses, items):
        return self.out


def test_checker_reward(items):
    wrong = [next(iter(violations(item, random.Random(0)).values())) for item in items]
    prompts = [item.prompt for item in items] * 2 + ["no item"]
    responses = [item.reference for item in items] + wrong + [items[0].reference]
    out = CheckerReward()(prompts, responses, [*items, *items, None])
    assert out.scores.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert out.valid.tolist() == [True] * 6 + [False]
    out = CheckerReward(pass_score=2.0, fail_score=-0.5)(prompts[:4], responses[:4], [*items, items[0]])
    assert out.scores.tolist() == [2.0, 2.0, 2.0, -0.5]
    assert out.scores.dtype == torch.float32 and out.valid.dtype == torch.bool


def test_checker_reward_length_mismatch(items):
    with pytest.raises(ValueError, match="2 prompts, 1 responses and 3 rows"):
        CheckerReward()(["a", "b"], ["x"], items)


def manual_raw(model, tokenizer, prompt, response, eos=True):
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] + tokenizer(response, add_special_tokens=False)[
        "input_ids"] + ([tokenizer.eos_token_id] if eos else [])
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        return (hidden @ model.score.weight[0]).item()


def test_model_reward_shift_scale_and_batching(reward_model, suite_tokenizer, items):
    prompts = [item.prompt for item in items]
    responses = [item.reference for item in items]
    raw = [manual_raw(reward_model, suite_tokenizer, p, r) for p, r in zip(prompts, responses)]
    out = ModelReward(reward_model, suite_tokenizer, batch_size=2, shift=0.5, scale=2.0)(prompts, responses, items)
    assert out.scores.tolist() == pytest.approx([(x - 0.5) / 2.0 for x in raw], abs=1e-5)
    assert out.valid.tolist() == [True, True, True]
    plain = ModelReward(reward_model, suite_tokenizer)(prompts, responses, [None] * 3)  # items are not needed
    assert plain.scores.tolist() == pytest.approx(raw, abs=1e-5)
    no_eos = ModelReward(reward_model, suite_tokenizer, append_eos=False)(prompts, responses, items)
    expected = [manual_raw(reward_model, suite_tokenizer, p, r, eos=False) for p, r in zip(prompts, responses)]
    assert no_eos.scores.tolist() == pytest.approx(expected, abs=1e-5)
    assert not torch.allclose(no_eos.scores, plain.scores, atol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_model_reward_scores_a_repeated_prompt_once_for_all_its_answers(suite_tokenizer, items, arch, monkeypatch):
    model = build_random_reward_model(suite_tokenizer, arch=arch, **TINY, seed=6).eval()
    rng = random.Random(1)
    answers = [[item.reference, *list(violations(item, rng).values())[:2], item.reference] for item in items]
    prompts = [item.prompt for item, texts in zip(items, answers) for _ in texts]  # each prompt 4 times
    responses = [text for texts in answers for text in texts]  # the reference twice: one distinct row
    groups = []  # the distinct rows each grouped forward pass was given
    pack = model_reward.pack_groups
    monkeypatch.setattr(model_reward, "pack_groups", lambda g, pad: groups.append(sum(map(len, g))) or pack(g, pad))
    out = ModelReward(model, suite_tokenizer, batch_size=4, shift=0.5)(prompts, responses, [None] * len(prompts))
    expected = [manual_raw(model, suite_tokenizer, p, r) - 0.5 for p, r in zip(prompts, responses)]
    assert out.scores.tolist() == pytest.approx(expected, abs=1e-5)
    assert sum(groups) == 9 and max(groups) <= 4  # 3 distinct rows a prompt, one prompt's group a pass
    assert out.scores.std() > 0.01  # the answers' scores differ, so equality above is not trivial


def test_model_reward_non_finite_rows_are_invalid(reward_model, suite_tokenizer, items):
    broken = copy.deepcopy(reward_model)
    with torch.no_grad():
        broken.score.weight.fill_(float("nan"))
    out = ModelReward(broken, suite_tokenizer)([i.prompt for i in items], [i.reference for i in items], items)
    assert out.valid.tolist() == [False, False, False]
    assert out.scores.tolist() == [0.0, 0.0, 0.0]


def test_model_reward_checks_arguments(reward_model, suite_tokenizer):
    with pytest.raises(UserInputError, match="scale must not be 0"):
        ModelReward(reward_model, suite_tokenizer, scale=0.0)


def test_random_model_reward(suite_tokenizer, items):
    prompts, responses = [i.prompt for i in items], [i.reference for i in items]
    a = random_model_reward(suite_tokenizer, seed=0, **TINY)(prompts, responses, items)
    b = REWARD_KINDS["random"](suite_tokenizer, seed=0, **TINY)(prompts, responses, items)
    assert torch.equal(a.scores, b.scores) and a.valid.all()
    assert len(set(a.scores.tolist())) == 3


def test_combined_reward_weights_and_validity():
    first = Fixed([1.0, 0.0, 1.0, 0.5], [True, True, False, True])
    second = Fixed([2.0, -4.0, 3.0, float("nan")], [True, True, True, False])
    out = CombinedReward([(first, 1.0), (second, 0.25)])(["p"] * 4, ["r"] * 4, [None] * 4)
    assert out.scores.tolist() == [1.5, -1.0, 0.0, 0.0]
    assert out.valid.tolist() == [True, True, False, False]
    with pytest.raises(UserInputError, match="at least one"):
        CombinedReward([])


def test_reward_kinds_table():
    assert set(REWARD_KINDS) == {"checker", "model", "random", "combined"}
    assert REWARD_KINDS["checker"] is CheckerReward and REWARD_KINDS["combined"] is CombinedReward
