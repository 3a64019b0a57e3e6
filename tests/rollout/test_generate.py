import pytest
import torch

from rlhflab.rollout import GenerationSettings, generate, response_logprobs, response_mask_after_eos
from rlhflab.rollout.generate import filter_logits

from tinyhf import CONFIGS, EOS, PAD, build


@pytest.fixture(params=sorted(CONFIGS))
def arch_model(request):
    return build(request.param)

GREEDY = GenerationSettings(max_new_tokens=8, do_sample=False)


def test_response_mask_keeps_first_eos_and_drops_the_rest():
    ids = torch.tensor([[5, 1, 7, 1], [5, 6, 7, 8], [1, 9, 9, 9]])
    assert response_mask_after_eos(ids, eos_id=1).tolist() == [
        [True, True, False, False], [True, True, True, True], [True, False, False, False]
    ]


def test_greedy_answer_does_not_depend_on_batch_company(arch_model):
    short = [7, 8, 9]
    long = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    alone = generate(arch_model, [short], pad_id=PAD, eos_id=EOS, settings=GREEDY)
    together = generate(arch_model, [long, short], pad_id=PAD, eos_id=EOS, settings=GREEDY)
    t = alone.response_ids.shape[1]
    assert together.response_ids[1, :t].tolist() == alone.response_ids[0].tolist()


def test_logprobs_do_not_change_with_left_padding(arch_model):
    torch.manual_seed(1)
    query = torch.tensor([[11, 12, 13, 14]])
    response = torch.tensor([[20, 21, 22, EOS]])
    rmask = torch.ones_like(response, dtype=torch.bool)
    base = response_logprobs(arch_model, query, torch.ones_like(query, dtype=torch.bool), response, rmask, 0.7)
    for pad in (1, 5):
        padded = torch.cat([torch.full((1, pad), PAD), query], dim=1)
        qmask = padded != PAD
        got = response_logprobs(arch_model, padded, qmask, response, rmask, 0.7)
        assert torch.allclose(got, base, atol=1e-5), (pad, got, base)


def test_response_logprobs_zero_after_mask():
    model = build("llama")
    query = torch.tensor([[11, 12]])
    response = torch.tensor([[20, EOS, PAD]])
    mask = torch.tensor([[True, True, False]])
    got = response_logprobs(model, query, torch.ones_like(query, dtype=torch.bool), response, mask)
    assert got[0, 2].item() == 0.0 and got[0, 0].item() < 0


def test_generation_stops_as_soon_as_every_sequence_has_eos():
    model = build("llama")
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[EOS] = 1.0  # logits favour EOS whenever hidden state sums positive...
        model.model.norm.weight.fill_(0.0)  # ...and a zero norm makes every logit 0: argmax = token 0
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    out = generate(model, [[5, 6], [7]], pad_id=PAD, eos_id=0, settings=GREEDY, lean=False)
    assert out.response_ids.shape == (2, 1)  # stopped after one token, not at max_new_tokens=8
    assert out.ended_with_eos.tolist() == [True, True]
    assert len(calls) == 1  # only the prefill forward ran
    lean = generate(model, [[5, 6], [7]], pad_id=PAD, eos_id=0, settings=GREEDY)  # the lean loop stops as early
    assert lean.response_ids.shape == (2, 1) and lean.ended_with_eos.tolist() == [True, True]


def test_length_cap_marks_no_eos():
    model = build("gpt2")
    out = generate(model, [[5, 6]], pad_id=PAD, eos_id=39, settings=GenerationSettings(max_new_tokens=3, do_sample=False))
    if out.ended_with_eos.item():  # the random model happened to say EOS: nothing to check
        return
    assert out.response_ids.shape == (1, 3) and out.response_mask.all()


def test_sampling_is_reproducible_with_a_seeded_generator():
    model = build("qwen2")
    settings = GenerationSettings(max_new_tokens=6, do_sample=True, temperature=1.3)
    a = generate(model, [[5, 6], [7, 8, 9]], pad_id=PAD, eos_id=EOS, settings=settings,
                 generator=torch.Generator().manual_seed(3))
    b = generate(model, [[5, 6], [7, 8, 9]], pad_id=PAD, eos_id=EOS, settings=settings,
                 generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.response_ids, b.response_ids)


def test_top_k_and_top_p_filtering_hand_worked():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    k2 = filter_logits(logits, top_k=2, top_p=1.0)
    assert torch.isinf(k2[0, 2:]).all() and torch.isfinite(k2[0, :2]).all()
    # mass before token: 0, 0.5, 0.8, 0.95 -> with top_p=0.8 tokens 0 and 1 stay
    p8 = filter_logits(logits, top_k=0, top_p=0.8)
    assert torch.isfinite(p8[0, :2]).all() and torch.isinf(p8[0, 2:]).all()
    shuffled = logits[:, [3, 1, 0, 2]]
    p8s = filter_logits(shuffled, top_k=0, top_p=0.8)
    assert torch.isfinite(p8s[0, [1, 2]]).all() and torch.isinf(p8s[0, [0, 3]]).all()
