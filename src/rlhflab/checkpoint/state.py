"""Run state <-> JSON + tensors, without pickle.

Optimiser and scheduler `state_dict()`s, RNG states and a trainer's loop counters are
nested dicts / lists / tuples of numbers, strings, tensors and numpy arrays. `encode`
turns such a structure into JSON, moving every tensor into a flat dict (saved with
safetensors) and leaving `{"__tensor__": key}` in its place; `decode` reverses it
exactly: dict keys keep their type (AdamW's state is keyed by int), tuples stay tuples,
and floats round-trip bit for bit (JSON writes the shortest repr that reads back equal).
"""

from __future__ import annotations

import random
from typing import Any, Callable

import numpy as np
import torch

from rlhflab.errors import UserInputError

_TENSOR, _TUPLE, _DICT, _ARRAY = "__tensor__", "__tuple__", "__dict__", "__ndarray__"


def encode(obj: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """JSON-able form of `obj`; its tensors go into `tensors` under their path."""
    if isinstance(obj, torch.Tensor):
        key = path or "tensor"
        tensors[key] = obj.detach().cpu().clone().contiguous()  # own storage: safetensors refuses shared ones
        return {_TENSOR: key}
    if isinstance(obj, np.ndarray):
        return {_ARRAY: obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return {_TUPLE: [encode(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode(v, tensors, f"{path}/{k}") for k, v in obj.items()}
        return {_DICT: [[encode(k, tensors, f"{path}/key{i}"), encode(v, tensors, f"{path}/{k}")]
                        for i, (k, v) in enumerate(obj.items())]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot checkpoint a {type(obj).__name__} at '{path}' without pickle")


def decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of `encode`."""
    if isinstance(obj, list):
        return [decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if _TENSOR in obj:
        return tensors[obj[_TENSOR]]
    if _ARRAY in obj:
        return np.array(obj[_ARRAY], dtype=obj["dtype"])
    if _TUPLE in obj:
        return tuple(decode(v, tensors) for v in obj[_TUPLE])
    if _DICT in obj:
        return {_hashable(decode(k, tensors)): decode(v, tensors) for k, v in obj[_DICT]}
    return {k: decode(v, tensors) for k, v in obj.items()}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


# --- RNG --------------------------------------------------------------------------------


def rng_state(generators: dict[str, torch.Generator] | None = None) -> dict:
    """python `random`, numpy, torch CPU (and CUDA) global RNGs, plus a trainer's own generators."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "generators": {name: g.get_state() for name, g in (generators or {}).items()}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict, generators: dict[str, torch.Generator] | None = None) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for name, g in (generators or {}).items():
        if name in state["generators"]:  # a generator added since the checkpoint was written keeps its seed
            g.set_state(state["generators"][name])


# --- weights ----------------------------------------------------------------------------


def trainable_weights(modules: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """`{"<module>.<param>": tensor}` for every trainable parameter (a tied weight once).

    Frozen weights (a LoRA base, the reference) come back from the model folder the run
    starts from, so they are not copied into every checkpoint.
    """
    out = {}
    for prefix, module in modules.items():
        for name, p in module.named_parameters():
            if p.requires_grad:
                out[f"{prefix}.{name}"] = p.detach()
    return out


@torch.no_grad()
def load_trainable_weights(modules: dict[str, torch.nn.Module], weights: dict[str, torch.Tensor],
                           where: str) -> None:
    """Copy `weights` into the trainable parameters; the names and shapes must match exactly."""
    params = {f"{prefix}.{n}": p for prefix, m in modules.items() for n, p in m.named_parameters() if p.requires_grad}
    missing, extra = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    if missing or extra:
        raise UserInputError(f"checkpoint weights do not fit this model (missing {missing[:3]}, unexpected "
                             f"{extra[:3]})", where, "resume with the model and LoRA / value settings of the run")
    for name, p in params.items():
        if weights[name].shape != p.shape:
            raise UserInputError(f"checkpoint weight {name} has shape {tuple(weights[name].shape)}, the model "
                                 f"{tuple(p.shape)}", where)
        p.copy_(weights[name].to(p.device, p.dtype))


def all_finite(weights: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in weights.values() if t.is_floating_point())


# --- optimiser and LR schedule -----------------------------------------------------------


def load_optimiser(optimizer: torch.optim.Optimizer, scheduler, state: dict, where: str,
                   load_moments: Callable[[], None] | None = None) -> None:
    """Moments and step counts from a checkpoint; hyperparameters from the config the run resumes with.

    `optimizer` and `scheduler` (a LambdaLR, as transformers' schedules are) are freshly built
    from the config. `load_state_dict` would bring back the checkpoint's lr / betas / eps /
    weight_decay and the schedule's peak lr, so a resume with `--allow_config_change` would
    silently keep training with the old values. They are put back from the fresh build, and the
    current lr is recomputed as peak · schedule(step) with the fresh schedule (warmup, decay,
    length), exactly as `scheduler.step()` computes it: an unchanged config resumes bit for bit.
    `load_moments`: how the optimiser's own state comes back when it is not in `state` (FSDP2 shards,
    read by every rank through torch.distributed.checkpoint); the same hyperparameter rule applies.
    """
    hyper = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in optimizer.param_groups]
    base_lrs = list(scheduler.base_lrs)
    try:
        load_moments() if load_moments is not None else optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    except (ValueError, KeyError, RuntimeError, TypeError) as err:
        raise UserInputError(f"the checkpoint's optimiser / LR-schedule state does not fit this run ({err})", where,
                             "resume with the model, LoRA and value settings of the run") from err
    scheduler.base_lrs = base_lrs
    for group, fresh, base_lr, lmbda in zip(optimizer.param_groups, hyper, base_lrs, scheduler.lr_lambdas,
                                            strict=True):
        group.update(fresh)
        group["lr"] = base_lr * lmbda(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
