"""The dependency rule, checked on the source (every import statement, also inside functions and TYPE_CHECKING):

- ``parsers`` imports nothing of ours outside ``ember.parsers``, and never torch;
- ``grammar`` imports only ``ember.grammar``, the parser profiles (``ember.parsers.profiles``, data) and the two pure
  parser modules it shares facts with (``ember.parsers.initial``: the initial state the parser also starts from;
  ``ember.parsers.xml_values``: how XML values are typed), and ``import ember.grammar.compiler`` loads no torch;
- ``server`` reaches the engine only through its client interface (`SERVER_ENGINE_MODULES`);
- ``engine`` and ``kernels`` import nothing from ``server``, ``parsers`` or ``grammar``;
- ``import ember.parsers.pipeline`` loads no torch.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SERVER_ENGINE_MODULES = (
    "ember.engine.client", "ember.engine.params", "ember.engine.args", "ember.engine.eos", "ember.engine.checkpoint",
    "ember.engine.demo",
    "ember.engine.async_engine", "ember.engine.core_client",
    "ember.engine.convert_llama2c", "ember.engine.quantize",
)
"""The engine modules the server may import: the client interface and its plain data (requests, outputs, settings,
EOS IDs, the checkpoint's tokenizer, the demo model's folder); the two implementations of that interface, which
`load_runtime` chooses between (in this process, or the engine core in its own); and the offline tools the `ember`
command dispatches to (`convert-llama2c`, `quantize-nvfp4`)."""

GRAMMAR_MAY_IMPORT = ("ember.grammar", "ember.parsers.profiles", "ember.parsers.initial", "ember.parsers.xml_values")


def _package_dirs() -> dict[str, Path]:
    """``ember.x`` -> its source folder, from pyproject's package-dir."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dirs = conf["tool"]["setuptools"]["package-dir"]
    return {pkg: ROOT / d for pkg, d in dirs.items() if pkg != "ember"}


PACKAGES = _package_dirs()


def _module_of(path: Path) -> str:
    for pkg, d in PACKAGES.items():
        if d in path.parents:
            parts = list(path.relative_to(d).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join([pkg, *parts])
    raise AssertionError(path)


def _exists(module: str) -> bool:
    for pkg, d in PACKAGES.items():
        if module == pkg or module.startswith(pkg + "."):
            rest = module[len(pkg):].lstrip(".").split(".") if module != pkg else []
            p = d.joinpath(*rest) if rest else d
            return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()
    return False


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports (relative imports resolved; ``from pkg import mod`` counts ``pkg.mod``)."""
    module = _module_of(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.add(sub if _exists(sub) else target)
    return out


def _sources(pkg: str) -> list[Path]:
    files = sorted(PACKAGES[pkg].rglob("*.py"))
    assert files, pkg
    return files


def _violations(pkg: str, allowed) -> list[str]:
    bad = []
    for path in _sources(pkg):
        for m in sorted(imports(path)):
            if not allowed(m):
                bad.append(f"{path.relative_to(ROOT)} imports {m}")
    return bad


def _ours(m: str) -> bool:
    return m == "ember" or m.startswith("ember.")


def _under(m: str, prefixes) -> bool:
    return any(m == p or m.startswith(p + ".") for p in prefixes)


def test_the_import_scanner_sees_relative_absolute_and_function_level_imports(tmp_path):
    for f in ("sub/probe.py", "sub/events.py", "engine/__init__.py", "engine/demo.py"):
        (tmp_path / f).parent.mkdir(exist_ok=True)
        (tmp_path / f).touch()
    (tmp_path / "sub/probe.py").write_text("import torch.nn\nfrom . import events\nfrom ..engine import demo, run\n"
                                           "def f():\n    from ember.grammar.compiler import compile_request\n")
    PACKAGES["ember.zzprobe"] = tmp_path
    try:
        found = imports(tmp_path / "sub/probe.py")
    finally:
        del PACKAGES["ember.zzprobe"]
    assert found == {"torch.nn", "ember.zzprobe.sub.events", "ember.zzprobe.engine.demo", "ember.zzprobe.engine",
                     "ember.grammar.compiler"}
    found = imports(PACKAGES["ember.parsers"] / "pipeline.py")
    assert {"ember.parsers.events", "ember.parsers.machine", "ember.parsers.profiles"} <= found


def test_parsers_import_nothing_of_ours_outside_parsers_and_never_torch():
    bad = _violations("ember.parsers", lambda m: (not _ours(m) or _under(m, ["ember.parsers"]))
                      and not _under(m, ["torch"]))
    assert not bad, bad


def test_grammar_imports_only_grammar_and_parser_data():
    bad = _violations("ember.grammar", lambda m: not _ours(m) or _under(m, GRAMMAR_MAY_IMPORT))
    assert not bad, bad


def test_engine_and_kernels_import_nothing_from_server_parsers_or_grammar():
    front = ["ember.server", "ember.parsers", "ember.grammar"]
    bad = _violations("ember.engine", lambda m: not _under(m, front))
    bad += _violations("ember.kernels", lambda m: not _under(m, front + ["ember.engine"]))
    assert not bad, bad


def test_server_reaches_the_engine_only_through_its_client_interface():
    bad = _violations("ember.server", lambda m: not _under(m, ["ember.engine"]) or m == "ember.engine"
                      or _under(m, SERVER_ENGINE_MODULES))
    assert not bad, bad


@pytest.mark.parametrize("module", ["ember.grammar.compiler", "ember.parsers.pipeline"])
def test_importing_the_pure_modules_loads_no_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_checkout_does_not_shadow_an_installed_package_of_a_folders_name(tmp_path):
    """With the checkout's root first on sys.path (as under pytest), `import kernels` finds an installed `kernels`
    distribution (Hugging Face's, which transformers >= 5.25 imports), not the checkout's `kernels/` folder."""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("INSTALLED = True\n")
    root = Path(__file__).resolve().parent.parent
    code = (f"import sys; sys.path[:0] = [{str(root)!r}, {str(site)!r}]; import ember, kernels, ember.kernels; "
            "assert getattr(kernels, 'INSTALLED', False), kernels.__file__; "
            "assert ember.kernels.__file__ != kernels.__file__")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
