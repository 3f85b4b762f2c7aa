"""The package's imports follow the data flow, and every import hidden inside a function says why.

The stages, earliest first (a module may import from its own stage and the
ones before it, never from a later one):

    base        seqjax.errors, .files, .progress    the error types, atomic writes, progress bars
    config      seqjax.config, .config_load/_diff   the typed config tree; reading it; comparing two
    plumbing    seqjax.cli                          what every CLI shares: flags, logging, exit codes
    data        seqjax.data.*                       text -> token store -> contract batches
    sharding    seqjax.sharding                     mesh axes and placement rules
    model       seqjax.model.*                      the Transformer, attention, loss, decoding
    train/eval  seqjax.train.*, seqjax.evaluate     libraries that run a model on data; seqjax.hf, HF folders
    cli         every __main__/CLI, seqjax.trained  the tools; --run/--checkpoint/--hf for those that read one


``seqjax.cli`` sits just above the config: it parses flags into a config and
turns errors into one line, and imports nothing of data/ or train/ (the CLIs
that read checkpoints share :mod:`seqjax.trained` instead).
``seqjax.sharding`` sits below the model because attention runs its kernels
per device shard and needs the mesh's axis names; it imports only the config.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "seqjax"

STAGES = [
    ("base", ("seqjax", "seqjax.errors", "seqjax.files", "seqjax.progress")),
    ("config", ("seqjax.config", "seqjax.config_load", "seqjax.config_diff")),
    ("cli plumbing", ("seqjax.cli",)),
    ("data", ("seqjax.data",)),
    ("sharding", ("seqjax.sharding",)),
    ("model", ("seqjax.model",)),
    ("train/eval", ("seqjax.train", "seqjax.evaluate", "seqjax.hf")),
    ("cli", ("seqjax.trained", "seqjax.prepare", "seqjax.eval", "seqjax.generate", "seqjax.data.__main__",
             "seqjax.train.__main__", "seqjax.export", "seqjax.import_hf", "seqjax.import")),
]


def stage_of(module: str) -> int:
    """Index of the stage whose longest listed prefix matches ``module``."""
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(STAGES):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best is None:
        raise AssertionError(f"{module} belongs to no stage: add it to STAGES in tests/test_layout.py")
    return best


def package_sources() -> dict[str, str]:
    sources = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        sources[".".join(parts)] = path.read_text()
    return sources


def imported_modules(module: str, source: str, known: set[str]) -> list[tuple[int, str]]:
    """(line, module) for every seqjax module ``source`` imports; ``from seqjax import x`` counts as seqjax.x."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the package this module is in
                package = (
                    module if any(other.startswith(module + ".") for other in known) else module.rpartition(".")[0]
                )
                base = importlib.util.resolve_name("." * node.level + base, package)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.append((node.lineno, full if full in known else base))
    return [(line, name) for line, name in found if name == "seqjax" or name.startswith("seqjax.")]


def flow_violations(sources: dict[str, str]) -> list[str]:
    """Every import of a later stage, as 'importer:line imports module (stage a -> stage b)'."""
    known = set(sources)
    problems = []
    for module, source in sources.items():
        own = stage_of(module)
        for line, name in imported_modules(module, source, known):
            if stage_of(name) > own:
                problems.append(f"{module}:{line} imports {name} ({STAGES[own][0]} -> {STAGES[stage_of(name)][0]})")
    return problems


def unexplained_local_imports(sources: dict[str, str]) -> list[str]:
    """Imports inside a function without a comment on their line or the line above (why is it not at the top?)."""
    problems = []
    for module, source in sources.items():
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    here, above = lines[inner.lineno - 1], lines[inner.lineno - 2] if inner.lineno > 1 else ""
                    if "#" not in here and not above.strip().startswith("#"):
                        problems.append(f"{module}:{inner.lineno}: {here.strip()}")
    return sorted(set(problems))


def test_no_module_imports_from_a_later_stage_of_the_flow():
    assert flow_violations(package_sources()) == []


def test_every_module_belongs_to_a_stage():
    for module in package_sources():
        stage_of(module)


def test_imports_inside_functions_say_why():
    assert unexplained_local_imports(package_sources()) == []


@pytest.mark.parametrize("importer, statement", [
    ("seqjax.data", "from .. import trained"),
    ("seqjax.model.attention", "from seqjax.train import loop"),
    ("seqjax.model.attention", "import seqjax.train.loop"),
    ("seqjax.data.sequences", "from seqjax import sharding"),
    ("seqjax.config", "from seqjax.data.store import TokenStore"),
    ("seqjax.evaluate", "from seqjax.trained import load_checkpoint"),
    # inside a function, with a reason given, it is still against the flow
    ("seqjax.cli", "def load():\n    # slow to import\n    from seqjax.train import checkpoint\n    return checkpoint"),
    ("seqjax.data.store", "def late():\n    # lazy\n    from seqjax.model import attention\n    return attention"),
])
def test_the_check_catches_an_import_of_a_later_stage(importer, statement):
    sources = package_sources()
    sources[importer] += f"\n{statement}\n"
    assert any(problem.startswith(f"{importer}:") for problem in flow_violations(sources))


def test_the_check_catches_a_function_level_import_without_a_reason():
    sources = package_sources()
    sources["seqjax.files"] += "\n\ndef late():\n    import json\n\n    return json\n"
    (problem,) = unexplained_local_imports(sources)
    assert problem.startswith("seqjax.files:") and problem.endswith(": import json")
