"""The repository explains itself: every file, test, module and section that its documents and code
cite exists in it, and nothing cites a document outside it. A renamed file or heading otherwise leaves a pointer to nothing."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Where the project describes itself (BENCHMARKS.md is bench/report.py's output; docs/benchmarks/ holds the
# findings of other commands). Tests cite files that exist only in their fixtures (tests/test_a.py), so only
# their citations of modules and sections are checked.
DOCUMENTS = [REPO / "README.md", REPO / "BENCHMARKS.md", REPO / "patches" / "README.md",
             *sorted((REPO / "docs").rglob("*.md"))]
CODE = sorted(p for folder in ("eagle_pipeline", "bench", "scripts", "patches", "configs")
              for p in (REPO / folder).rglob("*") if p.suffix in {".py", ".sh", ".yaml"}) + sorted(REPO.glob("0*_*.py"))
# This file is left out: its own examples name things that do not exist.
TESTS = sorted(p for p in (REPO / "tests").glob("*.py") if p.name != "test_docs.py")

TOP_FOLDERS = ("tests", "scripts", "eagle_pipeline", "bench", "docs", "configs", "patches", "data")
# A path inside the repository: one of its top folders, then a name with an extension, or a stage script.
CITED_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*\w\.(?:py|md|sh|yaml|jsonl)|0[1-6]_\w+\.py)(?:::(\w+))?"
                        % "|".join(TOP_FOLDERS))
# A section of a document: `docs/formats.md, "Draft vocabulary"` (the start of a heading; also a page of
# docs/benchmarks/) or a link's `#anchor`.
CITED_SECTION = re.compile(r"(docs/(?:\w+/)?\w+\.md)[`,)]*\s+\"([^\"]{1,120})\"")
LINKED_SECTION = re.compile(r"\]\(([\w./-]*\.md)?#([\w-]+)\)")
# A module or one of its names: `eagle_pipeline.serve.report.write_report`, `bench.run`.
CITED_MODULE = re.compile(r"(?<![\w./-])((?:eagle_pipeline|bench|patches)(?:\.[A-Za-z_]\w*)+)")
BENCHMARKS_SECTION = re.compile(r"BENCHMARKS\.md,? section (\d+)")
OUTSIDE = re.compile(r"REFERENCE\.md|CONVENTIONS\.md|\.\./shared")


def cited(files: list[Path]) -> list[tuple[str, str, str | None]]:
    found = []
    for file in files:
        for match in CITED_PATH.finditer(file.read_text(errors="replace")):
            found.append((str(file.relative_to(REPO)), match.group(1), match.group(2)))
    return found


def test_every_cited_file_and_test_exists():
    missing = []
    for source, path, name in cited(DOCUMENTS + CODE):
        target = REPO / path
        if not target.exists():
            missing.append(f"{source}: {path}")
        elif name and not re.search(rf"^(?:async )?def {name}\b|^class {name}\b", target.read_text(), re.M):
            missing.append(f"{source}: {path}::{name}")
    assert not missing, "cited but not in the repository:\n" + "\n".join(missing)


def resolves(dotted: str) -> bool:
    """Whether `a.b.c` is a module or package of the repository, or a name defined at the top of one."""
    path = REPO.joinpath(*dotted.split("."))
    if path.with_suffix(".py").exists() or (path / "__init__.py").exists():
        return True
    module, name = path.parent, path.name
    for source in (module.with_suffix(".py"), module / "__init__.py"):
        if source.exists() and re.search(rf"^(?:(?:async )?def|class) {name}\b|^{name}\b\s*[:=]|^from \S+ import .*\b{name}\b", source.read_text(), re.M):
            return True
    return False


def test_every_cited_module_and_name_exists():
    missing = sorted({f"{file.relative_to(REPO)}: {dotted}" for file in DOCUMENTS + CODE + TESTS
                      for dotted in CITED_MODULE.findall(file.read_text(errors="replace"))
                      if not dotted.endswith(".__file__") and not resolves(dotted)})
    assert not missing, "modules or names cited but not defined:\n" + "\n".join(missing)


def headings(document: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in document.read_text().splitlines() if line.startswith("#")]


def anchor(heading: str) -> str:
    """The anchor a Markdown renderer gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_every_cited_section_exists():
    missing = []
    for file in DOCUMENTS + CODE + TESTS:
        text, source = file.read_text(errors="replace"), str(file.relative_to(REPO))
        for path, section in CITED_SECTION.findall(text):
            section = " ".join(section.replace("#", " ").split())  # a citation wrapped over comment lines
            if not (REPO / path).exists() or not any(h.lower().startswith(section.lower()) for h in headings(REPO / path)):
                missing.append(f'{source}: {path}, "{section}"')
        for path, name in LINKED_SECTION.findall(text):
            document = (file.parent / path) if path else file
            if not document.exists() or name not in {anchor(h) for h in headings(document)}:
                missing.append(f"{source}: {path}#{name}")
        numbered = {h.split(".")[0] for h in headings(REPO / "BENCHMARKS.md") if h[:1].isdigit()}
        missing += [f"{source}: BENCHMARKS.md section {n}" for n in BENCHMARKS_SECTION.findall(text) if n not in numbered]
    assert not missing, "sections cited but not found:\n" + "\n".join(missing)


def test_the_check_sees_the_citations_it_is_meant_to():
    # Guards the pattern itself: the docs' own citations of a stage script, a test and a nested file.
    paths = {(path, name) for source, path, name in cited([REPO / "README.md", REPO / "docs" / "testing.md"])}
    assert ("01_generate_data.py", None) in paths
    assert ("tests/test_training.py", "test_launcher_trains_with_two_cpu_processes") in paths
    assert resolves("eagle_pipeline.serve.report.write_report") and not resolves("eagle_pipeline.serving.write_report")
    assert CITED_SECTION.findall('(docs/engines.md, "Machines differ")') == [("docs/engines.md", "Machines differ")]
    assert CITED_SECTION.findall('docs/benchmarks/training.md, "Packing"') == [("docs/benchmarks/training.md", "Packing")]
    assert anchor("Stage 05: `verify.json`") == "stage-05-verifyjson"
    assert ("scripts/avx2_only/sitecustomize.py", None) in {(p, n) for _, p, n in cited([REPO / "docs" / "engines.md"])}


def test_nothing_cites_a_document_outside_the_repository():
    offenders = [str(p.relative_to(REPO)) for p in DOCUMENTS + CODE + TESTS if OUTSIDE.search(p.read_text(errors="replace"))]
    assert not offenders, f"{offenders} point outside the repository; write what they rely on into docs/"
