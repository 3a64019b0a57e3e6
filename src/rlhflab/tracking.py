"""The run folder and the one metrics path.

Every command that trains or evaluates writes one folder:

    config.yaml     the effective config (pass it back with --config)
    versions.json   python, torch, transformers, peft, rlhflab, platform, CPU/GPU; seed and
                    determinism settings (deterministic kernels, threads, CUBLAS/cuDNN flags)
    metrics.jsonl   one JSON object per logged step, always with "step"
    samples.jsonl   generated answers with their verdicts
    summary.json    the run's headline figures, machine-readable
    model/          HF-format model folder(s)

`RunDir.log` is the single metrics path: metrics.jsonl always, and TensorBoard,
W&B or trackio in addition when `report_to` names them (any subset). Each backend is
imported only when chosen, so none of them is a dependency. Reports read these files only.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import math
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Sequence

from rlhflab.callbacks import Callback, CallbackSink
from rlhflab.errors import UserInputError, writing

RUN_MARKERS = ("config.yaml", "summary.json", "metrics.jsonl")


def default_run_path(stage: str) -> Path:
    return Path("runs") / f"{stage}-{time.strftime('%Y%m%d-%H%M%S')}"


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def collect_versions() -> dict[str, Any]:
    """Software and hardware facts that make a run reproducible and comparable."""
    import torch  # local: the report layer reads run folders without torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "python": sys.version.split()[0],
        **{name: _package_version(name) for name in ("torch", "transformers", "peft", "accelerate", "rlhflab")},
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "gpus": gpus,
    }


def determinism_settings(seed: int | None = None) -> dict[str, Any]:
    """The seed and every process setting that decides whether a rerun gives the same numbers."""
    import torch  # local, as above

    out = {
        "seed": seed,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }
    if torch.cuda.is_available():
        out["cudnn"] = {"deterministic": torch.backends.cudnn.deterministic,
                        "benchmark": torch.backends.cudnn.benchmark,
                        "allow_tf32": torch.backends.cudnn.allow_tf32,
                        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32}
    return out


def _jsonable(value: Any) -> Any:
    """Plain floats for tensors / numpy scalars; non-finite floats as strings JSON can hold."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _strict_json(value: Any) -> Any:
    """`value` with every non-finite float spelled as a string (as metrics.jsonl does), so the
    file is strict JSON that any parser reads (bare NaN / Infinity are not JSON)."""
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return _jsonable(value) if isinstance(value, float) else value


def check_folder_free(path: Path, overwrite: bool) -> None:
    """Refuse a file where the run folder should be, and a folder holding another run unless `overwrite`."""
    if path.exists() and not path.is_dir():
        raise UserInputError(f"output path is a file, not a folder: {path}", "--output_dir")
    held = [name for name in RUN_MARKERS if (path / name).exists()]
    if held and not overwrite:
        raise UserInputError(
            f"folder already holds a run ({', '.join(held)})",
            str(path),
            "choose another --output_dir, or pass --overwrite to replace it",
        )


class RunDir:
    """A run folder: created once, appended to while the run goes on."""

    def __init__(self, path: str | Path, *, overwrite: bool = False, report_to: str = "none", resume: bool = False,
                 callbacks: Sequence[Callback] = ()):
        """`resume=True` reopens a run's folder as it is (rlhflab.checkpoint cuts its histories back);
        `callbacks` see every logged row and the summary at the end (rlhflab.callbacks)."""
        self.path = Path(path)
        backends = sink_names(report_to)  # a typo fails before the folder is made
        check_folder_free(self.path, overwrite or resume)
        with writing("the run folder", self.path, self.path):  # a full disk at start-up: exit code 5 too
            self.path.mkdir(parents=True, exist_ok=True)
            for name in ("metrics.jsonl", "samples.jsonl"):
                if not resume:
                    (self.path / name).write_text("")
        self._sinks = [_make_sink(name, self.path) for name in backends]
        if callbacks:
            self._sinks.append(CallbackSink(callbacks, self.path))
        self.started = time.time()

    def write_json(self, name: str, payload: Any) -> Path:
        target = self.path / name
        tmp = target.with_suffix(target.suffix + ".tmp")
        text = json.dumps(_strict_json(payload), indent=2, default=_jsonable, allow_nan=False) + "\n"
        try:
            with writing(name, target, self.path, len(text.encode())):
                tmp.write_text(text)
                os.replace(tmp, target)
        except Exception:
            tmp.unlink(missing_ok=True)  # a half-written temp file never lingers; `target` is as it was
            raise
        return target

    def write_versions(self, seed: int | None = None) -> None:
        """versions.json: software, hardware, and a `determinism` block (seed, torch settings)."""
        self.write_json("versions.json", {**collect_versions(), "determinism": determinism_settings(seed)})

    def log(self, metrics: dict[str, Any], step: int) -> None:
        row = json.dumps({"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}) + "\n"
        with writing(f"metrics.jsonl (step {step})", self.path / "metrics.jsonl", self.path, len(row.encode())):
            with open(self.path / "metrics.jsonl", "a") as f:
                f.write(row)
        for sink in self._sinks:
            sink.log(metrics, step)

    def add_samples(self, rows: Iterable[dict[str, Any]]) -> None:
        text = "".join(json.dumps(row, ensure_ascii=False, default=_jsonable) + "\n" for row in rows)
        with writing("samples.jsonl", self.path / "samples.jsonl", self.path, len(text.encode())):
            with open(self.path / "samples.jsonl", "a", encoding="utf-8") as f:
                f.write(text)

    def update_summary(self, **fields: Any) -> dict[str, Any]:
        """Merge `fields` into summary.json (nested dicts merge one level deep)."""
        target = self.path / "summary.json"
        summary = json.loads(target.read_text()) if target.exists() else {}
        for key, value in fields.items():
            if isinstance(value, dict) and isinstance(summary.get(key), dict):
                summary[key].update(value)
            else:
                summary[key] = value
        self.write_json("summary.json", summary)
        return summary

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric values of a row as plain floats (NaN / inf kept as floats): what a dashboard plots.
    metrics.jsonl holds the same numbers (non-finite ones spelled as strings, which JSON needs)."""
    out = {}
    for key, value in metrics.items():
        value = value.item() if hasattr(value, "item") else value
        if isinstance(value, (int, float)):
            out[key] = float(value)
    return out


class _TensorBoardSink:
    def __init__(self, path: Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` extra

        self.writer = SummaryWriter(log_dir=str(path / "tensorboard"))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for key, value in _scalars(metrics).items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class _WandbSink:
    def __init__(self, path: Path):
        import wandb  # needs the `wandb` extra

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "rlhflab"), dir=str(path), name=path.name,
                              reinit=True)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(_scalars(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class _TrackioSink:
    """trackio (Hugging Face's local-first, W&B-compatible tracker): one run per run folder.

    It writes a SQLite database under `TRACKIO_DIR` (default `$HF_HOME/trackio`), read once when
    trackio is first imported; `trackio show` opens the dashboard. The sink holds its own `Run`:
    `trackio.log` / `trackio.finish` act on the most recently started run of the current context,
    which is another run folder's when two are open at once.
    """

    def __init__(self, path: Path):
        import trackio  # needs the `trackio` extra

        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "rlhflab"), name=path.name)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(_scalars(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


SINKS = {"tensorboard": _TensorBoardSink, "wandb": _WandbSink, "trackio": _TrackioSink}


def sink_names(report_to: str) -> list[str]:
    """'none', '' or 'tensorboard, wandb' -> the backends to open, checked before any is imported.

    Every name is checked first, so a typo in the second name does not leave a W&B run
    opened for the first one.
    """
    names = list(dict.fromkeys(n.strip() for n in report_to.split(",") if n.strip() not in ("", "none")))
    for name in names:
        if name not in SINKS:
            close = difflib.get_close_matches(name, list(SINKS), n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"use none or any of {', '.join(SINKS)}, comma-separated"
            raise UserInputError(f"unknown report_to backend '{name}'", "--report_to", hint)
        if not _installed(name):  # found without importing it, before the run folder is made
            raise UserInputError(f"report_to={name} needs the '{name}' package, which is not installed",
                                 "--report_to", f"pip install {name}   (or: pip install 'rlhflab[{name}]')")
    return names


def _installed(module: str) -> bool:
    return module in sys.modules or importlib.util.find_spec(module) is not None


def _make_sink(name: str, path: Path):
    try:
        return SINKS[name](path)
    except ImportError as err:
        raise UserInputError(
            f"report_to={name}: importing its package failed ({err})", "--report_to",
            f"pip install {name}   (or: pip install 'rlhflab[{name}]')") from err


class RunResult:
    """What a stage hands back: its folder, the model it wrote (if any) and its summary."""

    def __init__(self, run_dir: Path, summary: dict[str, Any], model_dir: Path | None = None):
        self.run_dir = run_dir
        self.summary = summary
        self.model_dir = model_dir

    def __repr__(self) -> str:
        return f"RunResult(run_dir={str(self.run_dir)!r}, model_dir={str(self.model_dir)!r})"
