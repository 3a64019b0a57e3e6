"""Reward-model trainer: a tiny RM learns a separable preference; metrics add up."""

import dataclasses
import json

import pytest
from tinyhf import save_suite_model
import torch

from rlhflab import models, parallel, sources, tasks
from rlhflab.config import RMConfig
from rlhflab.errors import UserInputError
from rlhflab.trainers import reward


@pytest.fixture(scope="module")
def backbone_dir(tmp_path_factory):
    return save_suite_model(tmp_path_factory.mktemp("backbone"))


def tiny_rm_cfg(backbone_dir, tmp_path, **overrides) -> RMConfig:
    base = dict(model=backbone_dir, output_dir=str(tmp_path / "rm"), num_train_prompts=110, num_validation_prompts=22,
                num_test_prompts=44, pair_kinds="wrong_case", pairs_per_prompt=1, num_epochs=8, batch_size=8,
                learning_rate=3e-3, log_every=5, progress=False, threads=1)
    return RMConfig(**{**base, **overrides})


@pytest.mark.parametrize("together", [0, 2])  # rows shuffled one by one; a prompt's two rows side by side
def test_a_tiny_reward_model_learns_a_separable_preference(backbone_dir, tmp_path, together):
    # wrong_case rejects differ from the chosen answer only in letter case: separable token by token
    result = reward.train(tiny_rm_cfg(backbone_dir, tmp_path, prompt_rows_together=together,
                                      pairs_per_prompt=2 if together else 1))
    pairs = result.summary["pairs"]
    assert pairs["train"]["accuracy"] > 0.9 and pairs["test"]["accuracy"] > 0.7, pairs  # chance is 0.5
    assert pairs["test"]["margin"] > 0
    assert set(pairs["test"]["per_violation"]) == {"wrong_case"}
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss/rm"] for r in rows if "loss/rm" in r]
    assert losses[-1] < losses[0]
    rm = models.load_reward_model(result.model_dir)
    assert rm.config.num_labels == 1


def test_evaluate_pairs_counts_hand_made_scores(backbone_dir, monkeypatch):
    batch = [reward.TokenizedPair([1], [2], "a", "x"), reward.TokenizedPair([1], [2], "b", "y"),
             reward.TokenizedPair([1], [2], "b", "x")]
    fake = iter([(torch.tensor([2.0, 0.0, 1.0]), torch.tensor([1.0, 1.0, 0.0]))])
    monkeypatch.setattr(reward, "pair_scores", lambda model, pairs, pad, chunks=1, shared_prefix=False: next(fake))
    out = reward.evaluate_pairs(torch.nn.Linear(1, 1), batch, pad_id=0)
    assert out["accuracy"] == pytest.approx(2 / 3) and out["margin"] == pytest.approx(1 / 3)
    assert out["per_family"] == {"a": 1.0, "b": 0.5} and out["per_violation"] == {"x": 1.0, "y": 0.0}


def test_length_sorted_chunks_and_packed_pairs_give_the_same_scores_and_gradient_as_one_pass(backbone_dir):
    tokenizer = models.load_tokenizer(backbone_dir)
    rm = models.build_reward_model_from_causal(backbone_dir, tokenizer)
    rm.config.pad_token_id = tokenizer.pad_token_id
    models.disable_dropout(rm)
    rm.train()
    assert models.can_pack_pairs(rm)
    lengths = [(3, 11), (9, 2), (5, 5), (14, 7), (1, 12)]  # chosen / rejected lengths, unsorted on purpose
    # rejected shares the chosen's first two tokens (a prompt), except where the chosen is one token long
    batch = [reward.TokenizedPair(list(range(4, 4 + c)), [4, 5][:c] + list(range(30, 30 + r)), None, None)
             for c, r in lengths]
    results = []
    for chunks, packed in ((1, False), (3, False), (1, True), (3, True)):
        rm.zero_grad()
        chosen, rejected = reward.pair_scores(rm, batch, tokenizer.pad_token_id, chunks, shared_prefix=packed)
        (chosen - 2 * rejected).sum().backward()
        results.append((chosen.detach(), rejected.detach(), rm.score.weight.grad.clone()))
    c1, r1, g1 = results[0]
    assert not torch.allclose(c1, r1)
    for c, r, g in results[1:]:
        assert torch.allclose(c1, c, atol=1e-5) and torch.allclose(r1, r, atol=1e-5)  # each score stays with its pair
        assert torch.allclose(g1, g, atol=1e-5)


def test_rows_of_one_prompt_scored_as_one_group_keep_each_rows_scores_and_gradient(backbone_dir, monkeypatch):
    tokenizer = models.load_tokenizer(backbone_dir)
    rm = models.build_reward_model_from_causal(backbone_dir, tokenizer)
    models.disable_dropout(rm)
    rm.train()
    prompt, other = [4, 5, 6], [7, 8]
    reference = prompt + [20, 21, 2]
    batch = [reward.TokenizedPair(reference, prompt + [22, 2], "f", "a", prompt_tokens=3),
             reward.TokenizedPair(other + [23, 2], other + [24, 25, 2], "f", "a", prompt_tokens=2),
             reward.TokenizedPair(reference, prompt + [26, 27, 28, 2], "f", "b", prompt_tokens=3),  # the same chosen
             reward.TokenizedPair(prompt + [22, 2], prompt + [22, 2], "f", reward.SAMPLED, labels=(False, False),
                                  prompt_tokens=3),  # two identical sampled answers, one already scored above
             reward.TokenizedPair([9, 10, 11], [9, 12], None, None)]  # prompt not known: a group of its own
    packed_sequences = []  # how many distinct sequences the grouped scorer was given
    pack = models.pack_groups
    monkeypatch.setattr(models, "pack_groups", lambda groups, pad: packed_sequences.append(
        sum(map(len, groups))) or pack(groups, pad))
    results = []
    for grouped in (False, True):
        rm.zero_grad()
        chosen, rejected = reward.pair_scores(rm, batch, tokenizer.pad_token_id, shared_prefix=grouped)
        (chosen * torch.tensor([1.0, -1.0, 2.0, 0.5, 1.5]) - 2 * rejected).sum().backward()
        results.append((chosen.detach(), rejected.detach(), [p.grad.clone() for p in rm.parameters()]))
    (c1, r1, g1), (c2, r2, g2) = results
    assert torch.allclose(c1, c2, atol=1e-5) and torch.allclose(r1, r2, atol=1e-5)
    assert packed_sequences == [7]  # 10 sequences, 7 distinct: the shared reference and the repeated answer once
    assert r1.std() > 0 and not torch.allclose(c1, r1)
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=1e-5 * max(1.0, b.abs().max().item()))


def test_prompt_major_order_keeps_a_prompts_rows_together_in_order_of_first_sight():
    row = lambda prompt, n=1: reward.TokenizedPair(prompt + [n], prompt + [n + 1], None, None,  # noqa: E731
                                                   prompt_tokens=len(prompt))
    pairs = [row([1, 2]), row([3]), row([1, 2], 5), row([4, 4]), row([3], 7),
             reward.TokenizedPair([9], [8], None, None), reward.TokenizedPair([9], [8], None, None)]
    assert reward.prompt_major(pairs, [4, 0, 5, 3, 2, 1, 6]) == [4, 1, 0, 2, 5, 3, 6]  # unknown prompts stay alone
    assert reward.prompt_major(pairs, [4, 0, 5, 3, 2, 1, 6], together=1) == [4, 0, 5, 3, 2, 1, 6]
    pairs.append(row([1, 2], 9))  # a third row of prompt [1, 2]: pieces of two, the third one at its own place
    assert reward.prompt_major(pairs, [4, 0, 5, 3, 7, 2, 1, 6], together=2) == [4, 1, 0, 7, 5, 3, 2, 6]
    pairs.append(dataclasses.replace(row([3], 11), violation=reward.HARD_NEGATIVE))  # the policy's own answer
    assert reward.prompt_major(pairs, [8, 4, 0, 1], together=3, apart=reward.POLICY_ROWS) == [8, 4, 1, 0]


def test_always_kinds_shape_the_training_pairs_only(backbone_dir, tmp_path):
    cfg = tiny_rm_cfg(backbone_dir, tmp_path, pair_kinds="", pairs_per_prompt=2)
    splits = sources.pair_prompt_sets(cfg)
    plain = sources.suite_pairs(cfg, splits)
    shaped = sources.suite_pairs(dataclasses.replace(cfg, pair_kinds_always="wrong_content"), splits)
    assert shaped["test"] == plain["test"] and shaped["validation"] == plain["validation"]  # comparable accuracies
    content = lambda pairs: sum(p.violation == "wrong_content" for p in pairs)  # noqa: E731
    assert content(shaped["train"]) > content(plain["train"])


def test_no_pairs_of_the_asked_kind_is_a_clear_error(backbone_dir, tmp_path):
    with pytest.raises(UserInputError):
        reward.train(tiny_rm_cfg(backbone_dir, tmp_path, pair_kinds="no_such_kind"))


def test_hard_negatives_are_the_policys_distinct_failing_answers_against_the_reference(backbone_dir, tmp_path):
    cfg = tiny_rm_cfg(backbone_dir, tmp_path, hard_negatives=3)
    tokenizer = models.load_tokenizer(backbone_dir)
    items = tasks.build_splits(0, 22, 11, 11)["test"]
    pairs = reward.hard_negative_pairs(cfg, tokenizer, items)
    assert pairs, "an untrained backbone fails nearly everything"
    by_prompt = {i.prompt: i for i in items}
    for pair in pairs:
        item = by_prompt[pair.prompt]
        assert pair.chosen == item.reference and pair.violation == reward.HARD_NEGATIVE
        assert not tasks.check(item, pair.rejected, True).passed
    assert len({(p.prompt, p.rejected) for p in pairs}) == len(pairs) <= 3 * len(items)


def test_hard_negatives_join_every_split_and_are_refused_for_a_users_pairs_file(backbone_dir, tmp_path):
    cfg = tiny_rm_cfg(backbone_dir, tmp_path, hard_negatives=1)
    pairs = reward.load_pairs(cfg, models.load_tokenizer(backbone_dir))
    assert all(any(p.violation == reward.HARD_NEGATIVE for p in split) for split in pairs.values())
    with pytest.raises(UserInputError, match="hard negatives"):
        reward.load_pairs(tiny_rm_cfg(backbone_dir, tmp_path, hard_negatives=1, train_file="x.jsonl"), None)


def test_near_misses_join_the_training_pairs_only_and_are_refused_for_a_users_pairs_file(backbone_dir, tmp_path):
    cfg = tiny_rm_cfg(backbone_dir, tmp_path, pair_kinds="", near_misses=2)
    pairs = reward.load_pairs(cfg, models.load_tokenizer(backbone_dir))
    plain = reward.load_pairs(dataclasses.replace(cfg, near_misses=0), models.load_tokenizer(backbone_dir))
    added = len(pairs["train"]) - len(plain["train"])
    assert 0 < added <= 2 * cfg.num_train_prompts
    assert sum(p.violation == sources.NEAR_MISS for p in pairs["train"]) == added
    assert not any(p.violation == sources.NEAR_MISS for split in ("validation", "test") for p in pairs[split])
    with pytest.raises(UserInputError, match="near misses"):
        reward.load_pairs(tiny_rm_cfg(backbone_dir, tmp_path, near_misses=1, train_file="x.jsonl"), None)


@pytest.mark.parametrize(("field", "value"), [("batch_size", 0), ("num_epochs", 0), ("length_chunks", -1),
                                              ("extra_layers", -1), ("frozen_layers", -2),
                                              ("prompt_rows_together", -1)])
def test_a_bad_size_is_refused_before_the_run_folder_exists(backbone_dir, tmp_path, field, value):
    with pytest.raises(UserInputError, match=f"{field} must be >= "):
        reward.train(tiny_rm_cfg(backbone_dir, tmp_path, **{field: value}))
    assert not (tmp_path / "rm").exists()


def test_gradient_accumulation_steps_is_refused_not_silently_ignored(backbone_dir, tmp_path):
    """RMConfig has the field (OptimFields) but the trainer never read it: a TRL-style config with it set trained
    whole batches without a word. Its memory lever is --length_chunks (the same gradient in several passes)."""
    with pytest.raises(UserInputError, match="--gradient_accumulation_steps: rlhflab rm has no gradient accumulation "
                                             r"\(gradient_accumulation_steps 4\) -> .*--length_chunks"):
        reward.train(tiny_rm_cfg(backbone_dir, tmp_path, gradient_accumulation_steps=4))
    assert not (tmp_path / "rm").exists()


def test_length_chunks_zero_runs_one_pass_per_16_pairs_of_the_step(monkeypatch):
    seen = []
    monkeypatch.setattr(reward, "pair_scores", lambda model, batch, pad, chunks, shared: seen.append(chunks) or (
        torch.zeros(len(batch), requires_grad=True), torch.zeros(len(batch), requires_grad=True)))
    monkeypatch.setattr(reward, "clip_and_step", lambda *a, **k: torch.tensor(1.0))
    wrapped = parallel.wrap_model(torch.nn.Linear(1, 1), parallel.init_world("cpu"), "auto")
    pair = reward.TokenizedPair([1, 2], [1, 3], "f", "v")
    for size, chunks in ((64, 0), (32, 0), (8, 0), (64, 3)):
        cfg = RMConfig(model="unused", length_chunks=chunks, batch_size=size)
        reward.train_step(wrapped, None, None, [pair] * size, parallel.share_of(size, wrapped.world), 0, cfg, False)
    assert seen == [4, 2, 1, 3]


def test_the_summary_says_whether_pairs_were_packed(backbone_dir, tmp_path):
    result = reward.train(tiny_rm_cfg(backbone_dir, tmp_path, num_epochs=1, num_train_prompts=22))
    assert result.summary["shared_prefix"] is True  # a Llama backbone packs by default


def test_a_grown_trunk_trains_its_new_layers_and_leaves_the_frozen_ones(backbone_dir, tmp_path):
    cfg = tiny_rm_cfg(backbone_dir, tmp_path, num_epochs=4, num_train_prompts=44, extra_layers=1, frozen_layers=1)
    result = reward.train(cfg)
    start = models.load_causal_lm(backbone_dir).model
    rm = models.load_reward_model(result.model_dir).model
    depth = len(start.layers)
    assert len(rm.layers) == depth + 1
    assert torch.equal(rm.embed_tokens.weight, start.embed_tokens.weight)  # frozen: bit for bit the backbone's
    assert all(torch.equal(a, b) for a, b in zip(rm.layers[0].parameters(), start.layers[0].parameters()))
    for trained, before in zip(rm.layers[1:depth], start.layers[1:depth]):  # the rest of the backbone trains
        assert all(not torch.equal(a, b) for a, b in zip(trained.parameters(), before.parameters()))
    new = rm.layers[depth]  # started as a copy of the last layer with zero residual outputs; all of it moved
    assert new.self_attn.o_proj.weight.abs().sum() > 0 and new.mlp.down_proj.weight.abs().sum() > 0
    assert not torch.equal(new.self_attn.q_proj.weight, start.layers[-1].self_attn.q_proj.weight)
    assert result.summary["pairs"]["train"]["accuracy"] > 0.7  # chance is 0.5


def test_a_gpt2_trunk_grows_and_freezes_as_a_llama_one(tmp_path):
    # the demo grows its reward model's trunk by default (rm_extra_layers 2), whatever --arch it was given
    backbone = save_suite_model(tmp_path / "gpt2", arch="gpt2")
    result = reward.train(tiny_rm_cfg(backbone, tmp_path, num_epochs=4, num_train_prompts=44, extra_layers=1,
                                      frozen_layers=1))
    start = models.load_causal_lm(backbone).transformer
    rm = models.load_reward_model(result.model_dir).transformer
    assert len(rm.h) == len(start.h) + 1 == rm.config.n_layer
    assert torch.equal(rm.wte.weight, start.wte.weight) and torch.equal(rm.wpe.weight, start.wpe.weight)  # frozen
    assert all(torch.equal(a, b) for a, b in zip(rm.h[0].parameters(), start.h[0].parameters()))
    assert rm.h[-1].attn.c_proj.weight.abs().sum() > 0 and rm.h[-1].mlp.c_proj.weight.abs().sum() > 0  # trained
    assert result.summary["pairs"]["train"]["accuracy"] > 0.7  # chance is 0.5


def test_freezing_more_layers_than_the_trunk_has_is_refused(backbone_dir, tmp_path):
    with pytest.raises(UserInputError, match="frozen_layers"):
        reward.train(tiny_rm_cfg(backbone_dir, tmp_path, frozen_layers=9))
