"""The tree's layering, read from the source (no import is run): no import circle, and no import up the layers.

    jaxrl_base  <-  envs, models  <-  jaxrl_llm: text -> generate -> rollout -> algos -> train -> cli

`envs/` and `models/` stand on their own (pure env functions and models other JAX code can reuse): they import
`jaxrl_base` but nothing of `jaxrl_llm`. Every import statement counts, at module level or inside a function,
type-checking ones included. A name that moved stays importable from its old module through
`jaxrl_base.moved.moved_names` (resolved on first use), which this test does not see as an import: that is
the one way back up, and it only serves old import paths.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxrl_base", "envs", "models", "jaxrl_llm")
# Within jaxrl_llm, the data-flow layers: a module may import its own layer and those before it.
FRAMEWORK_LAYERS = ("text", "generate", "rollout", "algos", "train", "cli")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _target(name: str) -> str | None:
    """The project module an imported dotted name belongs to (None: outside the project)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    """The project modules `module` imports (a `from package import submodule` counts as the submodule)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for name in names:
            target = _target(name)
            if target and target != module:
                found.add(target)
    return found


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]; counter[0] += 1
                    stack.append(child); on_stack.add(child)
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
                    member = stack.pop(); on_stack.discard(member); component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    assert _cycles(GRAPH) == []


@pytest.mark.parametrize("package", ["jaxrl_base", "envs", "models"])
def test_the_bottom_packages_do_not_import_the_framework(package):
    allowed = {"jaxrl_base": {"jaxrl_base"}, "envs": {"jaxrl_base", "envs"}, "models": {"jaxrl_base", "models"}}
    bad = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() if m.split(".")[0] == package
                 for t in targets if t.split(".")[0] not in allowed[package])
    assert bad == []


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] == "jaxrl_llm" and len(parts) > 1 and parts[1] in FRAMEWORK_LAYERS:
        return FRAMEWORK_LAYERS.index(parts[1])
    return None


def test_the_framework_layers_import_only_downwards():
    bad = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() for t in targets
                 if _layer(m) is not None and _layer(t) is not None and _layer(t) > _layer(m))
    assert bad == []


def test_moved_names_still_import_from_their_old_place():
    from envs.core import make
    from envs.registry import make as registry_make
    from jaxrl_llm.algos.grpo import GrpoConfig
    from jaxrl_llm.algos.grpo_config import GrpoConfig as config_class
    from jaxrl_llm.algos.sft import train_sft
    from jaxrl_llm.checks import ConfigError
    from jaxrl_llm.train.sft_loop import train_sft as loop_train_sft
    from jaxrl_base.errors import ConfigError as base_error

    assert make is registry_make and GrpoConfig is config_class and train_sft is loop_train_sft
    assert ConfigError is base_error
    from jaxrl_llm.generate import lfm2_model_fn
    from models.family import cached_call

    assert lfm2_model_fn is cached_call
    import envs.core

    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        envs.core.nothing_here  # noqa: B018


def test_modules_outside_models_stay_within_550_lines():
    long = sorted(f"{m}: {n}" for m, p in MODULES.items() if m.split(".")[0] != "models"
                  and (n := len(p.read_text().splitlines())) > 550)
    assert long == []
