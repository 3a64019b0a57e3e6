"""The length-bias probe on reward models whose dependence on length is known exactly."""

import math

import pytest
import torch
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutput

from rlhflab import models, tasks
from rlhflab.eval.length_bias import (FILLERS, appended, change_summary, describe, length_bias_probe,
                                      repeat_last_sentence)


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


# --- the edges (issue 36: mutants of length_bias.py that the cases above let through) -------------------------------


class LastTokenRM(LengthRM):
    """The score is the id of the last real token: the EOS for every answer when it is appended, else the answer's."""

    def forward(self, input_ids, attention_mask):
        last = attention_mask.sum(-1, keepdim=True) - 1  # right padding: ModelReward's batches
        return SequenceClassifierOutput(logits=input_ids.gather(1, last).float())


def test_change_summary_hand_worked():
    summary = change_summary([0.5, -0.25, 0.0, 1.0], [2, 1, 0, 3])
    assert summary == {"mean_change": 0.3125, "share_raised": 0.5, "mean_added_tokens": 1.5,
                       "change_per_token": pytest.approx(1.25 / 6)}  # a change of 0 raised nothing
    empty = change_summary([], [])
    assert all(math.isnan(v) for v in empty.values()) and list(empty) == list(summary)
    assert math.isnan(change_summary([0.5], [0])["change_per_token"])  # no token added: no rate


def test_the_fillers_and_the_console_line():
    assert {name: pad("Yes.") for name, pad in FILLERS.items()} == {
        "hope_this_helps": "Yes. Hope this helps!", "let_me_know": "Yes. Let me know if you need anything else.",
        "restate": "Yes. I hope this answer is clear and complete.", "repeat_last_sentence": "Yes. Yes."}
    assert appended("!")("a") == "a!" and repeat_last_sentence("  ") == "  " + " " + "  "  # no sentence: repeated whole
    assert repeat_last_sentence("A.\nB. C.") == "A.\nB. C.\nC."
    probe = {"pairs": 8, "mean_change": 0.25, "share_raised": 0.75, "mean_added_tokens": 3.4, "plain_score_std": 0.5}
    assert describe(probe) == ("length bias: padding the reference answer with filler (~3 tokens) changed the reward by "
                               "+0.250 on average (+0.50 std of the plain scores); it raised the reward in 75% of 8 pairs")
    for std in (0.0, float("nan"), float("inf")):
        assert describe({**probe, "plain_score_std": std}) == (
            "length bias: padding the reference answer with filler (~3 tokens) changed the reward by +0.250 on "
            "average; it raised the reward in 75% of 8 pairs")


def test_the_probe_reads_eos_batches_and_fillers_as_given(tokenizer, items):
    from rlhflab.rewards import ModelReward

    few = items[:3]
    prompts, plain = [i.prompt for i in few], [i.reference for i in few]
    fillers = {"bang": appended(" !")}
    with_eos = length_bias_probe(LastTokenRM(), tokenizer, few, fillers=fillers, batch_size=1)
    assert with_eos["fillers"] == ["bang"] and list(with_eos["per_filler"]) == ["bang"] and with_eos["pairs"] == 3
    assert with_eos["mean_change"] == 0.0 and with_eos["plain_score_std"] == 0.0  # every score is the EOS id
    bare = length_bias_probe(LastTokenRM(), tokenizer, few, fillers=fillers, append_eos=False)
    encoded = ModelReward(LastTokenRM(), tokenizer, append_eos=False).encode(prompts, plain)
    padded = ModelReward(LastTokenRM(), tokenizer, append_eos=False).encode(prompts, [a + " !" for a in plain])
    changes = [p[-1] - e[-1] for p, e in zip(padded, encoded)]
    assert bare["mean_change"] == pytest.approx(sum(changes) / 3) and bare["mean_change"] != 0.0
    assert bare["mean_added_tokens"] == pytest.approx(sum(len(p) - len(e) for p, e in zip(padded, encoded)) / 3)
    lengths = [len(e) for e in ModelReward(LengthRM(), tokenizer).encode(prompts, plain)]
    mean = sum(lengths) / 3
    spread = length_bias_probe(LengthRM(), tokenizer, few, fillers=fillers)["plain_score_std"]
    assert spread == pytest.approx(math.sqrt(sum((n - mean) ** 2 for n in lengths) / 3)) and spread > 0
    assert math.isnan(length_bias_probe(LengthRM(), tokenizer, [], fillers=fillers)["plain_score_std"])

