"""Unknown flags and YAML keys that are TRL's names get their rlhflab counterpart (docs/coming-from-trl.md)."""

import re
import shlex
from pathlib import Path

import pytest
import yaml

from rlhflab.config import PPOConfig, STAGES, SFTConfig, field_names, parse_config
from rlhflab.errors import UserInputError
from rlhflab.trl_names import TRL_NAMES

README = Path(__file__).resolve().parents[2] / "docs" / "coming-from-trl.md"  # the docs' "Coming from TRL"


def error_of(stage: str, argv: list[str]) -> str:
    with pytest.raises(UserInputError) as err:
        parse_config(STAGES[stage], argv, prog=f"rlhflab {stage}")
    return str(err.value)


# TRL 1.12's PPO example flags (issue 13, item 6) whose rlhflab name differs, and what `rlhflab ppo` suggests
PPO_SUGGESTIONS = {
    "dataset_name": "train_file",
    "dataset_train_split": "dataset_split",
    "reward_funcs": "reward_fn",
    "reward_model_name_or_path": "reward_model",
    "sft_model_path": "model",
    "reward_model_path": "reward_model",
    "per_device_train_batch_size": "batch_size",
    "model_name_or_path": "model",
    "use_peft": "lora_r",
    "torch_dtype": "dtype",  # storage; TRL's --bf16 / --fp16 (compute) are fields here
    "num_sample_generations": "eval_every",
    "num_train_epochs": "total_episodes",
    "logging_steps": "log_every",
    "save_steps": "save_every",
}


@pytest.mark.parametrize(("trl", "ours"), sorted(PPO_SUGGESTIONS.items()))
def test_each_mapped_trl_flag_on_ppo_gets_its_counterpart(trl, ours):
    message = error_of("ppo", [f"--{trl}", "1"])
    assert f"unknown option '--{trl}'" in message
    assert f"did you mean --{ours}? (TRL's --{trl}" in message


def test_the_issue_example_reads_as_promised():
    assert error_of("ppo", ["--sft_model_path", "X"]) == (
        "rlhflab ppo: unknown option '--sft_model_path' -> did you mean --model? "
        "(TRL's --sft_model_path is rlhflab's --model)")


def test_a_computed_counterpart_explains_the_arithmetic():
    message = error_of("ppo", ["--per_device_train_batch_size", "16"])
    assert "did you mean --batch_size?" in message
    assert "per_device_train_batch_size x gradient_accumulation_steps x GPUs" in message
    assert "is rlhflab's --batch_size" not in message  # not a rename: the value changes


@pytest.mark.parametrize("trl", ["local_rollout_forward_batch_size", "stop_token"])
def test_a_trl_flag_without_counterpart_says_so_and_why(trl):
    message = error_of("ppo", [f"--{trl}", "1"])
    assert f"TRL's --{trl} has no rlhflab counterpart: {TRL_NAMES[trl].note}" in message
    assert "did you mean" not in message


@pytest.mark.parametrize("stage", ["sft", "rm", "dpo", "ppo", "grpo", "rloo", "reinforce", "online-dpo"])
def test_trls_gradient_checkpointing_is_a_field_of_every_training_stage(stage):
    """TRL's --gradient_checkpointing has the same name and meaning here (models/checkpointing.py): off unless given."""
    assert "gradient_checkpointing" not in TRL_NAMES
    parse = lambda argv: parse_config(STAGES[stage], argv, prog=f"rlhflab {stage}")  # noqa: E731
    assert parse(["--gradient_checkpointing", "true"]).gradient_checkpointing is True
    assert parse([]).gradient_checkpointing is False


@pytest.mark.parametrize("stage", ["sft", "rm", "dpo", "ppo", "grpo", "rloo", "reinforce", "online-dpo"])
def test_trls_bf16_and_fp16_are_fields_of_every_training_stage(stage):
    """TRL's --bf16 / --fp16 (accelerate's --mixed_precision) are fields here with TRL's meaning (autocast over
    float32 masters, models/precision.py), not hints; unset, the precision is chosen for the device (auto)."""
    assert not {"bf16", "fp16", "mixed_precision"} & set(TRL_NAMES)
    parse = lambda argv: parse_config(STAGES[stage], argv, prog=f"rlhflab {stage}")  # noqa: E731
    assert parse(["--bf16"]).bf16 is True and parse(["--fp16", "true"]).fp16 is True
    assert parse(["--mixed_precision", "no"]).mixed_precision == "no"
    default = parse([])
    assert (default.bf16, default.fp16, default.mixed_precision) == (False, False, "auto")


@pytest.mark.parametrize(("stage", "trl", "expected"), [
    ("sft", "dataset_name", "did you mean --train_file?"),
    ("sft", "dataset_train_split", "did you mean --dataset_split? (TRL's --dataset_train_split is rlhflab's "
                                   "--dataset_split)"),
    ("eval", "dataset_name", "did you mean --prompts_file?"),
    ("rm diagnose", "sft_model_path", "did you mean --policy?"),
    ("rm", "num_train_epochs", "did you mean --num_epochs?"),
    ("sft", "reward_model_path", "TRL's --reward_model_path is rlhflab's --reward_model, which this stage does "
                                 "not take (stages that do: ppo, grpo, rloo, reinforce, online-dpo, rm diagnose, compare)"),
])
def test_only_names_the_stage_has_are_suggested(stage, trl, expected):
    assert expected in error_of(stage, [f"--{trl}", "x"])


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_every_suggestion_on_every_stage_is_a_field_of_that_stage(stage):
    fields = field_names(STAGES[stage])
    for trl in set(TRL_NAMES) - set(fields):  # GRPO / RLOO have TRL's own `beta`
        message = error_of(stage, [f"--{trl}", "x"])
        suggested = re.findall(r"did you mean --(\w+)\?", message)
        assert len(suggested) <= 1 and set(suggested) <= set(fields), (trl, message)
        assert suggested or "no rlhflab counterpart" in message or "which this stage does not take" in message


def test_every_rlhflab_name_in_the_table_is_a_field_of_some_stage():
    every_field = {name for cls in STAGES.values() for name in field_names(cls)}
    missing = {(trl, f) for trl, c in TRL_NAMES.items() for f in c.fields if f not in every_field}
    assert not missing
    # a TRL name that is a field of every stage is never unknown: no entry needed (`beta` is GRPO's and RLOO's
    # own field, and PPO's kl_coef)
    every_stage = set.intersection(*(set(field_names(cls)) for cls in STAGES.values()))
    assert not set(TRL_NAMES) & every_stage
    assert {name for name in TRL_NAMES if name in every_field} == {"beta"}


def test_a_typo_that_is_no_trl_name_still_gets_the_closest_field():
    assert "did you mean 'num_ppo_epochs'?" in error_of("ppo", ["--num_ppo_epoch", "2"])


def test_dashes_and_equals_forms_are_recognised():
    assert "did you mean --model?" in error_of("ppo", ["--sft-model-path=EleutherAI/pythia-1b"])


def test_every_unknown_flag_is_reported_at_once_with_its_own_hint():
    message = error_of("ppo", ["--sft_model_path", "A", "--seed", "3", "--reward_model_path", "B", "--push_to_hub",
                               "--bf16", "--num_ppo_epoch", "2"])  # --bf16 is a field: not among them
    assert "unknown options '--sft_model_path', '--reward_model_path', '--push_to_hub', '--num_ppo_epoch'" in message
    lines = message.split("\n")[1:]
    assert [line.split(":")[0].strip() for line in lines] == [
        "--sft_model_path", "--reward_model_path", "--push_to_hub", "--num_ppo_epoch"]
    assert "did you mean --reward_model?" in lines[1] and "did you mean 'num_ppo_epochs'?" in lines[3]


def test_trl_names_as_yaml_keys(tmp_path):
    file = tmp_path / "trl.yaml"
    file.write_text(yaml.safe_dump({"sft_model_path": "m", "learning_rate": 3e-6, "per_device_train_batch_size": 8},
                                   sort_keys=False))
    with pytest.raises(UserInputError) as err:
        parse_config(PPOConfig, ["--config", str(file)], prog="rlhflab ppo")
    message = str(err.value)
    assert message.startswith(f"{file}: unknown config keys 'sft_model_path', 'per_device_train_batch_size'")
    assert "did you mean 'model'? (TRL's 'sft_model_path' is rlhflab's 'model')" in message
    assert "did you mean 'batch_size'?" in message


def test_one_trl_yaml_key_reads_like_one_flag(tmp_path):
    file = tmp_path / "trl.yaml"
    file.write_text("dataset_name: trl-lib/tldr\n")
    with pytest.raises(UserInputError, match=r"unknown config key 'dataset_name' -> did you mean 'train_file'\?"):
        parse_config(SFTConfig, ["--config", str(file)], prog="rlhflab sft")


def test_a_trl_style_list_value_names_the_flag_before_it():
    message = error_of("ppo", ["--lora_r", "8", "--lora_target_modules", "q_proj", "v_proj"])
    assert "unexpected value 'v_proj' after --lora_target_modules" in message
    assert "--lora_target_modules q_proj,v_proj" in message


def test_the_cli_exits_2_with_the_hint(capsys):
    from rlhflab.cli import main

    assert main(["ppo", "--sft_model_path", "EleutherAI/pythia-1b-deduped"]) == 2
    assert "did you mean --model? (TRL's --sft_model_path is rlhflab's --model)" in capsys.readouterr().err


# --- docs/coming-from-trl.md: the two commands of "One command, both ways" ----------------------------------


def readme_commands() -> list[list[str]]:
    text = README.read_text()
    section = text[text.index("### One command, both ways"):]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)[:2]
    return [shlex.split(block.replace("\\\n", " ")) for block in blocks]


def test_readme_trl_command_gets_a_hint_for_each_trl_only_flag():
    trl, _ = readme_commands()
    assert trl[:2] == ["python", "examples/scripts/ppo/ppo.py"]
    message = error_of("ppo", trl[2:])
    trl_only = [t for t in trl[2:] if t.startswith("--") and t[2:] not in field_names(PPOConfig)]
    assert trl_only == ["--dataset_name", "--dataset_train_split", "--model_name_or_path", "--sft_model_path",
                        "--reward_model_path", "--per_device_train_batch_size", "--local_rollout_forward_batch_size",
                        "--stop_token"]
    hints = message.split("\n")[1:]
    assert [line.split(": ")[0].strip() for line in hints] == trl_only
    assert sum("did you mean" in line for line in hints) >= 5


def test_readme_rlhflab_command_parses_to_trls_numbers():
    _, ours = readme_commands()
    assert ours[:2] == ["rlhflab", "ppo"]
    cfg = parse_config(PPOConfig, ours[2:], prog="rlhflab ppo")
    per_device, accumulation, gpus, total = 16, 4, 1, 10000  # the README's TRL command
    trl_batch = per_device * accumulation * gpus
    assert cfg.batch_size == trl_batch
    assert cfg.batch_size // cfg.num_mini_batches // cfg.gradient_accumulation_steps == per_device  # micro-batch
    assert cfg.total_episodes // cfg.batch_size == -(-total // trl_batch) == 157  # TRL rounds the updates up
    assert (cfg.num_ppo_epochs, cfg.learning_rate, cfg.missing_eos_penalty) == (4, 3e-6, 1.0)
    assert (cfg.temperature, cfg.response_length, cfg.adam_beta2, cfg.adam_eps) == (0.7, 53, 0.999, 1e-8)
    assert cfg.value_mode == "separate" and cfg.value_model == cfg.reward_model == cfg.model
    assert (cfg.train_file, cfg.dataset_split) == ("trl-internal-testing/descriptiveness-sentiment-trl-style",
                                                   "descriptiveness")
