"""The import arrows point down: native/ (the C++ compiler driver) is the floor, models/ (target, draft, text facts,
choice names, quantisers, quiet) stands on it, runner/ and pipeline/ on models/, bench/ on everything. Read from the source
(ast), so an import inside a function counts as well."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where a pipeline module may reach into runner/: the stages that run the decoding loop (eval decodes the prompts,
# serve serves them), and the one reader both load their engine through.
RUNS_THE_LOOP = {"pipeline/stages/eval.py": None, "pipeline/stages/serve.py": None,
                 "pipeline/artifacts.py": "load_engine"}


def imports(path: Path) -> list[tuple[str, str | None]]:
    """(imported top-level package, the top-level function it sits in or None) for every absolute import."""
    out = []
    for top in ast.parse(path.read_text(), filename=str(path)).body:
        where = top.name if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        for node in ast.walk(top):
            if isinstance(node, ast.Import):
                out += [(alias.name.split(".")[0], where) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                out.append((node.module.split(".")[0], where))
    return out


def modules(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py"))


def test_no_model_or_pipeline_module_imports_runner_except_where_a_stage_runs_the_loop():
    wrong = []
    for path in modules("models", "pipeline"):
        rel = path.relative_to(ROOT).as_posix()
        for package, where in imports(path):
            if package != "runner":
                continue
            if rel in RUNS_THE_LOOP and RUNS_THE_LOOP[rel] in (None, where):
                continue
            wrong.append(f"{rel} ({where or 'module level'})")
    assert not wrong, f"modules importing runner/: {wrong}"


def test_models_imports_neither_runner_nor_pipeline():
    wrong = sorted({f"{p.relative_to(ROOT)} -> {pkg}" for p in modules("models") for pkg, _ in imports(p)
                    if pkg in ("runner", "pipeline", "bench")})
    assert not wrong, wrong


def test_nothing_outside_bench_imports_bench():
    wrong = sorted({str(p.relative_to(ROOT)) for p in modules("models", "pipeline", "runner", "kernels")
                    for pkg, _ in imports(p) if pkg == "bench"})
    assert not wrong, wrong


def test_native_imports_nothing_of_this_repository():
    wrong = sorted({f"{p.relative_to(ROOT)} -> {pkg}" for p in modules("native") for pkg, _ in imports(p)
                    if pkg in ("models", "runner", "pipeline", "kernels", "bench")})
    assert not wrong, wrong


def test_the_choices_module_imports_the_standard_library_only():
    """models.choices names every run-time choice for validation and for the code: it stays below every layer,
    so the config is checked before torch loads."""
    top = {pkg for pkg, _ in imports(ROOT / "models" / "choices.py")}
    assert top <= {"__future__"}, top
