"""Every function, class or attribute of the package that the docs (README.md, docs/*.md) or a docstring
names exists: a reader who follows ``steps.submit_attempt`` or ``RunDir.metrics_file`` finds it; and every
link of the docs to a section (``page.md#anchor``) names a heading of that page.

What counts as a reference to the package (imports and attribute look-ups only, no cluster):

- a Sphinx role in a docstring (``:func:`verl_pipeline.steps.freeze```, ``:meth:`RunDir.metrics_file```);
- backticked dotted text in the docs or a docstring that starts with ``verl_pipeline``, with one of its
  modules (``steps.freeze``, ``trainer.validate.keep``, ``jobs/attempts.metrics_file``) or with a class
  the package defines once (``RunDir.metrics_file``). Under a package the next part must be one of its
  modules, so verl keys that share a first word (``trainer.logger``, ``data.train_files``) are not taken
  for code; neither are file names (``report.json``).

A name is looked up from the package's root, else (in a docstring) from the module the docstring is in
(what it imports), else as a class the package defines once.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import verl_pipeline

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(verl_pipeline.__file__).parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: Last parts that make dotted text a file name, not code.
_FILE_SUFFIXES = frozenset({"py", "json", "jsonl", "html", "yaml", "yml", "md", "pt", "txt", "png", "parquet", "log",
                            "sh", "toml", "csv", "whl", "sif", "gz", "db", "pem", "env"})
_ROLE = re.compile(r":(?:func|meth|class|mod|data|attr|exc|obj):`~?\.?([A-Za-z_][\w.]*)`")
_TICKED = re.compile(r"(?<![`\w])`{1,2}~?((?:[A-Za-z_]\w*/)*[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\([^`]*\))?`{1,2}")


@dataclass(frozen=True)
class Text:
    """A doc page or a docstring; ``module`` is the docstring's module (None for a doc page)."""

    where: str
    module: str | None
    body: str


@cache
def modules() -> frozenset[str]:
    return frozenset({"verl_pipeline", *(m.name for m in pkgutil.walk_packages([str(PACKAGE)], "verl_pipeline."))})


@cache
def classes() -> dict[str, set[str]]:
    """Class name -> the modules that define a class of that name."""
    out: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, set()).add(_module_of(path))
    return out


def _module_of(path: Path) -> str:
    return ".".join(("verl_pipeline", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")


def texts() -> Iterator[Text]:
    for page in DOCS:
        yield Text(str(page.relative_to(ROOT)), None, page.read_text())
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_of(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    yield Text(str(path.relative_to(ROOT)), module, doc)


def is_ours(dotted: str) -> bool:
    """Whether dotted text names the package's code (see the module docstring)."""
    parts = dotted.split(".")
    if parts[-1] in _FILE_SUFFIXES:
        return False
    if parts[0] == "verl_pipeline":
        return True
    top = f"verl_pipeline.{parts[0]}"
    if top in modules():
        is_package = any(m.startswith(top + ".") for m in modules())
        return not is_package or f"{top}.{parts[1]}" in modules()
    return parts[0] in classes()


def references(text: Text) -> set[str]:
    found = {r.replace("/", ".") for r in _TICKED.findall(text.body)}
    if text.module is not None:
        found |= set(_ROLE.findall(text.body))
    return {r for r in found if "." in r and (is_ours(r) or _in_module(text.module, r.split(".")[0]))}


def _in_module(module: str | None, name: str) -> bool:
    return module is not None and hasattr(importlib.import_module(module), name)


_MISSING = object()


def _attribute(obj: Any, name: str) -> Any:
    """``obj.name``; for a class also a dataclass field or an annotated attribute without a class value."""
    if hasattr(obj, name):
        return getattr(obj, name)
    if isinstance(obj, type) and any(name in getattr(c, "__annotations__", {}) for c in obj.__mro__):
        return object()
    return _MISSING


def _follow(obj: Any, names: list[str]) -> bool:
    for name in names:
        obj = _attribute(obj, name)
        if obj is _MISSING:
            return False
    return True


def exists(dotted: str, module: str | None) -> bool:
    parts = dotted.split(".")
    absolute = parts if parts[0] == "verl_pipeline" else ["verl_pipeline", *parts]
    for i in range(len(absolute), 1, -1):
        if ".".join(absolute[:i]) in modules():
            if _follow(importlib.import_module(".".join(absolute[:i])), absolute[i:]):
                return True
            break
    if _in_module(module, parts[0]):
        return _follow(importlib.import_module(str(module)), parts)
    defined = classes().get(parts[0], set())
    return len(defined) == 1 and _follow(importlib.import_module(next(iter(defined))), parts)


def test_every_reference_of_the_docs_and_docstrings_to_the_package_exists() -> None:
    checked, missing = 0, []
    for text in texts():
        for ref in sorted(references(text)):
            checked += 1
            if not exists(ref, text.module):
                missing.append(f"{text.where}: {ref}")
    assert not missing, "named in the docs or a docstring but not in the package:\n" + "\n".join(sorted(set(missing)))
    assert checked > 100  # the scan found what the docs cite (a broken pattern would find nothing)


def test_the_scan_tells_code_from_verl_keys_and_file_names() -> None:
    assert is_ours("steps.submit.submit_attempt") and is_ours("jobs.attempts.metrics_file") and is_ours("RunDir.load")
    assert not is_ours("trainer.logger") and not is_ours("data.train_files") and not is_ours("report.json")
    assert not is_ours("airflow.sdk.Asset")  # Airflow's, though the package has an airflow subpackage
    assert exists("steps.submit.submit_attempt", None) and exists("RunDir.metrics_file", None)
    assert exists("RunSpec.run_name", None)  # a dataclass field without a default
    assert not exists("jobs.attempts.metrics_file", None) and not exists("RunDir.no_such_file", None)
    doc = Text("x.py", "verl_pipeline.jobs.submit", "each attempt's :meth:`RunDir.metrics_file`, see ``Submission``")
    assert references(doc) == {"RunDir.metrics_file"}


# -- links to a section: ``[text](page.md#anchor)`` names a heading of that page -----------------------------

_LINK = re.compile(r"\]\(([^)#\s]*)#([^)\s]+)\)")
_HEADING = re.compile(r"#{1,6} (.*)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (``-`` and ``_`` kept), spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor outside code fences; a repeated heading gets ``-1``, ``-2`` … as on GitHub."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        heading = None if fenced else _HEADING.match(line)
        if heading:
            base = slug(heading.group(1))
            out.add(f"{base}-{seen[base]}" if base in seen else base)
            seen[base] = seen.get(base, 0) + 1
    return out


def test_every_link_to_a_section_of_the_docs_names_a_heading_of_that_page() -> None:
    checked, broken = 0, []
    for page in DOCS:
        for target, anchor in _LINK.findall(page.read_text()):
            path = (page.parent / target).resolve() if target else page
            if path.suffix != ".md":
                continue
            checked += 1
            if not path.is_file() or anchor not in anchors(path):
                broken.append(f"{page.relative_to(ROOT)}: {target}#{anchor}")
    assert not broken, "links to a section that is not there:\n" + "\n".join(broken)
    assert checked > 50


def test_the_anchor_of_a_heading_is_githubs() -> None:
    assert slug("On a GPU — `bench/gpu_acceptance.py`") == "on-a-gpu--benchgpu_acceptancepy"
    assert slug("Precedence: which layer wins") == "precedence-which-layer-wins"
    assert slug("docker-compose.yaml: one box, GPU or CPU") == "docker-composeyaml-one-box-gpu-or-cpu"
