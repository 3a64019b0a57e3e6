"""The sampler's own log-probabilities of the tokens it draws (Generated.sampler_logprobs), and the per-update
sampler / trainer mismatch metrics built on them (trainers/online/loop.sampler_metrics)."""

import pytest
import torch

from rlhflab import data, tasks
from rlhflab.config import GRPOConfig
from rlhflab.rollout import GenerationSettings
from rlhflab.rollout.generate import sample_tokens
from rlhflab.rollout.rollout import collect_rollout
from rlhflab.trainers.online.loop import sampler_metrics
from rlhflab.trainers.online.setup import build_roles
from tinyhf import save_suite_model


def test_a_drawn_tokens_log_probability_is_the_one_of_the_distribution_it_was_drawn_from():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    token, logprob = sample_tokens(logits, GenerationSettings(4, True, 0.5), gen)
    expected = torch.log_softmax(logits / 0.5, dim=-1).gather(1, token[:, None]).squeeze(1)
    assert torch.allclose(logprob, expected, atol=1e-6)
    # top-k 2: the draw is from the two best, renormalised (row 0: p(0) = e^2 / (e^2 + e^1))
    token, logprob = sample_tokens(logits[:1], GenerationSettings(4, True, 1.0, top_k=2), gen)
    kept = torch.tensor([2.0, 1.0])
    assert logprob.item() == pytest.approx(torch.log_softmax(kept, 0)[token.item()].item(), abs=1e-6)
    token, logprob = sample_tokens(logits, GenerationSettings(4, False, 1.0), gen)  # greedy: its one choice
    assert token.tolist() == [0, 2] and logprob.tolist() == [0.0, 0.0]


def test_the_sampler_metrics_hand_worked():
    class Rollout:  # junk where masked: it must not count
        response_mask = torch.tensor([[True, True, False], [True, False, False]])
        logprobs = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -4.0, 3.0]])
        sampler_logprobs = torch.tensor([[-1.5, -1.0, 5.0], [-0.5, 7.0, 0.0]])

    metrics = sampler_metrics(Rollout())
    assert metrics["sampler/logprob_diff_mean"] == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    assert metrics["sampler/logprob_diff_max"] == pytest.approx(1.0)
    assert metrics["sampler/kl"] == pytest.approx(((-0.5 + 1.0) + 0.0) / 2)
    Rollout.sampler_logprobs = None
    assert sampler_metrics(Rollout()) == {}


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_suite_model(tmp_path_factory.mktemp("policy"))


@pytest.mark.parametrize("backend", ["lean", "hf"])
@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_sampler_and_trainer_agree_in_float32_and_nearly_in_bf16(policy_dir, backend, precision):
    """Rows that finish early too (the untrained model's most frequent token stands in for EOS), so the decoder
    drops finished rows and the log-probs must stay with their tokens."""
    cfg = GRPOConfig(model=policy_dir, generation_backend=backend, mixed_precision=precision, response_length=16,
                     threads=1)
    roles, tokenizer = build_roles(cfg, critic=False)
    items = tasks.build_splits(0, 22, 11, 11)["train"][:8]
    prompts = data.encode_prompts(tokenizer, [i.prompt for i in items])

    def rollout_with(eos):
        return collect_rollout(roles, prompts, pad_id=tokenizer.pad_token_id, eos_id=eos,
                               settings=GenerationSettings(16, True, 0.9), generator=torch.Generator().manual_seed(0))

    eos = torch.bincount(rollout_with(tokenizer.eos_token_id).response_ids.flatten()).argmax().item()
    rollout = rollout_with(eos)
    mask = rollout.response_mask
    lengths = mask.sum(dim=1)
    assert int(lengths.min()) < int(lengths.max()) <= 16  # some rows stopped early
    assert rollout.sampler_logprobs is not None and bool((rollout.sampler_logprobs[~mask] == 0).all())
    metrics = sampler_metrics(rollout)
    if precision == "no":  # the decoder's step and the whole-sequence forward: the same numbers to rounding
        assert metrics["sampler/logprob_diff_max"] < 1e-5
    else:  # bf16 arithmetic in a different order: visible, small
        assert 0 < metrics["sampler/logprob_diff_mean"] < 0.01 and abs(metrics["sampler/kl"]) < 0.05
