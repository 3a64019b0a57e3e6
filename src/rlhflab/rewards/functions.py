"""A practitioner's own reward and verifier functions, with TRL's `reward_funcs` signature.

    # my_rewards.py
    def exact(prompts, completions, answer, **kwargs):
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

    rlhflab ppo --train_file math.jsonl --reward_fn my_rewards.py:exact --verifier my_rewards.py:exact_bool

As TRL hands them: on standard (string) prompts, `prompts` and `completions` are lists of
strings (the completion is the text up to EOS); on conversational prompts (message lists),
`prompts` are the message lists and each completion is `[{"role": "assistant", "content": text}]`,
so `completion[0]["content"]` reads it. Every other column of the prompt rows arrives as a
keyword argument holding one value per row; during training also `completion_ids` (each
response's token ids, its EOS included, as TRL's) and `trainer_state` (`.global_step` only: the optimiser
steps done, as TRL counts them). A
function without `**kwargs` gets only the arguments it names. A reward returns one float per
row, or None where it cannot score that row: that row is left out of the update and counted.
A verifier returns one bool per row. An exception inside the function is reported with the
function's name, the row, where the row came from and its prompt.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from rlhflab.data.prompt_rows import PromptRow, column_lists
from rlhflab.errors import UserInputError
from rlhflab.rewards.base import Check, ScoreContext, Scored, check_lengths, scored

UserFunction = Callable[..., Sequence]


def load_function(spec: str, flag: str = "--reward_fn") -> UserFunction:
    """`path/to/file.py:NAME` or `package.module:NAME` -> the callable it names."""
    module_name, sep, name = spec.strip().rpartition(":")
    if not sep or not module_name or not name:
        raise UserInputError(f"{spec!r} does not name a function", flag,
                             "write FILE.py:NAME (e.g. my_rewards.py:exact) or package.module:NAME")
    module = _load_module(module_name, flag)
    if not hasattr(module, name):
        available = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                           and getattr(v, "__module__", None) == module.__name__)
        raise UserInputError(f"{module_name} has no function {name!r}", flag,
                             f"functions defined there: {', '.join(available) or 'none'}")
    fn = getattr(module, name)
    if not callable(fn):
        raise UserInputError(f"{spec} is a {type(fn).__name__}, not a function", flag)
    return fn


def _load_module(module_name: str, flag: str):
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise UserInputError(f"file not found: {module_name}", flag,
                                 f"give a path relative to {Path.cwd()} or an absolute one")
        unique = f"rlhflab_user_{abs(hash(str(path.resolve())))}_{path.stem}"
        loader_spec = importlib.util.spec_from_file_location(unique, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[unique] = module  # dataclasses and pickling inside the file need it registered
        try:
            loader_spec.loader.exec_module(module)
        except Exception as err:
            raise UserInputError(f"importing {module_name} failed: {type(err).__name__}: {err}", flag) from err
        return module
    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        raise UserInputError(f"cannot import module {module_name!r} ({err})", flag,
                             "install it, put it on PYTHONPATH, or pass a file path ending in .py") from err


def function_name(fn: UserFunction) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


class UserFunctionCall:
    """Calls `fn(prompts=..., completions=..., **columns)` and names the failing row when it raises."""

    def __init__(self, fn: UserFunction, what: str, name: str | None = None):
        self.fn, self.what = fn, what
        self.name = name or function_name(fn)
        params = inspect.signature(fn).parameters.values() if _inspectable(fn) else ()
        self.takes_all = not params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        self.named = {p.name for p in params}

    def __call__(self, prompts: list[str], completions: list[str], rows: Sequence[PromptRow],
                 context: ScoreContext | None = None) -> list:
        try:
            out = self._call(prompts, completions, rows, context)
        except Exception as err:  # a user function's own error: find the row it fails on
            raise self._located(err, prompts, completions, rows, context) from err
        if isinstance(out, torch.Tensor):
            out = out.tolist()
        if not isinstance(out, (list, tuple)) or len(out) != len(prompts):
            got = f"{len(out)} values" if isinstance(out, (list, tuple)) else f"a {type(out).__name__}"
            raise UserInputError(f"{self.what} {self.name} returned {got} for {len(prompts)} completions",
                                 self.name, "return a list with one value per completion, in the order given")
        return list(out)

    def _call(self, prompts, completions, rows, context: ScoreContext | None):
        arguments = column_lists(rows)
        for name in ("prompts", "completions", "completion", *TRAINER_ARGUMENTS):  # TRL leaves a dataset's own
            arguments.pop(name, None)  # completion out too: `completions` are the policy's
        arguments.update(trainer_arguments(context))
        if not self.takes_all:
            arguments = {k: v for k, v in arguments.items() if k in self.named}
        if rows and all(row.messages is not None for row in rows):  # conversational data: TRL's messages
            prompts = [list(row.messages) for row in rows]
            completions = [[{"role": "assistant", "content": text}] for text in completions]
        return self.fn(prompts=list(prompts), completions=list(completions), **arguments)

    def _located(self, err: Exception, prompts, completions, rows, context) -> UserInputError:
        for i in range(len(prompts)):
            try:
                self._call(prompts[i:i + 1], completions[i:i + 1], rows[i:i + 1],
                           None if context is None else context.rows(i, i + 1))
            except Exception as row_err:  # noqa: BLE001 - reported below
                where = f" ({rows[i].where})" if rows[i].where else ""
                return UserInputError(
                    f"{self.what} {self.name} raised {type(row_err).__name__}: {row_err} on row {i}{where}, "
                    f"prompt {_short(prompts[i])}, completion {_short(completions[i])}", self.name,
                    "fix the function (it must accept every row of the data), or fix that row")
        return UserInputError(f"{self.what} {self.name} raised {type(err).__name__}: {err} on the batch of "
                              f"{len(prompts)} rows (no single row fails alone)", self.name)


TRAINER_ARGUMENTS = ("completion_ids", "trainer_state")  # a dataset column of either name is not passed on


def trainer_arguments(context: ScoreContext | None) -> dict:
    """TRL's extra keyword arguments from what the trainer knows: `completion_ids` and `trainer_state`."""
    if context is None:
        return {}
    extra = {"trainer_state": context}
    if context.completion_ids is not None:
        extra["completion_ids"] = [list(ids) for ids in context.completion_ids]
    return extra


def _inspectable(fn) -> bool:
    try:
        inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    return True


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


class FunctionReward:
    """A user reward function as a reward source: floats, None / NaN marking rows it cannot score."""

    def __init__(self, fn: UserFunction, name: str | None = None):
        self.call = UserFunctionCall(fn, "reward function", name)
        self.name = self.call.name

    def __call__(self, prompts: list[str], responses: list[str], rows: Sequence[PromptRow],
                 context: ScoreContext | None = None) -> Scored:
        check_lengths(prompts, responses, rows)
        values = self.call(prompts, responses, rows, context)
        scores = torch.tensor([_as_float(v, self.name, i) for i, v in enumerate(values)], dtype=torch.float32)
        return scored(scores, torch.isfinite(scores))


def _as_float(value, name: str, row: int) -> float:
    if value is None:
        return math.nan
    if isinstance(value, (bool, int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1):
        return float(value)
    raise UserInputError(f"reward function {name} returned a {type(value).__name__} for row {row}", name,
                         "return a float (or None where the row cannot be scored)")


class FunctionVerifier:
    """A user verifier: pass / fail per row (None counts as a failure, kind "unverified")."""

    def __init__(self, fn: UserFunction, name: str | None = None):
        self.call = UserFunctionCall(fn, "verifier", name)
        self.name = self.call.name

    def __call__(self, prompts: list[str], completions: list[str], rows: Sequence[PromptRow],
                 ended_with_eos: Sequence[bool] | None = None) -> list[Check]:
        checks = []
        for i, value in enumerate(self.call(prompts, completions, rows)):
            if value is None:
                checks.append(Check(False, "unverified", f"{self.name} could not check this row"))
            elif isinstance(value, (bool, int, float)) and value in (0, 1):
                passed = bool(value)
                checks.append(Check(passed, "pass" if passed else "fail", "" if passed else f"{self.name}: fail"))
            else:
                raise UserInputError(f"verifier {self.name} returned {value!r} for row {i}", self.name,
                                     "return True / False (or None where it cannot check the row)")
        return checks
