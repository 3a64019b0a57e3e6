"""A reward model on a real pretrained encoder: MiniLM-L6 (BERT, uncased WordPiece, no EOS).

It reads its score the way its own HF head does (pooled [CLS]), on text framed by its own
tokenizer ([CLS] ... [SEP]); the trainer's data path and `rewards.ModelReward` encode alike;
a saved folder reloads to the same scores; and it scores a tiny Llama policy's answers, whose
BPE tokenizer shares nothing with WordPiece, by re-tokenising the decoded text.
"""

from __future__ import annotations

import pytest
import torch
from pretrained import minilm_path

from rlhflab import data, models, tasks
from rlhflab.data.prompt_rows import PromptRow
from rlhflab.rewards import ModelReward
from rlhflab.rollout import GenerationSettings, generate_answers
from rlhflab.trainers import reward

PROMPTS = ["What is the capital of France? ", "How many legs does a spider have? ", "Name a yellow fruit. "]
RESPONSES = ["The capital of France is Paris.", "Go away.", "A banana is yellow, and so is a lemon."]


@pytest.fixture(scope="module")
def minilm():
    """(reward model, tokenizer): MiniLM with a fresh one-output head, seeded, dropout off, eval mode."""
    path = minilm_path()
    tokenizer = models.load_tokenizer(path)
    torch.manual_seed(0)
    model = models.build_reward_model(path, tokenizer)
    return models.disable_dropout(model).eval(), tokenizer


def test_minilm_loads_as_an_encoder_reward_model_with_a_fresh_head(minilm):
    model, tokenizer = minilm
    assert type(model).__name__ == "BertForSequenceClassification" and model.config.num_labels == 1
    assert models.is_encoder_reward_model(model) and not models.can_pack_pairs(model)
    assert tokenizer.eos_token_id is None and model.config.pad_token_id == tokenizer.pad_token_id == 0
    assert models.special_tokens_frame(tokenizer) == ([tokenizer.cls_token_id], [tokenizer.sep_token_id])
    assert abs(model.classifier.weight.std().item() - 1 / (384 + 1) ** 0.5) < 0.01  # our init, not HF's 0.02
    # the pooler ([CLS] -> dense -> tanh) comes from the checkpoint, so two builds share it; the head does not
    other = models.build_reward_model(minilm_path(), tokenizer)
    assert torch.equal(other.bert.pooler.dense.weight, model.bert.pooler.dense.weight)
    assert not torch.equal(other.classifier.weight, model.classifier.weight)


def test_minilm_scores_are_deterministic_padding_free_and_match_hf_own_pipeline(minilm):
    model, tokenizer = minilm
    scorer = ModelReward(model, tokenizer)  # append_eos=True by default: an encoder has no EOS and needs none
    rows = scorer.encode(PROMPTS, RESPONSES)
    assert tokenizer.convert_ids_to_tokens(rows[1]) == ["[CLS]", "how", "many", "legs", "does", "a", "spider",
                                                        "have", "?", "go", "away", ".", "[SEP]"]
    first = scorer(PROMPTS, RESPONSES, [PromptRow(p) for p in PROMPTS]).scores
    again = scorer(PROMPTS, RESPONSES, [PromptRow(p) for p in PROMPTS]).scores
    assert torch.equal(first, again) and len(set(first.tolist())) == 3
    # HF's own pipeline on the joined text: tokenizer(..., padding) with token_type_ids, logits of the head
    texts = [p + r for p, r in zip(PROMPTS, RESPONSES)]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    assert batch["input_ids"][1, : len(rows[1])].tolist() == rows[1]
    with torch.no_grad():
        hf = model(**batch).logits[:, 0]
        alone = [model(**tokenizer(t, return_tensors="pt")).logits[0, 0].item() for t in texts]
        left = models.sequence_scores(model, *left_padded(rows))
    assert first.tolist() == pytest.approx(hf.tolist(), abs=1e-5)
    assert first.tolist() == pytest.approx(alone, abs=1e-5)
    assert left.tolist() == pytest.approx(alone, abs=1e-5)  # a left-padded batch is moved to the right first


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(map(len, rows))
    ids = torch.tensor([[0] * (length - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (length - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def test_trainer_data_path_and_model_reward_encode_and_score_alike(minilm):
    model, tokenizer = minilm
    pairs = [data.PairExample(p, r, "The answer is unknown.") for p, r in zip(PROMPTS, RESPONSES)]
    tokenized = reward.tokenize_pairs(pairs, tokenizer, max_length=12, encoder=True)  # some rows are cut
    scorer = ModelReward(model, tokenizer, max_length=12)
    assert [t.chosen for t in tokenized] == scorer.encode(PROMPTS, RESPONSES)
    assert all(len(t.chosen) <= 12 and t.chosen[0] == 101 and t.chosen[-1] == 102 for t in tokenized)
    with torch.no_grad():
        chosen, rejected = reward.pair_scores(model, tokenized, tokenizer.pad_token_id, chunks=2)
    assert chosen.tolist() == pytest.approx(scorer(PROMPTS, RESPONSES, [None] * 3).scores.tolist(), abs=1e-6)
    assert rejected.tolist() == pytest.approx(
        scorer(PROMPTS, ["The answer is unknown."] * 3, [None] * 3).scores.tolist(), abs=1e-6)


def test_saved_minilm_reward_model_reloads_to_identical_scores(minilm, tmp_path):
    model, tokenizer = minilm
    folder = models.save_model_folder(tmp_path / "rm", model, tokenizer)
    loaded = models.load_reward_model(folder).eval()
    loaded_tokenizer = models.load_tokenizer(folder)
    assert type(loaded).__name__ == "BertForSequenceClassification" and models.is_encoder_reward_model(loaded)
    assert ModelReward(loaded, loaded_tokenizer).encode(PROMPTS, RESPONSES) == ModelReward(
        model, tokenizer).encode(PROMPTS, RESPONSES)
    saved, reloaded = model.state_dict(), loaded.state_dict()
    assert all(torch.equal(saved[k], reloaded[k]) for k in saved)  # every weight back bit for bit
    before = ModelReward(model, tokenizer)(PROMPTS, RESPONSES, [None] * 3).scores
    after = ModelReward(loaded, loaded_tokenizer)(PROMPTS, RESPONSES, [None] * 3).scores
    # the same weights, but the reloaded tensors' memory layout can pick another kernel: 1.5e-8 apart seen here
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)


def test_minilm_scores_a_tiny_llama_policys_answers_through_text(minilm):
    model, rm_tokenizer = minilm
    policy_tokenizer = models.build_tokenizer(tasks.template_corpus(), vocab_size=256)  # BPE, with EOS
    policy = models.build_tiny_model(policy_tokenizer, hidden_size=32, num_layers=2, num_heads=4,
                                     intermediate_size=64, seed=0)
    prompts = ["Write the word cat in capital letters. Answer as RESULT: ", "Add 2 and 3. Answer as RESULT: "] * 2
    answers = generate_answers(policy, policy_tokenizer, prompts, GenerationSettings(12, True, 1.0),
                               generator=torch.Generator().manual_seed(0))
    texts = [a.text for a in answers]
    assert len(set(texts)) == 4 and all(texts)  # sampled: four different answers
    assert policy_tokenizer(prompts[0])["input_ids"] != rm_tokenizer(prompts[0], add_special_tokens=False)[
        "input_ids"]  # two vocabularies: only text crosses between them
    out = ModelReward(model, rm_tokenizer)(prompts, texts, [PromptRow(p) for p in prompts])
    with torch.no_grad():
        expected = [model(**rm_tokenizer(p + t, return_tensors="pt")).logits[0, 0].item()
                    for p, t in zip(prompts, texts)]
    assert out.valid.all() and out.scores.tolist() == pytest.approx(expected, abs=1e-5)
