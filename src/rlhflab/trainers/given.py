"""What a caller hands a stage in memory instead of naming it in the config (the Python API, rlhflab.api)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlhflab.callbacks import Callback


@dataclass(frozen=True)
class Given:
    """Reward functions with their weights (TRL's `reward_funcs` signature, besides any `--reward_fn`), a
    verifier (in place of `--verifier`) and callbacks. The command line hands none of them."""

    reward_functions: Sequence[tuple[Callable, float]] = ()
    verifier: Callable | None = None
    callbacks: Sequence[Callback] = ()


NOTHING = Given()
