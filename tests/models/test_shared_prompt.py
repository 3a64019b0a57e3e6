"""Each distinct prompt run once for its k answers (models/shared_prompt.py) = every row run on its own."""

import pytest
import torch

from rlhflab import data, models, tasks
from rlhflab.models.lean_decoder import LeanDecoder
from rlhflab.rollout.generate import GenerationSettings, generate
from rlhflab.rollout.roles import joined


def tiny_rollout(arch: str, group: int = 4, prompts: int = 3):
    """A tiny model and `prompts` prompts x `group` sampled answers (ragged prompts and answers)."""
    tokenizer = models.build_tokenizer(tasks.template_corpus(), vocab_size=256)
    model = models.build_tiny_model(tokenizer, arch=arch, hidden_size=32, num_layers=2, num_heads=4,
                                    intermediate_size=64, seed=0)
    items = tasks.build_splits(0, 22, 11, 11)["train"][:prompts]
    ids = data.encode_prompts(tokenizer, [i.prompt for i in items for _ in range(group)])
    out = generate(model, ids, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                   settings=GenerationSettings(8, True, 1.0), generator=torch.Generator().manual_seed(0))
    return model, out


def joined_logits(plan, out):
    """The plain lean forward over prompt + answer rows: logits predicting each answer token."""
    ids, attention, positions = joined(out.query_ids, out.query_mask, out.response_ids, out.response_mask)
    keep = out.response_ids.shape[1] + 1
    return plan.lm_head(models.lean_hidden(plan, ids, attention, positions)[:, -keep:])[:, :-1]


def test_distinct_prompts_finds_each_prompt_and_its_rows():
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [0, 5, 6]])
    mask = ids != 0
    first, rows = models.distinct_prompts(ids, mask)
    assert torch.equal(ids[first][rows], ids)  # every row is its prompt's first row
    assert sorted(first.tolist()) == [0, 2]
    assert models.distinct_prompts(ids[1:3], mask[1:3]) is None  # no prompt repeats: nothing to share


@pytest.mark.parametrize(("arch", "prompts"), [("llama", 3), ("qwen2", 3), ("llama", 8)])
def test_shared_prompt_logits_and_gradients_equal_the_plain_forward(arch, prompts):
    """3 prompts x 4 and 8 x 4 sampled answers: groups packed into one row or several; past each answer 0."""
    model, out = tiny_rollout(arch, prompts=prompts)
    model.train(True)
    models.disable_dropout(model)
    plan = models.plan_lean(model, allow_training=True)
    groups = models.distinct_prompts(out.query_ids, out.query_mask)
    assert len(groups[0]) == prompts
    mask = out.response_mask
    plain = joined_logits(plan, out)
    head_inputs = models.shared_prompt_logits(plan, out.query_ids, out.query_mask, out.response_ids, mask, *groups)
    shared = head_inputs.head(head_inputs.hidden)
    torch.testing.assert_close(shared[mask], plain[mask], rtol=0, atol=1e-5)
    assert bool((head_inputs.hidden[~mask] == 0).all())
    rows = models.shared_prompt.answer_rows(out.query_ids, out.query_mask, out.response_ids, mask, *groups, 0)
    assert int((rows.input_ids != 0).sum()) == int(out.query_mask[groups[0]].sum() + mask.sum())  # each prompt once
    shuffled = torch.randperm(len(mask), generator=torch.Generator().manual_seed(0))
    again = models.shared_prompt_logits(plan, *(t[shuffled] for t in (out.query_ids, out.query_mask, out.response_ids,
                                                                     mask)), *models.distinct_prompts(
        out.query_ids[shuffled], out.query_mask[shuffled]))
    assert torch.equal(again.hidden[torch.argsort(shuffled)], head_inputs.hidden)  # the rows' order changes no bit (ratio exactly 1)
    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.randn(plain[mask].shape, generator=torch.Generator().manual_seed(1))
    g_plain = torch.autograd.grad((plain[mask] * weights).sum(), params)
    g_shared = torch.autograd.grad((shared[mask] * weights).sum(), params)
    for a, b in zip(g_plain, g_shared):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)  # sums over answers reordered; grads are ~1e2


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_one_answer_per_prompt_packs_without_padding_and_equals_the_plain_forward(arch):
    """k = 1 (REINFORCE, a batch of distinct prompts): `every=True` groups each row alone, packed back to back;
    the logits equal the padded forward's, the padding is gone, and the rows' order changes no bit."""
    model, out = tiny_rollout(arch, group=1, prompts=8)
    model.train(True)
    models.disable_dropout(model)
    plan = models.plan_lean(model, allow_training=True)
    assert models.distinct_prompts(out.query_ids, out.query_mask) is None
    groups = models.distinct_prompts(out.query_ids, out.query_mask, every=True)
    assert sorted(groups[0].tolist()) == list(range(8)) and sorted(groups[1].tolist()) == list(range(8))
    mask = out.response_mask
    plain = joined_logits(plan, out)
    packed = models.shared_prompt_logits(plan, out.query_ids, out.query_mask, out.response_ids, mask, *groups)
    torch.testing.assert_close(packed.head(packed.hidden)[mask], plain[mask], rtol=0, atol=1e-5)
    rows = models.shared_prompt.answer_rows(out.query_ids, out.query_mask, out.response_ids, mask, *groups, 0)
    real = int(out.query_mask.sum() + mask.sum())
    assert int((rows.input_ids != 0).sum()) == real < out.query_ids.numel() + mask.numel()  # padded rows: more
    shuffled = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    parts = [t[shuffled] for t in (out.query_ids, out.query_mask, out.response_ids, mask)]
    again = models.shared_prompt_logits(plan, *parts, *models.distinct_prompts(*parts[:2], every=True))
    assert torch.equal(again.hidden[torch.argsort(shuffled)], packed.hidden)


def test_generation_prefills_each_prompt_once_and_samples_each_answer_on_its_own():
    model, out = tiny_rollout("llama")
    responses = out.response_ids.view(3, 4, -1)
    assert any(len({tuple(r.tolist()) for r in group}) > 1 for group in responses)  # answers differ
    plan = models.plan_lean(model.eval())
    decoder = LeanDecoder(plan, out.query_ids, out.query_mask,
                                      data.position_ids_from_mask(out.query_mask), 4)
    first, rows = models.distinct_prompts(out.query_ids, out.query_mask)
    shared = LeanDecoder(plan, out.query_ids[first], out.query_mask[first],
                                     data.position_ids_from_mask(out.query_mask[first]), 4)
    shared.select_rows(rows)
    torch.testing.assert_close(shared.logits, decoder.logits, rtol=0, atol=1e-5)
    token = out.response_ids[:, 0]
    torch.testing.assert_close(shared.step(token), decoder.step(token), rtol=0, atol=1e-5)
