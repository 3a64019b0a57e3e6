"""What a Python caller holds in memory, turned into what a stage's config names, before any model is loaded.

A run folder holds what it trained on: a dataset handed in memory is written to RUN/inputs/ (JSONL for a list
of dicts, Parquet for a `datasets.Dataset`), a model object and its tokenizer to RUN/inputs/model (safetensors),
and the config points at them, so config.yaml describes the run exactly and `resume` finds its inputs again.
A model id or folder, and a data file or dataset name, are passed through as they are (nothing is copied).
"""

from __future__ import annotations

import contextlib
import dataclasses
import filecmp
import inspect
import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rlhflab.config.parsing import check_values
from rlhflab.errors import UserInputError, writing


def check_config(args: Any, config_cls: type, where: str) -> None:
    """`args` is a `config_cls` whose every field has its declared type (as the CLI and YAML parsers insist)."""
    if not isinstance(args, config_cls):
        raise UserInputError(f"args is a {type(args).__name__}, not a {config_cls.__name__}", where,
                             f"pass args={config_cls.__name__}(...)")
    check_values({f.name: getattr(args, f.name) for f in dataclasses.fields(args)}, config_cls, f"{where} args")


def check_function(fn: Any, what: str) -> Callable:
    """A reward function or verifier with TRL's signature: called as fn(prompts=..., completions=..., **columns)."""
    if not callable(fn):
        raise UserInputError(f"{what} is a {type(fn).__name__}, not a function", what,
                             "pass a function fn(prompts, completions, **kwargs) -> list")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn  # a builtin or C callable: its call will tell
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [n for n in ("prompts", "completions") if n not in params and not takes_all]
    if missing:
        name = getattr(fn, "__name__", type(fn).__name__)
        raise UserInputError(f"{what} {name} takes no {' or '.join(repr(m) for m in missing)} argument", what,
                             "give it TRL's signature: def fn(prompts, completions, **kwargs) -> list")
    return fn


def reward_functions(funcs: Any, weights: Sequence[float] | None
                     ) -> tuple[list[tuple[str, float]], list[tuple[Callable, float]]]:
    """TRL's `reward_funcs` (one or a list: functions, or "FILE.py:NAME" / "package.module:NAME" specs) with
    their weights (1 each by default), split into the specs (the config's `reward_fn`) and the functions held in
    memory, each with its weight."""
    listed = [] if funcs is None else list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]
    weights = [1.0] * len(listed) if weights is None else [float(w) for w in weights]
    if len(weights) != len(listed):
        raise UserInputError(f"{len(weights)} reward weights for {len(listed)} reward functions", "reward_weights",
                             "give one weight per reward function, in the same order")
    specs = [(fn, w) for fn, w in zip(listed, weights) if isinstance(fn, str)]
    held = [(check_function(fn, f"reward_funcs[{i}]"), w)
            for i, (fn, w) in enumerate(zip(listed, weights)) if not isinstance(fn, str)]
    return specs, held


def write_dataset(dataset: Any, path: Path, what: str, kind: str, resumed: bool = False,
                  allow_change: bool = False) -> str:
    """A dataset handed in memory, written where the stage reads it; a str (file, folder or dataset name) as is.
    Its rows are checked as `kind` ("sft", "pairs", "prompts") before they take their place, so rows the stage
    would refuse never replace what the folder held. `resumed`: the run folder already holds the rows the run
    trained on, and other rows are refused (unless `allow_change`), as a changed config is."""
    if isinstance(dataset, (str, Path)):
        return str(dataset)
    with _writing_rows(what, path.parent, path.parent):
        path.parent.mkdir(parents=True, exist_ok=True)
    if hasattr(dataset, "to_parquet") and hasattr(dataset, "column_names"):  # a datasets.Dataset
        if len(dataset) == 0:
            raise UserInputError(f"{what} has no rows", what)
        target = path.with_suffix(".parquet")
        with _writing_rows(what, target, _partial(target)):
            dataset.to_parquet(str(_partial(target)))
        return _put_in_place(target, what, kind, resumed, allow_change)
    rows = list(dataset) if isinstance(dataset, Sequence) or hasattr(dataset, "__iter__") else None
    if rows is None or not rows:
        raise UserInputError(f"{what} is {'empty' if rows == [] else f'a {type(dataset).__name__}'}", what,
                             "pass a datasets.Dataset, a list of dicts (one per row) or a file / dataset name")
    target = path.with_suffix(".jsonl")
    with _writing_rows(what, target, _partial(target)), open(_partial(target), "w") as out:
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise UserInputError(f"{what} row {i} is a {type(row).__name__}, not a dict", what,
                                     "give each row as a dict of columns, e.g. {'prompt': ..., 'answer': ...}")
            try:
                out.write(json.dumps(row, allow_nan=False) + "\n")
            except (TypeError, ValueError) as err:
                raise UserInputError(f"{what} row {i} cannot be written as JSON ({err})", what,
                                     "keep to strings, numbers, bools, lists and dicts in the rows") from err
    return _put_in_place(target, what, kind, resumed, allow_change)


@contextlib.contextmanager
def _writing_rows(what: str, target: Path, partial: Path) -> Iterator[None]:
    """A full disk or an I/O error while writing `what` into RUN/inputs/ is a `WriteFailed` naming it (exit code 5,
    as for a checkpoint), and the partial file goes; a user mistake (a row that is no dict) is raised as it is."""
    inputs = target if target.name == "inputs" else target.parent
    try:
        with writing(f"{what} (the run's copy of its rows)", target, inputs.parent):
            yield
    except BaseException:
        if partial.is_file():
            partial.unlink(missing_ok=True)
        raise


def _put_in_place(target: Path, what: str, kind: str, resumed: bool, allow_change: bool) -> str:
    """The written partial file, checked, moved to `target`, whole or not at all (every process of a launch writes
    the same rows); on a resume, rows other than the run's are refused and the run's file is left as it was."""
    from rlhflab.data import load_examples

    partial = _partial(target)
    try:
        load_examples(partial, kind)  # the rows' shape (the stage checks their lengths with its tokenizer)
        if resumed and target.is_file() and not filecmp.cmp(partial, target, shallow=False) and not allow_change:
            raise UserInputError(f"{what} holds other rows than the run being resumed trained on ({target})", what,
                                 "resume with the same data, or pass allow_config_change=True to continue on them")
    except UserInputError as err:  # named by the argument, not by the file it was written to
        partial.unlink()
        named = lambda text: text and text.replace(str(partial), what)  # noqa: E731
        raise UserInputError(named(err.what), named(err.where) or what, err.fix) from err
    os.replace(partial, target)
    return str(target)


def _partial(target: Path) -> Path:
    """Where `target` is written first: hidden, this process's own, with the suffix its reader knows it by."""
    return target.with_name(f".{target.stem}.{os.getpid()}.partial{target.suffix}")


def write_model(model: Any, processing_class: Any, folder: Path, what: str) -> tuple[str, str]:
    """(model, tokenizer) as the config names them: an id / folder as is (the tokenizer's too, or "" for the
    model's own); a loaded `PreTrainedModel` (and its tokenizer) saved into `folder` as an ordinary HF folder."""
    if model is None:
        raise UserInputError(f"no {what} given", what, "pass a hub id, a local folder or a loaded PreTrainedModel")
    tokenizer = processing_class
    if isinstance(model, (str, Path)):
        if tokenizer is None or isinstance(tokenizer, (str, Path)):
            return str(model), str(tokenizer or "")
        with writing("processing_class (the run's copy of it)", folder / "tokenizer", folder.parent):
            tokenizer.save_pretrained(str(folder / "tokenizer"))
        return str(model), str(folder / "tokenizer")
    if not hasattr(model, "save_pretrained") or not hasattr(model, "config"):
        raise UserInputError(f"{what} is a {type(model).__name__}", what,
                             "pass a hub id, a local folder or a transformers PreTrainedModel")
    if hasattr(model, "peft_config"):
        raise UserInputError(f"{what} already holds peft adapters", what,
                             "pass the base model and the adapters' settings as peft_config=LoraConfig(...), "
                             "or merge them first (model.merge_and_unload())")
    if tokenizer is None or isinstance(tokenizer, (str, Path)):
        from rlhflab.models import load_tokenizer

        source = tokenizer or getattr(model, "name_or_path", "")
        if not source:
            raise UserInputError(f"{what} is a model object with no tokenizer", "processing_class",
                                 "pass processing_class=the model's tokenizer")
        tokenizer = load_tokenizer(str(source))
    from rlhflab.models import save_model_folder

    with writing(f"{what} (the run's copy of it)", folder / "model", folder.parent):  # a full disk: exit code 5
        save_model_folder(folder / "model", model, tokenizer)
    return str(folder / "model"), ""


def lora_fields(peft_config: Any, config_cls: type) -> dict[str, Any]:
    """A peft `LoraConfig` as the config's lora_* fields (rank, alpha, dropout, target modules)."""
    if peft_config is None:
        return {}
    names = {f.name for f in dataclasses.fields(config_cls)}
    if "lora_r" not in names:
        raise UserInputError(f"{config_cls.__name__} trains whole weights only", "peft_config",
                             "leave peft_config out for this stage")
    r = getattr(peft_config, "r", None)
    if not isinstance(r, int) or r <= 0:
        raise UserInputError(f"peft_config is a {type(peft_config).__name__} without a positive rank r", "peft_config",
                             "pass peft.LoraConfig(r=16, lora_alpha=32, target_modules='all-linear')")
    targets = getattr(peft_config, "target_modules", None) or "all-linear"
    targets = targets if isinstance(targets, str) else ",".join(sorted(targets))
    dropout = float(getattr(peft_config, "lora_dropout", 0.0) or 0.0)
    alpha = getattr(peft_config, "lora_alpha", 2 * r)
    if isinstance(alpha, float) and not math.isfinite(alpha):
        raise UserInputError(f"peft_config.lora_alpha is {alpha}", "peft_config")
    return {"lora_r": r, "lora_alpha": int(alpha), "lora_dropout": dropout, "lora_target_modules": targets}
