"""What a run reads again when it resumes, fingerprinted so that a resume notices when it changed
(docs/reading-a-run.md "Checkpoints and resume").

A fresh run writes RUN/fingerprints.json: one line per thing it read, `{name: description}`:

    "model/model.safetensors": "2097312 bytes, sha256 1a2b3c4d5e6f7a8b"   a file of a model / data folder
    "train_file": "data.jsonl: 5120 bytes, sha256 ..."                    a data file
    "reward_fn rewards.py:exact": "rewards.py: 812 bytes, sha256 ..."     the source file of a function
    "reward_model": "hub id org/name"                                     not a local path: its id, never downloaded
    "version torch": "2.5.1"                                              rlhflab, torch, transformers

Files up to 256 MiB are hashed whole (sha256, first 16 hex digits kept); bigger ones (weight shards) by their size
and the sha256 of four 1 MiB samples (start, 1/3, 2/3, end): a change confined to the unsampled middle of a big
file goes unnoticed, and a copy of an unchanged folder (other mtimes) is not a change. Hidden files are skipped. A
function named as package.module:NAME is fingerprinted by its module's file, not the modules that imports.
"""

from __future__ import annotations

import hashlib
import importlib.util
from importlib import metadata
from pathlib import Path

PATH_FIELDS = ("model", "tokenizer", "train_file", "validation_file", "reference", "reward_model", "value_model")
FUNCTION_FIELDS = ("reward_fn", "verifier")
BUILT_IN_VERIFIERS = ("", "checker", "none")
VERSIONS = ("rlhflab", "torch", "transformers")
WHOLE_BYTES = 256 * 2**20
SAMPLE_BYTES = 2**20
FILE = "fingerprints.json"


def file_digest(path: Path) -> str:
    """'N bytes, sha256 HEX16' (whole file) or 'N bytes, sampled sha256 HEX16' (a big file; module doc)."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= WHOLE_BYTES:
            for block in iter(lambda: f.read(2**20), b""):
                digest.update(block)
            return f"{size} bytes, sha256 {digest.hexdigest()[:16]}"
        for at in (0, size // 3, 2 * size // 3, size - SAMPLE_BYTES):
            f.seek(at)
            digest.update(f.read(SAMPLE_BYTES))
    return f"{size} bytes, sampled sha256 {digest.hexdigest()[:16]}"


def path_fingerprints(name: str, value: str) -> dict[str, str]:
    """A file, each file of a folder, or the id of what is not a local path (a hub model or datasets name)."""
    text = value if Path(value).exists() else value.partition(":")[0]  # data's NAME:SPLIT
    path = Path(text)
    if path.is_file():
        return {name: f"{value}: {file_digest(path)}"}
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        return {f"{name}/{p.relative_to(path).as_posix()}": file_digest(p) for p in files} or {name: f"{value}: empty"}
    return {name: f"hub id {value}"}


def function_fingerprints(name: str, specs: str) -> dict[str, str]:
    """The source file of each FILE.py:NAME / package.module:NAME in a comma-separated `specs`."""
    out = {}
    for spec in (s.strip() for s in specs.split(",")):
        if spec in BUILT_IN_VERIFIERS or ":" not in spec:
            continue
        module = spec.rpartition(":")[0]
        source = Path(module) if module.endswith(".py") else _module_file(module)
        out[f"{name} {spec}"] = f"{source}: {file_digest(source)}" if source and source.is_file() \
            else f"module {module}"
    return out


def _module_file(module: str) -> Path | None:
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return Path(found.origin) if found is not None and found.origin else None


def read_paths(cfg) -> dict[str, Path]:
    """The local files and folders `cfg`'s run reads ({field or "field spec": path}): its path fields and the
    source files of its FILE.py:NAME functions."""
    found = {name: Path(getattr(cfg, name)) for name in PATH_FIELDS if getattr(cfg, name, "")}
    for name in FUNCTION_FIELDS:
        for spec in (s.strip() for s in str(getattr(cfg, name, "") or "").split(",")):
            if spec not in BUILT_IN_VERIFIERS and spec.rpartition(":")[0].endswith(".py"):
                found[f"{name} {spec}"] = Path(spec.rpartition(":")[0])
    return found


def fingerprints(cfg) -> dict[str, str]:
    """Everything `cfg`'s run reads again on resume (the fields it has and sets), and the versions that compute."""
    out: dict[str, str] = {}
    for name in PATH_FIELDS:
        if getattr(cfg, name, ""):
            out.update(path_fingerprints(name, getattr(cfg, name)))
    for name in FUNCTION_FIELDS:
        if getattr(cfg, name, ""):
            out.update(function_fingerprints(name, getattr(cfg, name)))
    for package in VERSIONS:
        try:
            out[f"version {package}"] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[f"version {package}"] = "not installed"
    return out


def fingerprint_changes(was: dict[str, str], now: dict[str, str]) -> dict[str, dict]:
    """{name: {"was", "now"}} for every line that differs (None: not there)."""
    return {k: {"was": was.get(k), "now": now.get(k)} for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)}
