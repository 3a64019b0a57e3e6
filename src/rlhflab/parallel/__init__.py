"""Several processes, one run: a thin layer over torch.distributed and its engines (DDP, FSDP2; DeepSpeed
through accelerate). Trainers call this; they never call torch.distributed themselves (DESIGN.md).

Layer 1 (beside models and tracking): it knows processes, tensors and modules, never configs or run folders.
docs/scaling-out.md "Several processes"; /work/notes/parallel_api.md is the API in one page.
"""

from rlhflab.parallel.batch import Share, local_batch_size, share_of, take
from rlhflab.parallel.reduce import (all_max, all_mean, all_min, all_sum, gather_objects, gather_rows,
                                     masked_mean_std, max_metrics, mean_metrics, sum_metrics, total)
from rlhflab.parallel.world import SINGLE, World, fail_if_asked, init_world, launched_ranks, shutdown_world
from rlhflab.parallel.wrap import (STRATEGIES, Layout, Wrapped, holds_shards, require_deepspeed, resolve_strategy,
                                   wrap_frozen, wrap_model)

__all__ = [
    "SINGLE", "STRATEGIES", "Layout", "Share", "World", "Wrapped", "all_max", "all_mean", "all_min", "all_sum",
    "fail_if_asked", "gather_objects", "gather_rows", "holds_shards", "init_world", "launched_ranks",
    "local_batch_size", "masked_mean_std", "max_metrics", "mean_metrics", "require_deepspeed", "resolve_strategy",
    "share_of", "shutdown_world", "sum_metrics", "take", "total", "wrap_frozen", "wrap_model",
]
