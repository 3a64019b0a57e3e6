"""The online methods' configs: what PPO, GRPO, RLOO, REINFORCE and online DPO share, and each one's own fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlhflab.config.fields import (CheckpointFields, GenerationBackendFields, GenerationFields, LoraFields, ModelFields,
                                   MonitorFields, OptimFields, ParallelFields, PrecisionFields, PromptFileFields,
                                   RewardFunctionFields, RunFields, SuiteFields, arg)


@dataclass(frozen=True)
class LengthShapingFields:
    """What a response that runs long costs (docs/grpo-rloo-reinforce.md "Long responses"): every online method."""

    mask_truncated_completions: bool = arg(
        False, "leave the responses that hit response_length without EOS out of the loss (TRL's name; DAPO's "
               "overlong filtering): no gradient of their own, not in the loss's token or response counts; their "
               "scores stay in their group's baseline and the update's statistics (TRL does the same), so their "
               "siblings' advantages are the ones without masking; counted in completions/masked_truncated. Not "
               "for online DPO")
    overlong_buffer_len: int = arg(
        0, "DAPO's soft overlong punishment: a response longer than response_length - overlong_buffer_len tokens "
           "(EOS included) loses overlong_penalty_factor x (length - (response_length - overlong_buffer_len)) / "
           "overlong_buffer_len from its score, on top of missing_eos_penalty when it has no EOS; 0 = off")
    overlong_penalty_factor: float = arg(1.0, "the overlong penalty at response_length (DAPO's 1.0)")


@dataclass(frozen=True)
class OnlineFields(ParallelFields, MonitorFields, CheckpointFields, RunFields, ModelFields, SuiteFields,
                   PromptFileFields, RewardFunctionFields, LoraFields, OptimFields, PrecisionFields,
                   GenerationBackendFields, GenerationFields, LengthShapingFields):
    """What every online method (PPO, GRPO, RLOO, REINFORCE, online DPO) shares: the roles, the reward,
    the rollout cycle, evaluation during the run (trainers/online/loop.py)."""

    # the roles
    reference: str = arg("", "reference model folder; empty = the policy's starting weights")
    reward: Literal["auto", "checker", "model", "combined", "random"] = arg(
        "auto", "reward source: auto = the reward model and/or --reward_fn functions when given, else the suite's "
                "checker; checker / model / combined (checker + model) / random; --reward_fn adds to any of them")
    reward_model: str = arg("", "reward model folder (sequence classifier with one output)")
    checker_weight: float = arg(1.0, "weight of the checker reward in reward=combined")
    reward_model_weight: float = arg(1.0, "weight of the reward model in reward=combined")
    reward_shift: float = arg(0.0, "reward-model scores are (score - shift) / scale")
    reward_scale: float = arg(1.0, "reward-model scores are (score - shift) / scale")
    normalize_reward: bool = arg(False, "set shift/scale so the starting policy's answers score mean 0, std 1")
    calibration_prompts: int = arg(64, "train prompts answered by the starting policy to normalise the reward model")
    reference_mode: Literal["resident", "reload"] = arg(
        "resident", "keep a reference copy in memory, or reload it for each rollout's log-probs and free it")
    reward_model_mode: Literal["resident", "reload"] = arg(
        "resident", "keep the reward model in memory, or reload it for each rollout's scores and free it")
    lora_merge_generation: bool = arg(
        False, "LoRA: sample rollouts with the adapter merged into temporary weight copies (somewhat faster "
               "decoding; costs one extra copy of the adapted weights while generating; originals restored bit for bit)")
    reuse_rollout_forward: bool = arg(
        True, "with one minibatch of one micro-batch: keep the rollout's policy forward (with its autograd graph) "
              "as the first training step's forward instead of repeating it (its activations stay alive during scoring)")
    sampler_correction: Literal["auto", "none", "token_truncate", "token_mask", "sequence_truncate",
                                "sequence_mask"] = arg(
        "auto", "importance weights trainer / sampler probability on each token's policy-gradient term (TRL's "
                "vllm_importance_sampling_mode): per token or per response, clamped to [sampler_correction_min, "
                "sampler_correction_max] (truncate) or dropped outside it (mask); none = off; auto = token_truncate "
                "with vllm or async_generation, none with lean and hf (they agree with the trainer to ~1e-7 in "
                "float32: sampler/* metrics)")
    sampler_correction_min: float = arg(0.0, "lower bound of the sampler-correction weights")
    sampler_correction_max: float = arg(3.0, "upper bound of the sampler-correction weights (TRL: 3.0)")
    mmap_threshold_mib: int = arg(
        0, "CPU memory (glibc): allocations of at least this many MiB are mmapped and handed back to the OS when "
           "freed, which lowers peak RSS for big models (1 at ~25M parameters, 4 at 0.5B); 0 = malloc's default")
    async_generation: bool = arg(
        False, "sample the next rollouts in a second process while this one trains, with weights at most "
               "--max_staleness updates old (docs/scaling-out.md \"Asynchronous generation\"); one process only, lean / hf backends")
    max_staleness: int = arg(1, "async_generation: a rollout trained in update u was sampled with the weights of "
                                "update u - 1 - max_staleness (0 = the synchronous loop's, in another process)")
    generator_threads: int = arg(1, "async_generation: torch CPU threads of the generating process (the trainer "
                                    "keeps --threads, whose 0 = all cores: the generator samples for part of each "
                                    "update only)")
    # the cycle
    total_episodes: int = arg(3840, "responses generated over the run")
    max_seconds: float = arg(0.0, "stop after this many seconds of the run's cycle (updates and evaluations, not "
                                  "loading); 0 = no limit (rlhflab compare's wall-time budget)")
    batch_size: int = arg(64, "responses per rollout (one update); with num_generations k: batch_size / k prompts")
    num_mini_batches: int = arg(1, "minibatches (optimiser steps) each rollout is split into per pass")
    response_length: int = arg(26, "response-length cap in tokens during rollouts")
    missing_eos_penalty: float = arg(1.0, "subtracted from the score of a response that hit the length cap")
    temperature: float = arg(1.0, "sampling temperature of rollouts; log-probs use the same one")
    dynamic_sampling: bool = arg(
        False, "DAPO's dynamic sampling (GRPO, RLOO, online DPO, REINFORCE with leave_one_out): groups whose scores "
               "are all equal carry no group-relative signal and are dropped; the batch is refilled with the next "
               "prompts of the same order until it holds batch_size / num_generations informative groups or "
               "max_refill_rounds extra rounds were generated (then it is filled with the earliest dropped groups)")
    max_refill_rounds: int = arg(3, "dynamic_sampling: extra generation rounds (of batch_size answers each) at most "
                                    "per update")
    filter_prompts: Literal["none", "pass_rate"] = arg(
        "none", "before RL, answer every train prompt filter_samples times with the starting policy at the rollout "
                "temperature and drop the prompts whose verified pass rate is <= filter_low or >= filter_high "
                "(never / always solved: all-equal groups); the probe's answers are counted in summary.json")
    filter_samples: int = arg(8, "filter_prompts: answers sampled per train prompt")
    filter_low: float = arg(0.0, "filter_prompts: drop prompts whose pass rate is at or below this")
    filter_high: float = arg(1.0, "filter_prompts: drop prompts whose pass rate is at or above this")
    # evaluation during the run
    eval_every: int = arg(10, "validation pass rate every N updates; 0 = start and end only")
    eval_prompts: int = arg(100, "validation prompts used for the pass rate")
    sample_prompts: int = arg(8, "fixed validation prompts whose answers go to samples.jsonl at each evaluation")
    save_every: int = arg(20, "write RUN/checkpoints/step-N every N updates and at the end; 0 = only at the end; -1 = "
                                "none (only on SIGINT / SIGTERM)")
    console_samples: int = arg(4, "answers to the first N fixed validation prompts logged as a table (prompt, "
                                  "answer, pass/fail) at each evaluation; 0 = off")
    headroom_samples: int = arg(
        8, "headroom probe of the starting policy before the first update: answers sampled per validation prompt at "
           "the rollout temperature; per family greedy pass@1, sampled pass@1 and pass@k to RUN/headroom.json and "
           "the report (a family no sample passes has nothing for RL to reinforce); 0 = off")
    headroom_prompts: int = arg(0, "validation prompts the headroom probe reads; 0 = the eval_prompts ones")
    # RL optimiser defaults (FACTS.md: lr 3e-4 or 4 epochs blew PPO's KL up)
    learning_rate: float = arg(1e-4, "peak AdamW learning rate")
    adam_eps: float = arg(1e-5, "AdamW epsilon")
    warmup_steps: int = arg(0, "linear warmup in optimiser steps")
    lr_schedule: Literal["cosine", "linear", "constant"] = arg("linear", "decay after warmup")


@dataclass(frozen=True)
class EntropyFields:
    """The policy's entropy in the loss (TRL's GRPO names): PPO, GRPO, RLOO, REINFORCE."""

    entropy_coef: float = arg(
        0.0, "entropy bonus: the loss less entropy_coef x the mean token entropy of the policy over the step's "
             "trained tokens, the same meaning for every loss_type (TRL's name); with use_adaptive_entropy its "
             "starting value; 0 = off")
    use_adaptive_entropy: bool = arg(
        False, "Skywork-OR1's adaptive entropy control (TRL's name): at each update the coefficient goes up by "
               "entropy_coef_delta when the rollout's mean token entropy is at or below entropy_target, down "
               "otherwise, within [entropy_coef_min, entropy_coef_max]; the bonus applies only at or below the target")
    entropy_target: float = arg(
        0.2, "use_adaptive_entropy: the mean token entropy (nats) to hold, over the tokens the policy loss trains "
             "(the top_entropy_quantile ones when set); set it near the start's `entropy` metric",
        aliases=["--target_entropy"])
    entropy_coef_delta: float = arg(0.005, "use_adaptive_entropy: the coefficient's step per update")
    entropy_coef_min: float = arg(0.0, "use_adaptive_entropy: lower bound of the coefficient")
    entropy_coef_max: float = arg(1.0, "use_adaptive_entropy: upper bound of the coefficient")
    top_entropy_quantile: float = arg(
        1.0, "rho of Beyond the 80/20 Rule (TRL's name): the policy-gradient term (and the entropy bonus) only on "
             "the update's tokens whose entropy is in its top rho share (the rollout's entropies, over the tokens "
             "the loss trains); 1.0 = every token, 0.0 = the highest-entropy one only; the paper uses 0.2")


@dataclass(frozen=True)
class PPOConfig(EntropyFields, OnlineFields):
    """`rlhflab ppo`: PPO-RLHF with policy, reference, reward and value roles."""

    value_mode: Literal["shared", "separate", "lora_adapter"] = arg(
        "shared", "value head on the policy trunk, a separate value model, or a 2nd LoRA adapter on the shared base")
    value_model: str = arg("", "value model init for value_mode=separate; empty = the policy (a reward model also works)")
    value_step: Literal["joint", "after_policy"] = arg(
        "joint", "value_mode=separate, one process: one AdamW step over policy and value model, their gradients "
                 "clipped together (TRL), or the policy's step and then the value model's, each clipped on its own "
                 "(OpenRLHF, veRL), so only one model's gradients are held at a time; with max_grad_norm 0 the same "
                 "update (value warm-up rollouts then skip the policy's step)")
    batch_size: int = arg(64, "prompts per rollout (one PPO update), one response each")
    num_mini_batches: int = arg(2, "minibatches each rollout is split into per PPO epoch")
    num_ppo_epochs: int = arg(2, "passes over each rollout")
    cliprange: float = arg(0.2, "policy ratio clip epsilon")
    cliprange_value: float = arg(0.2, "value clip epsilon around the rollout's values")
    # the critic's defaults: issue 16 (demo PPO: a value head at the policy's 1e-4 never left
    # explained variance ~0; these three took it to ~0.2 at the same validation gain and ~30 % less KL)
    vf_coef: float = arg(0.5, "weight of the value loss (TRL: 0.1)")
    value_head_learning_rate: float = arg(3e-3, "AdamW learning rate of the scalar value head (the critic's trunk, "
                                               "shared or its own, keeps learning_rate); 0 = learning_rate")
    value_warmup_rollouts: int = arg(2, "the first N rollouts train the critic only (no policy loss; OpenRLHF's "
                                        "freezing_actor_steps); their episodes count towards total_episodes")
    kl_coef: float = arg(0.05, "beta: per-token KL penalty in the reward (initial value if adaptive)")
    kl_estimator: Literal["k1", "k2", "k3"] = arg("k1", "per-token KL estimator in the reward")
    adaptive_kl: bool = arg(False, "adapt kl_coef towards kl_target (Ziegler et al. 2019)")
    kl_target: float = arg(6.0, "adaptive KL: target KL per sequence (nats)")
    kl_horizon: int = arg(10000, "adaptive KL: horizon in episodes")
    gamma: float = arg(1.0, "discount")
    lam: float = arg(0.95, "GAE lambda")
    whiten_rewards: bool = arg(False, "whiten per-token rewards before GAE")
    whiten_advantages: bool = arg(True, "whiten advantages over the rollout")


@dataclass(frozen=True)
class GroupFields:
    """k samples per prompt and a clipped ratio: what GRPO and RLOO share (TRL's names)."""

    num_generations: int = arg(4, "responses sampled per prompt (the group); batch_size must be a multiple of it")
    num_iterations: int = arg(1, "mu: optimisation passes over each rollout (> 1 makes the clipped ratio matter)")
    epsilon: float = arg(0.2, "clip: the ratio is kept within [1 - epsilon, 1 + epsilon_high]")
    epsilon_high: float = arg(0.0, "upper clip; 0 = epsilon (DAPO's clip-higher: 0.28)")


@dataclass(frozen=True)
class GRPOConfig(EntropyFields, GroupFields, OnlineFields):
    """`rlhflab grpo`: group-relative policy optimisation, no critic (Shao et al. 2024), with TRL's variants."""

    beta: float = arg(0.04, "KL coefficient to the reference: a k3 loss term, or with kl_in_reward a penalty in the reward")
    kl_in_reward: bool = arg(False, "subtract beta * the sequence KL (k1) from the reward instead of a KL loss term")
    scale_rewards: Literal["group", "batch", "none"] = arg(
        "group", "divide centred rewards by the group's std, the batch's std, or not at all (Dr. GRPO)")
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = arg(
        "dapo", "token aggregation: grpo = mean per response then over responses; bnpo = over the minibatch's tokens; "
                "dr_grpo = sum / (responses x response_length); dapo = over the whole rollout's tokens")
    importance_sampling_level: Literal["token", "sequence"] = arg(
        "token", "ratio per token, or one per response from its mean log-ratio (GSPO)")


@dataclass(frozen=True)
class RLOOConfig(EntropyFields, GroupFields, OnlineFields):
    """`rlhflab rloo`: REINFORCE leave-one-out with k samples per prompt (Ahmadian et al. 2024)."""

    num_iterations: int = arg(2, "passes over each rollout (FACTS.md: 2 worked on the suite)")
    beta: float = arg(0.05, "KL coefficient: beta * the sequence KL (k1) is subtracted from each response's reward")
    normalize_advantages: bool = arg(False, "whiten the leave-one-out advantages over the rollout")


@dataclass(frozen=True)
class REINFORCEConfig(EntropyFields, OnlineFields):
    """`rlhflab reinforce`: the policy gradient with a baseline (Williams 1992), no critic, no clipping."""

    baseline: Literal["batch_mean", "moving_average", "leave_one_out"] = arg(
        "batch_mean", "what is subtracted from each return: the batch's mean score, a moving average of past "
                      "batches' means, or the mean of the prompt's other samples (needs num_generations >= 2)")
    baseline_decay: float = arg(0.9, "moving_average: weight of the old average at each update")
    num_generations: int = arg(1, "responses sampled per prompt; batch_size must be a multiple of it")
    kl_coef: float = arg(0.05, "per-token KL penalty -kl_coef * KL_t in the reward (reward-to-go); 0 = off")
    normalize_advantages: bool = arg(False, "whiten the advantages over the rollout")


@dataclass(frozen=True)
class OnlineDPOConfig(OnlineFields):
    """`rlhflab online-dpo`: iterative on-policy DPO (Guo et al. 2024): sample k answers per prompt from the
    current policy, rank them with the reward (model, functions or the checker), train on best vs worst."""

    num_generations: int = arg(4, "answers sampled per prompt; the best and the worst make one pair")
    num_iterations: int = arg(1, "passes over each rollout's pairs")
    beta: float = arg(0.1, "DPO beta: strength of the pull towards the reference")
    loss_type: Literal["sigmoid", "ipo"] = arg("sigmoid", "sigmoid = DPO (summed log-probs), ipo = IPO (length-averaged)")
    label_smoothing: float = arg(0.0, "cDPO: assumed share of flipped preferences (sigmoid only)")
    learning_rate: float = arg(5e-5, "peak AdamW learning rate")
