"""The CUDA paths in bf16: the lean forward and decoder against the model's own forward, the exact first
step (ratio == 1, KL == 0) with LoRA, and reproducible sampling from a seeded CUDA generator.

Marked `cuda`: skipped with the reason where torch sees no GPU (tests/conftest.py); benchmarks/gpu_check.sh
runs them. The CPU suite checks the same things in float32 (tests/models/test_models_lean.py,
tests/trainers/test_ppo_bf16.py)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from rlhflab import data, models, tasks
from rlhflab.config import GRPOConfig, PPOConfig
from rlhflab.core import kl_k1
from rlhflab.rollout import GenerationSettings
from rlhflab.rollout.backends import HF, LEAN
from rlhflab.rollout.rollout import collect_rollout

pytestmark = pytest.mark.cuda

PAD, EOS = 0, 1
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15], [16, 17, 18, 19]] * 4  # left padding of 0 to 4 tokens


def qwen2_on_cuda(seed: int = 0) -> torch.nn.Module:
    """A small Qwen2 in bf16 on the GPU, its logits spread enough (initializer_range) that bf16 rounding
    rarely changes which token is best."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.1, pad_token_id=PAD, eos_token_id=EOS)
    return AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16).eval()


def test_lean_forward_matches_the_model_forward_on_cuda_in_bf16():
    from rlhflab.data import left_pad, position_ids_from_mask

    model = qwen2_on_cuda()
    ids, mask = (t.cuda() for t in left_pad(PROMPTS, PAD))
    positions = position_ids_from_mask(mask)
    with torch.no_grad():
        hf = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                   output_hidden_states=True).hidden_states[-1]
        lean = models.lean_hidden(models.plan_lean(model), ids, mask.bool(), positions)
    real = mask.bool()
    scale = hf[real].float().abs().max()
    assert (lean[real].float() - hf[real].float()).abs().max() <= 2e-2 * scale  # bf16: ~3 significant digits


@pytest.mark.parametrize("backend", [LEAN, HF], ids=["lean", "hf"])
def test_greedy_decoding_on_cuda_picks_the_model_forward_s_best_token(backend):
    """Each greedy token of the KV-cached decoder is the best one of a full forward over the same sequence,
    up to bf16 rounding between the two computations."""
    model = qwen2_on_cuda()
    out = backend.generate(model, PROMPTS, pad_id=PAD, eos_id=EOS,
                           settings=GenerationSettings(max_new_tokens=12, do_sample=False))
    ids = torch.cat([out.query_ids, out.response_ids], dim=1)
    attention = torch.cat([out.query_mask, out.response_mask], dim=1).long()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention,
                       position_ids=data.position_ids_from_mask(attention)).logits.float()
    width = out.response_ids.shape[1]
    predicting = logits[:, -width - 1:-1]  # (B, T, V): the logits that chose each response token
    chosen = predicting.gather(-1, out.response_ids.unsqueeze(-1)).squeeze(-1)
    gap = (predicting.max(dim=-1).values - chosen)[out.response_mask]
    assert gap.numel() > 50
    assert gap.max() <= 0.1 and (gap == 0).float().mean() >= 0.9


@pytest.mark.parametrize("backend", [LEAN, HF], ids=["lean", "hf"])
def test_sampling_on_cuda_is_reproducible_from_a_seeded_generator(backend):
    model = qwen2_on_cuda()
    settings = GenerationSettings(max_new_tokens=10, do_sample=True, temperature=1.0)

    def sample(seed):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        return backend.generate(model, PROMPTS, pad_id=PAD, eos_id=EOS, settings=settings, generator=generator)

    first, again, other = sample(0), sample(0), sample(1)
    assert torch.equal(first.response_ids, again.response_ids) and torch.equal(first.response_mask, again.response_mask)
    assert not torch.equal(first.response_ids, other.response_ids)


def suite_qwen2_folder(folder) -> str:
    """A small Qwen2 with the suite's tokenizer, saved in bf16 as hub checkpoints are."""
    tokenizer = models.build_tokenizer(tasks.template_corpus(), vocab_size=256)
    model = models.build_tiny_model(tokenizer, arch="qwen2", hidden_size=128, num_layers=2, num_heads=2,
                                    intermediate_size=256, seed=0)
    models.save_model_folder(folder, model.to(torch.bfloat16), tokenizer)
    return str(folder)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return suite_qwen2_folder(tmp_path_factory.mktemp("cuda-policy"))


def cuda_cfg(policy_dir, cls=PPOConfig, **overrides):
    base = dict(model=policy_dir, device="cuda", dtype="bfloat16", lora_r=4, batch_size=8, num_mini_batches=1,
                response_length=8, total_episodes=16, eval_every=0, eval_prompts=4, sample_prompts=2, max_new_tokens=8,
                console_samples=0, num_train_prompts=22, num_validation_prompts=11, num_test_prompts=11,
                progress=False, learning_rate=1e-2, temperature=0.9, save_every=0, reuse_rollout_forward=False)
    return cls(**{**base, **overrides})


@pytest.mark.parametrize("value_mode", ["shared", "lora_adapter"])
def test_first_rollout_on_cuda_bf16_lora_has_ratio_one_and_kl_zero_exactly(policy_dir, value_mode):
    from rlhflab.trainers.online.setup import build_roles

    cfg = cuda_cfg(policy_dir, value_mode=value_mode)
    roles, tokenizer = build_roles(cfg)
    assert next(roles.policy.parameters()).is_cuda
    items = tasks.build_splits(0, 22, 11, 11)["train"][:8]
    prompts = data.encode_prompts(tokenizer, [i.prompt for i in items])
    rollout = collect_rollout(roles, prompts, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                              settings=GenerationSettings(cfg.response_length, True, cfg.temperature),
                              generator=torch.Generator(device="cuda").manual_seed(0))
    mask = rollout.response_mask
    assert mask.sum() > 8
    assert torch.equal(kl_k1(rollout.logprobs, rollout.ref_logprobs, mask), torch.zeros_like(rollout.logprobs))
    roles.train(True)
    logits, _ = roles.logits_and_values(rollout.query_ids, rollout.query_mask, rollout.response_ids, mask)
    ratio = torch.exp(models.token_logprobs(logits, rollout.response_ids, cfg.temperature) - rollout.logprobs)[mask]
    assert torch.equal(ratio, torch.ones_like(ratio))


def alternating(prompts, texts, rows):
    """0, 1, 0, 1, ... by row: every group of 4 holds both scores, so no advantage is 0 by a tie (a reward of the
    text alone can give a group four equal scores, and then GRPO's first update moves nothing)."""
    return [float(i % 2) for i in range(len(texts))]


@pytest.mark.parametrize("stage", ["ppo", "grpo"])
def test_online_runs_on_cuda_bf16_lora_start_exact_and_move(policy_dir, tmp_path, stage):
    from rlhflab.trainers import grpo, ppo

    # PPO's value warm-up (2 rollouts by default) off: the policy must train on the first rollout
    cls, trainer, extra = {"ppo": (PPOConfig, ppo, {"num_ppo_epochs": 1, "value_warmup_rollouts": 0}),
                           "grpo": (GRPOConfig, grpo, {"num_generations": 4})}[stage]
    cfg = cuda_cfg(policy_dir, cls, output_dir=str(tmp_path / "run"), **extra)
    result = trainer.train(cfg, reward_fn=alternating)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in rows if "objective/kl" in r]
    assert len(updates) == 2 and updates[0]["objective/kl"] == 0.0  # policy == reference at the first rollout
    ratios = [updates[0][k] for k in ("val/ratio", "policy/ratio_mean") if k in updates[0]]
    assert ratios and all(r == 1.0 for r in ratios)  # one minibatch, one pass: the only step sees the rollout's weights
    assert updates[1]["objective/kl"] != 0.0  # the first update moved the policy
    assert all(v == v for r in updates for v in r.values() if isinstance(v, float))  # no NaN


def test_async_generation_on_cuda_bf16_lora_k0_and_k1(policy_dir, tmp_path):
    """The generator process on the same GPU (rollout/async_generator.py). k = 0: the first rollout (the start
    weights, the same seed) is the synchronous run's, every rollout is fresh and sampled with the trainer's weights
    (importance weights ~1; later rollouts may part from the synchronous run's: another process's bf16 kernels can
    round a logit differently and sample another token); k = 1: the later rollouts are one update stale and
    corrected by importance weights."""
    from rlhflab.trainers import grpo

    def updates(result):
        rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        return [r for r in rows if "objective/kl" in r]

    runs = {name: updates(grpo.train(cuda_cfg(policy_dir, GRPOConfig, output_dir=str(tmp_path / name),
                                              num_generations=4, total_episodes=24, **flags), reward_fn=alternating))
            for name, flags in {"sync": {}, "k0": {"async_generation": True, "max_staleness": 0},
                                "k1": {"async_generation": True, "max_staleness": 1}}.items()}
    for name, rows in runs.items():  # what a GPU run shows, for the note
        print(name, [{k: round(v, 6) for k, v in r.items() if isinstance(v, float) and k.split("/")[0] in
                      ("objective", "sampler", "async", "loss")} for r in rows])
    sync, k0, k1 = runs["sync"], runs["k0"], runs["k1"]
    assert [u["async/staleness"] for u in k0] == [0, 0, 0] and [u["async/staleness"] for u in k1] == [0, 1, 1]
    for key in ("objective/scores", "loss"):
        assert k0[0][key] == pytest.approx(sync[0][key], rel=1e-3, abs=1e-4), key
    # k = 0 samples with the trainer's weights: sampler and trainer log-probs part by bf16 rounding only
    assert all(abs(u["sampler/kl"]) < 0.02 for u in k0), [u["sampler/kl"] for u in k0]
    assert all(0.5 < u["sampler/is_weight_mean"] < 2.0 for u in k1[1:])
    assert k1[-1]["objective/kl"] != 0.0  # the stale updates still moved the policy
