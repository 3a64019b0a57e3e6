"""Generation backends (rollout/backends.py): the dispatch at every place that generates, `hf` vs `lean`,
the engine-output layout, the config-time refusal of vLLM where it cannot run, and the pieces the vLLM
backend is built from that need no vLLM (weights named as a checkpoint, merged LoRA, sampling
arguments). Nothing here imitates vLLM itself: its own tests are CUDA-marked (tests/cuda)."""

import gc

import pytest
import torch
from tinyhf import EOS, PAD, build

from rlhflab import models
from rlhflab.config import PPOConfig
from rlhflab.errors import UserInputError
from rlhflab.rollout import GenerationSettings, generate, generate_answers
from rlhflab.rollout import backends
from rlhflab.rollout.backends import HF, LEAN, generate_with, generated_from_tokens, use_backend
from rlhflab.rollout.vllm_backend import VLLMBackend, sampling_arguments

PROMPTS = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]]
SAMPLED = GenerationSettings(max_new_tokens=8, do_sample=True, temperature=1.0)


def test_hf_backend_samples_the_same_tokens_as_lean_from_the_same_generator():
    """`hf` runs the model's own forward, `lean` the lean decoder: same weights, same sampler, same tokens."""
    model = build("llama")
    outs = [b.generate(model, PROMPTS * 4, pad_id=PAD, eos_id=EOS, settings=SAMPLED,
                       generator=torch.Generator().manual_seed(3)) for b in (LEAN, HF)]
    assert outs[0].response_mask.sum() > 40  # real sampled text, not all EOS at once
    for field in ("query_ids", "query_mask", "response_ids", "response_mask", "ended_with_eos"):
        assert torch.equal(getattr(outs[0], field), getattr(outs[1], field)), field


class Recording:
    """A backend that notes who asked and answers with the lean decoder."""

    name = "recording"

    def __init__(self):
        self.calls = 0

    def generate(self, model, prompts, **kwargs):
        self.calls += 1
        return LEAN.generate(model, prompts, **kwargs)


def test_every_place_that_generates_asks_the_model_s_bound_backend(tmp_path):
    from rlhflab.eval import kl_to_reference
    from rlhflab.rollout.roles import PolicyRoles
    from rlhflab.rollout.rollout import collect_rollout

    tokenizer = models.build_tokenizer(["Add 1 and 2. Answer"], vocab_size=270)
    policy = models.build_tiny_model(tokenizer, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    other = models.build_tiny_model(tokenizer, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    recording = Recording()
    use_backend(policy, recording)
    assert backends.backend_of(policy) is recording and backends.backend_of(other) is LEAN
    ids = [tokenizer("Add 1 and 2.")["input_ids"]] * 2
    collect_rollout(PolicyRoles(policy, value_mode="none", reference=other), ids, pad_id=tokenizer.pad_token_id,
                    eos_id=tokenizer.eos_token_id, settings=SAMPLED)
    generate_answers(policy, tokenizer, ["Add 1 and 2."] * 3, SAMPLED, batch_size=2)  # two batches
    kl_to_reference(policy, other, tokenizer, ["Add 1 and 2."], samples=2, response_length=4, temperature=1.0,
                    batch_size=8, seed=0)
    generate_answers(other, tokenizer, ["Add 1 and 2."], SAMPLED)  # unbound: lean, not the recording
    assert recording.calls == 1 + 2 + 1
    bound = len(backends._BOUND)
    del policy
    gc.collect()
    assert len(backends._BOUND) == bound - 1  # the binding ends with the model


def test_engine_token_lists_come_back_laid_out_as_rollout_generate_lays_them_out():
    model = build("llama")
    settings = GenerationSettings(max_new_tokens=6, do_sample=True)
    lean = generate(model, PROMPTS * 4, pad_id=PAD, eos_id=EOS, settings=settings,
                    generator=torch.Generator().manual_seed(0))
    assert 0 < lean.ended_with_eos.sum() < 16  # both kinds of rows: stopped at EOS and capped
    kept = [ids[mask].tolist() for ids, mask in zip(lean.response_ids, lean.response_mask)]
    stopped = lean.ended_with_eos.tolist()
    without_eos = [k[:-1] if s else k for k, s in zip(kept, stopped)]  # an engine may leave the stop token out
    for responses in (kept, without_eos):
        out = generated_from_tokens(PROMPTS * 4, responses, stopped, pad_id=PAD, eos_id=EOS, device="cpu")
        for field in ("query_ids", "query_mask", "response_ids", "response_mask", "ended_with_eos"):
            assert torch.equal(getattr(out, field), getattr(lean, field)), field


def test_engine_token_lists_with_pad_equal_to_eos_mask_only_real_tokens():
    out = generated_from_tokens([[4], [5, 6], [7]], [[7, 1], [8, 9, 3], [2]], [True, False, False],
                                pad_id=1, eos_id=1, device="cpu")
    assert out.response_ids.tolist() == [[7, 1, 1], [8, 9, 3], [2, 1, 1]]
    # row 3 stopped short without EOS (an aborted request): its padding (== EOS) is not a real EOS
    assert out.response_mask.tolist() == [[True, True, False], [True, True, True], [True, False, False]]
    assert out.ended_with_eos.tolist() == [True, False, False]
    assert out.query_ids.tolist() == [[1, 4], [5, 6], [1, 7]] and out.query_mask.tolist()[0] == [False, True]


def test_vllm_is_refused_at_config_check_time_where_it_cannot_run(tmp_path, monkeypatch):
    from importlib.util import find_spec

    from rlhflab.config import EvalConfig
    from rlhflab.eval import evaluate

    from rlhflab.trainers import ppo

    for name in ("lean", "hf"):
        ppo.check_config(PPOConfig(model="no/such/folder", generation_backend=name))  # nothing loads at check time
    with pytest.raises(UserInputError, match="vllm_gpu_memory_utilization"):
        backends.check_backend(PPOConfig(model="m", generation_backend="vllm", vllm_gpu_memory_utilization=1.5))
    with monkeypatch.context() as patched:  # several processes: refused, whatever this machine has
        patched.setenv("WORLD_SIZE", "2")
        with pytest.raises(UserInputError, match="runs in one process; this run has 2") as err:
            ppo.check_config(PPOConfig(model="no/such/folder", generation_backend="vllm"))
        assert "--generation_backend lean" in str(err.value)
        ppo.check_config(PPOConfig(model="no/such/folder", generation_backend="lean"))
    if find_spec("vllm") is not None and torch.cuda.is_available():
        pytest.skip("vLLM and a CUDA GPU are both here: nothing to refuse")
    with pytest.raises(UserInputError) as err:
        ppo.check_config(PPOConfig(model="no/such/folder", generation_backend="vllm"))
    text = str(err.value)
    assert "--generation_backend vllm" in text and "rlhflab[vllm]" in text
    assert ("vllm package" in text) == (find_spec("vllm") is None)
    assert ("CUDA GPU" in text) == (not torch.cuda.is_available())
    with pytest.raises(UserInputError, match="generation_backend vllm"):  # before `rlhflab eval` loads the model
        evaluate(EvalConfig(model="no/such/folder", generation_backend="vllm", output_dir=str(tmp_path / "eval")))
    assert not (tmp_path / "eval").exists()


def test_the_configured_backend_is_bound_to_the_policy(tmp_path):
    from tinyhf import save_suite_model

    from rlhflab.trainers.online.setup import build_roles

    folder = save_suite_model(tmp_path / "policy")
    for name, expected in (("hf", HF), ("lean", LEAN)):
        roles, _ = build_roles(PPOConfig(model=folder, generation_backend=name, lora_r=2, progress=False))
        assert backends.backend_of(roles.policy) is expected


def test_prompt_seeds_follow_the_run_generator():
    draw = lambda seed: backends.prompt_seeds(torch.Generator().manual_seed(seed), 6)  # noqa: E731
    assert draw(0) == draw(0) and draw(0) != draw(1) and len(set(draw(0))) == 6
    assert all(0 <= s < 2**31 for s in draw(0))


def test_sampling_arguments_match_rollout_generate_s_settings():
    greedy = sampling_arguments(GenerationSettings(12, do_sample=False, temperature=0.7, top_k=5), eos_id=3, seed=9)
    assert (greedy["temperature"], greedy["top_k"], greedy["top_p"]) == (0.0, 0, 1.0)  # vLLM's greedy
    sampled = sampling_arguments(GenerationSettings(12, True, 0.7, top_k=5, top_p=0.9), eos_id=3, seed=9)
    assert (sampled["temperature"], sampled["top_k"], sampled["top_p"], sampled["max_tokens"]) == (0.7, 5, 0.9, 12)
    assert sampled["stop_token_ids"] == [3] and sampled["ignore_eos"] and sampled["seed"] == 9
    assert sampled["logprobs"] == 0  # the sampled token's own log-prob comes back with it


def test_the_engine_s_log_probs_of_its_tokens_are_laid_out_with_them():
    """vLLM's per-token {token id: Logprob} -> Generated.sampler_logprobs, aligned with the responses."""
    from types import SimpleNamespace

    from rlhflab.rollout.vllm_backend import sampled_logprobs

    def completion(tokens, logprobs):
        steps = [{t: SimpleNamespace(logprob=lp, rank=1), 99: SimpleNamespace(logprob=-9.0, rank=2)}
                 for t, lp in zip(tokens, logprobs)]
        return SimpleNamespace(token_ids=tokens, logprobs=steps)

    rows = sampled_logprobs([completion([7, 1], [-0.5, -0.25]), completion([8, 9, 3], [-1.0, -2.0, -3.0])])
    assert rows == [[-0.5, -0.25], [-1.0, -2.0, -3.0]]
    assert sampled_logprobs([completion([7], [-0.5]), SimpleNamespace(token_ids=[8], logprobs=None)]) is None
    out = generated_from_tokens([[4], [5, 6]], [[7, 1], [8, 9, 3]], [True, False], pad_id=PAD, eos_id=EOS,
                                device="cpu", sampler_logprobs=rows)
    assert out.sampler_logprobs.tolist() == [[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0]]
    # an EOS the engine left out is appended without a log-prob: NaN there (the rollout puts the trainer's own)
    out = generated_from_tokens([[4]], [[7]], [True], pad_id=PAD, eos_id=EOS, device="cpu", sampler_logprobs=[[-0.5]])
    assert out.response_ids.tolist() == [[7, EOS]] and out.sampler_logprobs[0, 0].item() == -0.5
    assert torch.isnan(out.sampler_logprobs[0, 1])
    from rlhflab.rollout.rollout import sampler_logprobs_of

    assert sampler_logprobs_of(out, torch.tensor([[-0.75, -0.25]])).tolist() == [[-0.5, -0.25]]
    assert VLLMBackend("m").engine_arguments["logprobs_mode"] == "processed_logprobs"


def lora_llama(r=4):
    torch.manual_seed(0)
    policy = models.apply_lora(build("llama"), r=r, alpha=8)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # B starts at 0: make the adapter matter
    return policy


def test_a_lora_policy_s_weights_reach_an_engine_merged_under_plain_checkpoint_names():
    policy = lora_llama()
    plain = build("llama")
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    with torch.no_grad(), models.merged_adapter(policy):
        weights = dict(backends.checkpoint_weights(policy))
        assert list(weights) == [n for n, _ in plain.named_parameters()]
        q = policy.base_model.model.model.layers[0].self_attn.q_proj
        base = before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
        merged = base + (8 / 4) * q.lora_B["default"].weight @ q.lora_A["default"].weight  # W + alpha / r * B @ A
        torch.testing.assert_close(weights["model.layers.0.self_attn.q_proj.weight"], merged, rtol=0, atol=1e-6)
        assert (merged - base).abs().max() > 0.1
        assert torch.equal(weights["model.embed_tokens.weight"], plain.model.embed_tokens.weight)  # not adapted
    assert all(torch.equal(p, before[n]) for n, p in policy.named_parameters())  # the base is back, bit for bit


def test_adapters_that_cannot_be_merged_are_refused_before_any_engine_starts():
    torch.manual_seed(0)
    from peft import LoraConfig, get_peft_model

    dora = get_peft_model(build("llama"), LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    backend = VLLMBackend("unused-folder")
    with pytest.raises(UserInputError, match="cannot be merged"):
        backend.push_weights(dora)
    assert backend.llm is None


def test_the_vllm_engine_computes_in_vllm_dtype_whatever_the_training_dtype():
    """vLLM's engine is built lazily (vllm imported at its first generation): its arguments are checkable anywhere."""
    from rlhflab.config import PPOConfig

    config = PPOConfig(model="m", generation_backend="vllm")  # training storage float32
    assert config.dtype == "float32"
    assert backends._vllm_from_config(config, "m", 256).engine_arguments["dtype"] == "bfloat16"
    half = PPOConfig(model="m", generation_backend="vllm", dtype="bfloat16", vllm_dtype="float16")
    assert backends._vllm_from_config(half, "m", 256).engine_arguments["dtype"] == "float16"
