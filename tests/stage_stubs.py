"""Stand-ins shared by the SFT and DPO unit tests (tests/trainers/test_sft_unit.py, test_dpo_unit.py): a 6-token
Llama, a one-process parallel.Wrapped that records its forwards and sync flags, the optimiser step captured, and a
progress bar that records what it was asked to show."""

from contextlib import contextmanager
from types import SimpleNamespace

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhflab import parallel

PAD = 0


def tiny_llama() -> LlamaForCausalLM:
    """Vocabulary 6 (PAD 0, EOS 1), one layer of width 8, seeded, in training mode."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=6, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, pad_token_id=PAD, eos_token_id=1)
    return LlamaForCausalLM(config).train()


class RecordingWrapped:
    """parallel.Wrapped of one process, recording each forward's arguments and each sync flag."""

    def __init__(self, model):
        self.model, self.world, self.forwards, self.syncs = model, parallel.SINGLE, [], []

    def __call__(self, fn, *args):
        self.forwards.append((fn, *args))
        return fn(self.model, *args)

    @contextmanager
    def sync(self, enabled):
        self.syncs.append(enabled)
        yield

    def backward(self, loss_part):
        loss_part.backward()


def captured_step(monkeypatch, trainer, grad_norm) -> list[dict]:
    """`trainer.clip_and_step` replaced: records its arguments and the gradients it would clip; returns `grad_norm`."""
    calls = []

    def capture(optimizer, scheduler, params, max_grad_norm, loss, mode, stage, engine=None, precision=None):
        params = list(params)
        calls.append(dict(optimizer=optimizer, scheduler=scheduler, params=params, max_grad_norm=max_grad_norm,
                          loss=loss, mode=mode, stage=stage, engine=engine, precision=precision,
                          grads=[p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]))
        return grad_norm

    monkeypatch.setattr(trainer, "clip_and_step", capture)
    return calls


class RecordingBar:
    """What `tqdm(steps, **shown)` is handed and then told: the steps, the settings, each postfix, a close."""

    def __init__(self, steps, **shown):
        self.steps, self.shown, self.postfixes, self.closed = list(steps), shown, [], False

    def __iter__(self):
        return iter(self.steps)

    def set_postfix(self, **fields):
        self.postfixes.append(fields)

    def close(self):
        self.closed = True


def recorded_run_setup(monkeypatch, trainer, calls: list, tokenizer, clock) -> None:
    """`trainer`'s clock, thread / logits-chunk / seed settings, tokenizer loading and gradient checkpointing replaced,
    each call recorded in `calls`; the tokenizer loads as `tokenizer`, the clock reads `clock()`."""
    monkeypatch.setattr(trainer, "time", SimpleNamespace(time=clock))
    monkeypatch.setattr(trainer, "configure_threads", lambda n: calls.append(("threads", n)))
    monkeypatch.setattr(trainer.models, "configure_logits_chunks", lambda mib: calls.append(("logits_chunks", mib)))
    monkeypatch.setattr(trainer, "seed_everything", lambda *a: calls.append(("seed", *a)))
    monkeypatch.setattr(trainer.models, "load_tokenizer", lambda *a, **k: calls.append(("tokenizer", a, k)) or tokenizer)
    monkeypatch.setattr(trainer.models, "enable_gradient_checkpointing", lambda *a: calls.append(("checkpointing", *a)))


def recording_bars(monkeypatch, trainer) -> list[RecordingBar]:
    """`trainer.tqdm` replaced by RecordingBar; the bars made, in order."""
    bars = []
    monkeypatch.setattr(trainer, "tqdm", lambda steps, **shown: bars.append(RecordingBar(steps, **shown)) or bars[-1])
    return bars
