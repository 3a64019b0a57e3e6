"""What the online loop does with a monitor: feed it, log its alarms, stop, keep the best policy.

The alarms and the stopping rule live in `rlhflab.eval` (a layer above trainers), so
the loop only knows the small `Monitor` protocol below; `rlhflab.eval.RunMonitor`
implements it and the callers (cli, demo) pass one in. Without a monitor the loop
runs exactly as before: no alarms, no early stop, no best-policy restore.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from rlhflab.rollout.roles import PolicyRoles
from rlhflab.tracking import RunDir

log = logging.getLogger("rlhflab")


class Monitor(Protocol):
    def observe(self, step: int, metrics: dict) -> list[dict]:
        """Take one logged row (update or evaluation); return alarms fired at it: {"name", "step", "reason"}."""
        ...

    def stop_reason(self) -> str | None:
        """Why the run should stop now, or None to go on."""
        ...


class BestPolicy:
    """CPU copy of every trainable tensor (policy, LoRA adapters, value head) at the best held-out value.

    A copy of the trainable parameters only (adapters alone under LoRA); fine at the
    sizes this library trains on one machine. Full checkpoints are `rlhflab.checkpoint`'s job.
    Several processes: every rank offers and restores at the same updates (they read the same numbers);
    FSDP2 shards are kept whole (gathered: a collective), so a checkpoint written by rank 0 holds them.
    """

    def __init__(self, roles: PolicyRoles):
        self.params = roles.trainable_parameters()
        self.state: list[torch.Tensor] | None = None
        self.step: int | None = None
        self.pass_rate = float("-inf")  # the held-out signal's value (val/pass_rate, or val/reward)
        self.update_row: dict = {}  # the training metrics logged at `step` (empty for step 0)

    def offer(self, step: int, pass_rate: float, update_row: dict) -> None:
        """Keep the current parameters when `pass_rate` beats every earlier one (ties keep the earlier)."""
        if pass_rate > self.pass_rate:
            self.state = [whole(p).to("cpu", copy=True) for p in self.params]
            self.step, self.pass_rate, self.update_row = step, pass_rate, dict(update_row)

    @torch.no_grad()
    def restore(self) -> None:
        for p, saved in zip(self.params, self.state):
            p.copy_(as_held(saved.to(p.device), p))


def whole(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value (an FSDP2 shard is gathered: every rank must call it)."""
    return p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()


def as_held(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`value` (whole) laid out as `p` is held: this rank's shard of it for an FSDP2 parameter."""
    if not hasattr(p, "device_mesh"):
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)  # every rank has it whole


class RunWatch:
    """The loop's side of monitoring; every method is a no-op when `monitor` is None."""

    def __init__(self, monitor: Monitor | None, run: RunDir, roles: PolicyRoles, keep_best: bool,
                 signal: str = "val/pass_rate"):
        self.monitor = monitor
        self.signal = signal  # the held-out metric the best policy is chosen by
        self.update_rows: dict[int, dict] = {}  # latest training row per step, for the best policy's summary
        self.run = run
        self.best = BestPolicy(roles) if monitor is not None and keep_best else None
        self.alarms: list[dict] = []
        self.stopped: dict | None = None
        self.observed: list[tuple[int, dict]] = []  # every row fed to the monitor, to rebuild it on resume

    def observe(self, step: int, metrics: dict) -> None:
        """Feed a row just logged; log each new alarm as `alarm/<name>` = 1 and as a warning."""
        if self.monitor is None:
            return
        self.observed.append((step, dict(metrics)))
        if self.signal not in metrics:
            self.update_rows = {step: dict(metrics)}
        elif self.best is not None:
            self.best.offer(step, float(metrics[self.signal]), self.update_rows.get(step, {}))
        for alarm in self.monitor.observe(step, metrics):
            self.alarms.append(alarm)
            self.run.log({f"alarm/{alarm['name']}": 1}, step=step)
            log.warning("alarm %s at update %d: %s", alarm["name"], step, alarm["reason"])

    def state_dict(self) -> dict:
        """What a checkpoint keeps: alarms so far, the rows the monitor saw, the best policy's tensors."""
        best = None
        if self.best is not None and self.best.state is not None:
            best = {"step": self.best.step, "pass_rate": self.best.pass_rate, "params": self.best.state,
                    "update_row": self.best.update_row}
        return {"alarms": self.alarms, "stopped": self.stopped, "observed": self.observed, "best": best}

    def load_state_dict(self, state: dict) -> None:
        """Rebuild the monitor by replaying the rows it saw (its alarms were already logged: not again)."""
        self.alarms, self.stopped = list(state["alarms"]), state["stopped"]
        self.observed = [(int(step), row) for step, row in state["observed"]]
        if self.monitor is not None:
            for step, row in self.observed:
                self.monitor.observe(step, row)
                if self.signal not in row:
                    self.update_rows = {step: dict(row)}
        if self.best is not None and state["best"] is not None:
            self.best.step, self.best.pass_rate = state["best"]["step"], state["best"]["pass_rate"]
            self.best.state = [t.clone() for t in state["best"]["params"]]
            self.best.update_row = dict(state["best"].get("update_row") or {})

    def should_stop(self, step: int, episode: int) -> bool:
        reason = self.monitor.stop_reason() if self.monitor is not None else None
        if reason:
            self.stopped = {"step": step, "episode": episode, "reason": reason}
            log.warning("stopping early at update %d (episode %d): %s", step, episode, reason)
        return bool(reason)

    def finish(self, step: int, end_pass_rate: float) -> dict:
        """Restore the best policy if the run stopped early or ended below it; summary fields to record.

        `step` is the last update trained, `end_pass_rate` the last evaluation's held-out value.
        Under "best", `restored` says whether the saved policy is the best one, `update_row` holds the
        training metrics logged at its update (what summary.json's "final" must then describe).
        """
        if self.monitor is None:
            return {}
        fields: dict = {"alarms": self.alarms, "stopped": self.stopped}
        if self.best is not None and self.best.state is not None:
            below = self.stopped is not None or end_pass_rate < self.best.pass_rate
            restored = below and self.best.step != step
            if restored:
                self.best.restore()
                log.info("restored the policy of update %d (%s %.3f) before saving",
                         self.best.step, self.signal, self.best.pass_rate)
            fields["best"] = {"step": self.best.step, self.signal: self.best.pass_rate, "restored": restored,
                              "update_row": self.best.update_row}
        return fields
