"""The documents stay true to the code: the flag reference is generated from the config and current, every
relative link in the README and docs/ reaches a file, and a heading where it names one, each command's --help
opens with a whole sentence, the scripts' too, and the README's commands after a first run work as written."""

from __future__ import annotations

import json
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import write_results_table
from PIL import Image

from cifar_accel import compare, config, evaluate, export, predict
from cifar_accel.config import flag_reference

from conftest import REPO

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "docs" / "results" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of ``page``: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_the_flag_reference_is_generated_from_the_config_and_current():
    assert (REPO / "docs" / "flags.md").read_text() == flag_reference(), "run: python scripts/write_flag_reference.py"
    for flag in ("--lr_gamma", "--muon_momentum", "--hub_private_repo", "--batch-size"):  # every flag, aliases too
        assert f"`{flag}`" in flag_reference()


@pytest.mark.parametrize("page", DOCUMENTS, ids=[str(p.relative_to(REPO)) for p in DOCUMENTS])
def test_every_relative_link_resolves(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    links = [link for link in LINK.findall(text) if not re.match(r"[a-z]+:", link)]
    for link in links:
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        assert path.exists(), f"{page.name}: {link}"
        if anchor:
            assert anchor in anchors(path), f"{page.name}: {link}"


@pytest.mark.parametrize("command", [config, evaluate, predict, export, compare], ids=lambda m: m.__name__)
def test_each_commands_help_opens_with_a_whole_sentence(command):
    """The description is the module docstring's first line; compare's once stopped at "..., then"."""
    description = command.build_parser().description
    assert re.fullmatch(r"[A-Z][^\n]{20,}\.", description), description


SCRIPTS = sorted(path.stem for path in (REPO / "scripts").glob("*.py") if "ArgumentParser(" in path.read_text())


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_scripts_help_opens_with_a_whole_sentence(script, monkeypatch, capsys):
    """The description is the docstring's first paragraph, which argparse reflows; the first line alone cut
    side_by_side.py's short at "the same data, precision"."""
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--help"])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(str(REPO / "scripts" / f"{script}.py"), run_name="__main__")
    assert stopped.value.code == 0
    description = " ".join(capsys.readouterr().out.split("\n\n")[1].split())  # the paragraph after the usage
    assert re.fullmatch(r"[A-Z][^\n]{20,}\.", description), description


def test_the_readme_is_a_short_guide():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def test_the_results_tables_are_written_from_the_kept_compare_reports():
    """The README's results come from the `cifar_accel.compare` report of the fast preset as shipped, kept in
    docs/results/ with every other kept report, which docs/results/README.md tabulates; each row from its report's
    own statistics."""
    reports = write_results_table.reports()
    for page, table in write_results_table.tables().items():
        assert write_results_table.parts(page)[1] == table, "run: python scripts/write_results_table.py"
    readme = write_results_table.parts(REPO / "README.md")[1]
    every = write_results_table.parts(REPO / "docs" / "results" / "README.md")[1]
    rows = sum(len(report["precisions"]) for report in reports.values())
    assert len(every.splitlines()) == 2 + rows and rows > len(reports) >= 10
    shipped = reports[write_results_table.SHIPPED[0]]["precisions"]
    assert [s["precision"] for s in shipped] == ["bf16", "no"] and len(readme.splitlines()) == 2 + len(shipped)
    for s in shipped:
        tta = s["test_accuracy"]
        row = f"| {s['precision']} | 9 | 5 | {100 * tta['mean']:.2f}% ± {100 * tta['std']:.2f} "
        assert row in readme and row in every
        assert [run["seed"] for run in s["per_seed"]] == s["seeds"] == [0, 1, 2, 3, 4]
    assert "](docs/results/fast_windows28x5_5seeds/report.md)" in readme
    assert "](./fast_bf16/report.md)" in every


def readme_block(after: str) -> list[list[str]]:
    """The commands of the README's first code block after the line ``after``: continuation lines joined, comments
    left out, each split as the shell would."""
    text = (REPO / "README.md").read_text()
    block = text.split(after, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_the_readmes_commands_after_a_first_run_work_as_written(tiny_dataset, cli_env, tmp_path):
    """Each line of "Then use the model", run as written in the folder of a first run (its dataset the tiny one):
    the resume line once left out the run's dataset, so it asked the Hub for CIFAR-10 and stopped."""
    first = tmp_path / "outputs" / "first"
    trained = subprocess.run([sys.executable, "-m", "cifar_accel.train", "--dataset_name", str(tiny_dataset),
                              "--num_train_epochs", "3", "--output_dir", "outputs/first"], cwd=tmp_path, env=cli_env,
                             capture_output=True, text=True)  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    (tmp_path / "photos").mkdir()
    for name in ("cat.png", "photos/dog.png"):
        Image.new("RGB", (32, 32), (120, 80, 40)).save(tmp_path / name)
    commands = readme_block("Then use the model:")
    assert [command[:3] for command in commands] == [["python", "-m", f"cifar_accel.{name}"] for name in
                                                     ("evaluate", "predict", "export", "train")]  # fmt: skip
    for command in commands:
        proc = subprocess.run([sys.executable, *command[1:]], cwd=tmp_path, env=cli_env, capture_output=True,
                              text=True)  # fmt: skip
        assert proc.returncode == 0, f"{command}: {proc.stderr}"
    assert (first / "eval_test" / "metrics.json").is_file() and (first / "model.onnx").is_file()
    assert json.loads((first / "results.json").read_text())["epochs_completed"] == 5
