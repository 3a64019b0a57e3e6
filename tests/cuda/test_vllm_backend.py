"""The vLLM backend (rollout/vllm_backend.py) on a real engine: its tokens are the policy's greedy choices,
pushed weights (whole, or LoRA merged) are the ones it samples from, seeds reproduce, and a rollout sampled
by vLLM still has ratio == 1 and KL == 0 exactly, because the training model recomputes the log-probs.

Marked `cuda` and skipped without vLLM: nothing here imitates the engine. One engine serves the module
(vLLM initialises its distributed state once per process); benchmarks/gpu_check.sh runs this file."""

import pytest
import torch

from rlhflab import data, models, tasks
from rlhflab.core import kl_k1
from rlhflab.models.precision import float32_for_training
from rlhflab.rollout import GenerationSettings
from rlhflab.rollout.backends import LEAN, use_backend
from rlhflab.rollout.rollout import collect_rollout

pytestmark = pytest.mark.cuda

GREEDY = GenerationSettings(max_new_tokens=8, do_sample=False)


def small_qwen2(tokenizer, seed: int = 0):
    """A Qwen2 whose logits are spread enough (initializer_range) that bf16 rounding rarely changes the best token."""
    model = models.build_tiny_model(tokenizer, arch="qwen2", hidden_size=256, num_layers=2, num_heads=4,
                                    intermediate_size=512, seed=seed)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(std=0.1)
    return model.to("cuda", torch.bfloat16).eval()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'rlhflab[vllm]')")
    from rlhflab.rollout.vllm_backend import VLLMBackend

    tokenizer = models.build_tokenizer(tasks.template_corpus(), vocab_size=256)
    folder = tmp_path_factory.mktemp("vllm-policy")
    models.save_model_folder(folder, small_qwen2(tokenizer).cpu(), tokenizer)
    backend = VLLMBackend(str(folder), dtype="bfloat16", gpu_memory_utilization=0.2, max_model_len=256,
                          enforce_eager=True)  # no graph capture: the test's time goes to checks
    yield backend, str(folder), tokenizer
    backend.close()


def prompts_of(tokenizer, n=16):
    items = tasks.build_splits(0, 40, 11, 11)["train"][:n]
    return data.encode_prompts(tokenizer, [i.prompt for i in items])


def first_token_agreement(a, b) -> float:
    return (a.response_ids[:, 0] == b.response_ids[:, 0]).float().mean().item()


def test_vllm_greedy_tokens_are_the_policy_s_and_come_back_in_our_layout(engine):
    backend, folder, tokenizer = engine
    policy = models.load_causal_lm(folder, dtype="bfloat16", device="cuda")
    prompts = prompts_of(tokenizer)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    ours = backend.generate(policy, prompts, pad_id=pad, eos_id=eos, settings=GREEDY)
    lean = LEAN.generate(policy, prompts, pad_id=pad, eos_id=eos, settings=GREEDY)
    assert torch.equal(ours.query_ids, lean.query_ids) and torch.equal(ours.query_mask, lean.query_mask)
    assert ours.response_ids.is_cuda and ours.response_ids.shape[1] <= GREEDY.max_new_tokens
    assert first_token_agreement(ours, lean) >= 0.9
    # the mask is True up to and including the first EOS, nowhere else; a row without EOS ran to the cap
    lengths = ours.response_mask.sum(dim=1)
    for ids, length, ended in zip(ours.response_ids.tolist(), lengths.tolist(), ours.ended_with_eos.tolist()):
        assert (eos in ids[:length]) == ended and (ended or length == GREEDY.max_new_tokens)
        if ended:
            assert ids.index(eos) == length - 1


def test_vllm_samples_from_the_weights_pushed_last(engine):
    backend, folder, tokenizer = engine
    policy = models.load_causal_lm(folder, dtype="bfloat16", device="cuda")
    prompts = prompts_of(tokenizer)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    before = backend.generate(policy, prompts, pad_id=pad, eos_id=eos, settings=GREEDY)
    with torch.no_grad():  # an "update": other weights of the same shapes
        for p, q in zip(policy.parameters(), small_qwen2(tokenizer, seed=1).parameters()):
            p.copy_(q)
    after = backend.generate(policy, prompts, pad_id=pad, eos_id=eos, settings=GREEDY)
    lean_after = LEAN.generate(policy, prompts, pad_id=pad, eos_id=eos, settings=GREEDY)
    assert first_token_agreement(after, lean_after) >= 0.9
    assert first_token_agreement(after, before) < 0.5


def test_vllm_samples_a_lora_policy_with_its_adapter_merged(engine):
    backend, folder, tokenizer = engine
    policy = models.apply_lora(models.load_causal_lm(folder, dtype="bfloat16", device="cuda"), r=8, alpha=16)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    prompts = prompts_of(tokenizer)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    ours = backend.generate(policy, prompts, pad_id=pad, eos_id=eos, settings=GREEDY)
    with models.adapters_off(policy):
        base = LEAN.generate(policy, prompts, pad_id=pad, eos_id=eos, settings=GREEDY)
    adapted = LEAN.generate(policy, prompts, pad_id=pad, eos_id=eos, settings=GREEDY)
    assert first_token_agreement(adapted, base) < 0.5  # the adapter matters
    assert first_token_agreement(ours, adapted) >= 0.9


def test_vllm_sampling_follows_the_run_seed(engine):
    backend, folder, tokenizer = engine
    policy = models.load_causal_lm(folder, dtype="bfloat16", device="cuda")
    prompts = prompts_of(tokenizer)
    settings = GenerationSettings(max_new_tokens=8, do_sample=True, temperature=1.0)

    def sample(seed):
        return backend.generate(policy, prompts, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                                settings=settings, generator=torch.Generator(device="cuda").manual_seed(seed))

    first, again, other = sample(0), sample(0), sample(1)
    assert torch.equal(first.response_ids, again.response_ids)
    assert not torch.equal(first.response_ids, other.response_ids)


def test_a_rollout_sampled_by_vllm_has_ratio_one_and_kl_zero_exactly(engine):
    from rlhflab.rollout.roles import PolicyRoles

    backend, folder, tokenizer = engine
    policy = models.apply_lora(models.load_causal_lm(folder, dtype="bfloat16", device="cuda"), r=4, alpha=8)
    policy = float32_for_training(policy, "policy")
    roles = PolicyRoles(policy, value_mode="none", lora=True)
    use_backend(policy, backend)
    rollout = collect_rollout(roles, prompts_of(tokenizer, 8), pad_id=tokenizer.pad_token_id,
                              eos_id=tokenizer.eos_token_id, settings=GenerationSettings(8, True, 0.9),
                              generator=torch.Generator(device="cuda").manual_seed(0))
    mask = rollout.response_mask
    assert mask.sum() > 8
    assert torch.equal(kl_k1(rollout.logprobs, rollout.ref_logprobs, mask), torch.zeros_like(rollout.logprobs))
    roles.train(True)
    logits, _ = roles.logits_and_values(rollout.query_ids, rollout.query_mask, rollout.response_ids, mask)
    ratio = torch.exp(models.token_logprobs(logits, rollout.response_ids, 0.9) - rollout.logprobs)[mask]
    assert torch.equal(ratio, torch.ones_like(ratio))
