"""The package's Python modules form layers: no import circle (lazy imports inside functions included), and no
module imports another's private names (what callers share lives under public names, as call_prep's helpers)."""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "src" / "graphattn"


def _modules() -> dict:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(("graphattn",) + (parts[:-1] if parts[-1] == "__init__" else parts))
        found[name] = path
    for path in PACKAGE.glob("*.pyx"):  # the compiled extensions (_cpu, _sycl): modules of their own
        found[f"graphattn.{path.stem}"] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: dict) -> list:
    """(imported module, imported names) of every import in the file, at any depth, resolved to the package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:  # `from . import functional` names a module
                    edges.append((sub, ()))
                elif target in modules:
                    edges.append((target, (alias.name,)))
        elif isinstance(node, ast.Import):
            edges += [(alias.name, ()) for alias in node.names if alias.name in modules]
    return edges


def _graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items() if path.suffix == ".py"}


def test_no_module_imports_another_private_name():
    borrowed = [(name, target, n) for name, edges in _graph().items() for target, names in edges for n in names
                if n.startswith("_") and not n.startswith("__")]
    assert not borrowed, f"private names imported across modules: {borrowed}"


def test_no_import_circle():
    graph = {name: sorted({t for t, _ in edges if t != name and t != "graphattn"}) for name, edges in _graph().items()}
    state, stack, circles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == "open":
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_graph_sees_lazy_and_relative_imports():
    """The graph walk resolves relative and lazy imports (a function-level `from . import x` counts)."""
    edges = _imports("graphattn.functional", PACKAGE / "functional.py", _modules())
    assert ("graphattn.torch_autograd", ()) in edges  # imported inside _load_torch_ops
    assert ("graphattn.forward_call", ()) in edges
