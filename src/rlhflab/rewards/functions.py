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
function's name, the row, where the row came from and its prompt; so is a call that takes longer than
`--reward_timeout` seconds (rewards/deadline.py). Under `--reward_errors invalid` such rows are left out
instead (as a None is) and counted per function (`lost_rows`, summary.json's `reward_errors`). A return
that is not one float (bool) per row is always an error naming the function and the row.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhflab import parallel
from rlhflab.data.prompt_rows import PromptRow, column_lists
from rlhflab.errors import UserInputError
from rlhflab.rewards.base import Check, ScoreContext, Scored, check_lengths, scored
from rlhflab.rewards.deadline import CallTimedOut, call_with_deadline

log = logging.getLogger("rlhflab")
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


ERROR_MODES = ("stop", "invalid")
LOST_KINDS = ("raised", "timed_out")
MAX_ROW_TIMEOUTS = 2  # per call, when rows are called alone to find the ones that fail: the rest are then lost


@dataclass(frozen=True)
class CallLimits:
    """How a user's function is called (`--reward_timeout`, `--reward_errors`): seconds one call may take
    (0 = no limit), and what a row the function raises or times out on does: "stop" ends the run with the
    function's name, the row and its prompt; "invalid" leaves the row out (as a None) and counts it."""

    timeout: float = 600.0
    errors: str = "stop"

    def __post_init__(self) -> None:
        if self.errors not in ERROR_MODES:
            raise UserInputError(f"unknown reward error mode {self.errors!r}", "--reward_errors",
                                 f"choose one of {', '.join(ERROR_MODES)}")
        if not self.timeout >= 0:  # NaN too
            raise UserInputError(f"reward_timeout must be >= 0 seconds, got {self.timeout}", "--reward_timeout",
                                 "give the seconds one call of a reward or verifier function may take, or 0 for no "
                                 "limit")


@dataclass(frozen=True)
class Lost:
    """A row the function raised or timed out on, left out under `--reward_errors invalid`."""

    kind: str  # one of LOST_KINDS
    reason: str


class UserFunctionCall:
    """Calls `fn(prompts=..., completions=..., **columns)` once per batch under `limits.timeout`; when the call
    raises or times out, calls each row alone to name the failing row (stop) or to lose only that row (invalid).

    The call is per batch, as TRL's: a function may score the batch at once (one request to a judge, one
    sandbox); a row is called alone only after the batch call failed. `lost` counts the rows lost so far."""

    def __init__(self, fn: UserFunction, what: str, name: str | None = None, limits: CallLimits = CallLimits()):
        self.fn, self.what, self.limits = fn, what, limits
        self.name = name or function_name(fn)
        params = inspect.signature(fn).parameters.values() if _inspectable(fn) else ()
        self.takes_all = not params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        self.named = {p.name for p in params}
        self.lost = dict.fromkeys(LOST_KINDS, 0)

    def __call__(self, prompts: list[str], completions: list[str], rows: Sequence[PromptRow],
                 context: ScoreContext | None = None) -> list:
        """One value per row, in order; a `Lost` where the function failed on the row (errors="invalid")."""
        try:
            out = self._timed(prompts, completions, rows, context)
        except CallTimedOut as err:
            log.warning("%s %s: no answer after %g s on a batch of %d rows; calling each row alone to find the "
                        "row it hangs on (each up to %g s)", self.what, self.name, err.seconds, len(prompts),
                        self.limits.timeout)
            return self._rows_alone(prompts, completions, rows, context, err)
        except Exception as err:  # a user function's own error: find the rows it fails on
            return self._rows_alone(prompts, completions, rows, context, err)
        return self._checked(out, len(prompts))

    def _timed(self, prompts, completions, rows, context):
        return call_with_deadline(lambda: self._call(prompts, completions, rows, context), self.limits.timeout,
                                  f"{self.what} {self.name}")

    def _checked(self, out, n: int) -> list:
        if hasattr(out, "tolist") and not isinstance(out, (list, tuple)):  # a tensor or numpy array
            out = out.tolist()
        if not isinstance(out, (list, tuple)) or len(out) != n:
            got = f"{len(out)} values" if isinstance(out, (list, tuple)) else f"a {type(out).__name__}"
            raise UserInputError(f"{self.what} {self.name} returned {got} for {n} completions", self.name,
                                 "return a list with one value per completion, in the order given")
        return list(out)

    def _rows_alone(self, prompts, completions, rows, context, batch_err: Exception) -> list:
        out: list = []
        timeouts = 0
        for i in range(len(prompts)):
            if timeouts >= MAX_ROW_TIMEOUTS:  # invalid: stop searching; the rest of the batch is lost
                out.append(Lost("timed_out", f"not called alone after {timeouts} rows timed out"))
                continue
            try:
                out += self._checked(self._timed(prompts[i:i + 1], completions[i:i + 1], rows[i:i + 1],
                                                 None if context is None else context.rows(i, i + 1)), 1)
            except CallTimedOut as err:
                timeouts += 1
                out.append(self._failed(i, "timed_out", err, prompts, completions, rows))
            except UserInputError:
                raise  # a wrong return shape is a bug in the function, not a row's failure
            except Exception as err:  # noqa: BLE001 - the row's failure, reported or counted
                out.append(self._failed(i, "raised", err, prompts, completions, rows))
        lost = [(i, v) for i, v in enumerate(out) if isinstance(v, Lost)]
        if not lost:
            if self.limits.errors == "stop":
                raise self._batch_error(batch_err, len(prompts)) from batch_err
            log.warning("%s; each row's own value kept", self._batch_error(batch_err, len(prompts)).what)
        for _, v in lost:
            self.lost[v.kind] += 1
        if lost:
            more = f"; {len(lost) - 1} more of the batch's {len(prompts)} rows failed too" if len(lost) > 1 else ""
            log.warning("%s%s: left out (--reward_errors invalid)", lost[0][1].reason, more)
        return out

    def _failed(self, i: int, kind: str, err: Exception, prompts, completions, rows) -> Lost:
        """The row's failure: raised at once under errors="stop", else returned as Lost."""
        row = f"row {i}{_where(rows[i])}, prompt {_short(prompts[i])}, completion {_short(completions[i])}"
        if kind == "timed_out":
            at = f"; it was at {err.where}" if err.where else ""
            what = f"{self.what} {self.name} did not return within {err.seconds:g} s on {row}{at}"
            fix = ("make it faster on such rows or give it its own time limit; raise --reward_timeout (0 = no limit), "
                   "or pass --reward_errors invalid to leave such rows out and count them")
        else:
            what = f"{self.what} {self.name} raised {type(err).__name__}: {err} on {row}"
            fix = ("fix the function (it must accept every row of the data) or that row, or pass --reward_errors "
                   "invalid to leave such rows out and count them")
        if self.limits.errors == "stop":
            raise UserInputError(what, self.name, fix) from err
        return Lost(kind, what)

    def _batch_error(self, err: Exception, n: int) -> UserInputError:
        if isinstance(err, CallTimedOut):
            return UserInputError(f"{self.what} {self.name} did not return within {err.seconds:g} s on the batch "
                                  f"of {n} rows, though each row alone did", self.name,
                                  "make it faster, or raise --reward_timeout (0 = no limit)")
        return UserInputError(f"{self.what} {self.name} raised {type(err).__name__}: {err} on the batch of "
                              f"{n} rows (no single row fails alone)", self.name)

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


def _brief(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _short(text, limit: int = 80) -> str:
    text = text if isinstance(text, str) else repr(text)  # a conversational prompt: its message list
    return repr(text if len(text) <= limit else text[:limit] + "...")


class FunctionReward:
    """A user reward function as a reward source: floats, None / NaN marking rows it cannot score (and, under
    `--reward_errors invalid`, rows it raised or timed out on)."""

    def __init__(self, fn: UserFunction, name: str | None = None, limits: CallLimits = CallLimits()):
        self.call = UserFunctionCall(fn, "reward function", name, limits)
        self.name = self.call.name

    def __call__(self, prompts: list[str], responses: list[str], rows: Sequence[PromptRow],
                 context: ScoreContext | None = None) -> Scored:
        check_lengths(prompts, responses, rows)
        values = self.call(prompts, responses, rows, context)
        scores = torch.tensor([math.nan if isinstance(v, Lost) else self._as_float(v, i, prompts, rows)
                               for i, v in enumerate(values)], dtype=torch.float32)
        return scored(scores, torch.isfinite(scores))

    def _as_float(self, value, row: int, prompts, rows) -> float:
        value = _plain(value)
        if value is None:
            return math.nan
        if isinstance(value, (bool, int, float)):
            return float(value)
        raise UserInputError(f"reward function {self.name} returned {_brief(value)} (a {type(value).__name__}) "
                             f"for row {row}{_where(rows[row])}, prompt {_short(prompts[row])}", self.name,
                             "return one float per completion (or None where it cannot score the row), not a "
                             "nested list or a (B, 1) tensor")


def _plain(value):
    """A one-element tensor or a numpy scalar as the Python number it holds; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return value.item()
    return value


def _where(row: PromptRow) -> str:
    return f" ({row.where})" if row.where else ""


class FunctionVerifier:
    """A user verifier: pass / fail per row (None counts as a failure, kind "unverified"; a row it raised or
    timed out on under `--reward_errors invalid`: a failure of kind "error")."""

    def __init__(self, fn: UserFunction, name: str | None = None, limits: CallLimits = CallLimits()):
        self.call = UserFunctionCall(fn, "verifier", name, limits)
        self.name = self.call.name

    def __call__(self, prompts: list[str], completions: list[str], rows: Sequence[PromptRow],
                 ended_with_eos: Sequence[bool] | None = None) -> list[Check]:
        checks = []
        for i, value in enumerate(self.call(prompts, completions, rows)):
            value = _plain(value)
            if isinstance(value, Lost):
                checks.append(Check(False, "error", value.reason))
            elif value is None:
                checks.append(Check(False, "unverified", f"{self.name} could not check this row"))
            elif isinstance(value, (bool, int, float)) and value in (0, 1):
                passed = bool(value)
                checks.append(Check(passed, "pass" if passed else "fail", "" if passed else f"{self.name}: fail"))
            else:
                raise UserInputError(f"verifier {self.name} returned {_brief(value)} for row {i}"
                                     f"{_where(rows[i])}, prompt {_short(prompts[i])}", self.name,
                                     "return True / False (or None where it cannot check the row)")
        return checks


def _calls(sources) -> list[UserFunctionCall]:
    """The user functions among `sources`, a CombinedReward's parts included."""
    parts = [p for s in sources for p in ([x for x, _ in s.sources] if hasattr(s, "sources") else [s])]
    return [p.call for p in parts if isinstance(getattr(p, "call", None), UserFunctionCall)]


def lost_rows(*sources, world=None) -> dict[str, dict[str, int]]:
    """{"reward function NAME" | "verifier NAME": {"raised": n, "timed_out": n}} of every user function among
    `sources` (a CombinedReward's parts included): the rows each has lost so far in this process, or, given a
    `parallel.World`, summed over its ranks (then every rank must call it: a collective)."""
    calls = _calls(sources)
    counts = torch.tensor([[call.lost[k] for k in LOST_KINDS] for call in calls], dtype=torch.long).reshape(-1, 2)
    if world is not None and calls:
        counts = parallel.all_sum(counts, world).cpu()
    out: dict[str, dict[str, int]] = {}
    for call, row in zip(calls, counts.tolist()):
        key, n = f"{call.what} {call.name}", 2
        while key in out:  # two functions of one name (from two files)
            key, n = f"{call.what} {call.name} ({n})", n + 1
        out[key] = dict(zip(LOST_KINDS, row))
    return out


def error_summary(*sources, world=None) -> dict:
    """summary.json's `reward_errors`: the mode and time limit of the user functions among `sources`, and the
    rows each lost (`lost_rows`, over `world`'s ranks when given); {} when there is no user function."""
    calls = _calls(sources)
    if not calls:
        return {}
    return {"mode": calls[0].limits.errors, "timeout_s": calls[0].limits.timeout,
            "lost_rows": lost_rows(*sources, world=world)}
