"""The docs stay what a reader needs: the README links each of them, reliability.md names only tests that exist, no
page carries issue numbers (history is in git), and architecture.md stays a short description, not a logbook."""
import re
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ("usage.md", "architecture.md", "performance.md", "performance-history.md", "reliability.md",
        "reference.md")


def test_the_readme_links_every_doc_and_each_exists():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for name in DOCS:
        assert f"(docs/{name})" in readme, f"README.md does not link docs/{name}"
        assert (ROOT / "docs" / name).is_file(), f"docs/{name} is linked but missing"


def test_the_readme_stays_a_first_page_with_two_set_up_commands():
    """A newcomer's page: the two fresh-machine commands and the quick paths; the reference is docs/usage.md."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = readme.count("\n")
    assert lines <= 200, f"README.md has {lines} lines: move reference text to docs/usage.md"
    fresh = readme.split("## Fresh machine", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split("#")[0].strip() for line in fresh.splitlines()] == ["make demo", "make test"]


def referenced_tests(text: str) -> list[tuple[str, str]]:
    """(file, test) for every `test_x.py::name`, and every `::name` after it, in the order written."""
    found, current = [], None
    for match in re.finditer(r"\b(test_\w+\.py)\b|::(test_\w+)", text):
        if match.group(1):
            current = match.group(1)
        else:
            assert current, f"::{match.group(2)} names no file before it"
            found.append((current, match.group(2)))
    return found


def test_reliability_names_only_tests_that_exist():
    references = referenced_tests((ROOT / "docs" / "reliability.md").read_text(encoding="utf-8"))
    assert len(references) > 50  # the page is read: each promise names its tests
    missing = [f"{file}::{name}" for file, name in references
               if not (ROOT / "tests" / file).is_file()
               or not re.search(rf"^\s*def {name}\(", (ROOT / "tests" / file).read_text(encoding="utf-8"),
                                re.MULTILINE)]
    assert missing == [], f"docs/reliability.md names tests that do not exist: {missing}"


def test_the_reference_reader_follows_a_file_to_its_tests():
    text = "`test_a.py::test_x`, `::test_y`; `test_b.py::test_z`"
    assert referenced_tests(text) == [("test_a.py", "test_x"), ("test_a.py", "test_y"), ("test_b.py", "test_z")]


def test_no_doc_carries_issue_numbers():
    for name in DOCS:
        text = (ROOT / "docs" / name).read_text(encoding="utf-8")
        hits = re.findall(r".{0,30}(?:\bissues?\b|#\d+).{0,30}", text, flags=re.IGNORECASE)
        assert hits == [], f"docs/{name}: {hits}"


def test_architecture_stays_a_description_not_a_logbook():
    lines = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8").count("\n")
    # ~100 of them are the Layout map (several small modules of a folder to a line); the rest describes the system.
    assert lines <= 350, f"docs/architecture.md has {lines} lines: move figures to performance.md, history to git"


# A path of a development machine: its project root, or root's home (the venv's interpreter lives there).
MACHINE_PATH = re.compile(r"(?<![\w}.$~-])/(?:work|root)/")
TEXT_SUFFIXES = {".py", ".md", ".txt", ".toml", ".sh", ".cfg", ".ini", ".yaml", ".yml", ".json", ".csv"}


def project_text_files() -> list[pathlib.Path]:
    """The project's text files: sources, docs, tests, examples, build files (not hidden folders but .ci, no caches,
    nothing git ignores: a developer's runs/ holds its own logs)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True)
    candidates = ([ROOT / line for line in listed.stdout.splitlines()] if listed.returncode == 0
                  else list(ROOT.rglob("*")))
    found = []
    for path in candidates:
        parts = path.relative_to(ROOT).parts
        if any(p.startswith(".") and p != ".ci" or p in ("__pycache__", "build", "dist") or p.endswith(".egg-info")
               for p in parts[:-1]) or not path.is_file():
            continue
        if path.suffix in TEXT_SUFFIXES or path.name in ("Makefile", "run", ".gitignore"):
            found.append(path)
    return found


def test_no_machine_path_in_project_text():
    """Shared data is named by its place beside the project (../shared/...), never by a development machine's
    absolute path (it was in three modules' docstrings, a test and performance.md)."""
    hits = [f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}"
            for path in project_text_files()
            for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if MACHINE_PATH.search(line)]
    assert hits == [], hits


def test_the_machine_path_check_reads_what_it_should():
    work, root = "/" + "work/", "/" + "root/"   # spelt apart: this file is project text too
    assert MACHINE_PATH.search(f"calibrated on {work}shared/gpu (the profile)")
    assert MACHINE_PATH.search(f"python at {root}.pyenv/versions/3.11.7/bin/python")
    assert not MACHINE_PATH.search("the profile in ../shared/gpu beside the project")
    assert not MACHINE_PATH.search('f"{gcs_dir}/work/x"') and not MACHINE_PATH.search("~/work/x and runs/work/y")
    assert {p.name for p in project_text_files()} >= {"gpu_estimate.py", "performance.md", "test_docs.py", "Makefile"}


def test_presets_carry_no_priced_step_figures():
    """A preset's docstring named a compiled step's estimate (14.8 ms, 38.5%) that drifted from what `compile` prints
    (13.77 ms, 41.3%): presets point to `bertjax compile` and performance.md, which states the commit."""
    import ast

    for path in sorted((ROOT / "configs").glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        figures = re.findall(r"\d[\d.]* ?m?s/step|\d+\.\d+% MFU|\d[\d.]* GiB", doc)
        assert figures == [], f"{path.name}: {figures}"
