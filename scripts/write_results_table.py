"""Write the README's results table from the comparison reports kept in docs/results/<name>/report.json
(each the output of ``python -m cifar_accel.compare``, copied there with its report.md).

python scripts/write_results_table.py
"""

import argparse
import json
from pathlib import Path

from cifar_accel.compare import results_table

REPO = Path(__file__).resolve().parents[1]
BEGIN = "<!-- results table: written by scripts/write_results_table.py from docs/results/*/report.json -->\n"
END = "<!-- end of the results table -->\n"


def reports() -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in (REPO / "docs" / "results").glob("*/report.json")}


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # --help, and no arguments
    readme = REPO / "README.md"
    text = readme.read_text()
    before, rest = text.split(BEGIN)
    _, after = rest.split(END)
    readme.write_text(before + BEGIN + results_table(reports()) + END + after)
    print(f"wrote the results table of {readme}")
