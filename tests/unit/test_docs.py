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


def _code_lines(doc: Path) -> list[str]:
    """The lines of doc's ``` blocks."""
    return [line for block in doc.read_text().split("```")[1::2] for line in block.splitlines()]


def test_a_command_the_docs_give_runs_from_the_environment_setup_makes():
    """nox and tensorboard are in .venv/bin alone (setup.sh installs them there): a bare `nox` or `tensorboard` is
    'command not found' to a new user who did not activate .venv."""
    for doc in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for line in _code_lines(doc):
            assert not re.match(r"\s*(nox|tensorboard)\b", line), f"{doc.name}: {line.strip()}"


def test_the_readme_names_the_systems_the_smoke_runs():
    """It said 'every system' where the smoke runs 4 of 6 (torchao's optimizer and the paper's code need CUDA)."""
    import tomllib

    from megatrain.systems import SYSTEMS

    suite = tomllib.loads((ROOT / "suites" / "smoke.toml").read_text())
    runs = {s for case in suite["cases"] for s in ([case["systems"]] if isinstance(case["systems"], str)
                                                    else case["systems"])}
    readme = (ROOT / "README.md").read_text()
    said = readme[readme.index("# the main job"):readme.index("nox -s smoke")]
    named = {s for s in SYSTEMS if re.search(rf"\b{s}\b", said)}
    assert runs < set(SYSTEMS) and "every system" not in said + suite["description"]
    assert named == set(SYSTEMS) and all(s in suite["description"] for s in runs), "those it runs, and those not"


def test_the_readme_and_the_guide_agree_on_the_engine_under_torchrun():
    """The GUIDE (and tests/unit/test_distributed.py) have the Engine under torchrun; the README said it was not in
    it yet."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    missing = readme[readme.index("The Engine serves"):readme.index("not in it yet")]
    assert "Under `torchrun` every rank makes the same Engine" in " ".join((ROOT / "docs" / "GUIDE.md").read_text()
                                                                           .split())
    assert "torchrun" not in missing.split(");")[-1], "the README lists torchrun among what the Engine lacks"


def test_the_guides_train_section_names_every_setting_train_shares_with_bench():
    """'every bench setting' left out --moments."""
    import dataclasses

    from megatrain.flags import CaseFlags

    guide = (ROOT / "docs" / "GUIDE.md").read_text()
    start = guide.index("## Train your own model")
    train = guide[start:guide.index("\n## ", start + 1)]
    for field in dataclasses.fields(CaseFlags):
        flag = "--" + field.name.replace("_", "-")
        assert f"`{flag}" in train, f"docs/GUIDE.md's Train section does not name {flag}"


def test_ci_runs_the_readmes_test_command_as_written():
    """CI calls the test command the README gives a new user, not a variant of it."""
    readme = (ROOT / "README.md").read_text()
    command = next(line for line in readme.splitlines() if line.startswith("bash scripts/setup.sh && ")
                   and "tests" in line).removeprefix("bash scripts/setup.sh && ")
    assert command in (ROOT / ".ci" / "run").read_text()
