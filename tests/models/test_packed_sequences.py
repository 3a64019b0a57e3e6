"""SFT sequence packing (models/packed_sequences.py) against the padded batch's loss and gradient."""

import random

import pytest
import torch
import torch.nn.functional as F

from rlhflab import data
from rlhflab.models import can_pack_sequences, fill_rows, pack_rows, pack_sequences, packed_target_logits
from rlhflab.trainers.sft import completion_loss_sum, micro_batches, packed_loss_sum
import tinyhf

PAD = tinyhf.PAD


def test_rows_are_filled_best_fit_longest_first():
    rows = fill_rows([5, 3, 4, 2, 1, 6], row_length=6)
    assert rows == [[5], [0, 4], [2, 3], [1]]  # 6 | 5+1 | 4+2 | 3: every row within 6, none could take another
    assert fill_rows([9, 2], row_length=4) == [[0], [1]]  # too long for a row: a row of its own


def test_layout_of_a_packed_row():
    packed = pack_sequences([([7, 8, 9, 1], 2), ([4, 5, 1], 1)], pad_id=PAD, row_length=7)
    assert packed.input_ids.tolist() == [[7, 8, 9, 1, 4, 5, 1]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]  # each sequence from 0
    # targets: the next token where it is a label (9, 1 of the first; 5, 1 of the second), never across sequences
    assert packed.targets.tolist() == [[-100, 9, 1, -100, 5, 1, -100]]
    assert packed.num_label_tokens == 4
    allowed = packed.allowed[0].int().tolist()
    assert allowed[5] == [0, 0, 0, 0, 1, 1, 0]  # the second sequence reads only itself, causally
    assert allowed[3] == [1, 1, 1, 1, 0, 0, 0]


def test_padding_and_a_sequence_with_no_prompt():
    packed = pack_sequences([([3, 4, 5, 1], 0), ([6, 1], 1)], pad_id=PAD)  # row length = the longest, 4
    assert packed.input_ids.tolist() == [[3, 4, 5, 1], [6, 1, PAD, PAD]]
    assert packed.targets.tolist() == [[4, 5, 1, -100], [1, -100, -100, -100]]  # position 0 is never predicted
    assert packed.allowed[1, 2:].sum(-1).tolist() == [1, 1]  # a padding query reads itself only
    assert not packed.allowed[1, :2, 2:].any()  # real tokens never read padding
    with pytest.raises(ValueError):
        pack_rows([([], 0)], [[0]], PAD)


def random_examples(n: int, seed: int) -> list[data.TokenizedSFT]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(2, tinyhf.VOCAB) for _ in range(rng.randint(2, 12))]
        out.append(data.TokenizedSFT(prompt, [rng.randrange(2, tinyhf.VOCAB) for _ in range(rng.randint(1, 6))]
                                     + [tinyhf.EOS]))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_loss_and_gradient_equal_the_padded_ones(arch):
    model = tinyhf.build(arch).train()
    examples = random_examples(24, seed=1)
    padded = micro_batches(examples, PAD, parts=2, packing=False)
    packed = micro_batches(examples, PAD, parts=2, packing=True)
    tokens = sum(b.num_label_tokens for b in padded)
    assert sum(p.num_label_tokens for p in packed) == tokens
    run = lambda loss_fn, batches: sum(loss_fn(model, b) for b in batches) / tokens  # noqa: E731
    loss_padded = run(completion_loss_sum, padded)
    grads_padded = torch.autograd.grad(loss_padded, list(model.parameters()))
    loss_packed = run(packed_loss_sum, packed)
    grads_packed = torch.autograd.grad(loss_packed, list(model.parameters()))
    assert loss_packed.item() == pytest.approx(loss_padded.item(), rel=1e-5)
    for a, b in zip(grads_packed, grads_padded):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # and it runs fewer positions: the padded micro-batches hold more tokens than the packed rows
    assert sum(p.input_ids.numel() for p in packed) < sum(b.input_ids.numel() for b in padded)


def test_logits_at_targets_are_the_models_own():
    model = tinyhf.build("llama")
    packed = pack_sequences([([5, 6, 7, 1], 1), ([8, 9, 1], 1)], pad_id=PAD, row_length=8)
    scores, targets = packed_target_logits(model, packed)
    logits = scores.head(scores.hidden)
    alone = model(input_ids=torch.tensor([[5, 6, 7, 1]])).logits[0, :3]  # predicts 6, 7, 1
    torch.testing.assert_close(logits[:3], alone, rtol=1e-4, atol=1e-5)
    assert targets.tolist() == [6, 7, 1, 9, 1]
    assert F.cross_entropy(logits, targets).isfinite()


def test_only_llama_layouts_pack():
    assert can_pack_sequences(tinyhf.build("llama").train())
    assert not can_pack_sequences(tinyhf.build("gpt2").train())


def test_sft_packs_only_when_asked_and_able():
    from rlhflab.config import SFTConfig
    from rlhflab.trainers.sft import use_packing

    llama = tinyhf.build("llama").train()
    assert use_packing(SFTConfig(), llama)
    assert not use_packing(SFTConfig(packing=False), llama)
    assert not use_packing(SFTConfig(), tinyhf.build("gpt2").train())  # padded, with a log line
