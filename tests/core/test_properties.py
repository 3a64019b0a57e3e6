"""Properties of core/ that say more than examples (issue 36, item 3), checked with hypothesis on small tensors:

- padding invariance: garbage (huge, NaN, ±inf) at padded positions and padding columns appended past the
  response mask change no loss, statistic, advantage, return, KL, masked reduction or real token's log-prob;
- a group's RLOO and GRPO advantages sum to zero, and RLOO's is the score minus the mean of its siblings';
- GAE with λ = 1 is the discounted return minus the value, and with λ = 0 the one-step TD error;
- chunked log-probs and entropies (and their gradients) equal the full-logits ones, for any chunk size.

Tensors come from a drawn seed (a torch Generator), not element by element, so an example costs a few
milliseconds; float64 where the maths allows, so the tolerances stay a few ulps.
"""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhflab.core.advantages import discounted_returns, gae, grpo_advantages, rloo_advantages
from rlhflab.core.kl import KL_ESTIMATORS
from rlhflab.core.logprobs import (chunked_head_logprobs, entropy_from_logits, recomputed_head_logprobs,
                                   selective_log_softmax, shifted_token_logprobs)
from rlhflab.core.losses import (aggregate_token_loss, clipped_ratio_loss, clipped_value_loss, explained_variance,
                                 ppo_policy_loss, sequence_log_ratio)
from rlhflab.core.masked import mask_from_lengths, masked_mean, masked_sum, masked_var, whiten

SEEDS = st.integers(0, 2**31 - 1)
GARBAGE = st.sampled_from(["huge", "nan", "inf", "-inf", "mixed"])
SETTINGS = settings(max_examples=40, deadline=None)


def _close(got, want, **tol):
    torch.testing.assert_close(got, want, equal_nan=True, **(tol or dict(atol=1e-12, rtol=1e-12)))


def _garbage(kind: str, shape, g: torch.Generator) -> torch.Tensor:
    """(shape) float64 values a padded position may hold: left-overs of another row, NaN, inf."""
    big = torch.randn(shape, generator=g, dtype=torch.float64) * 1e6
    fill = {"huge": big, "nan": torch.full(shape, math.nan, dtype=torch.float64),
            "inf": torch.full(shape, math.inf, dtype=torch.float64),
            "-inf": torch.full(shape, -math.inf, dtype=torch.float64)}
    if kind != "mixed":
        return fill[kind]
    pick = torch.randint(0, 4, shape, generator=g)
    return torch.stack([fill["huge"], fill["nan"], fill["inf"], fill["-inf"]]).gather(0, pick.unsqueeze(0))[0]


class Padded:
    """One batch twice: `clean` (B, T) with 0 at padding, and `dirty` (B, T + extra) with garbage at every padded
    position, `extra` padding columns appended. A right-padded mask; a row may be all padding."""

    def __init__(self, seed: int, batch: int, length: int, extra: int, kind: str):
        self.g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(0, length + 1, (batch,), generator=self.g)
        lengths[0] = length  # one full row, so something is real
        self.mask = mask_from_lengths(lengths, length)
        self.long_mask = mask_from_lengths(lengths, length + extra)
        self.length, self.extra, self.kind = length, extra, kind

    def pair(self, scale: float = 1.0, shift: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = self.mask.shape
        x = torch.randn(B, T, generator=self.g, dtype=torch.float64) * scale + shift
        clean = torch.where(self.mask, x, torch.zeros_like(x))
        dirty = torch.cat([x, torch.zeros(B, self.extra, dtype=torch.float64)], dim=1)
        dirty = torch.where(self.long_mask, dirty, _garbage(self.kind, dirty.shape, self.g))
        return clean, dirty

    def real(self, dirty_out: torch.Tensor) -> torch.Tensor:
        """The first T columns of a per-token output of the long batch."""
        return dirty_out[:, :self.length]


def padded_batches():
    return st.builds(Padded, SEEDS, st.integers(1, 4), st.integers(1, 6), st.integers(0, 3), GARBAGE)


# --- padding invariance -------------------------------------------------------------------------------------


@SETTINGS
@given(batch=padded_batches(), cliprange=st.floats(0.05, 0.5))
def test_ppo_policy_loss_and_its_stats_ignore_padding(batch, cliprange):
    logprobs, dirty_logprobs = batch.pair(scale=0.3, shift=-2.0)
    old, dirty_old = batch.pair(scale=0.3, shift=-2.0)
    advantages, dirty_advantages = batch.pair()
    want_loss, want = ppo_policy_loss(logprobs, old, advantages, batch.mask, cliprange)
    got_loss, got = ppo_policy_loss(dirty_logprobs, dirty_old, dirty_advantages, batch.long_mask, cliprange)
    _close(got_loss, want_loss)
    assert got.keys() == want.keys()
    for name in want:
        _close(got[name], want[name])


@SETTINGS
@given(batch=padded_batches(), cliprange=st.floats(0.05, 0.5))
def test_clipped_value_loss_and_explained_variance_ignore_padding(batch, cliprange):
    values, dirty_values = batch.pair()
    old, dirty_old = batch.pair()
    returns, dirty_returns = batch.pair()
    want_loss, want = clipped_value_loss(values, old, returns, batch.mask, cliprange)
    got_loss, got = clipped_value_loss(dirty_values, dirty_old, dirty_returns, batch.long_mask, cliprange)
    _close(got_loss, want_loss)
    for name in want:
        _close(got[name], want[name])
    _close(explained_variance(dirty_values, dirty_returns, batch.long_mask),
           explained_variance(values, returns, batch.mask))


@SETTINGS
@given(batch=padded_batches(), loss_type=st.sampled_from(["grpo", "bnpo", "dapo", "dr_grpo"]),
       eps=st.floats(0.05, 0.3), eps_high=st.floats(0.05, 0.4))
def test_aggregate_token_loss_ignores_padding_for_every_loss_type(batch, loss_type, eps, eps_high):
    """The clipped per-token loss of GRPO, aggregated; the step's totals (rows, tokens, the configured
    max_length) are the caller's and do not move with the tensors' width."""
    log_ratio, dirty_log_ratio = batch.pair(scale=0.3)
    advantages, dirty_advantages = batch.pair()
    per_token, low, high = clipped_ratio_loss(log_ratio, advantages, eps, eps_high)
    dirty_per_token, dirty_low, dirty_high = clipped_ratio_loss(dirty_log_ratio, dirty_advantages, eps, eps_high)
    assert torch.equal(batch.real(dirty_low) & batch.mask, low & batch.mask)
    assert torch.equal(batch.real(dirty_high) & batch.mask, high & batch.mask)
    totals = dict(rows=batch.mask.shape[0], tokens=int(batch.mask.sum()), max_length=batch.length + 3)
    _close(aggregate_token_loss(dirty_per_token, batch.long_mask, loss_type, **totals),
           aggregate_token_loss(per_token, batch.mask, loss_type, **totals))
    for reduce in ("sum", "mean"):
        _close(sequence_log_ratio(dirty_log_ratio, torch.zeros_like(dirty_log_ratio), batch.long_mask, reduce),
               sequence_log_ratio(log_ratio, torch.zeros_like(log_ratio), batch.mask, reduce))


@SETTINGS
@given(batch=padded_batches(), gamma=st.floats(0.0, 1.0), lam=st.floats(0.0, 1.0))
def test_gae_and_discounted_returns_ignore_padding_and_return_0_there(batch, gamma, lam):
    rewards, dirty_rewards = batch.pair()
    values, dirty_values = batch.pair()
    for got, want in zip(gae(dirty_rewards, dirty_values, batch.long_mask, gamma, lam),
                         gae(rewards, values, batch.mask, gamma, lam)):
        _close(batch.real(got), want)
        assert torch.equal(got[~batch.long_mask], torch.zeros_like(got[~batch.long_mask]))
    got = discounted_returns(dirty_rewards, batch.long_mask, gamma)
    _close(batch.real(got), discounted_returns(rewards, batch.mask, gamma))
    assert torch.equal(got[~batch.long_mask], torch.zeros_like(got[~batch.long_mask]))


@SETTINGS
@given(batch=padded_batches(), unbiased=st.booleans())
def test_masked_reductions_and_whiten_ignore_padding(batch, unbiased):
    x, dirty = batch.pair(scale=3.0, shift=1.0)
    _close(masked_sum(dirty, batch.long_mask), masked_sum(x, batch.mask))
    _close(masked_mean(dirty, batch.long_mask), masked_mean(x, batch.mask))
    _close(masked_mean(dirty, batch.long_mask, dim=1), masked_mean(x, batch.mask, dim=1))
    _close(masked_var(dirty, batch.long_mask, unbiased), masked_var(x, batch.mask, unbiased))
    for shift_mean in (True, False):
        got = whiten(dirty, batch.long_mask, shift_mean=shift_mean)
        _close(batch.real(got), whiten(x, batch.mask, shift_mean=shift_mean))
        assert torch.equal(got[~batch.long_mask], torch.zeros_like(got[~batch.long_mask]))


@SETTINGS
@given(batch=padded_batches(), name=st.sampled_from(sorted(KL_ESTIMATORS)))
def test_kl_estimators_ignore_padding_and_return_0_there(batch, name):
    logprobs, dirty_logprobs = batch.pair(scale=0.5, shift=-2.0)
    ref, dirty_ref = batch.pair(scale=0.5, shift=-2.0)
    got = KL_ESTIMATORS[name](dirty_logprobs, dirty_ref, batch.long_mask)
    _close(batch.real(got), KL_ESTIMATORS[name](logprobs, ref, batch.mask))
    assert torch.equal(got[~batch.long_mask], torch.zeros_like(got[~batch.long_mask]))


@SETTINGS
@given(seed=SEEDS, length=st.integers(2, 6), extra=st.integers(1, 3), vocab=st.integers(2, 9),
       temperature=st.sampled_from([1.0, 0.6, 1.7]))
def test_appended_positions_change_no_earlier_tokens_log_prob(seed, length, extra, vocab, temperature):
    """A causal model's logits at a position do not see later ones: the log-probs of the first tokens are the
    same whatever tokens and logits (NaN included) come after them."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, length + extra, vocab, generator=g)
    ids = torch.randint(0, vocab, (2, length + extra), generator=g)
    logits[:, length:] = torch.where(torch.rand(2, extra, vocab, generator=g) < 0.5, math.nan, 1e30)
    want = shifted_token_logprobs(logits[:, :length], ids[:, :length], temperature)
    got = shifted_token_logprobs(logits, ids, temperature)
    assert got.shape == (2, length + extra - 1)
    _close(got[:, :length - 1], want, atol=0, rtol=0)


# --- group advantages ----------------------------------------------------------------------------------------


def _group_scores(seed: int, groups: int, size: int, nan_share: float, ties: bool) -> torch.Tensor:
    """(groups·size,) float64 scores, some NaN (a failed reward), drawn from a few values when `ties`."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(groups * size, generator=g, dtype=torch.float64) * 2.0
    if ties:
        scores = torch.randint(0, 3, scores.shape, generator=g).to(torch.float64)
    return torch.where(torch.rand(scores.shape, generator=g) < nan_share, math.nan, scores)


GROUP_SCORES = dict(seed=SEEDS, groups=st.integers(1, 4), size=st.integers(2, 6),
                    nan_share=st.sampled_from([0.0, 0.0, 0.3]), ties=st.booleans())


@SETTINGS
@given(**GROUP_SCORES)
def test_rloo_advantage_is_the_score_minus_the_mean_of_the_scored_others(seed, groups, size, nan_share, ties):
    scores = _group_scores(seed, groups, size, nan_share, ties)
    got = rloo_advantages(scores, size).tolist()
    for start in range(0, len(scores), size):
        group = scores[start:start + size].tolist()
        for i, s in enumerate(group):
            others = [o for j, o in enumerate(group) if j != i and not math.isnan(o)]
            want = 0.0 if math.isnan(s) or not others else s - sum(others) / len(others)
            assert math.isclose(got[start + i], want, rel_tol=1e-12, abs_tol=1e-12)


@SETTINGS
@given(**GROUP_SCORES, scale=st.sampled_from(["group", "batch", "none"]), rloo=st.booleans())
def test_a_groups_advantages_sum_to_zero(seed, groups, size, nan_share, ties, scale, rloo):
    """RLOO: Σ_i (s_i − mean of the others) = 0 exactly in the maths; GRPO: centred on the group mean, then one
    divisor per group (or per batch). A NaN-scored sample gets 0 and is out of both sums."""
    scores = _group_scores(seed, groups, size, nan_share, ties)
    advantages = rloo_advantages(scores, size) if rloo else grpo_advantages(scores, size, scale=scale)
    assert torch.isfinite(advantages).all()
    assert torch.equal(advantages[torch.isnan(scores)], torch.zeros_like(advantages[torch.isnan(scores)]))
    for group, group_scores in zip(advantages.view(groups, size), scores.view(groups, size)):
        spread = float(group_scores.nan_to_num(0.0).abs().max()) + 1.0
        bound = 1e-12 * spread * (1.0 if rloo or scale == "none" else 1e4)  # /(std + eps) magnifies rounding
        assert abs(float(group.sum())) <= bound


# --- GAE at the ends of λ -------------------------------------------------------------------------------------


def _episode(seed: int, batch: int, length: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, length + 1, (batch,), generator=g)
    mask = mask_from_lengths(lengths, length)
    rewards = torch.randn(batch, length, generator=g, dtype=torch.float64)
    values = torch.randn(batch, length, generator=g, dtype=torch.float64)
    return mask, rewards, values


EPISODES = dict(seed=SEEDS, batch=st.integers(1, 4), length=st.integers(1, 7), gamma=st.floats(0.0, 1.0))


@SETTINGS
@given(**EPISODES)
def test_gae_with_lambda_1_is_the_discounted_return_minus_the_value(seed, batch, length, gamma):
    mask, rewards, values = _episode(seed, batch, length)
    advantages, returns = gae(rewards, values, mask, gamma, 1.0)
    to_go = discounted_returns(rewards, mask, gamma)
    _close(advantages, torch.where(mask, to_go - values, torch.zeros_like(values)), atol=1e-12, rtol=1e-9)
    _close(returns, to_go, atol=1e-12, rtol=1e-9)


@SETTINGS
@given(**EPISODES)
def test_gae_with_lambda_0_is_the_one_step_td_error(seed, batch, length, gamma):
    """δ_t = r_t + γ V_{t+1} − V_t, with V = 0 after the last real token (the episode ends there)."""
    mask, rewards, values = _episode(seed, batch, length)
    advantages, returns = gae(rewards, values, mask, gamma, 0.0)
    next_values = torch.cat([values[:, 1:] * mask[:, 1:], torch.zeros(batch, 1, dtype=values.dtype)], dim=1)
    td = torch.where(mask, rewards + gamma * next_values - values, torch.zeros_like(values))
    _close(advantages, td)
    _close(returns, torch.where(mask, rewards + gamma * next_values, torch.zeros_like(values)))


# --- chunked equals unchunked ---------------------------------------------------------------------------------


class Head:
    """hidden (B, T, H), an output layer (V, H) (+ (V,) bias) and tokens (B, T), logits of std ~1 as a language
    model's (a chunk's matmul may round its last bit unlike the whole batch's: larger logits would add that)."""

    def __init__(self, seed: int, shape: tuple[int, int], hidden_size: int, vocab: int, bias: bool):
        g = torch.Generator().manual_seed(seed)
        self.hidden = torch.randn(*shape, hidden_size, generator=g)
        self.weight = torch.randn(vocab, hidden_size, generator=g) / math.sqrt(hidden_size)
        self.bias = torch.randn(vocab, generator=g) if bias else None
        self.tokens = torch.randint(0, vocab, shape, generator=g)
        self.loss_weights = torch.randn(2, *shape, generator=g)  # a random loss reading log-probs and entropies

    def leaves(self, trains: str) -> list[torch.Tensor]:
        """Fresh leaves, those named in `trains` requiring a gradient: "hidden" alone is a frozen head (LoRA, a
        reference), "hidden weight bias" full fine-tuning, "hidden bias" a frozen weight with a trained bias."""
        hidden = self.hidden.clone().requires_grad_("hidden" in trains)
        weight = self.weight.clone().requires_grad_("weight" in trains)
        bias = None if self.bias is None else self.bias.clone().requires_grad_("bias" in trains)
        return [hidden, weight, bias]

    def full(self, leaves, temperature: float):
        logits = torch.nn.functional.linear(leaves[0], leaves[1], leaves[2])
        return selective_log_softmax(logits, self.tokens, temperature), entropy_from_logits(logits, temperature)

    def grads(self, leaves, logprobs, entropy, reads: str) -> list[torch.Tensor]:
        """Gradients of a loss reading the log-probs, the entropy (an entropy bonus alone) or both."""
        loss = 0.0
        if reads in ("logprobs", "both"):
            loss = loss + (self.loss_weights[0] * logprobs).sum()
        if reads in ("entropy", "both"):
            loss = loss + (self.loss_weights[1] * entropy).sum()
        return list(torch.autograd.grad(loss, [x for x in leaves if x is not None and x.requires_grad]))


HEADS = st.builds(Head, SEEDS, st.tuples(st.integers(1, 3), st.integers(1, 5)), st.integers(1, 6),
                  st.integers(2, 12), st.booleans())
TEMPERATURES = st.sampled_from([1.0, 1.0, 0.7, 1.6, 2.0])
TRAINS = st.sampled_from(["hidden", "hidden weight bias", "weight bias", "hidden bias", "weight", "bias"])
READS = st.sampled_from(["logprobs", "entropy", "both"])
CLOSE = dict(atol=1e-5, rtol=1e-5)


def _assert_gradients_close(got, want):
    assert len(got) == len(want)
    for x, y in zip(got, want):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert (x - y).abs().max().item() <= 1e-5 * max(1.0, y.abs().max().item())


@settings(max_examples=80, deadline=None)
@given(head=HEADS, chunk=st.integers(0, 17), temperature=TEMPERATURES, trains=TRAINS, entropy_grad=st.booleans(),
       reads=READS)
def test_chunked_head_equals_the_full_logits_for_any_chunk(head, chunk, temperature, trains, entropy_grad, reads):
    """Values, and the gradients of a loss reading the log-probs, the entropy (when differentiable) or both, for
    any leaves trained: the frozen head's hidden gradient is formed in the forward, the others' in the backward.
    A chunk of 0 is read as 1."""
    if head.bias is None and trains == "bias":
        trains = "weight"
    leaves = head.leaves(trains)
    got = chunked_head_logprobs(leaves[0], leaves[1], head.tokens, chunk=chunk, temperature=temperature,
                                bias=leaves[2], entropy_grad=entropy_grad)
    want = head.full(leaves, temperature)
    for x, y in zip(got, want):
        assert x.dtype == torch.float32 and x.shape == head.tokens.shape
        torch.testing.assert_close(x, y, **CLOSE)
    assert got[1].requires_grad == entropy_grad
    reads = reads if entropy_grad else "logprobs"
    _assert_gradients_close(head.grads(leaves, *got, reads), head.grads(leaves, *want, reads))


@settings(max_examples=30, deadline=None)
@given(head=HEADS, chunk=st.integers(1, 17), temperature=TEMPERATURES, trains=TRAINS, grad=st.booleans())
def test_recomputed_head_equals_the_full_logits_for_any_chunk(head, chunk, temperature, trains, grad):
    if head.bias is None and trains == "bias":
        trains = "weight"
    leaves = head.leaves(trains)
    layer = lambda h: torch.nn.functional.linear(h, leaves[1], leaves[2])  # noqa: E731
    with torch.set_grad_enabled(grad):
        got = recomputed_head_logprobs(leaves[0], layer, head.tokens, chunk=chunk, temperature=temperature)
        want = head.full(leaves, temperature)
    for x, y in zip(got, want):
        assert x.shape == head.tokens.shape
        torch.testing.assert_close(x, y, **CLOSE)
    if grad:
        _assert_gradients_close(head.grads(leaves, *got, "both"), head.grads(leaves, *want, "both"))
