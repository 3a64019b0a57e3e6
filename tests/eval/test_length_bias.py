"""The length-bias probe on reward models whose dependence on length is known exactly."""

import pytest
import torch
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutput

from rlhflab import models, tasks
from rlhflab.eval.length_bias import FILLERS, describe, length_bias_probe, repeat_last_sentence


class LengthRM(nn.Module):
    """A sequence classifier whose score is `per_token` x the number of real tokens (EOS included)."""

    def __init__(self, per_token: float = 1.0):
        super().__init__()
        self.per_token = per_token
        self.unused = nn.Parameter(torch.zeros(1))  # ModelReward reads the device from a parameter

    @property
    def base_model(self):
        return self

    def forward(self, input_ids, attention_mask):
        return SequenceClassifierOutput(logits=self.per_token * attention_mask.sum(-1, keepdim=True).float())


class FirstTokenRM(LengthRM):
    """Ignores length: the score is the id of the first token (the prompt's, the same in both answers)."""

    def forward(self, input_ids, attention_mask):
        return SequenceClassifierOutput(logits=input_ids[:, :1].float())


@pytest.fixture(scope="module")
def tokenizer():
    return models.build_tokenizer(tasks.template_corpus(), vocab_size=256)


@pytest.fixture(scope="module")
def items():
    return tasks.build_splits(0, 22, 11, 11)["test"]


def added_tokens(tokenizer, answer: str, padded: str) -> int:
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    return count(padded) - count(answer)


def test_a_reward_of_half_a_point_per_token_shows_exactly_that_increase(tokenizer, items):
    probe = length_bias_probe(LengthRM(per_token=0.5), tokenizer, items)
    assert probe["pairs"] == len(items) * len(FILLERS) and probe["fillers"] == list(FILLERS)
    all_added = []
    for name, pad in FILLERS.items():
        added = [added_tokens(tokenizer, i.reference, pad(i.reference)) for i in items]
        all_added += added
        got = probe["per_filler"][name]
        assert got["mean_added_tokens"] == pytest.approx(sum(added) / len(added))
        assert got["mean_change"] == pytest.approx(0.5 * sum(added) / len(added))
        assert got["share_raised"] == 1.0 and got["change_per_token"] == pytest.approx(0.5)
    assert probe["mean_change"] == pytest.approx(0.5 * sum(all_added) / len(all_added))
    assert probe["share_raised"] == 1.0 and probe["change_per_token"] == pytest.approx(0.5)
    assert "raised the reward in 100%" in describe(probe)


def test_a_reward_that_ignores_length_shows_no_change(tokenizer, items):
    probe = length_bias_probe(FirstTokenRM(), tokenizer, items)
    assert probe["mean_change"] == 0.0 and probe["share_raised"] == 0.0
    assert all(f["mean_change"] == 0.0 and f["mean_added_tokens"] > 0 for f in probe["per_filler"].values())


def test_a_reward_that_punishes_length_shows_a_fall_never_a_raise(tokenizer, items):
    probe = length_bias_probe(LengthRM(per_token=-1.0), tokenizer, items)
    assert probe["mean_change"] == pytest.approx(-probe["mean_added_tokens"]) and probe["share_raised"] == 0.0


def test_repeat_last_sentence():
    assert repeat_last_sentence("It is red. It is big.") == "It is red. It is big. It is big."
    assert repeat_last_sentence("- a\n- b") == "- a\n- b\n- b"
    assert repeat_last_sentence('{"x": 1}') == '{"x": 1} {"x": 1}'


def test_rm_diagnose_reports_the_probe_in_its_summary_and_on_the_console(tokenizer, tmp_path, capsys):
    import json

    from rlhflab.cli import main

    policy = models.build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64, seed=0)
    models.save_model_folder(tmp_path / "policy", policy, tokenizer)
    rm = models.build_random_reward_model(tokenizer, seed=1)
    models.save_model_folder(tmp_path / "rm", rm, tokenizer)
    code = main(["rm", "diagnose", "--policy", str(tmp_path / "policy"), "--reward_model", str(tmp_path / "rm"),
                 "--split", "test", "--num_train_prompts", "22", "--num_validation_prompts", "11",
                 "--num_test_prompts", "11", "--max_new_tokens", "4", "--samples_per_prompt", "1",
                 "--progress", "false", "--threads", "1", "--out", str(tmp_path / "diag")])
    assert code == 0
    probe = json.loads((tmp_path / "diag" / "summary.json").read_text())["length_bias"]
    assert probe["pairs"] == 11 * len(FILLERS) and set(probe["per_filler"]) == set(FILLERS)
    per_filler = [f["mean_change"] for f in probe["per_filler"].values()]
    assert probe["mean_change"] == pytest.approx(sum(per_filler) / len(FILLERS))
    assert "length bias: padding the reference answer" in capsys.readouterr().out
    metrics = json.loads((tmp_path / "diag" / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["length_bias/mean_change"] == pytest.approx(probe["mean_change"])
