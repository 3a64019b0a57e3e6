"""PPO's console table of sample answers: what it shows, that it goes to the log, that rich loads only for it."""

import builtins
import logging

import pytest

from rlhflab import models, rewards, sources, tasks
from rlhflab.config import PPOConfig
from rlhflab.tracking import RunDir
from rlhflab.trainers.online.evaluate import Evaluator, samples_table


@pytest.fixture(scope="module")
def policy_and_tokenizer():
    tokenizer = models.build_tokenizer(tasks.template_corpus(), vocab_size=256)
    model = models.build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64, seed=0)
    return model.eval(), tokenizer


def test_table_shows_prompt_answer_and_verdict_and_keeps_brackets_literal():
    rows = [{"prompt": "Say resu 2 times,\nseparated by spaces.\n", "answer": "[bold]resu resu", "passed": True},
            {"prompt": "What is 10 plus 42?\n", "answer": "RESULT: 51", "passed": False, "kind": "wrong_content"}]
    text = samples_table(rows, "update 10")
    lines = text.splitlines()
    assert lines[0].startswith("update 10") and "prompt" in lines[1] and "verdict" in lines[1]
    assert "[bold]resu resu" in text  # model text is never parsed as rich markup
    assert "Say resu 2 times, separated by spaces." in text  # the prompt on one line
    assert "pass" in text and "FAIL wrong_content" in text and "\x1b[" not in text  # no colour codes in a log


def evaluator_run(tmp_path, policy_and_tokenizer, console_samples: int):
    policy, tokenizer = policy_and_tokenizer
    cfg = PPOConfig(model="unused", eval_prompts=5, sample_prompts=2, console_samples=console_samples,
                    max_new_tokens=4, num_train_prompts=22, num_validation_prompts=11, num_test_prompts=11)
    run = RunDir(tmp_path / f"run{console_samples}")
    rows = sources.suite_prompts(tasks.build_splits(0, 22, 11, 11)["validation"], "validation")
    evaluator = Evaluator(rows, tokenizer, cfg, run, rewards.CheckerVerifier())
    metrics = evaluator.evaluate(policy, step=3, episode=24)
    run.close()
    return metrics, run


def test_evaluation_logs_the_table_of_the_first_prompts_not_into_metrics(tmp_path, policy_and_tokenizer, caplog):
    with caplog.at_level(logging.INFO, logger="rlhflab"):
        metrics, run = evaluator_run(tmp_path, policy_and_tokenizer, console_samples=3)
    tables = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sample answers")]
    assert len(tables) == 1 and "update 3 (episode 24)" in tables[0]
    prompts = [" ".join(i.prompt.split()) for i in tasks.build_splits(0, 22, 11, 11)["validation"][:4]]
    assert all(p[:20] in tables[0] for p in prompts[:3]) and prompts[3][:20] not in tables[0]
    assert set(metrics) == {"val/pass_rate", "episode", *(k for k in metrics if k.startswith("val/pass_rate/"))}
    assert len((run.path / "samples.jsonl").read_text().splitlines()) == 2  # sample_prompts, unchanged


def test_no_table_and_no_rich_import_when_off(tmp_path, policy_and_tokenizer, caplog, monkeypatch):
    imported = []
    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__",
                        lambda name, *a, **k: (imported.append(name) if name.startswith("rich") else None)
                        or real_import(name, *a, **k))
    with caplog.at_level(logging.INFO, logger="rlhflab"):
        evaluator_run(tmp_path, policy_and_tokenizer, console_samples=0)
    assert not any(r.getMessage().startswith("sample answers") for r in caplog.records) and imported == []
