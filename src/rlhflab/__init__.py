"""rlhflab: PPO-based RLHF with honest evaluation.

From Python (rlhflab.api; docs/own-data.md "Python API"):

    from rlhflab import GRPOConfig, GRPOTrainer
    result = GRPOTrainer(model="runs/sft/model", reward_funcs=[my_reward], train_dataset=rows,
                         args=GRPOConfig(output_dir="runs/grpo")).train()

The names below are imported on first use, so `import rlhflab` stays light (the CLI starts without torch).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> (module, attribute)
_EXPORTS = {
    **{name: ("rlhflab.config", name) for name in (
        "SFTConfig", "PPOConfig", "GRPOConfig", "RLOOConfig", "DPOConfig", "OnlineDPOConfig", "EvalConfig",
        "RMDiagnoseConfig", "CompareConfig", "RMConfig", "REINFORCEConfig")},
    "RewardConfig": ("rlhflab.config", "RMConfig"),  # TRL's name
    "ReinforceConfig": ("rlhflab.config", "REINFORCEConfig"),
    **{name: ("rlhflab.api", name) for name in (
        "SFTTrainer", "RewardTrainer", "PPOTrainer", "GRPOTrainer", "RLOOTrainer", "ReinforceTrainer", "DPOTrainer",
        "OnlineDPOTrainer", "compare_methods", "diagnose", "evaluate", "write_report", "run_stage")},
    "Callback": ("rlhflab.callbacks", "Callback"),
    "RunResult": ("rlhflab.tracking", "RunResult"),
    "UserInputError": ("rlhflab.errors", "UserInputError"),
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rlhflab' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return __all__
