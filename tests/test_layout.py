"""The package's layout: docs/architecture.md's Layout section lists exactly the modules in the tree, and no
module of `bertjax/` imports itself back through others (an import cycle), and importing it starts nothing of JAX."""
import ast
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def listed_modules(block: str) -> list[str]:
    """The modules a Layout block names, in order: a line starts with a module's path (`folder/name.py`), or with
    several, comma-separated; other lines (a continued description, a file that is not a module) name none."""
    modules = []
    for paths in re.findall(r"^((?:\S+\.py, )*\S+\.py),?(?=\s|$)", block, flags=re.MULTILINE):
        modules += paths.split(", ")
    return modules


def test_the_layout_reader_takes_several_paths_on_a_line():
    block = ("README.md           the commands\n"
             "pkg/__init__.py, pkg/cli.py\n"
             "                       the entry point; its commands; pkg/not_listed.py in a description names none\n"
             "pkg/sub/a.py, pkg/sub/b.py,\n"
             "pkg/sub/c.py\n"
             "                       three modules of one folder\n"
             "pkg/sub/d.py           one module\n")
    assert listed_modules(block) == ["pkg/__init__.py", "pkg/cli.py", "pkg/sub/a.py", "pkg/sub/b.py", "pkg/sub/c.py",
                                     "pkg/sub/d.py"]


def test_layout_lists_every_module_and_only_existing_ones():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    listed = listed_modules(block)
    in_tree = {str(p.relative_to(ROOT)) for folder in ("bertjax", "launch", "pipelines", "configs", "bench")
               for p in (ROOT / folder).rglob("*.py")}
    assert sorted(in_tree - set(listed)) == [], "modules missing from docs/architecture.md's Layout"
    assert sorted(set(listed) - in_tree) == [], "Layout lists modules that do not exist"
    assert len(listed) == len(set(listed)), "Layout lists a module twice"


def import_graph(package_dir: pathlib.Path) -> dict[str, set[str]]:
    """{module: modules of the same package it imports}, anywhere in the module (also inside functions: a lazy
    import still ties the two modules together)."""
    package = package_dir.name
    modules = {".".join(p.relative_to(package_dir.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in package_dir.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from a.b import c` imports the module a.b.c if there is one, else a name of a.b
                edges.update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules
                             else node.module for alias in node.names)
        graph[name] = {edge for edge in edges if edge in modules and edge != name and edge.startswith(package)}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_cycle_finder_sees_a_lazy_import_cycle(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "loop.py").write_text("from pkg.sub import job\n")
    (package / "sub" / "job.py").write_text("def f():\n    from pkg import compiler\n")
    (package / "compiler.py").write_text("import pkg.loop\n")
    (package / "leaf.py").write_text("from pkg.sub.job import f\n")
    assert import_cycles(import_graph(package)) == [["pkg.compiler", "pkg.loop", "pkg.sub.job"]]


def test_no_import_cycles_in_the_package():
    graph = import_graph(ROOT / "bertjax")
    assert "bertjax.pretraining.job" in graph["bertjax.cloud.compile"]  # the graph sees the package's imports
    assert import_cycles(graph) == []


def test_importing_the_package_does_not_start_jax():
    """A multi-host job calls jax.distributed.initialize() after its imports, which JAX refuses once anything has
    started the XLA backend: no module may make a JAX array (or ask for devices) when it is imported."""
    code = ("import importlib, pkgutil, bertjax\n"
            "for module in pkgutil.walk_packages(bertjax.__path__, 'bertjax.'):\n"
            "    importlib.import_module(module.name)\n"
            "from jax._src import xla_bridge\n"
            "print(xla_bridge.backends_are_initialized())\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-1] == "False", "importing bertjax started JAX's backend"


def test_the_wheel_carries_every_folder_of_the_package():
    """pyproject.toml lists the packages a wheel installs by name: a new folder left off it imports from a checkout
    and fails on a TPU slice's workers, which run the wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "bertjax").rglob("__init__.py")}
    assert folders - listed == set(), "folders of bertjax/ that pyproject.toml's packages leave out of the wheel"
    assert "bertjax.configs" in listed
