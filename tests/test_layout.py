"""The package's layers (README, "Design"): a module imports only from its own layer and the
layers below it. Read from the source (every import statement, at module level or inside
a function), so no layer has to be importable for the check to run."""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "torch_tree_attn"

# Lowest first. A module's layer is the first entry its dotted name starts with.
LAYERS = (
    ("op API", ("torch_tree_attn._C", "torch_tree_attn._fake", "torch_tree_attn.ops", "torch_tree_attn.reference")),
    ("backends", ("torch_tree_attn.backends",)),
    ("tree utilities", ("torch_tree_attn.tree",)),
    ("model integration", ("torch_tree_attn.hf",)),
    ("speculative decoding", ("torch_tree_attn.speculative",)),
)
ENTRY = "torch_tree_attn"   # the package's __init__: above every layer


def layer_of(module: str) -> int:
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    raise KeyError(module)


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, name: str, is_package: bool):
    """(line, imported module) for every import of a torch_tree_attn module in ``source``, the
    text of module ``name`` (``is_package``: an __init__.py), relative imports resolved."""
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == ENTRY:
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != ENTRY:
                continue
            if target == ENTRY:   # "from torch_tree_attn import x": x is the module imported
                for alias in node.names:
                    yield node.lineno, f"{ENTRY}.{alias.name}"
            else:
                yield node.lineno, target


def package_imports(path: pathlib.Path):
    return imports_of(path.read_text(), module_name(path), path.name == "__init__.py")


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_has_a_layer():
    names = [module_name(p) for p in MODULES]
    assert len(names) > 20, names
    unplaced = []
    for name in names:
        if name == ENTRY:
            continue
        try:
            layer_of(name)
        except KeyError:
            unplaced.append(name)
    assert not unplaced, f"modules in no layer (add them to LAYERS and the README's Design table): {unplaced}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_imports_run_downward(path):
    name = module_name(path)
    if name == ENTRY:
        return
    own = layer_of(name)
    upward = []
    for line, target in package_imports(path):
        assert target != ENTRY, f"{path}:{line}: a layer imports the package entry"
        if layer_of(target) > own:
            upward.append(f"{path.name}:{line} ({LAYERS[own][0]}) imports {target} ({LAYERS[layer_of(target)][0]})")
    assert not upward, upward


def test_the_check_sees_an_upward_import():
    """Relative imports resolve the way Python resolves them, so an upward import written the
    way the package writes its imports is caught (the test above can fail)."""
    src = "from ..hf import compat\nfrom . import draft\n\n\ndef f():\n    from ..speculative.engine import release\n"
    found = [t for _, t in imports_of(src, "torch_tree_attn.tree.structure", False)]
    assert found == ["torch_tree_attn.hf", "torch_tree_attn.tree", "torch_tree_attn.speculative.engine"]
    assert [layer_of(t) > layer_of("torch_tree_attn.tree.structure") for t in found] == [True, False, True]
    init = [t for _, t in imports_of("from ... import _C\nfrom . import compiler\n", "torch_tree_attn.backends.cuda", True)]
    assert init == ["torch_tree_attn._C", "torch_tree_attn.backends.cuda"]
