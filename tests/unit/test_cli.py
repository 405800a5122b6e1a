"""The command line around the commands: --version, a --help that imports no torch, the registry's sizes, the suite's
resume line, and a wheel that carries the suites. CPU, seconds (the wheel build ~20 s, in the subprocess session):
pytest tests/unit/test_cli.py"""

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import megatrain
import megatrain.bench.suite
from megatrain.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_version_names_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"megatrain {megatrain.__version__}"


def test_help_lists_every_command_without_importing_torch():
    code = ("import sys\nfrom megatrain.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    *help_lines, imported = proc.stdout.splitlines()
    assert imported == "False"
    assert all(f"    {name}" in "\n".join(help_lines) for name in ("bench", "train", "models", "suite", "report"))


def test_models_prints_the_tiny_shapes_in_thousands(capsys):
    assert main(["models"]) == 0
    sizes = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()}
    assert sizes["tiny"] == "162.6K" and sizes["qwen2.5-14b"] == "14.770B"
    assert not any(size.startswith("0.000") for size in sizes.values())


def test_an_interrupted_suite_names_the_command_that_resumes_it(tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(megatrain.bench.suite, "run_suite", interrupted)
    out = tmp_path / "smoke-local"
    assert main(["suite", "smoke", "--out-dir", str(out), "--new-run", "--only", "native"]) == 130
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.endswith(f"to resume: python -m megatrain suite smoke --out-dir {out} --only native")


@pytest.mark.parametrize("flags, says", [
    (["--only", "("], "argument --only: '(' is not a regular expression (missing ), unterminated subpattern at "
                      "position 0)"),
    (["--timeout", "-5"], "argument --timeout: '-5' is not a number of seconds > 0"),
    (["--timeout", "nan"], "argument --timeout: 'nan' is not a number of seconds > 0"),
])
def test_a_suite_flag_out_of_its_kind_is_refused_before_anything_is_made(tmp_path, capsys, flags, says):
    out = tmp_path / "smoke-local"
    with pytest.raises(SystemExit) as exited:
        main(["suite", "smoke", "--out-dir", str(out), *flags])
    assert exited.value.code == 2 and not out.exists()
    assert capsys.readouterr().err == f"error: {says} (see python -m megatrain suite --help)\n"


@pytest.mark.parametrize("argv", [["train", "--lr", "abc"], ["train", "--device", "gpu"], ["bench", "--seq"], []])
def test_a_flag_argparse_refuses_is_one_line_without_the_usage(capsys, argv):
    """argparse printed the command's usage before its error: 24 lines for train's flags, the line that matters last."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert err.endswith(f"(see python -m megatrain{''.join(' ' + a for a in argv[:1])} --help)\n")


def test_train_help_offers_what_train_takes(capsys):
    """--system lists the systems train trains (it offered paper, a benchmark peer train refuses), and --init-from
    every family it reads (it said 'Qwen2 or Llama')."""
    from megatrain.models.handwritten.families import FAMILIES
    from megatrain.systems import SYSTEMS, system_spec

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    offered = re.search(r"--system SYSTEM ([\w |]+) \(default megatrain\)", said).group(1).split(" | ")
    assert offered == [s for s in SYSTEMS if system_spec(s).trains] and "paper" not in offered
    init_from = said[said.rindex("--init-from DIR"):said.rindex("--model MODEL")]  # the option, not the usage
    assert all(family in init_from for family in FAMILIES) and "any other transformers decoder" in init_from


def test_a_suite_file_that_is_a_folder_is_one_line(tmp_path, capsys):
    (tmp_path / "suite.toml").mkdir()
    assert main(["suite", str(tmp_path / "suite.toml"), "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'suite.toml'}: cannot be read (Is a directory)"


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_wheel_carries_the_suites_and_runs_one_from_an_install(tmp_path):
    source = tmp_path / "source"  # a copy: the build leaves build/ and an egg-info beside the sources it builds
    for name in ("megatrain", "suites"):
        shutil.copytree(ROOT / name, source / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("megatrain-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert sorted(n for n in names if n.startswith("megatrain/suites/")) == \
        sorted(f"megatrain/suites/{p.name}" for p in (ROOT / "suites").glob("*.toml"))
    assert "megatrain/systems/native.py" in names and "megatrain/systems/deepspeed_zero3.py" in names  # the peers ship
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    work = tmp_path / "elsewhere"  # no suites/ here: the installed package's own
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "MEGATRAIN_WORKSPACE"}
    proc = subprocess.run([sys.executable, "-m", "megatrain", "suite", "smoke", "--dry-run"], cwd=work,
                          env={**env, "PYTHONPATH": str(site)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert f"records: {work.resolve() / 'results' / 'smoke'}" in said and "native" in said  # the install's, run here
