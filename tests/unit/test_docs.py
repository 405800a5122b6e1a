"""The layout the docs draw is the tree: every path named in docs/GUIDE.md's Layout section (and in DESIGN.md's house)
exists, and the Layout names every package, module and suite there is. CPU, instant: pytest tests/unit/test_docs.py"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("megatrain/", "suites/", "results/", "scripts/", "tests/", "docs/")  # reports/ is generated


def _block(doc: str, heading: str) -> str:
    """The first ``` block after `heading` in docs/`doc`."""
    text = (ROOT / "docs" / doc).read_text()
    return text[text.index(heading):].split("```")[1]


def _tokens(block: str) -> set[str]:
    return {t.rstrip(",.;:)") for t in re.findall(r"[\w./-]+", block)}


def test_every_path_the_layouts_name_exists():
    for doc, heading in (("GUIDE.md", "## Layout"), ("DESIGN.md", "## The house")):
        for token in _tokens(_block(doc, heading)):
            if token.startswith(TOPS) and "/" in token:
                assert (ROOT / token).exists(), f"{doc} names {token}, which is not in the tree"


def test_the_guide_layout_names_every_package_module_and_suite():
    block = _block("GUIDE.md", "## Layout")
    tokens = _tokens(block)
    top = sorted(p for p in (ROOT / "megatrain").iterdir() if p.name not in ("__init__.py", "__pycache__"))
    for path in top:  # a folder by its path, a module by its path or its name in a line that starts at megatrain/
        named = f"megatrain/{path.name}/" in tokens if path.is_dir() else \
            path.name in tokens or f"megatrain/{path.name}" in tokens
        assert named, f"docs/GUIDE.md's Layout does not name megatrain/{path.name}"
    models = ROOT / "megatrain" / "models"
    entry = block[block.index("megatrain/models/"):block.index("megatrain/engine/")]
    for path in sorted(models.iterdir()):
        if path.name not in ("__init__.py", "__pycache__"):
            assert (f"{path.name}/" if path.is_dir() else path.name.removesuffix(".py")) in entry, \
                f"docs/GUIDE.md's Layout does not say what megatrain/models/{path.name} is"
    suites = block[block.index("\nsuites/"):block.index("\nresults/")]
    for suite in sorted((ROOT / "suites").glob("*.toml")):
        assert re.search(rf"\b{suite.stem}\b", suites), f"docs/GUIDE.md's Layout does not list suite {suite.stem}"
