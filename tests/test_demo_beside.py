"""A stage run in a second process (demo/beside.py): its config goes through YAML, its failure is reported
with the log's tail and where the log is, and leaving its block early stops it."""

import pytest

from rlhflab.config import PPOConfig, read_yaml_config
from rlhflab.demo.beside import StageBeside
from rlhflab.errors import StageFailed


def test_a_failing_stage_names_its_log_and_exit_code(tmp_path):
    cfg = PPOConfig(model=str(tmp_path / "no-such-model"), output_dir=str(tmp_path / "ppo"), threads=1,
                    progress=False)
    with StageBeside("ppo", cfg, tmp_path / "ppo.log") as beside:
        assert read_yaml_config(str(tmp_path / "ppo.yaml"), PPOConfig)["model"] == cfg.model  # what the child ran
        with pytest.raises(StageFailed) as err:
            beside.wait()
    message = str(err.value)
    assert str(tmp_path / "ppo.log") in message and "exit code 2" in message and "--stages_side_by_side false" in message
    assert "no-such-model" in (tmp_path / "ppo.log").read_text() and beside.cpu_seconds > 0


def test_a_stage_failing_in_several_processes_names_its_log_and_the_one_process_flag(tmp_path):
    from rlhflab.config import SFTConfig

    cfg = SFTConfig(model=str(tmp_path / "no-such-model"), output_dir=str(tmp_path / "sft"), threads=1, progress=False)
    with StageBeside("sft", cfg, tmp_path / "sft.log", processes=2) as beside:
        with pytest.raises(StageFailed) as err:
            beside.wait()
    message = str(err.value)
    assert "in 2 processes" in message and "--stage_processes 1" in message and str(tmp_path / "sft.log") in message
    assert "no-such-model" in (tmp_path / "sft.log").read_text() and not (tmp_path / "sft").exists()


def test_leaving_the_block_early_stops_the_child(tmp_path):
    import signal
    import time

    from rlhflab.config import DemoConfig

    cfg = DemoConfig(output_dir=str(tmp_path / "demo"), threads=1, progress=False)  # minutes of work if left alone
    with pytest.raises(RuntimeError, match="failing here"):
        with StageBeside("demo", cfg, tmp_path / "demo.log") as beside:
            time.sleep(0.2)
            raise RuntimeError("failing here")
    assert beside.process.returncode == -signal.SIGTERM  # stopped by the block's exit, and reaped
