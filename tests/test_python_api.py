"""The Python API as a notebook uses it: a model, a `datasets.Dataset` and reward functions built in memory, no file
written by the user; the same weights as the command line on the same settings; bad input refused before any
model is loaded, nothing of an earlier run overwritten."""

import json
import textwrap

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

import rlhflab
from rlhflab import Callback, DPOConfig, GRPOConfig, PPOConfig, UserInputError, cli, models, tasks

REWARDS = '''
def correct(prompts, completions, answer, **kwargs):
    return [1.0 if c[0]["content"].strip() == a else 0.0 for c, a in zip(completions, answer)]

def short(completions, **kwargs):
    return [-len(c[0]["content"]) / 10 for c in completions]
'''
namespace: dict = {}
exec(REWARDS, namespace)  # the notebook's cell
correct, short = namespace["correct"], namespace["short"]

SETTINGS = dict(num_generations=2, batch_size=4, total_episodes=8, response_length=6, max_new_tokens=6, eval_every=0,
                eval_prompts=4, learning_rate=1e-2, progress=False, write_report=False, threads=2, seed=3)
FLAGS = [f"--{k}={v}" for k, v in SETTINGS.items()]


def ask(a: int) -> list[dict]:
    return [{"role": "user", "content": f"Add {a} and {a}."}]


@pytest.fixture(scope="module")
def in_memory():
    tokenizer = models.build_tokenizer(tasks.template_corpus(), vocab_size=256)
    model = models.build_tiny_model(tokenizer, arch="llama", hidden_size=32, num_layers=2, num_heads=4,
                                    intermediate_size=64, seed=0)
    prompts = Dataset.from_list([{"prompt": ask(a), "answer": str(2 * a)} for a in range(16)])
    pairs = Dataset.from_list([{"prompt": ask(a), "chosen": [{"role": "assistant", "content": str(2 * a)}],
                                "rejected": [{"role": "assistant", "content": str(2 * a + 1)}]} for a in range(16)])
    return model, tokenizer, prompts, pairs


def weights(run_dir):
    return load_file(str(run_dir / "model" / "model.safetensors"))


def as_files(tmp_path, model, tokenizer, dataset, name):
    """What a command-line user writes by hand: the model folder, the data as JSONL, the functions' file."""
    models.save_model_folder(tmp_path / "model", model, tokenizer)
    (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in dataset.to_list()))
    (tmp_path / "rewards.py").write_text(textwrap.dedent(REWARDS))
    return str(tmp_path / "model"), str(tmp_path / f"{name}.jsonl"), str(tmp_path / "rewards.py")


class Seen(Callback):
    def __init__(self):
        self.logs, self.evaluations, self.summary = [], [], None

    def on_log(self, logs, step):
        self.logs.append(step)

    def on_evaluate(self, metrics, step):
        self.evaluations.append((step, metrics["val/reward"]))

    def on_train_end(self, summary):
        self.summary = summary


def test_grpo_from_memory_equals_the_cli_and_callbacks_see_the_run(in_memory, tmp_path):
    model, tokenizer, prompts, _ = in_memory
    seen = Seen()
    result = rlhflab.GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[correct, short],
                                 train_dataset=prompts, callbacks=[seen],
                                 args=GRPOConfig(output_dir=str(tmp_path / "api"), **SETTINGS)).train()
    assert result.summary["reward_functions"] == ["correct", "short"] and result.summary["updates"] == 2
    assert seen.summary["updates"] == 2 and [s for s, _ in seen.evaluations] == [0, 2]
    assert seen.logs.count(1) == 1 and seen.logs.count(2) == 2  # update 2: its metrics and the evaluation
    model_dir, data, fns = as_files(tmp_path, model, tokenizer, prompts, "prompts")
    assert cli.main(["grpo", "--model", model_dir, "--train_file", data, "--reward_fn",
                     f"{fns}:correct,{fns}:short", "--output_dir", str(tmp_path / "cli"), *FLAGS]) == 0
    api, by_cli = weights(result.run_dir), weights(tmp_path / "cli")
    assert api.keys() == by_cli.keys() and all(torch.equal(api[k], by_cli[k]) for k in api)
    start = model.state_dict()
    assert any(not torch.equal(api[k], start[k]) for k in api)  # it trained; the object passed is untouched
    assert (result.run_dir / "inputs" / "train.parquet").is_file()  # the run folder holds what it trained on
    assert rlhflab.write_report(result.run_dir) == result.run_dir / "report.html"


def test_dpo_with_a_peft_config_from_memory_equals_the_cli(in_memory, tmp_path):
    from peft import LoraConfig

    model, tokenizer, _, pairs = in_memory
    settings = dict(max_steps=3, batch_size=4, learning_rate=1e-2, eval_every=0, progress=False, write_report=False,
                    threads=2)
    result = rlhflab.DPOTrainer(model=model, processing_class=tokenizer, train_dataset=pairs,
                                peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                                args=DPOConfig(output_dir=str(tmp_path / "api"), **settings)).train()
    assert (result.run_dir / "adapter" / "adapter_config.json").is_file()
    model_dir, data, _ = as_files(tmp_path, model, tokenizer, pairs, "pairs")
    flags = [f"--{k}={v}" for k, v in settings.items()]
    assert cli.main(["dpo", "--model", model_dir, "--train_file", data, "--lora_r", "4", "--lora_alpha", "8",
                     "--lora_target_modules", "q_proj,v_proj", "--output_dir", str(tmp_path / "cli"), *flags]) == 0
    api, by_cli = weights(result.run_dir), weights(tmp_path / "cli")
    assert all(torch.equal(api[k], by_cli[k]) for k in api)


def test_ppo_from_memory_with_a_verifier_equals_the_cli(in_memory, tmp_path):
    model, tokenizer, prompts, _ = in_memory
    verifier = lambda prompts, completions, answer, **kw: [c[0]["content"].strip() == a  # noqa: E731
                                                            for c, a in zip(completions, answer)]
    settings = {k: v for k, v in SETTINGS.items() if k != "num_generations"}
    train, validation = prompts.select(range(12)), prompts.select(range(12, 16))
    result = rlhflab.PPOTrainer(model=model, processing_class=tokenizer, reward_funcs=correct, verifier=verifier,
                                train_dataset=train, eval_dataset=validation,
                                args=PPOConfig(output_dir=str(tmp_path / "ppo"), **settings)).train()
    assert result.summary["held_out"]["metric"] == "val/pass_rate"
    assert result.summary["validation_pass_rate"]["start"] == 0.0 and result.model_dir.is_dir()
    model_dir, data, fns = as_files(tmp_path, model, tokenizer, train, "prompts")
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in validation.to_list()))
    (tmp_path / "rewards.py").write_text(textwrap.dedent(REWARDS) + textwrap.dedent('''
        def verifier(prompts, completions, answer, **kw):
            return [c[0]["content"].strip() == a for c, a in zip(completions, answer)]
        '''))
    flags = [f"--{k}={v}" for k, v in settings.items()]
    assert cli.main(["ppo", "--model", model_dir, "--train_file", data, "--validation_file", str(tmp_path / "val.jsonl"),
                     "--reward_fn", f"{fns}:correct", "--verifier", f"{fns}:verifier",
                     "--output_dir", str(tmp_path / "cli"), *flags]) == 0
    api, by_cli = weights(result.run_dir), weights(tmp_path / "cli")
    assert api.keys() == by_cli.keys() and all(torch.equal(api[k], by_cli[k]) for k in api)


def test_bad_input_is_refused_before_any_model_is_loaded_and_an_earlier_run_is_kept(in_memory, tmp_path, monkeypatch):
    model, tokenizer, prompts, _ = in_memory
    with pytest.raises(UserInputError, match="'learning_rate' should be float"):
        rlhflab.GRPOTrainer(model=model, args=GRPOConfig(learning_rate="fast"))
    with pytest.raises(UserInputError, match="takes no 'completions'"):
        rlhflab.GRPOTrainer(model=model, reward_funcs=[lambda prompts, answers: [0.0]])
    with pytest.raises(UserInputError, match="trains whole weights only"):
        from peft import LoraConfig

        rlhflab.RewardTrainer(model="m", peft_config=LoraConfig(r=4))

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load_causal_lm", no_loading)
    missing = Dataset.from_list([{"question": "Add 1 and 1.", "answer": "2"}] * 8)
    trainer = rlhflab.GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[correct],
                                  train_dataset=missing, args=GRPOConfig(output_dir=str(tmp_path / "run"), **SETTINGS))
    with pytest.raises(UserInputError, match="train_dataset.*no valid prompts rows"):
        trainer.train()
    assert not (tmp_path / "run" / "inputs" / "train.parquet").exists()  # refused rows never took a place
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.yaml").write_text("an earlier run\n")
    trainer = rlhflab.GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[correct],
                                  train_dataset=prompts, args=GRPOConfig(output_dir=str(tmp_path / "old"), **SETTINGS))
    with pytest.raises(UserInputError, match="already holds a run"):
        trainer.train()
    assert [p.name for p in (tmp_path / "old").iterdir()] == ["config.yaml"]  # nothing written into it


def test_sft_from_a_list_of_dicts_with_callbacks_on_its_validation(in_memory, tmp_path):
    model, tokenizer, _, _ = in_memory
    rows = [{"prompt": ask(a), "completion": [{"role": "assistant", "content": str(2 * a)}]} for a in range(12)]
    seen = Seen()
    seen.on_evaluate = lambda metrics, step: seen.evaluations.append((step, metrics["val/loss"]))
    result = rlhflab.SFTTrainer(model=model, processing_class=tokenizer, train_dataset=rows[:8], eval_dataset=rows[8:],
                                callbacks=[seen], args=rlhflab.SFTConfig(
                                    output_dir=str(tmp_path / "sft"), max_steps=4, batch_size=4, eval_every=2,
                                    log_every=1, progress=False, write_report=False, threads=2)).train()
    assert [s for s, _ in seen.evaluations] == [2, 4] and seen.logs.count(3) == 1
    assert result.summary["validation"]["val/loss"] == seen.evaluations[-1][1]
    assert (result.run_dir / "inputs" / "train.jsonl").read_text().count("\n") == 8


def test_the_readme_python_example_runs_as_written(in_memory, tmp_path, monkeypatch, capsys):
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "docs" / "own-data.md").read_text()  # its "## Python API"
    block = readme.split("## Python API", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    model, tokenizer, _, _ = in_memory
    models.save_model_folder(tmp_path / "runs" / "sft" / "model", model, tokenizer)
    monkeypatch.chdir(tmp_path)
    small = "total_episodes=8, batch_size=4, num_generations=2, response_length=4, max_new_tokens=4, eval_prompts=4, " \
            "eval_every=0, progress=False, write_report=False, threads=2, "
    assert "GRPOConfig(total_episodes=1024, " in block  # the one setting made small here
    exec(block.replace("GRPOConfig(total_episodes=1024, ", f"GRPOConfig({small}"), {})
    printed = capsys.readouterr().out
    assert "'start':" in printed and str(Path("runs/grpo/model")) in printed


def test_an_api_run_resumes_on_its_own_inputs_and_refuses_other_rows(in_memory, tmp_path):
    model, tokenizer, prompts, _ = in_memory
    settings = dict(SETTINGS, save_every=1)
    first = rlhflab.GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[correct], train_dataset=prompts,
                                args=GRPOConfig(output_dir=str(tmp_path / "run"), **settings)).train()
    stored = (first.run_dir / "inputs" / "train.parquet").read_bytes()
    resume = dict(settings, resume=str(first.run_dir / "checkpoints" / "step-1"))  # no output_dir: the run's own
    other = prompts.select(range(8))
    with pytest.raises(UserInputError, match="other rows than the run being resumed"):
        rlhflab.GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[correct], train_dataset=other,
                            args=GRPOConfig(**resume)).train()
    assert (first.run_dir / "inputs" / "train.parquet").read_bytes() == stored  # the run's rows left as they were
    again = rlhflab.GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[correct], train_dataset=prompts,
                                args=GRPOConfig(**resume)).train()
    assert again.run_dir == first.run_dir and again.summary["resumes"][-1]["step"] == 1


def test_run_stage_and_the_verifier_are_checked(in_memory):
    model, _, _, _ = in_memory
    with pytest.raises(UserInputError, match="no training stage 'ppo2'"):
        rlhflab.run_stage("ppo2", PPOConfig())
    with pytest.raises(UserInputError, match="stage grpo takes a GRPOConfig, not a PPOConfig"):
        rlhflab.run_stage("grpo", PPOConfig())
    with pytest.raises(UserInputError, match="a verifier both in verifier= and in args.verifier"):
        rlhflab.GRPOTrainer(model=model, verifier=correct, args=GRPOConfig(verifier="mine.py:check"))
