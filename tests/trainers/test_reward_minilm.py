"""`rlhflab rm` on a real pretrained backbone: MiniLM-L6 (BERT, uncased WordPiece) learns a user's
preference pairs from a JSONL file, and held-out pairs it never saw move the right way.

The preference is helpful answer over dismissive refusal, written fresh for the held-out file,
so the gain there comes from what the pretrained encoder already knows about language.
(Letter case would not do: this tokenizer lowercases, so "PARIS" and "paris" are the same ids.)
"""

from __future__ import annotations

import json

import pytest
import torch
from pretrained import minilm_path

from rlhflab import data, models
from rlhflab.config import RMConfig
from rlhflab.trainers import reward

TRAIN = [
    ("What is the capital of France?", "The capital of France is Paris.", "Figure it out yourself."),
    ("How many legs does a spider have?", "A spider has eight legs.", "Why would I tell you that?"),
    ("What colour is the sky on a clear day?", "On a clear day the sky is blue.", "Stop asking me silly questions."),
    ("Name a fruit that is yellow.", "A banana is a yellow fruit.", "I refuse to answer."),
    ("What is two plus two?", "Two plus two is four.", "Nobody cares about that."),
    ("Which animal says moo?", "A cow says moo.", "Go away, I am busy."),
    ("What do bees make?", "Bees make honey.", "Look it up, I will not help."),
    ("What is frozen water called?", "Frozen water is called ice.", "That question is boring, ask someone else."),
    ("How many wheels does a bicycle have?", "A bicycle has two wheels.", "Not interested."),
    ("What is the boiling point of water?", "Water boils at 100 degrees Celsius.", "You should already know that."),
    ("Which season comes after winter?", "Spring comes after winter.", "I do not feel like answering."),
    ("What do you call a baby dog?", "A baby dog is called a puppy.", "Ask me later, or never."),
]
HELD_OUT = [
    ("What is the largest planet?", "Jupiter is the largest planet.", "Ask somebody who cares."),
    ("How many days are in a week?", "A week has seven days.", "Leave me alone."),
    ("What gas do plants take in?", "Plants take in carbon dioxide.", "Do your own homework."),
    ("What is the opposite of hot?", "The opposite of hot is cold.", "Not my problem."),
    ("Where do fish live?", "Fish live in water.", "Whatever, I do not know and do not care."),
    ("What is the colour of grass?", "Grass is green.", "I will not waste my time on you."),
]
MAX_LENGTH = 64


def write_pairs(path, rows) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in rows))
    return str(path)


def minilm_rm_cfg(tmp_path, **overrides) -> RMConfig:
    base = dict(model=str(minilm_path()), train_file=write_pairs(tmp_path / "train.jsonl", TRAIN),
                validation_file=write_pairs(tmp_path / "held_out.jsonl", HELD_OUT), output_dir=str(tmp_path / "rm"),
                max_length=MAX_LENGTH, num_epochs=2, batch_size=4, learning_rate=2e-4, warmup_steps=2,
                log_every=1, progress=False, threads=2, seed=0, report_to="tensorboard")
    return RMConfig(**{**base, **overrides})


def held_out_before_training(cfg: RMConfig) -> dict:
    """The fresh reward model the trainer starts from (same seed, same head init) on the held-out pairs."""
    tokenizer = models.load_tokenizer(cfg.model)
    torch.manual_seed(cfg.seed)
    model = models.build_reward_model(cfg.model, tokenizer)
    models.disable_dropout(model)
    pairs = data.load_examples(cfg.validation_file, "pairs", tokenizer=tokenizer)
    tokenized = reward.tokenize_pairs(pairs, tokenizer, cfg.max_length, encoder=True)
    return reward.evaluate_pairs(model, tokenized, tokenizer.pad_token_id)


def test_minilm_reward_model_learns_user_pairs_and_generalises(tmp_path):
    reader = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    cfg = minilm_rm_cfg(tmp_path)
    before = held_out_before_training(cfg)
    result = reward.train(cfg)
    after = result.summary["pairs"]
    print(f"held-out accuracy {before['accuracy']:.2f} -> {after['validation']['accuracy']:.2f}, "
          f"margin {before['margin']:+.3f} -> {after['validation']['margin']:+.3f}")
    assert result.summary["steps"] == 6 and result.summary["shared_prefix"] is False  # an encoder never packs
    assert before["accuracy"] < 0.9 and abs(before["margin"]) < 0.3  # measured: 0.67, +0.011 (a fresh head)
    assert after["train"]["accuracy"] == 1.0  # measured: 1.0 train, 1.0 held-out, held-out margin +1.25
    assert after["validation"]["accuracy"] >= 5 / 6 and after["validation"]["margin"] > before["margin"] + 1.0
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["loss/rm"]) for r in rows if "loss/rm" in r]
    assert [step for step, _ in losses] == [1, 2, 3, 4, 5, 6] and losses[-1][1] < 0.5 * losses[0][1]
    # the same numbers, read back from TensorBoard's event files with its own reader (float32 there)
    events = reader.EventAccumulator(str(result.run_dir / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss/rm")] == [(s, pytest.approx(v)) for s, v in losses]
    [held_out] = events.Scalars("validation/accuracy")
    assert held_out.step == 6 and held_out.value == pytest.approx(after["validation"]["accuracy"])
    rm = models.load_reward_model(result.model_dir)
    assert type(rm).__name__ == "BertForSequenceClassification" and rm.config.num_labels == 1
