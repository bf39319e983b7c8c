"""The shape of `flows/`: which package may import what, and no import runs in a circle.

Read from the source (every import statement, at module top or inside a function; those
under `if TYPE_CHECKING:` are for the type checker and do not run), so the rules hold for
code paths that no other test reaches.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
FLOWS = ROOT / "flows"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> set[str]:
    """Every module an import statement names, TYPE_CHECKING blocks left out."""
    found: set[str] = set()
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking_only(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _graph() -> dict[str, set[str]]:
    """flows module → the modules it imports."""
    return {_module_name(path): _imports(ast.parse(path.read_text(), str(path))) for path in sorted(FLOWS.rglob("*.py"))}


def _flows_module(name: str, modules: set[str]) -> str | None:
    """The flows module an imported name is (`from flows.run import config` names the package)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


# package → (the flows packages it may import, the libraries it must not import). Bottom up:
# the run is data; tracking records runs in MLflow; characterization measures, and has its
# runs recorded by tracking; the Prefect stages; tuning, which runs stages; the deployed flows,
# which run both; and the command line over all of them (flows/cli, imported by nothing).
LAYERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "flows.run": (("flows.run",), ("prefect", "mlflow")),
    "flows.tracking": (("flows.run", "flows.tracking"), ("prefect",)),
    "flows.characterize": (("flows.run", "flows.tracking", "flows.characterize"), ("prefect", "mlflow")),
    "flows.stages": (("flows.run", "flows.tracking", "flows.stages"), ()),
    "flows.tuning": (("flows.run", "flows.tracking", "flows.characterize", "flows.stages", "flows.tuning"), ()),
    "flows.deployments": (("flows.run", "flows.tracking", "flows.characterize", "flows.stages", "flows.tuning",
                           "flows.deployments"), ()),
}
# Prefect is imported only where flows, tasks and deployments are declared (and its plumbing);
# MLflow only in flows/tracking
PREFECT_PACKAGES = ("flows.stages", "flows.tuning", "flows.deployments")


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_each_layer_imports_only_what_lies_below_it():
    graph = _graph()
    for package, (may_import, must_not) in LAYERS.items():
        members = {name: imports for name, imports in graph.items() if _in(name, package)}
        assert len(members) > 1, f"{package} holds its modules"
        broken = {
            name: sorted(
                imported
                for imported in imports
                if imported.split(".")[0] in must_not
                or (_in(imported, "flows") and imported != "flows" and not any(_in(imported, p) for p in may_import))
            )
            for name, imports in members.items()
        }
        assert not {name: found for name, found in broken.items() if found}, (
            f"{package} imports only {', '.join(may_import)} of flows, and none of {', '.join(must_not)}"
        )
    prefect = sorted(name for name, imports in graph.items() if any(_in(i, "prefect") for i in imports)
                     and not any(_in(name, p) for p in PREFECT_PACKAGES))  # fmt: skip
    assert prefect == [], "Prefect is imported only by the stages, tuning and the deployments"
    mlflow = sorted(name for name, imports in graph.items() if any(_in(i, "mlflow") for i in imports)
                    and not _in(name, "flows.tracking"))  # fmt: skip
    assert mlflow == [], "MLflow is imported only by tracking"
    cli = sorted(name for name, imports in graph.items() if not _in(name, "flows.cli")
                 and any(_in(i, "flows.cli") for i in imports))  # fmt: skip
    assert cli == [], "nothing imports the command line"
    run = {name for name in graph if _in(name, "flows.run")}
    assert {"flows.run.config", "flows.run.resolve", "flows.run.job", "flows.run.nights", "flows.run.rows"} <= run


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each import circle found by a depth-first walk, as the modules round it."""
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for target in sorted(edges.get(name, ())):
            if state.get(target) == 1:
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name)
    return circles


def test_no_flows_module_imports_itself_round_a_circle():
    graph = _graph()
    modules = set(graph)
    edges = {name: {m for i in imports if (m := _flows_module(i, modules)) and m != name} for name, imports in graph.items()}
    circles = _circles(edges)
    assert not circles, "import circles in flows/: " + "; ".join(" → ".join(c) for c in circles)


def test_the_checks_see_a_circle_and_a_forbidden_import():
    """The two rules above can fail: a module that imports Prefect is seen, and so is a loop."""
    source = "import prefect\nfrom flows.run import config\nif TYPE_CHECKING:\n    import mlflow\ndef f():\n    import flows.cli"
    found = _imports(ast.parse(source))
    assert found == {"prefect", "flows.run", "flows.cli"}
    assert _flows_module("flows.run.config.PipelineConfig", {"flows.run.config", "flows.run"}) == "flows.run.config"
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _circles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_a_host_that_only_trains_imports_neither_prefect_nor_mlflow():
    """`dlrm train` runs on every host of a job (by hand, from Slurm's batch script, as a
    served trainer node): what it imports (flows/run/host_training.py) leaves out Prefect and
    MLflow, about 3 s of a start, read here from a fresh interpreter."""
    probe = ("import sys, flows.run.host_training; "
             "print(sorted({name.split('.')[0] for name in sys.modules} & {'prefect', 'mlflow'}))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout
