"""Rollouts sampled in a second process while the trainer trains: `--async_generation --max_staleness k`.

The generator process holds its own copy of the policy. The trainer asks for rollout u (its prompts) once the
weights of update u - 1 - k are pushed, and trains update u on what comes back:

    trainer   push v0 | ask 1..1+k | train 1 | push v1, ask 2+k | train 2 | push v2, ask 3+k | ...
    generator         | sample 1 (v0), 2 (v0) ... | sample 2+k (v1) | sample 3+k (v2) | ...

Rollout u is always sampled with the weights of update max(start, u - 1 - k), whatever the timing, so an async
run is as reproducible as a synchronous one (the sampling noise is the update's own generator, as in the
synchronous loop); k = 0 samples what the synchronous loop samples, in the other process. Weights travel
through shared memory (torch.multiprocessing): k + 1 slots of the trainable tensors, version v in slot v mod
(k + 1); the slot of v is next written by the push of v + k + 1, which comes after rollout v + k + 1, the last
to read v, was delivered, so a slot is never read while it is written and neither side waits on the other but
for a rollout not yet sampled. Only the trainable tensors travel (LoRA: the adapters); the frozen rest came
with the model when the process started.

The trainer scores the rollout with its own weights (old log-probs = the proximal policy, reference, values,
advantages), and the sampler's log-probs travel with the tokens: the update's per-token importance weights
trainer / sampler (trainers/online: --sampler_correction, token_truncate by default here) correct for the
stale sampler, with weight 1 exactly when k = 0.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import queue
import signal
import sys
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from rlhflab import models
from rlhflab.models.precision import MixedPrecision
from rlhflab.rollout.backends import HF, generate_with, generation_autocast, use_backend
from rlhflab.rollout.generate import Generated, GenerationSettings

log = logging.getLogger("rlhflab")
POLL_S = 1.0  # how often a waiting trainer checks that the generator is still alive


@dataclass(frozen=True)
class GeneratorJob:
    """What the generator process needs besides the policy: how to sample and with how many threads."""

    settings: GenerationSettings
    pad_id: int
    eos_id: int
    backend: str  # lean or hf
    threads: int
    autocast: str  # "no", "bf16", "fp16": the run's mixed precision (sampling runs in the training forward's)
    merge_lora: bool = False  # sample with the LoRA adapter merged into the weights (--lora_merge_generation)


@dataclass(frozen=True)
class Delivered:
    """Rollout `update`'s sampled tokens, the weights' version they were sampled with and the seconds it took."""

    update: int
    version: int
    generated: Generated
    seconds: float


def trainable_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


class AsyncGenerator:
    """The trainer's side: start the process, push weights after each update, ask for rollouts, receive them."""

    def __init__(self, policy: torch.nn.Module, job: GeneratorJob, max_staleness: int, start_version: int):
        ctx = mp.get_context("spawn")
        self.max_staleness, self.start = max_staleness, start_version
        source = trainable_tensors(policy)
        self.slots = [{name: t.detach().clone().share_memory_() for name, t in source.items()}
                      for _ in range(max_staleness + 1)]
        self.versions = ctx.Array("q", [-1] * (max_staleness + 1))
        self.requests, self.results, self.stopping = ctx.Queue(), ctx.Queue(), ctx.Event()
        clone = copy.deepcopy(policy).eval()
        self.push(policy, start_version)
        self.process = ctx.Process(target=serve, args=(clone, self.slots, self.versions, self.requests, self.results,
                                                       self.stopping, os.getpid(), job),
                                   daemon=True, name="rlhflab-generator")
        with main_module_left_alone():
            self.process.start()
        self.received: dict[int, Delivered] = {}
        started = time.perf_counter()
        self._next_result("starting")  # its imports and the model's copy: the run's set-up, not its first update
        self.startup_s = time.perf_counter() - started

    def version_for(self, update: int) -> int:
        """The weights rollout `update` is sampled with."""
        return max(self.start, update - 1 - self.max_staleness)

    def push(self, policy: torch.nn.Module, version: int) -> None:
        """The trainer's weights after update `version` into their slot."""
        slot = version % len(self.slots)
        with torch.no_grad():
            for name, tensor in trainable_tensors(policy).items():
                self.slots[slot][name].copy_(tensor.detach())
        self.versions[slot] = version

    def ask(self, update: int, prompts: list[list[int]], seed: int) -> None:
        """Sample rollout `update` for `prompts` (token ids) with the weights of `version_for(update)`, which must
        have been pushed, drawing with a generator seeded `seed` (the update's own: trainers/online/ranks.py)."""
        version = self.version_for(update)
        if self.versions[version % len(self.slots)] != version:
            raise RuntimeError(f"rollout {update} asked before the weights of update {version} were pushed")
        self.requests.put((update, version, prompts, seed))

    def receive(self, update: int) -> Delivered:
        """Rollout `update`, waiting for it; a generator process that died ends the run with its exit code."""
        self.peek(update)
        return self.received.pop(update)

    def peek(self, update: int) -> Delivered:
        """Rollout `update`, waiting for it, and kept for `receive` (a checkpoint writes the rollouts in flight)."""
        while update not in self.received:
            delivered = self._next_result(f"rollout {update}")
            self.received[delivered.update] = delivered
        return self.received[update]

    def restore(self, delivered: Delivered) -> None:
        """A rollout a checkpoint kept, received again as if the process had just sampled it."""
        self.received[delivered.update] = delivered

    def _next_result(self, awaited: str):
        """The process's next message, checking every POLL_S that it is still alive."""
        ended = (f"the generator process ended (exit code {{}}) before {awaited}: its error, if any, is printed "
                 "above; run without --async_generation to meet it in this process")
        while True:
            try:
                message = self.results.get(timeout=POLL_S)
            except queue.Empty:
                if not self.process.is_alive():
                    raise RuntimeError(ended.format(self.process.exitcode)) from None
                continue
            except (OSError, EOFError, RuntimeError) as err:  # its tensors' file descriptors went with the process
                raise RuntimeError(ended.format(self.process.exitcode)) from err
            if isinstance(message, BaseException):
                raise RuntimeError(f"the generator process failed: {message!r}") from message
            return message

    def close(self) -> None:
        """Stop the process (rollouts asked for and not received are dropped, not sampled)."""
        self.stopping.set()
        if self.process.is_alive():
            self.requests.put(None)
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5)
        for channel in (self.requests, self.results):  # unread bytes must not hold this process at its exit
            channel.cancel_join_thread()


@contextmanager
def main_module_left_alone() -> Iterator[None]:
    """A spawned process runs the parent's main script again (as `__mp_main__`) before its target, which a script
    without an `if __name__ == "__main__":` guard turns into a second training run. Everything the generator
    needs is importable from rlhflab, so the main module is hidden from the start-up data while it is taken."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def serve(policy: torch.nn.Module, slots: list[dict[str, torch.Tensor]], versions, requests, results, stopping,
          trainer_pid: int, job: GeneratorJob) -> None:
    """The generator process: sample each asked rollout with the weights it names, in order, until None or the
    trainer stops it. SIGINT / SIGTERM are the trainer's to act on (Ctrl-C reaches the whole process group): it
    checkpoints, reading the rollouts in flight from here, then stops this process. A trainer that died (SIGKILL,
    the OOM killer) ends it within POLL_S."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(max(job.threads, 1))
    try:
        sample = sampler_of(policy, slots, versions, job)
        results.put("ready")
        while (request := next_request(requests, stopping, trainer_pid)) is not None:
            results.put(sample(*request))
    except BaseException as err:  # the trainer raises it where it waits; the tensors already sent stay readable
        results.put(RuntimeError(f"{type(err).__name__}: {err}"))
        while next_request(requests, stopping, trainer_pid) is not None:
            pass


def next_request(requests, stopping, trainer_pid: int):
    """The next request, or None once the trainer asks to stop or is gone."""
    while not stopping.is_set() and os.getppid() == trainer_pid:
        try:
            return requests.get(timeout=POLL_S)
        except queue.Empty:
            continue
    return None


def sampler_of(policy: torch.nn.Module, slots: list[dict[str, torch.Tensor]], versions, job: GeneratorJob):
    """sample(update, version, prompts, seed) -> Delivered: the rollout sampled with that version's weights."""
    if job.backend == "hf":
        use_backend(policy, HF)
    elif job.backend != "lean":
        raise ValueError(f"async generation samples with the lean or hf backend, not {job.backend}")
    device = next(policy.parameters()).device
    autocast = MixedPrecision(job.autocast, device.type).autocast
    params, loaded = trainable_tensors(policy), [-1]

    def sample(update: int, version: int, prompts: list[list[int]], seed: int) -> Delivered:
        started = time.perf_counter()
        if version != loaded[0]:
            slot = version % len(slots)
            if versions[slot] != version:
                raise RuntimeError(f"rollout {update}: slot {slot} holds update {versions[slot]}, not {version}")
            with torch.no_grad():
                for name, tensor in params.items():
                    tensor.copy_(slots[slot][name])
            loaded[0] = version
        merged = models.merged_adapter(policy) if job.merge_lora else contextlib.nullcontext()
        with torch.no_grad(), merged, generation_autocast(policy, autocast):
            out = generate_with(policy, prompts, pad_id=job.pad_id, eos_id=job.eos_id, settings=job.settings,
                                generator=torch.Generator(device=device).manual_seed(seed))
        return Delivered(update, version, out, time.perf_counter() - started)

    return sample
