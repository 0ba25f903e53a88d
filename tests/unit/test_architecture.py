"""The layout's rules: every module imports alone, dependencies point one way (no cycle between
modules, nor between the packages of `picker/`), and the product never imports the simulator or
the bench (distributions of their own, outside its wheel)."""

from __future__ import annotations

import ast
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "picker"
# The repository's import packages, each with its directory: the product and its test rig.
PACKAGES = {
    "picker": PACKAGE,
    "picker_sim": ROOT / "sim" / "picker_sim",
    "picker_bench": ROOT / "bench" / "picker_bench",
}
RIG = set(PACKAGES) - {"picker"}

# Each module is imported in a child forked from an interpreter that has imported nothing of
# picker (nor its dependencies): as if alone in a fresh interpreter, at a fork's cost.
_IMPORT_EACH = """
import importlib, os, sys, traceback
failed = []
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        failed.append(name)
print("FAILED:" + ",".join(failed))
"""


def module_files() -> dict[str, Path]:
    """Every module of the repository's packages, by name."""
    files = {}
    for directory in PACKAGES.values():
        for path in sorted(directory.rglob("*.py")):
            parts = path.relative_to(directory.parent).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The picker modules `path` imports at run time (imports under `if TYPE_CHECKING:` are
    for annotations only and do not count)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            type_only.update(id(child) for child in ast.walk(node))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("picker"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("picker"):
            found.add(node.module)
            found.update(
                f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in known
            )
    return found & known


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {name: imported_modules(path, known) - {name} for name, path in files.items()}


def package_of(module: str) -> str:
    """`picker.x` for picker's modules; the simulator and the bench count as one package each."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "picker" else parts[0]


def top_level_imports(path: Path) -> set[str]:
    """The top-level packages `path` imports anywhere (under `if TYPE_CHECKING:` too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.partition(".")[0])
    return found


def test_every_picker_module_imports_alone_in_a_fresh_interpreter() -> None:
    names = list(module_files())
    assert len(names) > 50
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, *names], capture_output=True, text=True, cwd=ROOT, timeout=240
    )
    assert result.returncode == 0, result.stderr
    failed = result.stdout.strip().rpartition("FAILED:")[2]
    assert failed == "", f"modules that do not import alone: {failed}\n{result.stderr[-4000:]}"


def test_no_import_cycle_between_modules() -> None:
    try:
        TopologicalSorter(import_graph()).prepare()
    except CycleError as error:
        raise AssertionError(f"import cycle between modules: {' -> '.join(error.args[1])}") from None


def test_packages_depend_on_each_other_one_way() -> None:
    graph: dict[str, set[str]] = {}
    for module, imports in import_graph().items():
        graph.setdefault(package_of(module), set()).update(package_of(i) for i in imports)
    for package, imports in graph.items():
        imports.discard(package)
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as error:
        raise AssertionError(f"packages import each other: {' -> '.join(error.args[1])}") from None


def test_the_cycle_checks_see_a_cycle() -> None:
    """The checks above are only as good as the graph: a known edge must be in it."""
    graph = import_graph()
    assert "picker.framework.plugin" in graph["picker.scheduling.scheduler"]
    assert "picker.prefix.plugins" in graph["picker.kvevents.plugins"]
    graph["picker.framework.plugin"].add("picker.scheduling.scheduler")
    try:
        TopologicalSorter(graph).prepare()
    except CycleError:
        return
    raise AssertionError("an added back edge was not reported as a cycle")


def declared_dependencies(directory: Path) -> set[str] | None:
    """The packages (and top-level modules) of picker a package's docstring says it may import
    (None: "anything")."""
    docstring = ast.get_docstring(ast.parse((directory / "__init__.py").read_text(encoding="utf-8"))) or ""
    _, found, rule = docstring.partition("May import:")
    assert found, f"{directory / '__init__.py'} does not say what it may import"
    rule = rule.split(".")[0]
    if rule.strip().startswith("anything"):
        return None
    names = {p.stem for p in PACKAGE.iterdir() if (p / "__init__.py").exists() or p.suffix == ".py"}
    return {word for word in rule.replace(",", " ").replace("(", " ").split() if word in names}


def picker_packages_imported(imports: set[str]) -> set[str]:
    """The packages of picker among `imports` (`picker.prefix.hashing` → `prefix`)."""
    return {i.split(".")[1] for i in imports if i.startswith("picker.")}


def test_packages_import_only_what_their_docstring_allows() -> None:
    actual: dict[Path, set[str]] = {}
    for module, imports in import_graph().items():
        parts = module.split(".")
        if parts[0] == "picker" and len(parts) > 1 and (PACKAGE / parts[1]).is_dir():
            actual.setdefault(PACKAGE / parts[1], set()).update(picker_packages_imported(imports) - {parts[1]})
        elif parts[0] in RIG:
            actual.setdefault(PACKAGES[parts[0]], set()).update(picker_packages_imported(imports))
    assert PACKAGES["picker_sim"] in actual
    for directory, imports in sorted(actual.items()):
        allowed = declared_dependencies(directory)
        if allowed is not None:
            assert imports <= allowed, (
                f"{directory} imports {sorted(imports - allowed)} of picker, not in its docstring"
            )


def test_the_product_never_imports_the_simulator_or_the_bench() -> None:
    """They are not in picker's wheel or image: an import of them from picker would fail there."""
    offending = {
        str(path.relative_to(ROOT)): sorted(top_level_imports(path) & RIG) for path in sorted(PACKAGE.rglob("*.py"))
    }
    assert {path: rig for path, rig in offending.items() if rig} == {}
    # The scan sees such imports where they are: the bench's runner imports the simulator.
    assert "picker_sim" in top_level_imports(PACKAGES["picker_bench"] / "runner.py")
