"""The last layer at the read positions only (`lean_hidden`'s `read`) and the packed prompt pass
(models/prompt_pass.py) give the numbers of the plain padded forward."""

import pytest
import torch

from rlhflab import data, models, tasks
from rlhflab.models.prompt_pass import prompt_pass, prompt_rows


def tiny(arch: str, num_kv_heads: int | None = None):
    tokenizer = models.build_tokenizer(tasks.template_corpus(), vocab_size=256)
    model = models.build_tiny_model(tokenizer, arch=arch, hidden_size=32, num_layers=2, num_heads=4,
                                    intermediate_size=64, seed=0)
    if num_kv_heads is not None:  # grouped-query attention: rebuild with fewer key / value heads
        config = model.config
        config.num_key_value_heads = num_kv_heads
        torch.manual_seed(0)
        model = type(model)(config)
    models.disable_dropout(model)
    return tokenizer, model.train(True)


def suite_prompts(tokenizer, count: int):
    items = tasks.build_splits(0, 40, 11, 11)["train"][:count]
    ids, mask = data.left_pad(data.encode_prompts(tokenizer, [i.prompt for i in items]), tokenizer.pad_token_id)
    return ids, mask.bool(), data.position_ids_from_mask(mask.long())


def test_read_columns_lists_flagged_columns_in_order_then_repeats():
    flags = torch.tensor([[False, True, False, True], [False, False, False, False], [True, True, True, False]])
    read, valid = models.read_columns(flags)
    assert read.tolist() == [[1, 3, 1], [0, 0, 0], [0, 1, 2]]
    assert valid.tolist() == [[True, True, False], [False, False, False], [True, True, True]]


@pytest.mark.parametrize(("arch", "kv_heads"), [("llama", None), ("qwen2", None), ("llama", 2)])
def test_reading_some_positions_equals_the_full_forward_values_and_gradients(arch, kv_heads):
    tokenizer, model = tiny(arch, kv_heads)
    plan = models.plan_lean(model, allow_training=True)
    ids, mask, positions = suite_prompts(tokenizer, 6)
    flags = torch.rand(ids.shape, generator=torch.Generator().manual_seed(0)) < 0.3
    flags[:, -1] = True  # every row's last token, and some of its others (padding ones too) ...
    flags[2] = False  # ... but one row reads nothing
    read, valid = models.read_columns(flags)
    full = models.lean_hidden(plan, ids, mask, positions)[flags]
    part = models.lean_hidden(plan, ids, mask, positions, read=read)[valid]
    torch.testing.assert_close(part, full, rtol=0, atol=1e-5)
    weights = torch.randn(full.shape, generator=torch.Generator().manual_seed(1))
    params = [p for p in model.parameters() if p.requires_grad]
    g_full = torch.autograd.grad((full * weights).sum(), params)
    g_part = torch.autograd.grad((part * weights).sum(), params)
    for a, b in zip(g_full, g_part):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-3)  # grads are ~1e2, summed in another order


def test_prompt_rows_pack_each_prompt_whole_with_its_own_positions_and_attention():
    # lengths 5, 2, 3, 1 left-padded to 5: rows of width 5 hold {5}, {3, 2}, {1} -> 15 slots instead of 20 ...
    ids = torch.tensor([[11, 12, 13, 14, 15], [0, 0, 0, 21, 22], [0, 0, 31, 32, 33], [0, 0, 0, 0, 41]])
    mask = ids != 0
    positions = data.position_ids_from_mask(mask.long())
    rows = prompt_rows(ids, mask, positions, pad_id=0)
    assert rows.slots is not None and rows.input_ids.numel() < ids.numel()
    flat_ids, flat_positions = rows.input_ids.reshape(-1), rows.position_ids.reshape(-1)
    assert torch.equal(flat_ids[rows.slots][mask], ids[mask])  # every prompt token is in its slot ...
    assert torch.equal(flat_positions[rows.slots][mask], positions[mask])  # ... at its own position
    width = rows.input_ids.shape[1]
    for n in range(4):  # a token reads exactly its own prompt's tokens up to itself
        real = rows.slots[n][mask[n]]
        for i, slot in enumerate(real.tolist()):
            row, column = divmod(slot, width)
            readable = (rows.allowed[row, column].nonzero().squeeze(1) + row * width).tolist()
            assert readable == real[: i + 1].tolist()
    # each prompt's last token, through `read` and `last`
    last_columns = rows.read.reshape(-1)[rows.last]
    assert torch.equal(rows.input_ids[rows.slots[:, -1] // width, last_columns], ids[:, -1])


def test_prompts_that_would_pack_poorly_run_as_they_are():
    ids = torch.tensor([[11, 12, 13], [21, 22, 23]])  # equal lengths: nothing to save
    rows = prompt_rows(ids, ids != 0, data.position_ids_from_mask(torch.ones_like(ids)), pad_id=0)
    assert rows.slots is None and torch.equal(rows.input_ids, ids)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prompt_pass_equals_the_padded_forward_keys_values_last_state_and_gradients(arch):
    tokenizer, model = tiny(arch)
    plan = models.plan_lean(model, allow_training=True)
    ids, mask, positions = suite_prompts(tokenizer, 8)
    assert prompt_rows(ids, mask, positions, 0).slots is not None  # ragged suite prompts are packed
    kv: list = []
    padded_last = models.lean_hidden(plan, ids, mask, positions, kv_keep=kv)[:, -1]
    packed = prompt_pass(plan, ids, mask, positions)
    torch.testing.assert_close(packed.last_hidden, padded_last, rtol=0, atol=1e-5)
    real = mask[:, None, :, None]  # padding slots hold no key a real token reads
    for (k, v), k_packed, v_packed in zip(kv, packed.keys, packed.values):
        torch.testing.assert_close(k_packed * real, k * real, rtol=0, atol=1e-5)
        torch.testing.assert_close(v_packed * real, v * real, rtol=0, atol=1e-5)
    weights = torch.randn(padded_last.shape, generator=torch.Generator().manual_seed(2))
    key_weights = torch.randn(kv[0][0].shape, generator=torch.Generator().manual_seed(3)) * real
    params = [p for p in model.parameters() if p.requires_grad]
    g_padded = torch.autograd.grad((padded_last * weights).sum() + (kv[0][0] * key_weights).sum(), params)
    g_packed = torch.autograd.grad((packed.last_hidden * weights).sum() + (packed.keys[0] * key_weights).sum(),
                                   params)
    for a, b in zip(g_padded, g_packed):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-3)  # grads are ~1e2, summed in another order


def test_value_model_lean_path_equals_its_own_forward_at_the_kept_positions():
    tokenizer, model = tiny("llama")
    value = models.ValueModel(model.model)
    torch.nn.init.normal_(value.value_head.summary.weight, generator=torch.Generator().manual_seed(4))
    ids, mask, positions = suite_prompts(tokenizer, 5)
    own = value(ids, mask.long(), positions)[:, -7:]
    lean = value(ids, mask.long(), positions, keep=7, lean=True)
    assert models.plan_lean(value.backbone, allow_training=True) is not None  # the lean path really ran
    torch.testing.assert_close(lean[mask[:, -7:]], own[mask[:, -7:]], rtol=0, atol=1e-5)


def test_a_batch_with_an_empty_prompt_runs_unpacked():
    ids = torch.tensor([[0, 0, 0], [0, 21, 22], [31, 32, 33]])  # the first prompt has no token
    mask = ids != 0
    rows = prompt_rows(ids, mask, data.position_ids_from_mask(mask.long()), pad_id=0)
    assert rows.slots is None and torch.equal(rows.input_ids, ids)
