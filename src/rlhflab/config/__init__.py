"""One frozen config dataclass per stage, built from small shared parts.

Every stage config is a flat dataclass assembled by inheritance from the parts
below (model, data, optimiser, generation, run), so a YAML file's keys are the
field names and `--field value` flags override them. Parsing goes through
`transformers.HfArgumentParser`, as TRL users know it; see `parse_config`.

Parts: `fields` (the shared field groups), `online` (PPO, GRPO, RLOO, REINFORCE, online DPO), `stages` (every
other stage and the STAGES table), `parsing` (YAML and flags).
"""

from rlhflab.config.fields import (  # noqa: F401
    arg, RunFields, LoadFields, ModelFields, TinyModelFields, SuiteFields, DatasetFields, DataFields,
    PromptFileFields, RewardFunctionFields, OptimFields, GenerationFields, GenerationBackendFields, CheckpointFields,
    LoraFields, MonitorFields, ParallelFields, RewardCallFields,
)
from rlhflab.config.online import (  # noqa: F401
    OnlineFields, PPOConfig, GroupFields, GRPOConfig, RLOOConfig, REINFORCEConfig, OnlineDPOConfig,
)
from rlhflab.config.stages import (  # noqa: F401
    SFTConfig, EvalConfig, TasksExportConfig, RMConfig, RMDiagnoseConfig, DemoConfig, DPOConfig, CompareConfig,
    ReportConfig, COMPARE_METHODS, COMPARE_VARIANTS, STAGES,
)
from rlhflab.config.parsing import (  # noqa: F401
    field_names, read_yaml_config, check_values, build_parser, parse_config, config_to_dict, write_config,
)
