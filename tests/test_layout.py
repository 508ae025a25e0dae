"""docs/architecture.md's Layout section lists exactly the modules in the tree."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_layout_lists_every_module_and_only_existing_ones():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    listed = set(re.findall(r"^(\S+\.py)\b", block, flags=re.MULTILINE))
    in_tree = {str(p.relative_to(ROOT)) for folder in ("bertjax", "launch", "pipelines", "configs", "bench")
               for p in (ROOT / folder).rglob("*.py")}
    assert sorted(in_tree - listed) == [], "modules missing from docs/architecture.md's Layout"
    assert sorted(listed - in_tree) == [], "Layout lists modules that do not exist"
