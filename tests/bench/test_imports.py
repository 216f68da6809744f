"""The bench scripts stand on the package alone: a benchmark that imported the tests would measure, or
break with, whatever a test fixture happens to be."""

from __future__ import annotations

import ast

from tests.bench import BENCH


def test_no_bench_script_imports_the_tests() -> None:
    offenders = []
    for script in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text(), str(script))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{script.name}:{node.lineno}: {n}" for n in names if n == "tests" or n.startswith("tests.")]
    assert not offenders, "bench scripts importing tests/:\n" + "\n".join(offenders)
