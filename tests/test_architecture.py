"""The house rules of docs/architecture.md, checked on the source (AST, no imports executed).

Every `import` / `from ... import` of a meshplan module, at module level or inside a function,
is an arrow from its package to another. The allowed arrows follow the data flow
model -> profile (profiling) -> costs -> search -> Plan -> runtime -> training; an arrow against it fails
here with the file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "meshplan"

# package -> the meshplan packages it may import (besides itself). "meshplan" is the lazy
# top-level namespace (meshplan/__init__.py), "api" the public entry points.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "ir": {"errors"},
    "cluster": {"errors"},
    "kernels": {"errors"},
    "models": {"errors", "kernels"},
    "cost_models": {"errors", "ir", "cluster", "kernels"},
    # the tracer and the model's profile sit below the planner: the planner reads them, never the reverse
    "profiling": {"errors", "ir", "models"},
    "planner": {"errors", "ir", "cluster", "kernels", "models", "cost_models", "profiling"},
    "export": {"errors", "ir", "models"},
    "api": {"errors", "ir", "cluster", "kernels", "models", "cost_models", "profiling", "planner", "export"},
    "reports": {"errors", "ir", "cluster", "models", "cost_models", "planner", "export", "api", "meshplan"},
    # the parallel engine reads the Plan types, never the planner or the cost model
    "runtime": {"errors", "ir", "kernels", "models"},
    "train": {"errors", "ir", "kernels", "models", "runtime"},
    # the command line calls the public API and the applications built on it
    "cli": {"errors", "ir", "cluster", "models", "api", "export", "reports", "runtime", "train", "meshplan",
            "cost_models"},
    "meshplan": {"errors", "ir", "cluster", "api"},    # __init__'s TYPE_CHECKING imports
}
MAX_LINES = 600

# The planner's integer programs and the search's lower bound read the cost model through its
# tables (cost_models/tables.py: any name in its __all__) and its public entry, never its
# internals (constants, compute, comm, private helpers): cost-model module -> the names they may
# import from it (None: the module's __all__).
TABLE_READERS = ("planner/ilp/", "planner/bound.py")
COST_MODEL_INTERFACE: dict[str, frozenset[str] | None] = {
    "meshplan.cost_models.tables": None,
    "meshplan.cost_models.estimate": frozenset({"estimate_profile"}),
}


def _package(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.name != "__init__.py" else "meshplan"


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path):
    """(line, imported meshplan module) for every import in the file."""
    return _imports_in(path.read_text(), _module(path), path.name == "__init__.py")


def _import_nodes(source: str, module: str, is_pkg: bool):
    """(line, meshplan module, the names it imports or None for `import x`) for every import of meshplan."""
    tree = ast.parse(source)
    here = module.split(".")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "meshplan":
                    yield node.lineno, a.name, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here if is_pkg else here[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "meshplan":
                yield node.lineno, target, [a.name for a in node.names]


def _imports_in(source: str, module: str, is_pkg: bool):
    for line, target, names in _import_nodes(source, module, is_pkg):
        if names is not None and target == "meshplan":    # `from meshplan import cluster` names submodules
            for n in names:
                yield line, f"meshplan.{n}"
        else:
            yield line, target


def _imported_names(source: str, module: str, is_pkg: bool):
    """(line, meshplan module, name or None for a whole-module import) for every import."""
    for line, target, names in _import_nodes(source, module, is_pkg):
        if names is None:
            yield line, target, None
            continue
        for n in names:
            sub = f"{target}.{n}"
            # `from meshplan.cost_models import tables` names a submodule
            if (ROOT.parent / sub.replace(".", "/")).with_suffix(".py").exists() or \
                    (ROOT.parent / sub.replace(".", "/")).is_dir():
                yield line, sub, None
            else:
                yield line, target, n


def _public_names(module: str) -> frozenset[str]:
    """A meshplan module's __all__, read from its source."""
    tree = ast.parse((ROOT.parent / module.replace(".", "/")).with_suffix(".py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return frozenset(ast.literal_eval(node.value))
    return frozenset()


def _interface_violations(source: str, module: str, is_pkg: bool) -> list[str]:
    """The imports of cost-model internals in a table reader's source."""
    bad = []
    for line, target, name in _imported_names(source, module, is_pkg):
        if _target_package(target) != "cost_models":
            continue
        if target not in COST_MODEL_INTERFACE:
            bad.append(f"{line}: {target}{'.' + name if name else ''} (not the cost model's interface)")
            continue
        allowed = COST_MODEL_INTERFACE[target]
        if name is None:
            if allowed is not None:     # a whole module would expose what the names leave out
                bad.append(f"{line}: import of the whole module {target} (import its names {sorted(allowed)})")
            continue
        if name.startswith("_") or name not in (allowed if allowed is not None else _public_names(target)):
            bad.append(f"{line}: {target}.{name} (not in the interface of {target})")
    return bad


def _target_package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "meshplan"


FILES = sorted(ROOT.rglob("*.py"))


def test_every_package_has_a_rule():
    packages = {_package(p) for p in FILES}
    assert packages <= set(ALLOWED), f"packages without an import rule: {sorted(packages - set(ALLOWED))}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_follow_the_data_flow(path):
    pkg = _package(path)
    bad = []
    for line, module in _imports(path):
        target = _target_package(module)
        if target in ("__version__",):
            continue
        if target != pkg and target not in ALLOWED[pkg]:
            bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {module} ({pkg} -> {target})")
    assert not bad, "imports against docs/architecture.md:\n" + "\n".join(bad)


READERS = [p for p in FILES if str(p.relative_to(ROOT)).startswith(TABLE_READERS)]


@pytest.mark.parametrize("path", READERS, ids=lambda p: str(p.relative_to(ROOT)))
def test_ilps_and_bound_read_the_cost_model_through_its_tables(path):
    bad = _interface_violations(path.read_text(), _module(path), path.name == "__init__.py")
    assert not bad, (f"{path.relative_to(ROOT.parent)} reaches into the cost model; read it through "
                     f"meshplan.cost_models.tables (add a table entry there if one is missing):\n" + "\n".join(bad))


def test_the_interface_checker_sees_internals():
    """The table readers' checker itself: internals, private names and aliased modules are seen;
    the tables and the public entry pass."""
    src = ("from meshplan.cost_models import constants as K\nfrom meshplan.cost_models.estimate import _pp_comm\n"
           "from meshplan.cost_models.tables import layer_table, _state_sum\nimport meshplan.cost_models.comm\n"
           "def f():\n    from ..cost_models.compute import gemm_time\n")
    bad = _interface_violations(src, "meshplan.planner.bound", False)
    assert [b.split(":")[0] for b in bad] == ["1", "2", "3", "4", "6"], bad
    ok = ("from meshplan.cost_models.tables import OpCostTable, layer_table\n"
          "from meshplan.cost_models import tables\nfrom meshplan.cost_models.estimate import estimate_profile\n"
          "from meshplan.ir.estimate import GB\n")
    assert _interface_violations(ok, "meshplan.planner.ilp.fp8", False) == []
    assert READERS and all("planner" in str(p) for p in READERS)


def test_modules_stay_small():
    big = [f"{p.relative_to(ROOT.parent)}: {n} lines" for p in FILES
           if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not big, f"modules over {MAX_LINES} lines (split them along their jobs):\n" + "\n".join(big)


def test_the_rule_checker_sees_violations():
    """The checker itself: relative and absolute imports of the runtime from the planner are seen."""
    src = ("from meshplan.runtime.parallel import parallelize\nimport meshplan.train.loop\n"
           "def f():\n    from ..runtime import fsdp\n    from meshplan import runtime\n")
    found = [m for _, m in _imports_in(src, "meshplan.planner.probe", False)]
    assert found == ["meshplan.runtime.parallel", "meshplan.train.loop", "meshplan.runtime", "meshplan.runtime"]
    assert all(_target_package(m) not in ALLOWED["planner"] for m in found)
