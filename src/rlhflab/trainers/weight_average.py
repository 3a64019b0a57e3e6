"""A running mean of a model's weights over the last steps of training (stochastic weight
averaging, Izmailov et al. 2018; for reward models see WARM, Ramé et al. 2024).

The mean of the weights a constant or slowly decaying learning rate visits near the end of
training sits nearer the middle of the basin than any single iterate: its scores are less
tied to the last mini-batches seen. Under a schedule that decays to zero the last iterates
are close together already, so the gain is smaller. The state is a plain dict of tensors plus a count, so it travels in
a checkpoint's `progress` and a resumed run averages exactly as an uninterrupted one.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def first_averaged_step(total_steps: int, fraction: float) -> int:
    """The first step whose weights enter the mean: the last `fraction` of `total_steps` (0 = none)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"weight-averaging fraction must be in [0, 1], got {fraction}")
    if fraction == 0.0:
        return total_steps + 1
    return total_steps - max(1, math.ceil(fraction * total_steps)) + 1


class WeightAverage:
    """Mean of the trainable parameters after each included step, kept in float32 on each
    parameter's device (a bf16 running mean drifts by more than the weights it averages)."""

    def __init__(self, model: nn.Module, state: dict | None = None):
        """`state`: what `state()` returned, possibly back from a checkpoint (tensors on the CPU)."""
        self.model = model
        params = dict(model.named_parameters())
        self.names = [n for n, p in params.items() if p.requires_grad]
        self.count = 0
        self.mean: dict[str, torch.Tensor] = {}
        if state:
            self.count = int(state["count"])
            self.mean = {n: t.to(params[n].device, torch.float32) for n, t in state["mean"].items()}

    def update(self) -> None:
        """Fold the model's current weights into the mean."""
        self.count += 1
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name in self.names:
                p = params[name].detach().float()
                if name not in self.mean:
                    self.mean[name] = p.clone()
                else:
                    self.mean[name].add_(p - self.mean[name], alpha=1.0 / self.count)

    def state(self) -> dict:
        """The count and the means, for a checkpoint's progress."""
        return {"count": self.count, "mean": self.mean}

    def apply(self) -> bool:
        """Copy the mean into the model; False (model untouched) when no step was averaged."""
        if not self.count:
            return False
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, value in self.mean.items():
                params[name].copy_(value)  # copy_ casts back to the parameter's dtype
        return True
