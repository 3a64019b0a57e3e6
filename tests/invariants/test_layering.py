"""Imports flow down only (DESIGN.md): a module imports from lower layers or its own package."""

import ast
from pathlib import Path

import rlhflab

PACKAGE = Path(rlhflab.__file__).parent
LAYERS = {
    "errors": 0, "core": 0,
    "intervals": 0,  # pure-Python statistics (Wilson, McNemar, paired differences), read by eval, report, compare
    "trl_names": 0,  # pure data (TRL flag name -> rlhflab field), read by config's unknown-flag hints
    "callbacks": 0,  # the Callback base class a run folder's metric sink calls (pure Python)
    "config": 1, "tasks": 1, "data": 1, "models": 1, "tracking": 1,
    "parallel": 1,  # processes, reductions, engine wrapping (DDP / FSDP2); trainers call it, never torch.distributed
    "rollout": 2, "rewards": 2, "sources": 2, "checkpoint": 2,  # checkpoint sits below the trainers that call it
    "trainers": 3,
    "eval": 4,
    "report": 5, "demo": 5,
    "sweep": 6,  # runs trainers and writes reports
    "compare": 6,  # runs trainers, evaluates their models, writes reports (beside sweep)
    "api": 7,  # trainer objects and command functions for Python callers; the CLI runs stages through it
    "cli": 8,
    "__main__": 9,  # `python -m rlhflab` (torchrun / accelerate launch -m rlhflab)
}


def top_level(module_path: Path) -> str:
    rel = module_path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def rlhflab_imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlhflab"):
            parts = node.module.split(".")
            if len(parts) > 1:
                names.append(parts[1])
            else:  # from rlhflab import tasks, models
                names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.extend(a.name.split(".")[1] for a in node.names if a.name.startswith("rlhflab."))
    return names


def modules():
    return [p for p in PACKAGE.rglob("*.py") if p.parent != PACKAGE or p.name != "__init__.py"]


def test_every_package_module_has_a_layer():
    unknown = {top_level(p) for p in modules()} - set(LAYERS)
    assert not unknown, f"add these to LAYERS (and DESIGN.md): {unknown}"


def test_imports_flow_down_only():
    bad = []
    for path in modules():
        own = top_level(path)
        for name in rlhflab_imports(path):
            if name == own or name == "__version__":
                continue
            if LAYERS[name] >= LAYERS[own] or (own == "core" and name != "core"):
                bad.append(f"{path.relative_to(PACKAGE)} imports rlhflab.{name}")
    assert not bad, "\n".join(bad)


def test_report_never_imports_torch():
    for path in (PACKAGE / "report").rglob("*.py"):
        text = path.read_text()
        assert "import torch" not in text and "from torch" not in text, path


def test_trainers_read_the_suite_through_sources_only():
    """DESIGN.md "Prompt sources": the suite is one source among user files; a generic trainer never imports
    `tasks` (its demonstrations, pairs and checker come through `sources` and `rewards`)."""
    bad = [str(p.relative_to(PACKAGE)) for p in (PACKAGE / "trainers").rglob("*.py") if "tasks" in rlhflab_imports(p)]
    assert not bad, f"trainers importing rlhflab.tasks: {bad}"
