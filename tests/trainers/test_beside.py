"""A stage run in a second process (trainers/beside.py): its config goes through YAML, its failure is reported
with the log's tail and where the log is."""

import pytest

from rlhflab.config import PPOConfig, read_yaml_config
from rlhflab.errors import UserInputError
from rlhflab.trainers.beside import StageBeside


def test_a_failing_stage_names_its_log_and_exit_code(tmp_path):
    cfg = PPOConfig(model=str(tmp_path / "no-such-model"), output_dir=str(tmp_path / "ppo"), threads=1,
                    progress=False)
    beside = StageBeside("ppo", cfg, tmp_path / "ppo.log")
    assert read_yaml_config(str(tmp_path / "ppo.yaml"), PPOConfig)["model"] == cfg.model  # what the child ran
    with pytest.raises(UserInputError) as err:
        beside.wait()
    assert str(tmp_path / "ppo.log") in str(err.value) and "exit code" in str(err.value)
    assert "no-such-model" in (tmp_path / "ppo.log").read_text()
