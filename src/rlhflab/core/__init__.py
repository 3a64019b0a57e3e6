"""core: pure tensor math (torch only). Shapes: B batch, T response tokens, G group size."""

from rlhflab.core.advantages import (
    ADVANTAGES,
    MovingAverageBaseline,
    batch_mean_baseline,
    discounted_returns,
    gae,
    group_std,
    grpo_advantages,
    rloo_advantages,
    token_rewards,
)
from rlhflab.core.entropy import (AdaptiveEntropyController, entropy_bonus, entropy_threshold,
                                  top_entropy_mask)
from rlhflab.core.importance import SAMPLER_CORRECTIONS, sampler_correction_weights
from rlhflab.core.kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_k1, kl_k2, kl_k3
from rlhflab.core.losses import (
    PREFERENCE_LOSSES,
    REFERENCE_FREE,
    aggregate_token_loss,
    bradley_terry_loss,
    clipped_ratio_loss,
    clipped_surrogate,
    clipped_value_loss,
    dpo_loss,
    explained_variance,
    ipo_loss,
    ppo_policy_loss,
    reward_centering_penalty,
    pass_fail_loss,
    sequence_log_ratio,
    simpo_loss,
)
from rlhflab.core.masked import mask_from_lengths, masked_mean, masked_sum, masked_var, whiten
from rlhflab.core.shaping import length_shaped_scores, overlong_penalty

_MODULES = {"advantages", "entropy", "importance", "kl", "losses", "masked", "shaping"}
__all__ = [name for name in dir() if not name.startswith("_") and name not in _MODULES]
