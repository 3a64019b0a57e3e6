"""Build an online run's roles, reward source and verifier from its config (PPO, GRPO, RLOO, REINFORCE ...)."""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch

from rlhflab import models, rewards
from rlhflab.config import OnlineFields
from rlhflab.errors import UserInputError
from rlhflab.rollout import GenerationSettings, generate_answers
from rlhflab.rollout.backends import backend_from_config, check_backend, generation_autocast, use_backend
from rlhflab.rollout.roles import PolicyRoles
from rlhflab.data.prompt_rows import PromptRow
from rlhflab.sources import PromptSplits
from rlhflab.models.precision import MixedPrecision, float32_for_training, precision_from_config
from rlhflab.trainers.given import NOTHING, Given
from rlhflab.trainers.headroom import check_probe_fields
from rlhflab.trainers.setup import add_lora, resolve_device

log = logging.getLogger("rlhflab")


def check_online_config(cfg: OnlineFields, epochs: int = 1, group: int = 1) -> None:
    """Refuse combinations that cannot work, before anything is loaded (an algorithm checks its own fields).

    `epochs`: the algorithm's passes over each rollout; `group`: its responses per prompt."""
    if not cfg.model:
        raise UserInputError("no policy given", "--model", "pass the SFT model folder, e.g. runs/demo-.../sft/model")
    check_backend(cfg)
    check_probe_fields(cfg)
    check_sampler_correction(cfg)
    call_limits(cfg)  # a negative --reward_timeout, refused before anything loads (reward functions or not)
    positive = {"batch_size": cfg.batch_size, "num_mini_batches": cfg.num_mini_batches,
                "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
                "response_length": cfg.response_length, "temperature": cfg.temperature}
    for name, value in positive.items():
        if value <= 0:
            raise UserInputError(f"{name} must be > 0, got {value}", f"--{name}")
    if epochs <= 0:
        raise UserInputError(f"passes over each rollout must be > 0, got {epochs}", "--num_ppo_epochs / --num_iterations")
    if cfg.reward_model and cfg.reward in ("checker", "random"):
        log.warning("reward=%s: --reward_model %s is not used", cfg.reward, cfg.reward_model)
    if cfg.reward_model_mode == "reload" and reward_kind(cfg) not in ("model", "combined"):
        log.warning("--reward_model_mode reload: this run scores with no reward model (reward=%s)", reward_kind(cfg))
    if cfg.reward in ("checker", "combined") and cfg.train_file and not cfg.verifier.strip():
        log.warning("reward=%s on your own prompts: the suite's checker scores only rows with 'family' and "
                    "'reference' columns", cfg.reward)
    if group > 1 and cfg.batch_size % group:
        raise UserInputError(f"batch_size {cfg.batch_size} is not a multiple of num_generations {group}",
                             "--batch_size / --num_generations", "batch_size counts responses: prompts x num_generations")
    if cfg.total_episodes % cfg.batch_size:
        log.warning("total_episodes %d is not a multiple of batch_size %d: running %d episodes",
                    cfg.total_episodes, cfg.batch_size, cfg.total_episodes // cfg.batch_size * cfg.batch_size)
    if cfg.batch_size % cfg.num_mini_batches:
        raise UserInputError(
            f"batch_size {cfg.batch_size} is not divisible by num_mini_batches {cfg.num_mini_batches}",
            "--num_mini_batches", "choose a divisor of batch_size")
    if cfg.total_episodes < cfg.batch_size:
        raise UserInputError(f"total_episodes {cfg.total_episodes} < batch_size {cfg.batch_size}: no update",
                             "--total_episodes", "raise total_episodes or lower batch_size")
    if cfg.max_seconds < 0:
        raise UserInputError(f"max_seconds must be >= 0, got {cfg.max_seconds}", "--max_seconds", "0 = no limit")
    if cfg.reward in ("model", "combined") and not cfg.reward_model:
        raise UserInputError(f"reward={cfg.reward} needs a reward model", "--reward_model", "pass a reward model folder")
    if not 0 <= cfg.overlong_buffer_len <= cfg.response_length or cfg.overlong_penalty_factor < 0:
        raise UserInputError(f"overlong_buffer_len must be in [0, response_length {cfg.response_length}] and "
                             f"overlong_penalty_factor >= 0, got {cfg.overlong_buffer_len}, "
                             f"{cfg.overlong_penalty_factor}", "--overlong_buffer_len / --overlong_penalty_factor",
                             "e.g. a quarter of response_length and 1.0 (DAPO's 4096 of 20480)")


def sampler_correction_mode(cfg: OnlineFields) -> str:
    """--sampler_correction with auto resolved: token_truncate where vLLM samples or an asynchronous generator
    samples with older weights (the decoupled objective: the clipped ratio against the trainer's weights at the
    rollout's start, times the truncated weight trainer / sampler), none where the lean or HF sampler of this
    process does (the trainer's own arithmetic: nothing to correct)."""
    if cfg.sampler_correction != "auto":
        return cfg.sampler_correction
    return "token_truncate" if cfg.generation_backend == "vllm" or cfg.async_generation else "none"


def check_sampler_correction(cfg: OnlineFields) -> None:
    """--sampler_correction's bounds hold 1 (equal log-probs: weight 1)."""
    if sampler_correction_mode(cfg) == "none":
        return
    if not 0.0 <= cfg.sampler_correction_min <= 1.0 <= cfg.sampler_correction_max:
        raise UserInputError(f"sampler correction bounds [{cfg.sampler_correction_min}, {cfg.sampler_correction_max}] "
                             "must hold 1 and start at 0 or above", "--sampler_correction_min / --sampler_correction_max",
                             "e.g. 0 and 3 (TRL's)")


def build_roles(cfg: OnlineFields, critic: bool = True,
                precision: MixedPrecision | None = None) -> tuple[PolicyRoles, object]:
    """Policy (+ LoRA), reference (copy, reload or adapter-off) and, with a critic, value (shared, separate,
    adapter: `cfg.value_mode`); every forward of them under `precision` (default: the config's, resolved here
    before anything is loaded).

    Whatever trains whole weights (a policy without LoRA, a separate value model) is float32 even when
    `dtype` is half, and a full-fine-tuning reference is cast like its policy (models/precision.py): stored
    in the policy's float32 too, so that under autocast both cast the same weights and KL == 0 at the start."""
    device = resolve_device(cfg.device)
    precision = precision or precision_from_config(cfg, device)
    tokenizer = models.load_tokenizer(cfg.tokenizer or cfg.model, trust_remote_code=cfg.trust_remote_code)
    load = lambda path: models.load_causal_lm(  # noqa: E731
        path, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code, device=device)
    policy = load(cfg.model)
    lora = cfg.lora_r > 0
    if lora:
        policy = add_lora(policy, cfg, f"policy {cfg.model}")
    else:
        policy = float32_for_training(policy, f"policy {cfg.model}")
    reference, load_reference = None, None
    if not lora:
        reference_path, dtype = cfg.reference or cfg.model, policy.dtype
        # in the policy's dtype: policy == reference exactly at the start (KL == 0), whatever cfg.dtype
        load_frozen = lambda: load(reference_path).to(dtype).requires_grad_(False).eval()  # noqa: E731
        if cfg.reference_mode == "resident":
            reference = load_frozen()
        else:
            load_reference = load_frozen
    elif cfg.reference:
        log.warning("LoRA policy: the reference is the base with the adapter off; --reference is ignored")
    hidden = policy.config.hidden_size
    value_head, value_model = None, None
    value_mode = cfg.value_mode if critic else "none"
    if value_mode == "none":
        pass
    elif value_mode == "shared":
        value_head = models.ValueHead(hidden).to(device)
    elif value_mode == "separate":
        value_model = models.ValueModel.from_pretrained(cfg.value_model or cfg.model, dtype=cfg.dtype,
                                                        trust_remote_code=cfg.trust_remote_code).to(device)
        value_model = float32_for_training(value_model, f"value model {cfg.value_model or cfg.model}")
    else:  # "lora_adapter" (the config's Literal admits no other value)
        models.add_value_adapter(policy, r=cfg.lora_r, alpha=cfg.lora_alpha)
        value_head = models.ValueHead(hidden).to(device)
    if cfg.gradient_checkpointing:  # the trained models; the reference and the reward model run without grad
        for model, what in ((policy, "policy"), (value_model, "value model")):
            if model is not None:
                models.enable_gradient_checkpointing(model, what)
    roles = PolicyRoles(policy, value_mode=value_mode, value_head=value_head, value_model=value_model,
                        reference=reference, load_reference=load_reference, lora=lora,
                        merge_lora_for_generation=cfg.lora_merge_generation, precision=precision)
    longest = cfg.max_prompt_tokens + max(cfg.response_length, cfg.max_new_tokens)  # rollouts and validation
    use_backend(policy, backend_from_config(cfg, cfg.model, max_model_len=longest))
    return roles, tokenizer


def calibrate_reward_model(learned: rewards.ModelReward, policy, tokenizer, rows: list[PromptRow],
                           cfg: OnlineFields) -> dict:
    """Shift and scale so the starting policy's own answers score mean 0, std 1.

    The meaning of kl_coef depends on the reward's scale (FACTS.md: normalising RM scores
    let one beta serve both the checker and the learned reward).
    """
    settings = GenerationSettings(cfg.response_length, True, cfg.temperature)
    generator = torch.Generator().manual_seed(cfg.seed + 1)
    prompts = [r.prompt for r in rows]
    with generation_autocast(policy, learned.autocast):  # the policy samples as it does in rollouts
        answers = generate_answers(policy, tokenizer, prompts, settings, generator=generator)
    raw = rewards.ModelReward(learned.reward_model, learned.tokenizer, autocast=learned.autocast)(
        prompts, [a.text for a in answers], rows).scores
    shift, scale = raw.mean().item(), max(raw.std().item(), 1e-6)
    log.info("reward model normalised on %d answers of the starting policy: shift %.3f, scale %.3f",
             len(rows), shift, scale)
    return {"shift": shift, "scale": scale, "calibration_answers": len(rows)}


def reward_functions(cfg) -> list[tuple[rewards.FunctionReward, float]]:
    """(source, weight) for each `--reward_fn`, weights from `--reward_weights` (1 each when empty)."""
    specs = [s.strip() for s in cfg.reward_fn.split(",") if s.strip()]
    weights = [1.0] * len(specs)
    if cfg.reward_weights.strip():
        try:
            weights = [float(w) for w in cfg.reward_weights.split(",")]
        except ValueError as err:
            raise UserInputError(f"--reward_weights {cfg.reward_weights!r} is not a list of numbers",
                                 "--reward_weights", "e.g. --reward_weights 1.0,0.5") from err
        if len(weights) != len(specs):
            raise UserInputError(f"{len(weights)} reward weights for {len(specs)} reward functions",
                                 "--reward_weights", "give one weight per --reward_fn function, in the same order")
    return [(rewards.FunctionReward(rewards.load_function(spec, "--reward_fn"), limits=call_limits(cfg)), w)
            for spec, w in zip(specs, weights)]


def call_limits(cfg) -> rewards.CallLimits:
    """`--reward_timeout` and `--reward_errors`: how the user's reward and verifier functions are called."""
    return rewards.CallLimits(cfg.reward_timeout, cfg.reward_errors)


def reward_kind(cfg: OnlineFields, given: Given = NOTHING) -> str:
    """`cfg.reward` with "auto" resolved: model and / or functions when given, else the checker."""
    if cfg.reward != "auto":
        return cfg.reward
    if cfg.reward_model:
        return "model"
    return "functions" if cfg.reward_fn.strip() or given.reward_functions else "checker"


def build_reward(cfg: OnlineFields, tokenizer, policy=None, calibration_rows=None,
                 precision: MixedPrecision | None = None, given: Given = NOTHING) -> tuple[object, dict]:
    """The reward source the config names (`reward`, `reward_model`, `reward_fn`) and the functions `given`
    in memory, behind one call, and how RM scores were normalised. A reward model scores under `precision`'s
    autocast (its weights stay in `--dtype`: frozen, they need no float32 master)."""
    autocast = (precision or MixedPrecision()).autocast
    kind = reward_kind(cfg, given)
    parts = reward_functions(cfg) + [(rewards.FunctionReward(fn, limits=call_limits(cfg)), weight)
                                     for fn, weight in given.reward_functions]
    norm: dict = {}
    if kind == "random":
        rm = models.build_random_reward_model(tokenizer, seed=cfg.seed).to(resolve_device(cfg.device))
        parts.insert(0, (rewards.ModelReward(rm, tokenizer, autocast=autocast), 1.0))
    if kind in ("model", "combined"):
        learned, norm = learned_reward(cfg, tokenizer, policy, calibration_rows, autocast)
        parts.insert(0, (learned, cfg.reward_model_weight if kind == "combined" or parts else 1.0))
    if kind in ("checker", "combined"):
        parts.insert(0, (rewards.CheckerReward(), cfg.checker_weight if kind == "combined" or parts else 1.0))
    if len(parts) == 1 and parts[0][1] == 1.0:
        return parts[0][0], norm
    return rewards.CombinedReward(parts), norm


def learned_reward(cfg: OnlineFields, tokenizer, policy, calibration_rows,
                   autocast=nullcontext) -> tuple[rewards.ModelReward | rewards.ReloadedModelReward, dict]:
    """The reward model as a source, normalised on the starting policy's answers when asked; with
    `reward_model_mode=reload` read from disk again for each rollout's scores (loaded here once to check and
    calibrate it, then freed)."""
    rm_tokenizer = models.load_tokenizer(cfg.reward_model, trust_remote_code=cfg.trust_remote_code)
    load = lambda: models.load_reward_model(  # noqa: E731
        cfg.reward_model, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code,
        tokenizer=rm_tokenizer).to(resolve_device(cfg.device))
    rm = load()
    norm = {"shift": cfg.reward_shift, "scale": cfg.reward_scale, "calibration_answers": 0}
    learned = rewards.ModelReward(rm, rm_tokenizer, shift=norm["shift"], scale=norm["scale"], autocast=autocast)
    if cfg.normalize_reward and policy is not None and calibration_rows:
        norm = calibrate_reward_model(learned, policy, tokenizer, calibration_rows, cfg)
        learned = rewards.ModelReward(rm, rm_tokenizer, shift=norm["shift"], scale=norm["scale"], autocast=autocast)
    if cfg.reward_model_mode == "reload":
        return rewards.ReloadedModelReward(load, rm_tokenizer, shift=norm["shift"], scale=norm["scale"],
                                           autocast=autocast), norm
    return learned, norm


def build_verifier(cfg, prompts: PromptSplits, given: Given = NOTHING) -> rewards.Verifier | None:
    """A verifier `given` in memory, else `--verifier`: a user function, 'checker', or by default the checker on
    the suite and none on user prompts."""
    if given.verifier is not None:
        return rewards.FunctionVerifier(given.verifier, limits=call_limits(cfg))
    spec = cfg.verifier.strip()
    if spec == "checker" or (not spec and prompts.is_suite):
        if not any(rewards.task_item(r) for r in prompts.validation[:1]):
            raise UserInputError("the suite's checker needs 'family' and 'reference' columns in the prompts",
                                 "--verifier checker", "pass your own --verifier FILE.py:NAME")
        return rewards.CheckerVerifier()
    if not spec or spec == "none":
        return None
    return rewards.FunctionVerifier(rewards.load_function(spec, "--verifier"), limits=call_limits(cfg))


def held_out_metric(cfg, given: Given = NOTHING) -> str:
    """What validation, alarms, stopping and keep_best read: the verifier's pass rate, else the reward itself."""
    spec = cfg.verifier.strip()
    has_verifier = given.verifier is not None or spec not in ("", "none") or (not spec and not cfg.train_file)
    return "val/pass_rate" if has_verifier else "val/reward"
