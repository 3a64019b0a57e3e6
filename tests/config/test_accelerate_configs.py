"""configs/accelerate/*.yaml are what `accelerate launch --config_file` accepts, and they start the strategy
their name says: parsed by accelerate's own config loader, run through its own launch validation and the
environment it hands to the processes, which rlhflab.parallel's `auto` strategy reads."""

from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

from rlhflab.parallel import World, resolve_strategy

FOLDER = Path(__file__).resolve().parents[2] / "configs" / "accelerate"
EXPECTED = {"ddp.yaml": ("MULTI_GPU", "ddp"), "fsdp2.yaml": ("FSDP", "fsdp2"), "zero3.yaml": ("DEEPSPEED", "deepspeed")}


def launch_environment(path: Path) -> dict:
    """The environment `accelerate launch --config_file PATH -m rlhflab ppo` gives each process (no launch)."""
    args = launch_command_parser().parse_args(["--config_file", str(path), "-m", "rlhflab", "ppo"])
    args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    if not args.use_deepspeed:
        return prepare_multi_gpu_env(args)
    fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mixed_precision_from_config else [])
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)  # as accelerate's launch_command sets it
    return prepare_deepspeed_cmd_env(args)[1]


def test_every_shipped_accelerate_config_is_tested():
    assert sorted(p.name for p in FOLDER.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_accelerate_loads_the_config_and_launches_the_strategy_it_names(name, monkeypatch):
    config = load_config_from_file(str(FOLDER / name))
    distributed_type, strategy = EXPECTED[name]
    assert config.distributed_type.value == distributed_type
    assert config.num_processes == 8 and config.num_machines == 1 and config.mixed_precision == "no"
    env = launch_environment(FOLDER / name)
    if name == "fsdp2.yaml":
        assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
        assert env["FSDP_AUTO_WRAP_POLICY"] == "TRANSFORMER_BASED_WRAP" and env["FSDP_RESHARD_AFTER_FORWARD"] == "true"
    if name == "zero3.yaml":
        assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    for key in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(key, raising=False)
        if key in env:
            monkeypatch.setenv(key, env[key])
    assert resolve_strategy("auto", World(rank=0, world_size=2)) == strategy
