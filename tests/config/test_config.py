import dataclasses
from pathlib import Path

import pytest
import yaml

from rlhflab.config import EvalConfig, RMConfig, SFTConfig, STAGES, build_parser, parse_config
from rlhflab.errors import UserInputError


def test_defaults_then_yaml_then_cli(tmp_path):
    file = tmp_path / "sft.yaml"
    file.write_text(yaml.safe_dump({"learning_rate": 0.01, "max_steps": 7, "batch_size": 3}))
    cfg = parse_config(SFTConfig, ["--config", str(file), "--max_steps", "9"], prog="rlhflab sft")
    assert cfg.learning_rate == 0.01  # from YAML
    assert cfg.max_steps == 9  # CLI beats YAML
    assert cfg.batch_size == 3  # YAML beats default
    assert cfg.warmup_steps == SFTConfig().warmup_steps  # default kept


def test_cli_order_does_not_matter_for_config_flag(tmp_path):
    file = tmp_path / "sft.yaml"
    file.write_text("max_steps: 7\n")
    cfg = parse_config(SFTConfig, ["--max_steps", "11", "--config", str(file)], prog="rlhflab sft")
    assert cfg.max_steps == 11


def test_unknown_yaml_key_suggests_the_closest(tmp_path):
    file = tmp_path / "sft.yaml"
    file.write_text("learning_rte: 0.1\n")
    with pytest.raises(UserInputError) as err:
        parse_config(SFTConfig, ["--config", str(file)], prog="rlhflab sft")
    assert "learning_rte" in str(err.value) and "did you mean 'learning_rate'" in str(err.value)
    assert str(file) in str(err.value)


def test_unknown_cli_flag_suggests_the_closest():
    with pytest.raises(UserInputError) as err:
        parse_config(SFTConfig, ["--max_step", "3"], prog="rlhflab sft")
    assert "did you mean 'max_steps'" in str(err.value)


def test_abbreviated_flags_are_not_accepted():
    with pytest.raises(UserInputError):
        parse_config(SFTConfig, ["--learning", "0.1"], prog="rlhflab sft")


def test_yaml_value_of_wrong_type_is_an_error(tmp_path):
    file = tmp_path / "sft.yaml"
    file.write_text("max_steps: many\n")
    with pytest.raises(UserInputError) as err:
        parse_config(SFTConfig, ["--config", str(file)], prog="rlhflab sft")
    assert "max_steps" in str(err.value) and "int" in str(err.value)


def test_yaml_int_is_accepted_for_float_and_literal_checked(tmp_path):
    file = tmp_path / "sft.yaml"
    file.write_text("learning_rate: 1\nlr_schedule: linear\n")
    cfg = parse_config(SFTConfig, ["--config", str(file)], prog="rlhflab sft")
    assert cfg.learning_rate == 1.0 and isinstance(cfg.learning_rate, float)
    file.write_text("lr_schedule: exponential\n")
    with pytest.raises(UserInputError):
        parse_config(SFTConfig, ["--config", str(file)], prog="rlhflab sft")


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(UserInputError) as err:
        parse_config(SFTConfig, ["--config", str(tmp_path / "nope.yaml")], prog="rlhflab sft")
    assert "nope.yaml" in str(err.value)


def test_bool_flags_and_out_alias():
    cfg = parse_config(EvalConfig, ["--do_sample", "--out", "x", "--progress", "false"], prog="rlhflab eval")
    assert cfg.do_sample is True and cfg.output_dir == "x" and cfg.progress is False


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SFTConfig().max_steps = 3


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_help_lists_every_field_with_its_help(stage):
    text = build_parser(STAGES[stage], prog=f"rlhflab {stage}").format_help()
    for field in dataclasses.fields(STAGES[stage]):
        assert f"--{field.name}" in text
        assert field.metadata.get("help"), f"{stage}.{field.name} has no help"
    assert "(default:" in text


def test_yaml_scientific_notation_without_dot_is_a_float(tmp_path):
    file = tmp_path / "sft.yaml"
    file.write_text("learning_rate: 1e-4\n")  # PyYAML reads this as the string '1e-4'
    assert parse_config(SFTConfig, ["--config", str(file)], prog="rlhflab sft").learning_rate == 1e-4


@pytest.mark.parametrize(("name", "stage"), [
    ("sft_tiny", "sft"), ("sft", "sft"), ("eval", "eval"), ("demo", "demo"),
    ("ppo_tiny", "ppo"), ("ppo_lora", "ppo"), ("rm_tiny", "rm"), ("rm_deep", "rm"),
    ("rm_shallow", "rm"),
])
def test_shipped_config_files_parse(name, stage):
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / f"{name}.yaml"
    cfg = parse_config(STAGES[stage], ["--config", str(path)], prog=f"rlhflab {stage}")
    assert dataclasses.is_dataclass(cfg)


def test_every_shipped_config_file_is_tested():
    from pathlib import Path

    shipped = {p.stem for p in (Path(__file__).resolve().parents[2] / "configs").glob("*.yaml")}
    assert shipped == {"sft_tiny", "sft", "eval", "demo", "ppo_tiny", "ppo_lora", "rm_tiny", "rm_deep",
                       "rm_shallow"}


def test_a_no_flag_says_it_turns_the_option_off_and_keeps_the_default():
    help_text = " ".join(build_parser(RMConfig, "rlhflab rm").format_help().split())
    assert "--no_shared_prefix, --no-shared-prefix turn shared_prefix off" in help_text
    assert parse_config(RMConfig, [], "rlhflab rm").shared_prefix is True
    assert parse_config(RMConfig, ["--no_shared_prefix"], "rlhflab rm").shared_prefix is False


def test_the_deep_reward_model_file_sets_the_recipe_the_readme_measured():
    path = Path(__file__).resolve().parents[2] / "configs" / "rm_deep.yaml"
    cfg = parse_config(RMConfig, ["--config", str(path), "--model", "m"], prog="rlhflab rm")
    assert (cfg.extra_layers, cfg.pair_prompts, cfg.num_epochs, cfg.batch_size) == (2, 9600, 1, 64)
    assert (cfg.learning_rate, cfg.hard_negatives, cfg.calibration_coef, cfg.frozen_layers) == (6e-4, 2, 3.0, 0)


def test_the_demo_config_file_spells_out_the_demos_defaults():
    from rlhflab.config import DemoConfig

    path = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
    assert parse_config(DemoConfig, ["--config", str(path)], prog="rlhflab demo") == DemoConfig()


def recipe_of(demo_cfg) -> dict:
    from rlhflab.demo import rm_stage_config

    rm = rm_stage_config(demo_cfg, "m", "out")
    return {f: getattr(rm, f) for f in ("extra_layers", "pair_prompts", "num_epochs", "batch_size", "learning_rate",
                                        "pairs_per_prompt", "pair_kinds_always", "hard_negatives",
                                        "calibration_coef", "center_rewards_coef", "prompt_rows_together",
                                        "near_misses", "frozen_layers")}


def test_the_demo_trains_the_deep_recipe_by_default_and_the_shallow_file_is_its_earlier_one():
    from rlhflab.config import DemoConfig

    configs = Path(__file__).resolve().parents[2] / "configs"
    default = recipe_of(DemoConfig())
    assert default == recipe_of(DemoConfig(rm_config=str(configs / "rm_deep.yaml")))
    assert (default["extra_layers"], default["pair_prompts"], default["num_epochs"]) == (2, 9600, 1)
    shallow = recipe_of(DemoConfig(rm_config=str(configs / "rm_shallow.yaml")))
    assert shallow == {**default, "extra_layers": 0, "pair_prompts": 2400, "num_epochs": 3}


def test_the_split_that_chose_the_reward_model_recipe_is_recorded_only_for_an_unchanged_chosen_recipe(tmp_path):
    from rlhflab.config import DemoConfig
    from rlhflab.demo import recipe_chosen_on

    deep = str(Path(__file__).resolve().parents[2] / "configs" / "rm_deep.yaml")
    assert recipe_chosen_on(DemoConfig()) == "validation"  # the demo's own recipe
    assert recipe_chosen_on(DemoConfig(rm_config=deep)) == "validation"  # the file says so
    assert recipe_chosen_on(DemoConfig(rm_epochs=5)) is None
    assert recipe_chosen_on(DemoConfig(rm_config=deep, rm_near_misses=2)) is None  # a flag the file does not set
    unstated = tmp_path / "mine.yaml"
    unstated.write_text("extra_layers: 1\n")
    assert recipe_chosen_on(DemoConfig(rm_config=str(unstated))) is None
