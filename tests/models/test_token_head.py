"""Log-probs through `models.HeadInputs` chunk by chunk equal the whole-logits ones, on real forwards.

`LOGITS_CHUNK_BYTES` is shrunk so that the tiny models' few hundred pieces go 3 positions a chunk: the chunked path
(core/logprobs.py) then runs where the whole logits would otherwise be formed. Rows are left-padded prompts of
different lengths with sampled answers (the rollout's layout), packed rows (SFT), and packed pairs (DPO).
"""

import pytest
import torch

from rlhflab import data, models, tasks
from rlhflab.models import token_head
from rlhflab.rollout.generate import GenerationSettings, generate
from rlhflab.rollout.roles import PolicyRoles
from rlhflab.trainers import dpo_logps, sft


def tiny(arch: str, lora: bool = False):
    tokenizer = models.build_tokenizer(tasks.template_corpus(), vocab_size=256)
    model = models.build_tiny_model(tokenizer, arch=arch, hidden_size=32, num_layers=2, num_heads=4,
                                    intermediate_size=64, seed=0)
    models.disable_dropout(model)
    if lora:
        model = models.apply_lora(model, r=4, alpha=8, dropout=0.0, target_modules="all-linear")
        with torch.no_grad():  # B starts at zero: move it so the adapter matters
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    return model, tokenizer


def chunked(monkeypatch, positions: int, vocab: int) -> list[int]:
    """Make `token_head` cut chunks of `positions` positions at this vocabulary; the chunk sizes it then uses
    are appended to the list returned (so a test sees that the chunked path did run)."""
    monkeypatch.setattr(token_head, "LOGITS_CHUNK_BYTES", positions * vocab * 4)
    used = []
    for name in ("chunked_head_logprobs", "recomputed_head_logprobs"):
        def spy(*args, _real=getattr(token_head, name), **kwargs):
            used.append(kwargs["chunk"])
            return _real(*args, **kwargs)
        monkeypatch.setattr(token_head, name, spy)
    return used


def both_ways(monkeypatch, vocab: int, compute):
    """compute() with the logits whole, then 3 positions a chunk; each (values, gradients)."""
    whole = compute()
    used = chunked(monkeypatch, 3, vocab)
    parts = compute()
    assert used and set(used) == {3}
    return whole, parts


def assert_same(whole, parts, atol=1e-6):
    """Values within `atol`; each parameter's gradient within 4 `atol` of its largest entry: it sums over every
    position in another order (chunk by chunk, and in the frozen-head form through precomputed vectors)."""
    (v1, g1), (v2, g2) = whole, parts
    torch.testing.assert_close(v2, v1, atol=atol, rtol=1e-6)
    worst = max((a - b).abs().max().item() / max(1.0, a.abs().max().item()) for a, b in zip(g1, g2))
    assert worst <= 4 * atol, worst


@pytest.mark.parametrize("arch,lean,lora", [("llama", True, False), ("llama", False, False), ("qwen2", True, True),
                                            ("gpt2", False, False), ("gpt2", False, True)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_logprobs_and_entropy_chunked_equal_whole(monkeypatch, arch, lean, lora, temperature):
    model, tokenizer = tiny(arch, lora)
    items = tasks.build_splits(0, 22, 11, 11)["train"][:3]
    ids = data.encode_prompts(tokenizer, [i.prompt for i in items for _ in range(2)])  # ragged: left padding
    out = generate(model, ids, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                   settings=GenerationSettings(8, True, 1.0), generator=torch.Generator().manual_seed(0))
    roles = PolicyRoles(model, value_mode="none", lora=lora, lean=lean)
    roles.train(True)
    params = [p for p in model.parameters() if p.requires_grad]
    mask = out.response_mask
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))

    def compute():
        scores, _ = roles.logits_and_values(out.query_ids, out.query_mask, out.response_ids, mask)
        assert isinstance(scores, models.HeadInputs)
        logprobs, entropy = models.token_logprobs_and_entropy(scores, out.response_ids, temperature)
        grads = torch.autograd.grad((weights * logprobs)[mask].sum(), params)
        return torch.cat([logprobs[mask], entropy[mask]]).detach(), grads

    assert_same(*both_ways(monkeypatch, len(tokenizer), compute))


def test_the_reference_logprobs_chunked_equal_whole(monkeypatch):
    model, tokenizer = tiny("llama", lora=True)
    ids = data.encode_prompts(tokenizer, ["Say yes.", "Add 1 and 2. Answer as RESULT: <sum>"])
    out = generate(model, ids, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                   settings=GenerationSettings(8, True, 1.0), generator=torch.Generator().manual_seed(0))
    roles = PolicyRoles(model, value_mode="none", lora=True)
    args = (out.query_ids, out.query_mask, out.response_ids, out.response_mask)
    whole = roles.reference_logprobs(*args, temperature=0.8)
    used = chunked(monkeypatch, 2, len(tokenizer))
    parts = roles.reference_logprobs(*args, temperature=0.8)
    assert used == [2]
    torch.testing.assert_close(parts[out.response_mask], whole[out.response_mask], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("packed", [True, False])
def test_sft_loss_chunked_equals_whole(monkeypatch, packed):
    model, tokenizer = tiny("llama" if packed else "gpt2")
    examples = [data.TokenizedSFT(prompt, completion) for prompt, completion in
                [([5, 6], [7, 8, 1]), ([9], [10, 1]), ([11, 12, 13], [14, 15, 16, 1])]]
    params = [p for p in model.parameters() if p.requires_grad]

    def compute():
        if packed:
            loss = sft.packed_loss_sum(model, models.pack_sequences(
                [(e.prompt_ids + e.completion_ids, len(e.prompt_ids)) for e in examples], pad_id=0, row_length=12))
        else:
            loss = sft.completion_loss_sum(model, data.collate_sft(examples, pad_id=0))
        return loss.detach(), torch.autograd.grad(loss, params)

    assert_same(*both_ways(monkeypatch, len(tokenizer), compute), atol=1e-5)


@pytest.mark.parametrize("packed", [True, False])
def test_dpo_token_logps_chunked_equal_whole(monkeypatch, packed):
    model, tokenizer = tiny("llama")
    pairs = [dpo_logps.PreferencePair([5, 6, 7, 8, 9, 1], [5, 6, 7, 10, 1], 3, 3),
             dpo_logps.PreferencePair([5, 11, 12, 1], [5, 11, 13, 14, 1], 2, 2)]
    params = [p for p in model.parameters() if p.requires_grad]

    def compute():
        logps = dpo_logps.token_logps(model, dpo_logps.pair_batch(pairs, 0, packed))
        return logps.detach(), torch.autograd.grad(logps.sum(), params)

    assert_same(*both_ways(monkeypatch, len(tokenizer), compute))


def test_logits_chunk_mib_sets_the_chunks_and_zero_forms_the_logits_whole(monkeypatch):
    monkeypatch.setattr(token_head, "LOGITS_CHUNK_BYTES", token_head.LOGITS_CHUNK_BYTES)  # restored after the test
    models.configure_logits_chunks(1)
    assert token_head.LOGITS_CHUNK_BYTES == 1 << 20 and token_head.chunk_rows(151936) == 1
    used = chunked(monkeypatch, 3, 50)
    models.configure_logits_chunks(0)
    hidden, weight = torch.randn(4, 5, 8), torch.nn.Linear(8, 50, bias=False)
    tokens = torch.randint(0, 50, (4, 5))
    got = models.token_logprobs(models.HeadInputs(hidden, weight), tokens)
    assert used == []  # whole, though 20 positions are more than 3 a chunk
    want = torch.log_softmax(weight(hidden), dim=-1).gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
