"""The package's layout shows its architecture (ARCHITECTURE.md): no import circle between its
modules at any level (at import, for type checking, or inside a function, where a lazy import
would only hide a circle), no private name (``_name``) of a module used by another one (a name
two modules use is public in its home), no folder holding more than 40 % of its lines, and no
module over 600 lines (issue 53)."""

from __future__ import annotations

import ast
import pathlib

import graphdist

PACKAGE = pathlib.Path(graphdist.__file__).parent
MAX_FOLDER_SHARE = 0.40
MAX_MODULE_LINES = 600


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports run when the module is imported or type-checked: at module level, also inside
    ``if``/``try`` blocks (``if TYPE_CHECKING:``), not inside functions or classes."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If | ast.Try):
            todo.extend(node.body + node.orelse)
            todo.extend(getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                todo.extend(handler.body)
    return found


def _all_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import of a module, wherever it is: in functions and classes too."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]


def import_graph(*, lazy: bool = False) -> dict[str, set[str]]:
    """Each graphdist module -> the graphdist modules it imports at import or type-check time
    (``lazy``: anywhere, inside functions too)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    find = _all_imports if lazy else _top_level_imports
    for name, path in modules.items():
        edges: set[str] = set()
        for node in find(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve(name, path, node)
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def _resolve(name: str, path: pathlib.Path, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` in module ``name`` (file ``path``) imports from."""
    base = node.module or ""
    if node.level:  # relative: resolve against this module's package
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}".rstrip(".")
    return base


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(sources: dict[str, tuple[pathlib.Path, str]]) -> list[str]:
    """``user: home.name`` for every private name of a graphdist module that another module
    imports (``from home import _name``, anywhere in it) or reads from the module
    (``home._name``, ``home`` imported as a module, by ``import ... as`` or ``from``);
    ``sources``: module name -> (its file, its text). Importing a public name under a private
    alias (``import x as _x``) is no such use."""
    found: list[str] = []
    for user, (path, text) in sorted(sources.items()):
        tree = ast.parse(text)
        modules: dict[str, str] = {}  # local name -> the graphdist module it is
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in sources:
                        modules[alias.asname or alias.name] = alias.name
            elif isinstance(node, ast.ImportFrom):
                home = _resolve(user, path, node)
                for alias in node.names:
                    if f"{home}.{alias.name}" in sources:
                        modules[alias.asname or alias.name] = f"{home}.{alias.name}"
                    elif home in sources and home != user and _private(alias.name):
                        found.append(f"{user}: {home}.{alias.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                owner = ast.unparse(node.value)
                home = modules.get(owner, owner)
                if home in sources and home != user:
                    found.append(f"{user}: {home}.{node.attr}")
    return sorted(set(found))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycles_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_even_for_type_checking():
    graph = import_graph()
    assert "graphdist._local.fleet" in graph  # the walk found the package
    assert cycles(graph) == []


def test_no_import_circle_even_through_lazy_imports():
    """A run backend that imported the launcher's names, which imports it back inside a
    function, was such a circle (issue 37)."""
    graph = import_graph(lazy=True)
    assert "graphdist._distribute.launcher" in graph["graphdist._cli.runcmds"]  # lazy: counted
    assert cycles(graph) == []


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between the package's folders (``graphdist._net``) and top-level
    modules (``graphdist._cluster``): an edge wherever a module of one imports one of the
    other."""

    def folder(module: str) -> str:
        return ".".join(module.split(".")[:2])

    folders: dict[str, set[str]] = {folder(m): set() for m in graph}
    for module, edges in graph.items():
        folders[folder(module)].update(folder(e) for e in edges if folder(e) != folder(module))
    return folders


#: Module imports that still make a circle between folders, each with why it is left (issue 53).
FOLDER_CIRCLE_EDGES_LEFT = {
    # the TLS gateway's owner stops its process with the one stop escalation of _proc/process.py,
    # which the guard also runs as a bare script: to move it below _net, the escalation must
    # leave the guard's file (a module of its own that the script does not import)
    ("graphdist._net.gateway", "graphdist._proc.process"),
}


def test_no_import_circle_between_folders():
    """``_net`` and ``_proc`` imported each other, and ``_cluster`` imported ``_net.ports``
    (issue 53): each folder sits on one layer. Lazy imports count."""
    graph = import_graph(lazy=True)
    for module, imported in FOLDER_CIRCLE_EDGES_LEFT:
        assert imported in graph[module], f"{module} no longer imports {imported}: drop the entry"
        graph[module].discard(imported)
    assert cycles(folder_graph(graph)) == []


def test_a_circle_between_folders_is_found():
    graph = {"graphdist._a.x": {"graphdist._b.y"}, "graphdist._b.y": {"graphdist._a.z"}}
    graph["graphdist._a.z"] = set()
    assert cycles(folder_graph(graph)) == [["graphdist._a", "graphdist._b"]]


def test_run_backends_know_only_the_contract():
    """A run backend imports neither the launcher nor the attempt loop (at any level): the loop
    calls it through :mod:`graphdist._distribute.runbackends`, so a fourth engine is one module."""
    graph = import_graph(lazy=True)
    above = {"graphdist._distribute.launcher", "graphdist._distribute.supervise"}
    modules = ("graphdist._local.run", "graphdist._ray.run", "graphdist._distribute.commandrun")
    assert {m: graph[m] & above for m in modules} == {m: set() for m in modules}


#: Slurm's commands: only its engine's module runs them.
SLURM_COMMANDS = ("srun", "scancel", "sinfo", "squeue", "scontrol", "sbatch", "salloc")
#: Who else imports that module, and why.
SLURM_IMPORTERS = {
    "graphdist._fleet.command": "SlurmFleet, the engine's fleet with a jobid (a public name)",
}


def slurm_strangers(package: pathlib.Path) -> list[str]:
    """Modules of ``package`` but its Slurm module that run a Slurm command (name one as a
    string constant) or import that module without a reason in :data:`SLURM_IMPORTERS`."""
    found = []
    for path in sorted(package.rglob("*.py")):
        name = _module_name(path)
        if name.endswith("._proc.slurm"):
            continue
        tree = ast.parse(path.read_text())
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
        imports = {getattr(n, "module", None) or "" for n in _all_imports(tree)} | {
            a.name for n in _all_imports(tree) if isinstance(n, ast.Import) for a in n.names
        }
        runs = strings & set(SLURM_COMMANDS)
        if runs or ("graphdist._proc.slurm" in imports and name not in SLURM_IMPORTERS):
            found.append(f"{name}: {sorted(runs) or 'imports graphdist._proc.slurm'}")
    return found


def test_slurm_is_one_module():
    """Issue 53, point 1: Slurm is its engine's module (graphdist/_proc/slurm.py); its fleet and
    its run are the engine-free halves over :class:`graphdist._engine.Engine`."""
    assert slurm_strangers(PACKAGE) == []


def test_each_built_in_engine_is_one_module_or_one_folder():
    """Issue 53, point 1: an engine's own halves live in its module or folder (``_local/``,
    ``_ray/``); an engine of primitives (Slurm) has the engine-free halves, bound to it."""
    from graphdist import _engine

    found = {}
    for name, cls in _engine.classes().items():
        halves = [
            getattr(cls, k).partition(":")[0] for k in ("FLEET", "RUN") if getattr(cls, k, None)
        ]
        found[name] = [
            m
            for m in halves
            if not m.startswith(cls.__module__ + ".")
            and m != "graphdist._fleet.command"  # SlurmFleet: the free half
        ]
    assert {n: found[n] for n in ("local", "ray", "slurm")} == {"local": [], "ray": [], "slurm": []}
    assert {n: _engine.classes()[n].__module__ for n in ("local", "ray", "slurm")} == {
        "local": "graphdist._local",
        "ray": "graphdist._ray",
        "slurm": "graphdist._proc.slurm",
    }


def test_slurm_strangers_finds_a_command_or_an_import(tmp_path):
    package = tmp_path / "graphdist"
    (package / "_x").mkdir(parents=True)
    (package / "_x" / "a.py").write_text("argv = ['scancel', '--signal=KILL']\n")
    (package / "_x" / "b.py").write_text("from graphdist._proc.slurm import allocation\n")
    (package / "_x" / "c.py").write_text("words = 'srun said no'\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, package
    try:
        assert slurm_strangers(package) == [
            "graphdist._x.a: ['scancel']",
            "graphdist._x.b: imports graphdist._proc.slurm",
        ]
    finally:
        PACKAGE = saved


def test_lazy_imports_are_found_where_top_level_ones_are_not(tmp_path):
    tree = ast.parse("import os\ndef f():\n    import graphdist._local.fleet\n")
    assert len(_all_imports(tree)) == 2 and len(_top_level_imports(tree)) == 1


def test_no_private_name_is_used_by_another_module():
    """A name used by two modules is public in its home: a private name (``_name``) is one that
    its module may rename or drop without looking elsewhere."""
    sources = {_module_name(p): (p, p.read_text()) for p in PACKAGE.rglob("*.py")}
    assert sorted(set(private_uses(sources))) == []


def test_private_uses_finds_imports_and_attributes():
    here = PACKAGE / "_x" / "a.py"
    sources = {
        "graphdist._x": (PACKAGE / "_x" / "__init__.py", ""),
        "graphdist._x.b": (PACKAGE / "_x" / "b.py", "_hidden = 1\nshown = 2\n"),
        "graphdist._x.a": (
            here,
            "import graphdist._x.b as bee\n"
            "from graphdist._x.b import _hidden, shown as _shown\n"
            "from . import b\n"
            "from .b import _also\n"
            "def f():\n"
            "    return bee._one, b._two, b.shown, graphdist._x.b._three, bee.__name__\n",
        ),
    }
    assert private_uses(sources) == [
        f"graphdist._x.a: graphdist._x.b.{name}"
        for name in ("_also", "_hidden", "_one", "_three", "_two")
    ]


def module_sizes() -> dict[str, int]:
    """Each module of the package (its path under graphdist/) -> its number of lines."""
    return {
        p.relative_to(PACKAGE).as_posix(): len(p.read_text().splitlines())
        for p in PACKAGE.rglob("*.py")
    }


def test_no_module_is_over_600_lines():
    """Every module of graphdist/, in every folder and at the top, the CLI's parser included (it
    holds no command: those are in _cli/*cmds.py)."""
    sizes = module_sizes()
    assert {"_cli/main.py", "_cluster.py", "_net/gateway.py"} <= sizes.keys()  # found them all
    assert {n: s for n, s in sizes.items() if s > MAX_MODULE_LINES} == {}


def test_no_folder_holds_more_than_40_percent_of_the_lines():
    lines: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        folder = str(path.parent.relative_to(PACKAGE.parent))
        lines[folder] = lines.get(folder, 0) + len(path.read_text().splitlines())
    total = sum(lines.values())
    shares = {folder: n / total for folder, n in lines.items()}
    assert max(shares.values()) <= MAX_FOLDER_SHARE, shares
