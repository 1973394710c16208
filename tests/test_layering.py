"""Imports run one way, ``micro <- drafters <- engine <- server <- clients``, with no cycle
among modules at import time; drafters reach the engine through ``drafters.base`` alone.

Read from the source (``ast``), lazy imports inside functions included for the direction."""

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
LAYERS = ["micro", "drafters", "engine", "server", "clients"]
# drafters' shared parts, which any drafter may import (not another drafter, nor the
# registry: only ``auto``, which builds its candidates, does)
SHARED = {"base", "costs", "draft_vocab", "goodput", "ngrams"}


def modules() -> dict[str, Path]:
    out = {}
    for package in LAYERS:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports(path: Path, top_level_only: bool) -> set[str]:
    """The nodraft modules ``path`` imports (``nodraft.`` stripped)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # `if TYPE_CHECKING:` blocks import nothing at run time
        nodes = [n for n in nodes if not isinstance(n, ast.If)]
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nodraft."):
            base = node.module[len("nodraft."):]
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}  # `from pkg import module`
        elif isinstance(node, ast.Import):
            found |= {a.name[len("nodraft."):] for a in node.names if a.name.startswith("nodraft.")}
    return found


def test_nothing_imports_the_bare_top_level_names():
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                assert node.module.split(".")[0] not in LAYERS, (name, node.module)
            if isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] not in LAYERS for a in node.names), name


def test_imports_run_one_way():
    mods = modules()
    for name, path in mods.items():
        layer = LAYERS.index(name.split(".")[0])
        for target in imports(path, top_level_only=False):
            if target in mods:
                assert LAYERS.index(target.split(".")[0]) <= layer, f"{name} imports {target}"


def test_no_import_cycle_at_module_level():
    mods = modules()
    graph = {n: {t for t in imports(p, top_level_only=True) if t in mods and t != n}
             for n, p in mods.items()}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError(" -> ".join(path + [node, nxt]))
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [])


def test_drafters_import_only_the_shared_parts_and_micro():
    mods = modules()
    for name, path in mods.items():
        parts = name.split(".")
        if parts[0] != "drafters" or len(parts) < 2 or parts[1] in SHARED | {"registry", "auto"}:
            continue
        own = ".".join(parts[:2])  # a drafter's own module or package (drafters.eagle)
        for target in imports(path, top_level_only=False):
            t = target.split(".")
            if t[0] != "drafters" or target not in mods or target == "drafters":
                continue
            assert t[1] in SHARED or ".".join(t[:2]) == own or name.endswith("_train") \
                and ".".join(t[:2]) == own[:-len("_train")] or parts[1] == "evaluation", \
                f"{name} imports {target}"
