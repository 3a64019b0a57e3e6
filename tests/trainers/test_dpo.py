"""DPO / IPO / SimPO math through the trainer's own log-prob function: hand-worked losses on a bigram model,
no gradient from prompt or padding, packed == padded == a naive per-sequence forward, precomputed reference
== resident reference (and not kept), gradient accumulation, loss log 2 at the start."""

import gc
import json
import math
import weakref

import pytest
import torch
from tinyhf import save_suite_model
from transformers import LlamaConfig, LlamaForCausalLM

from rlhflab import data, models, parallel, tasks
from rlhflab.config import DPOConfig
from rlhflab.trainers import dpo
from rlhflab.trainers.dpo_data import PreferencePair, load_dpo_data, tokenize_preferences
from rlhflab.trainers.dpo_logps import pair_batch, precompute_logps, select, sequence_logps

LN = math.log
# Bigram policy: after token i the next is SUCC[i] with probability 1/2, each of the other 5 with 1/10.
SUCC = {0: 2, 1: 2, 2: 1, 3: 4, 4: 2, 5: 3}
PAD, EOS, PROMPT_ONLY = 0, 1, 5  # token 5 only ever opens a prompt: nothing it predicts is scored
# prompt [5, 3]: chosen 4 2 EOS (each the successor: 3 x log 1/2), rejected 3 EOS (2 x log 1/10)
# prompt [5, 4]: chosen 2 EOS (2 x log 1/2), rejected 4 3 EOS (3 x log 1/10)
PAIRS = [PreferencePair([5, 3, 4, 2, 1], [5, 3, 3, 1], 2, 2), PreferencePair([5, 4, 2, 1], [5, 4, 4, 3, 1], 2, 2)]
POLICY_SUMS = {"chosen": [-3 * LN(2), -2 * LN(2)], "rejected": [-2 * LN(10), -3 * LN(10)]}
REFERENCE_SUMS = {"chosen": [-3 * LN(6), -2 * LN(6)], "rejected": [-2 * LN(6), -3 * LN(6)]}  # uniform over 6


def bigram_llama(uniform: bool = False) -> LlamaForCausalLM:
    """A 1-layer Llama that is exactly a bigram table: attention and MLP outputs are zero, so the final norm
    sees the one-hot embedding e_i scaled to sqrt(8) e_i, and lm_head column i holds log P(. | i) / sqrt(8)."""
    config = LlamaConfig(vocab_size=6, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1e-12, pad_token_id=PAD,
                         eos_token_id=EOS, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    table = torch.full((6, 6), 0.1)  # (previous, next)
    for prev, nxt in SUCC.items():
        table[prev, nxt] = 0.5
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in (model.model.norm, model.model.layers[0].input_layernorm,
                     model.model.layers[0].post_attention_layernorm):
            norm.weight.fill_(1.0)
        model.model.embed_tokens.weight[:, :6] = torch.eye(6)
        if not uniform:
            model.lm_head.weight[:, :6] = table.log().T / math.sqrt(8)
    return model.train()


@pytest.mark.parametrize("packed", [True, False])
def test_the_bigram_model_gives_the_hand_worked_sequence_log_probs(packed):
    logps = sequence_logps(bigram_llama(), pair_batch(PAIRS, PAD, packed))
    assert torch.allclose(logps.chosen, torch.tensor(POLICY_SUMS["chosen"]), atol=1e-5)
    assert torch.allclose(logps.rejected, torch.tensor(POLICY_SUMS["rejected"]), atol=1e-5)
    assert logps.chosen_tokens.tolist() == [3, 2] and logps.rejected_tokens.tolist() == [2, 3]
    reference = precompute_logps(bigram_llama(uniform=True), PAIRS, PAD, packed)
    assert torch.allclose(reference.chosen, torch.tensor(REFERENCE_SUMS["chosen"]), atol=1e-5)
    assert torch.allclose(reference.rejected, torch.tensor(REFERENCE_SUMS["rejected"]), atol=1e-5)


# DPO on sums: beta * h = beta * ln 75 (pair 1: 3 ln 3 + 2 ln 10 - 2 ln 6) and beta * ln(125 / 3) (pair 2).
# IPO and SimPO on per-token means: both pairs have mean log-probs -ln 2 (chosen) and -ln 10 (rejected), and
# the uniform reference's means cancel, so h = ln 5.
HAND_WORKED = {
    ("sigmoid", 0.1, 0.0): (math.log1p(75 ** -0.1) + math.log1p((125 / 3) ** -0.1)) / 2,
    ("sigmoid", 0.1, 0.2): sum(0.8 * math.log1p(x ** -0.1) + 0.2 * math.log1p(x ** 0.1) for x in (75, 125 / 3)) / 2,
    ("ipo", 0.5, 0.0): (LN(5) - 1.0) ** 2,  # (h - 1 / (2 beta))^2
    ("ipo", 0.1, 0.0): (LN(5) - 5.0) ** 2,
    ("simpo", 2.0, 0.0): math.log1p(math.exp(-(2.0 * LN(5) - 0.5))),  # -log sigmoid(beta h - gamma), gamma 0.5
}


@pytest.mark.parametrize("loss_type,beta,smoothing", sorted(HAND_WORKED))
@pytest.mark.parametrize("packed", [True, False])
def test_each_loss_on_the_trainers_log_probs_matches_hand_worked_numbers(loss_type, beta, smoothing, packed):
    cfg = DPOConfig(model="unused", loss_type=loss_type, beta=beta, label_smoothing=smoothing, simpo_gamma=0.5)
    reference = precompute_logps(bigram_llama(uniform=True), PAIRS, PAD, packed)
    loss, stats = dpo.preference_loss(cfg, sequence_logps(bigram_llama(), pair_batch(PAIRS, PAD, packed)),
                                      reference if loss_type != "simpo" else None)
    assert loss.item() == pytest.approx(HAND_WORKED[(loss_type, beta, smoothing)], abs=1e-5)
    assert stats["rewards/accuracies"] == 1.0 and stats["rewards/margins"] > 0
    if loss_type == "sigmoid":  # rewards beta (log pi - log pi_ref) on sums, averaged over the two pairs
        expected = beta * sum(p - r for p, r in zip(POLICY_SUMS["chosen"], REFERENCE_SUMS["chosen"])) / 2
        assert stats["rewards/chosen"] == pytest.approx(expected, abs=1e-5)
        assert stats["logps/chosen"] == pytest.approx(sum(POLICY_SUMS["chosen"]) / 2, abs=1e-5)
    else:  # IPO and SimPO read per-token means
        assert stats["logps/chosen"] == pytest.approx(-LN(2), abs=1e-5)
        assert stats["logps/rejected"] == pytest.approx(-LN(10), abs=1e-5)


@pytest.mark.parametrize("packed", [True, False])
def test_padding_and_prompt_tokens_get_no_gradient(packed):
    """In the bigram model lm_head column t and embedding row t get gradient only from positions holding t that
    predict a scored token: the prompt-only token and the padding must get exactly none, the others some."""
    model = bigram_llama()
    logps = sequence_logps(model, pair_batch(PAIRS, PAD, packed))
    (logps.chosen.sum() - logps.rejected.sum()).backward()
    head, embed = model.lm_head.weight.grad, model.model.embed_tokens.weight.grad
    for token in (PAD, PROMPT_ONLY):
        assert torch.count_nonzero(head[:, token]) == 0 and torch.count_nonzero(embed[token]) == 0
    for token in (2, 3, 4):  # every token that predicts a completion token
        assert torch.count_nonzero(head[:, token]) > 0


@pytest.fixture(scope="module")
def suite_dir(tmp_path_factory):
    return save_suite_model(tmp_path_factory.mktemp("policy"))


def suite_pairs(tokenizer, n=6, max_length=160):
    items = tasks.build_splits(0, 22, 11, 11)["train"][:n]
    rows = tasks.pair_rows(items, pairs_per_prompt=1, seed=0)
    examples = [data.PairExample(r["prompt"], r["chosen"], r["rejected"]) for r in rows]
    return tokenize_preferences(examples, tokenizer, max_length)


def naive_logps(model, pairs):
    """Each sequence alone through the model's own HF forward; completion tokens summed."""
    out = []
    for pair in pairs:
        for seq, start in ((pair.chosen, pair.chosen_start), (pair.rejected, pair.rejected_start)):
            logits = model(input_ids=torch.tensor([seq])).logits[0].float()  # (L, V)
            logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
            out.append(logp[max(start - 1, 0) :].sum())  # start 0: prompt cut away whole, token 0 has no logit
    return torch.stack(out).view(-1, 2)  # (B, 2): chosen, rejected


@pytest.mark.parametrize("arch,packed", [("llama", True), ("llama", False), ("gpt2", False), ("qwen2", True)])
def test_batched_log_probs_and_gradients_equal_each_sequence_alone(suite_dir, arch, packed):
    tokenizer = models.load_tokenizer(suite_dir)
    model = models.build_tiny_model(tokenizer, arch=arch, hidden_size=32, num_layers=2, num_heads=4,
                                    intermediate_size=64, seed=1).train()
    models.disable_dropout(model)
    pairs = suite_pairs(tokenizer) + suite_pairs(tokenizer, 6, max_length=20)  # some prompts cut from the left
    logps = sequence_logps(model, pair_batch(pairs, tokenizer.pad_token_id, packed))
    (logps.chosen.sum() - 2 * logps.rejected.sum()).backward()
    batched_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    naive = naive_logps(model, pairs)
    (naive[:, 0].sum() - 2 * naive[:, 1].sum()).backward()
    assert torch.allclose(logps.chosen, naive[:, 0], atol=1e-4) and torch.allclose(logps.rejected, naive[:, 1], atol=1e-4)
    for batched, alone in zip(batched_grads, (p.grad for p in model.parameters())):
        assert torch.allclose(batched, alone, atol=1e-5)


def tiny_cfg(model_dir, **overrides) -> DPOConfig:
    base = dict(model=model_dir, num_train_prompts=22, num_validation_prompts=11, num_test_prompts=11,
                pairs_per_prompt=2, batch_size=8, eval_prompts=4, max_new_tokens=6, progress=False, threads=1,
                learning_rate=1e-3, log_every=1, eval_every=0)
    return DPOConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def other_reference(suite_dir, tmp_path_factory):
    """A reference that is not the policy: the suite model re-initialised with another seed."""
    tokenizer = models.load_tokenizer(suite_dir)
    model = models.build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, seed=7)
    return str(models.save_model_folder(tmp_path_factory.mktemp("reference"), model, tokenizer))


def test_precomputed_reference_equals_a_resident_reference_and_is_not_kept(suite_dir, other_reference, monkeypatch):
    cfg = tiny_cfg(suite_dir, reference=other_reference)
    policy, tokenizer = dpo.build_policy(cfg)
    pairs = load_dpo_data(cfg, tokenizer)
    loaded = []
    load = models.load_causal_lm
    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: loaded.append(load(*a, **k)) or loaded[-1])
    precomputed = dpo.reference_logps(cfg, policy, pairs, tokenizer.pad_token_id)
    gone = weakref.ref(loaded.pop())
    gc.collect()
    assert gone() is None  # read once, then freed: the reference is not resident during training

    resident = models.load_causal_lm(other_reference).train()  # as a resident reference would run: training batches
    batch_ids = [5, 0, 17, 3, 9, 30, 12, 21]
    with torch.no_grad():
        live = sequence_logps(resident, pair_batch([pairs.train[i] for i in batch_ids], tokenizer.pad_token_id, True))
    stored = select(precomputed["train"], batch_ids)
    for name in ("chosen", "rejected", "chosen_tokens", "rejected_tokens"):
        assert torch.allclose(getattr(stored, name), getattr(live, name), atol=1e-5), name
    assert precomputed["validation"].chosen.shape == (len(pairs.validation),)


def test_gradient_accumulation_and_length_chunks_give_the_gradient_of_one_big_batch(suite_dir, monkeypatch):
    captured = []

    def capture(optimizer, scheduler, params, max_grad_norm, loss, mode, stage, engine=None, precision=None):
        captured.append(([p.grad.clone() for p in params], loss))
        optimizer.zero_grad()
        return torch.tensor(0.0)

    monkeypatch.setattr(dpo, "clip_and_step", capture)
    for steps, chunks in ((1, 1), (3, 1), (1, 3), (2, 2)):
        cfg = tiny_cfg(suite_dir, gradient_accumulation_steps=steps, length_chunks=chunks)
        policy, tokenizer = dpo.build_policy(cfg)
        pairs = load_dpo_data(cfg, tokenizer)
        reference = dpo.reference_logps(cfg, policy, pairs, tokenizer.pad_token_id)["train"]
        with torch.no_grad():  # move the policy off the reference, so the loss has a real gradient
            for p in policy.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
        ids = list(range(8))
        dpo.train_step(parallel.wrap_model(policy, parallel.SINGLE), optimizer, None, [pairs.train[i] for i in ids],
                       select(reference, ids), parallel.share_of(len(ids), parallel.SINGLE), cfg, True,
                       tokenizer.pad_token_id)
    (one, loss_one), *others = captured
    assert any(g.abs().sum() > 0 for g in one)
    for grads, loss in others:
        assert loss == pytest.approx(loss_one, abs=1e-6)
        for a, b in zip(one, grads):
            assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("overrides,expected", [
    (dict(), math.log(2)),
    (dict(lora_r=4), math.log(2)),
    (dict(label_smoothing=0.1), math.log(2)),
    (dict(loss_type="ipo", beta=0.25), 4.0),  # (0 - 1 / (2 beta))^2
])
def test_the_first_loss_is_the_one_of_policy_equal_to_reference(suite_dir, tmp_path, overrides, expected):
    result = dpo.train(tiny_cfg(suite_dir, output_dir=str(tmp_path / "run"), max_steps=2, **overrides))
    first = json.loads((result.run_dir / "metrics.jsonl").read_text().splitlines()[1])  # row 0: evaluation
    assert first["step"] == 1
    assert first["loss"] == pytest.approx(expected, abs=1e-6)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert first["rewards/accuracies"] == 0.0  # ties are not accuracies (TRL)
