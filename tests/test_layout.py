"""The package's shape: no import cycles (type-checking imports included), subpackages that
import only the layers below them, a small root, every error class a caller may catch
importable from the package itself, and import paths (the README's, the old flat ones) that
work."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re
import sys

import pytest

import dsa_async
from dsa_async import _moved, errors

PACKAGE_DIR = pathlib.Path(dsa_async.__file__).parent
PACKAGE = PACKAGE_DIR.name


def _modules(package_dir: pathlib.Path = PACKAGE_DIR) -> dict[str, tuple[pathlib.Path, bool]]:
    """Every module of a package: dotted name -> (file, whether it is a package)."""
    found = {}
    for path in package_dir.rglob("*.py"):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found[".".join(parts)] = (path, is_package)
    return found


def import_graph(modules: dict[str, tuple[pathlib.Path, bool]], *, outside: bool = False
                 ) -> dict[str, set[str]]:
    """Edges module -> module it imports, read from the source (every ``import`` and ``from``
    statement at any depth, so ``if TYPE_CHECKING:`` blocks and imports inside functions
    count). ``from package import name`` points at ``package.name`` when that is a module, else
    at the package. ``outside``: keep edges to names that are no module of ``modules`` (under
    the same top-level package) too."""
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    child = f"{source}.{alias.name}"
                    targets.add(child if child in modules else source)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        top = name.partition(".")[0]
        graph[name] = {t for t in targets if t != name and (
            t in modules or (outside and t.partition(".")[0] == top))}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each one holds a cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(start: str) -> None:  # Tarjan, iterative
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_the_package_has_no_import_cycles():
    modules = _modules()
    assert len(modules) > 50  # the walk found the package
    assert cycles(import_graph(modules)) == []


#: Which subpackages each subpackage may import (the README's Architecture section). The root
#: modules (errors, config, geometry, kinds) are open to all.
LAYERS = {
    "paging": set(),
    "observability": set(),
    "host_memory": {"paging"},
    "transfer": {"paging"},
    "scheduling": {"paging", "host_memory", "transfer", "observability", "completion"},
    "completion": {"paging", "host_memory", "transfer", "observability", "scheduling"},
    "front_door": {"paging", "host_memory", "transfer", "observability", "scheduling",
                   "completion"},
}


def test_subpackages_import_only_the_layers_below_them():
    modules = _modules()
    for name, targets in import_graph(modules).items():
        parts = name.split(".")
        if len(parts) < 3 or parts[1] not in LAYERS:
            continue
        for target in targets:
            target_parts = target.split(".")
            in_subpackage = len(target_parts) >= 3 or modules[target][1]
            if target == PACKAGE or not in_subpackage or target_parts[1] == parts[1]:
                continue  # a root module, or the same subpackage
            assert target_parts[1] in LAYERS[parts[1]], f"{name} imports {target}"


def test_the_cycle_finder_sees_type_checking_and_function_level_imports(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub import b\n")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import C\n")
    (package / "c.py").write_text("def f():\n    from pkg import a\n")
    (package / "d.py").write_text("from . import a\n")  # imports into the cycle, not part of it
    modules = _modules(package)
    assert cycles(import_graph(modules)) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    (package / "c.py").write_text("def f():\n    pass\n")
    assert cycles(import_graph(modules)) == []


def test_the_package_root_holds_only_the_public_surface():
    root_modules = sorted(p.name for p in PACKAGE_DIR.glob("*.py"))
    assert len(root_modules) <= 8, root_modules


def _error_classes() -> list[type]:
    return [cls for _, cls in inspect.getmembers(errors, inspect.isclass)
            if issubclass(cls, BaseException) and cls.__module__ == errors.__name__]


def test_every_error_class_is_importable_from_the_package():
    classes = _error_classes()
    assert len(classes) >= 15
    for cls in classes:
        assert getattr(dsa_async, cls.__name__) is cls
        assert cls.__name__ in dsa_async.__all__


@pytest.mark.parametrize("name", sorted(dsa_async.__all__))
def test_every_public_name_resolves(name):
    assert getattr(dsa_async, name) is not None


REPO = PACKAGE_DIR.parent


def _imported_package_modules(path: pathlib.Path) -> set[str]:
    """The ``dsa_async...`` modules an absolute import in ``path`` names (source or target)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name == PACKAGE or name.startswith(PACKAGE + ".")}


def test_the_project_imports_modules_where_they_live_not_through_moved_paths():
    modules = _modules()
    for name, targets in import_graph(modules, outside=True).items():
        for target in targets:
            assert target in modules, f"{name} imports {target}, which is no module"
    for path in sorted((REPO / "tests").rglob("*.py")):
        if path == pathlib.Path(__file__):
            continue  # this file imports old paths on purpose, to test them
        for name in _imported_package_modules(path):
            assert name in modules, f"{path.relative_to(REPO)} imports {name}, which is no module"
    scripts = [*(REPO / "tests").rglob("*.sh"), *(REPO / "docker").rglob("*"),
               *(REPO / ".ci").rglob("*")]
    statement = re.compile(r"^\s*(?:from|import) (dsa_async[\w.]*)", re.MULTILINE)
    for path in sorted(p for p in scripts if p.is_file()):
        for name in statement.findall(path.read_text()):
            assert name in modules, f"{path.relative_to(REPO)} imports {name}, which is no module"


def test_every_dotted_path_the_readme_names_is_a_module_or_a_name_in_one():
    text = (REPO / "README.md").read_text()
    paths = set(re.findall(r"\b(dsa_async(?:\.[A-Za-z_]\w*)+)", text))
    paths.discard("dsa_async.json")  # a file
    assert len(paths) >= 5  # the README names some
    modules = _modules()
    for dotted in sorted(paths):
        if dotted in modules:
            importlib.import_module(dotted)
            continue
        owner, _, attr = dotted.rpartition(".")
        if dotted in LOGGER_NAMES or (owner == PACKAGE and attr in _moved.MOVED):
            continue  # a logger's name, or an old path the README names as old
        assert owner in modules, f"README names {dotted}: neither a module nor in one"
        assert hasattr(importlib.import_module(owner), attr), dotted


def test_every_import_the_readme_shows_works_at_its_path():
    text = (REPO / "README.md").read_text()
    imports = re.findall(r"^from (dsa_async[\w.]*) import \(?([\w, \n]+)\)?$", text, re.MULTILINE)
    assert len(imports) >= 2
    modules = _modules()
    for module, names in imports:
        assert module in modules, f"README imports from {module}, which is no module"
        owner = importlib.import_module(module)
        for name in filter(None, (n.strip() for n in names.replace("\n", ",").split(","))):
            assert hasattr(owner, name), f"README: from {module} import {name}"


#: Logger names the README tells operators about (they keep their names across moves).
LOGGER_NAMES = {"dsa_async.service"}


def _forget(monkeypatch: pytest.MonkeyPatch, old: str) -> None:
    """As if ``dsa_async.<old>`` had never been imported in this process."""
    monkeypatch.delitem(sys.modules, f"{PACKAGE}.{old}", raising=False)
    monkeypatch.delattr(dsa_async, old, raising=False)


def test_a_moved_module_is_the_same_module_at_its_old_path_with_a_warning(monkeypatch):
    from dsa_async.host_memory import budget

    _forget(monkeypatch, "budget")

    with pytest.warns(DeprecationWarning, match="dsa_async.budget moved to "
                                                "dsa_async.host_memory.budget") as caught:
        import dsa_async.budget as old
    assert old is budget
    assert caught[0].filename == __file__  # it blames the import statement, which it shows


def test_a_split_module_at_its_old_path_gives_the_names_it_had(monkeypatch):
    from dsa_async.paging import runs, tokens

    _forget(monkeypatch, "pages")

    with pytest.warns(DeprecationWarning, match="dsa_async.pages moved to"):
        old = importlib.import_module("dsa_async.pages")
    assert old.page_runs is runs.page_runs
    assert old.checked_index_array is tokens.checked_index_array
    with pytest.raises(AttributeError, match="no attribute 'nothing_like_this'"):
        _ = old.nothing_like_this


def test_every_moved_path_resolves_to_modules_that_exist():
    modules = _modules()
    for old, homes in _moved.MOVED.items():
        assert f"{PACKAGE}.{old}" not in modules, f"{old} is both moved and present"
        for home in homes:
            assert f"{PACKAGE}.{home}" in modules, (old, home)


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_every_old_path_imports_with_a_warning_naming_where_it_went(monkeypatch, old):
    _forget(monkeypatch, old)
    homes = [importlib.import_module(f"{PACKAGE}.{home}") for home in _moved.MOVED[old]]
    with pytest.warns(DeprecationWarning, match=f"{PACKAGE}.{old} moved to {PACKAGE}.") as caught:
        module = importlib.import_module(f"{PACKAGE}.{old}")
    assert all(home.__name__ in str(caught[0].message) for home in homes)
    public = [name for home in homes for name in vars(home) if not name.startswith("_")]
    assert public and all(getattr(module, name) is not None for name in public)


def test_the_readmes_architecture_table_names_every_module_of_each_step_and_no_other():
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Architecture"):]
    section = section[:section.index("\n## ", 1)]
    rows = re.findall(r"^\| [^|]+ \| `dsa_async\.(\w+)` \| (.+) \|$", section, re.MULTILINE)
    assert {package for package, _ in rows} == set(LAYERS)  # one row per step of the flow
    for package, cell in rows:
        named = set(re.findall(r"`(\w+)\.py`", cell))
        present = {p.stem for p in (PACKAGE_DIR / package).glob("*.py")} - {"__init__"}
        assert named == present, (package, sorted(named ^ present))

