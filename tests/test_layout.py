"""The package's imports follow the data flow, and every import hidden inside a function says why.

The stages, earliest first (a module may import from its own stage and the
ones before it, never from a later one):

    core      seqjax.core.*     the error types, atomic writes, progress bars
    config    seqjax.config.*   the typed config tree; reading it; comparing two
    store     seqjax.store.*    text -> token store (corpora, tokenizer, instruction examples, shards)
    data      seqjax.data.*     token store -> contract batches (strategies, packers, plans, epochs)
    model     seqjax.model.*    the Transformer, attention, loss, decoding; the mesh and placement rules
    objectives seqjax.objectives.* what a step's loss is (train.objective): the table and its rows
    hf        seqjax.hf.*       Hugging Face folders in and out
    weights   seqjax.weights.*  where a model's weights come from: run, step, HF and adapter folders, the
                                reference model, checkpoints as read
    eval      seqjax.eval.*     perplexity and the evaluation protocols
    train     seqjax.train.*    the step, the loop and its hooks, checkpoints, resume
    main      seqjax.main.*     the commands, and the small modules that ``python -m`` runs them by

``seqjax.model.sharding`` lives with the model because attention runs its
kernels per device shard and needs the mesh's axis names; training imports it
from there. The training loop scores validation with ``seqjax.eval``, so eval
sits below train.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "seqjax"

# The modules that ``python -m seqjax.<command>`` runs: each only forwards to seqjax.main.<command>.
ENTRY_POINTS = ("seqjax.prepare", "seqjax.generate", "seqjax.export", "seqjax.import", "seqjax.data.__main__",
                "seqjax.train.__main__", "seqjax.eval.__main__")

STAGES = [
    ("core", ("seqjax", "seqjax.core")),
    ("config", ("seqjax.config",)),
    ("store", ("seqjax.store",)),
    ("data", ("seqjax.data",)),
    ("model", ("seqjax.model",)),
    ("engine", ("seqjax.engine",)),
    ("objectives", ("seqjax.objectives",)),
    ("hf", ("seqjax.hf",)),
    ("weights", ("seqjax.weights",)),
    ("eval", ("seqjax.eval",)),
    ("train", ("seqjax.train",)),
    ("main", ("seqjax.main",) + ENTRY_POINTS),
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
    ("seqjax.data", "from ..main import trained"),
    ("seqjax.model.attention", "from seqjax.train import loop"),
    ("seqjax.model.attention", "import seqjax.train.loop"),
    ("seqjax.data.sequences", "from seqjax.model import sharding"),
    ("seqjax.store.build", "from seqjax.data import contract"),
    ("seqjax.config.tree", "from seqjax.store.reader import TokenStore"),
    ("seqjax.eval.evaluate", "from seqjax.main.trained import load_checkpoint"),
    # inside a function, with a reason given, it is still against the flow
    ("seqjax.data.plan", "def load():\n    # slow to import\n    from seqjax.train import checkpoint\n    return ckpt"),
    ("seqjax.store.reader", "def late():\n    # lazy\n    from seqjax.model import attention\n    return attention"),
])
def test_the_check_catches_an_import_of_a_later_stage(importer, statement):
    sources = package_sources()
    sources[importer] += f"\n{statement}\n"
    assert any(problem.startswith(f"{importer}:") for problem in flow_violations(sources))


def test_the_check_catches_a_function_level_import_without_a_reason():
    sources = package_sources()
    sources["seqjax.core.files"] += "\n\ndef late():\n    import json\n\n    return json\n"
    (problem,) = unexplained_local_imports(sources)
    assert problem.startswith("seqjax.core.files:") and problem.endswith(": import json")


def test_the_top_level_holds_packages_and_only_the_modules_python_m_names():
    """seqjax/ is packages by stage; the only top-level modules are the command names ``python -m`` runs, and
    they, like the packages' ``__main__`` modules, only forward to seqjax.main."""
    top = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert top == {"prepare", "generate", "export", "import"}
    sources = package_sources()
    for module in ENTRY_POINTS:
        imported = {name for _, name in imported_modules(module, sources[module], set(sources))}
        assert imported and all(name.startswith("seqjax.main.") for name in imported), (module, imported)
        assert len(sources[module].splitlines()) <= 10, module


def test_the_kernels_never_import_the_dispatch_that_loads_them():
    """attention.py loads each kernel by name (importlib, so a machine without Triton or Mosaic still runs the
    model); the kernels take the mask and the input checks from seqjax.model.mask, below both: no circle."""
    sources = package_sources()
    from seqjax.model.attention import _KERNELS  # the importlib edges, which the AST walk above cannot see

    for module, _ in _KERNELS.values():
        assert module in sources, module
        imported = {name for _, name in imported_modules(module, sources[module], set(sources))}
        assert "seqjax.model.attention" not in imported, module
        assert stage_of(module) == stage_of("seqjax.model.attention")


def name_comparisons(source: str, attributes: tuple[str, ...]) -> list[int]:
    """Lines comparing ``<x>.strategy`` / ``<x>.packer`` (or a bare ``packer``) with a literal name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        named = any((isinstance(s, ast.Attribute) and s.attr in attributes)
                    or (isinstance(s, ast.Name) and s.id in attributes) for s in sides)
        literal = any(isinstance(s, ast.Constant) and isinstance(s.value, str)
                      or isinstance(s, (ast.Tuple, ast.List, ast.Set)) and s.elts
                      and all(isinstance(e, ast.Constant) for e in s.elts) for s in sides)
        if named and literal:
            found.append(node.lineno)
    return found


def test_only_the_strategies_table_compares_strategy_or_packer_names():
    """seqjax.data.strategies' docstring promises it: every other module asks its tables (a Strategy's or a
    Packer's row) rather than test data.strategy or data.packer against a name."""
    sources = package_sources()
    offenders = {module: lines for module, source in sources.items()
                 if module != "seqjax.data.strategies"
                 and (lines := name_comparisons(source, ("strategy", "packer")))}
    assert offenders == {}
    planted = sources["seqjax.data.plan"] + '\n\ndef late(d):\n    return d.packer == "fill"\n'
    assert name_comparisons(planted, ("strategy", "packer"))  # the check sees one


def test_training_and_evaluation_name_no_objective():
    """The step, the loop and evaluation look objectives up in seqjax.objectives' table (or take its base types);
    none imports an objective's own module, so a new objective is a row, not an edit to them."""
    sources = package_sources()
    rows = {m for m in sources if m.startswith("seqjax.objectives.") and m != "seqjax.objectives.base"}
    assert rows, "the objectives' own modules"
    for module, source in sources.items():
        if module.startswith(("seqjax.train", "seqjax.eval", "seqjax.main")):
            imported = {name for _, name in imported_modules(module, source, set(sources))}
            assert not imported & rows, (module, imported & rows)


def test_functions_modules_and_lines_stay_readable_sizes():
    """No function over 70 lines, no module over 500, and fewer than 5% of the package's lines over 100
    characters: a reader sees a function in one screen (the loop's included)."""
    long_functions, long_modules, lines, wide = [], [], 0, 0
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        rows = text.split("\n")
        lines, wide = lines + len(rows), wide + sum(len(row) > 100 for row in rows)
        if len(rows) > 501:  # (a file ending in a newline splits into one empty last row)
            long_modules.append(f"{path.relative_to(PACKAGE)}: {len(rows) - 1} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 70:
                long_functions.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}")
    assert long_functions == [] and long_modules == []
    assert wide / lines < 0.05, f"{wide} of {lines} lines are over 100 characters"
