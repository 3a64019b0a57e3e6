"""Reductions over every rank: sums, means, mean and std, gathers; for statistics and metrics.

Statistics that define an update (whitening means, group baselines, score means, the KL controller's
input) must be computed over all ranks (DESIGN.md). Two ways, both here:

- exact: `gather_rows` every rank's (B_local, ...) rows into the global (B, ...) batch, in rank order,
  which is the global batch's position order (`batch.share_of`), and compute the statistic as a single
  process would (e.g. `core` whitening on the gathered scores; slice your block back with `Share`);
- streaming: `all_sum` of local sums and counts, or `masked_mean_std` (float64 accumulators).

Results are new tensors, never part of an autograd graph; in one process the input comes back as is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from rlhflab.parallel.world import World


def _reduced(t: Tensor, world: World, op) -> Tensor:
    if not world.distributed:
        return t
    out = t.detach().to(world.device, copy=True)
    dist.all_reduce(out, op=op)
    return out.to(t.device)


def all_sum(t: Tensor, world: World) -> Tensor:
    """Elementwise sum over ranks."""
    return _reduced(t, world, dist.ReduceOp.SUM)


def all_max(t: Tensor, world: World) -> Tensor:
    return _reduced(t, world, dist.ReduceOp.MAX)


def all_min(t: Tensor, world: World) -> Tensor:
    return _reduced(t, world, dist.ReduceOp.MIN)


def all_mean(t: Tensor, world: World) -> Tensor:
    """Elementwise mean over ranks (equal weights: use `all_sum` of sums and counts for unequal shares)."""
    return all_sum(t, world) / world.world_size if world.distributed else t


def total(value: float | int, world: World) -> float | int:
    """A Python number summed over ranks (a count of tokens, of rows; an int stays an int)."""
    if not world.distributed:
        return value
    summed = all_sum(torch.tensor([float(value)], dtype=torch.float64), world).item()
    return round(summed) if isinstance(value, int) else summed


def masked_mean_std(values: Tensor, mask: Tensor | None, world: World, unbiased: bool = True) -> tuple[Tensor, Tensor]:
    """Mean and std of `values` where `mask` is True, over every rank's elements (scalars, float32).

    Sums, sums of squares and counts in float64, one all_reduce: the statistics of whitening
    (`core.whiten`) over the global batch. `unbiased`: divide by n - 1, as torch.var does."""
    mask = torch.ones_like(values, dtype=torch.bool) if mask is None else mask.bool()
    v = values.detach().double()[mask]
    moments = torch.stack([v.sum(), (v * v).sum(), torch.tensor(float(v.numel()), dtype=torch.float64)])
    s, sq, n = all_sum(moments, world).tolist()
    mean = s / max(n, 1.0)
    var = max(sq - n * mean * mean, 0.0) / max(n - 1.0 if unbiased else n, 1.0)
    return torch.tensor(mean, dtype=torch.float32), torch.tensor(var ** 0.5, dtype=torch.float32)


def gather_rows(t: Tensor, world: World) -> Tensor:
    """Every rank's rows (dim 0, sizes may differ), concatenated in rank order, on every rank."""
    if not world.distributed:
        return t
    local = t.detach().to(world.device)
    sizes = [torch.zeros(1, dtype=torch.long, device=world.device) for _ in range(world.world_size)]
    dist.all_gather(sizes, torch.tensor([local.shape[0]], dtype=torch.long, device=world.device))
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros((longest, *local.shape[1:]), dtype=local.dtype, device=world.device)
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(world.world_size)]
    dist.all_gather(parts, padded)
    return torch.cat([p[: int(n.item())] for p, n in zip(parts, sizes)]).to(t.device)


def gather_objects(value, world: World) -> list:
    """[rank 0's value, rank 1's, ...] on every rank (picklable objects: answers, per-row records)."""
    if not world.distributed:
        return [value]
    out = [None] * world.world_size
    dist.all_gather_object(out, value)
    return out


def _metric_vector(metrics: dict[str, float]) -> Tensor:
    return torch.tensor([float(v) for v in metrics.values()], dtype=torch.float64)


def sum_metrics(metrics: dict[str, float], world: World) -> dict[str, float]:
    """Each value summed over ranks (every rank must pass the same keys, in the same order)."""
    if not world.distributed:
        return metrics
    return dict(zip(metrics, all_sum(_metric_vector(metrics), world).tolist()))


def mean_metrics(metrics: dict[str, float], world: World, weight: float = 1.0) -> dict[str, float]:
    """Each value's mean over ranks, weighted by `weight` (e.g. this rank's rows or tokens)."""
    if not world.distributed:
        return metrics
    vector = torch.cat([_metric_vector(metrics) * weight, torch.tensor([float(weight)], dtype=torch.float64)])
    summed = all_sum(vector, world).tolist()
    return {key: value / summed[-1] for key, value in zip(metrics, summed[:-1])}


def max_metrics(metrics: dict[str, float], world: World) -> dict[str, float]:
    if not world.distributed:
        return metrics
    return dict(zip(metrics, all_max(_metric_vector(metrics), world).tolist()))
