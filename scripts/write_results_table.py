"""Write the results tables from the comparison reports kept in docs/results/<name>/report.json (each the output of
``python -m cifar_accel.compare``, copied there with its report.md): the README's, of the fast preset as shipped,
and docs/results/README.md's, of every kept report.

python scripts/write_results_table.py
"""

import argparse
import json
from pathlib import Path

from cifar_accel.compare import results_table

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
BEGIN = "<!-- results table: written by scripts/write_results_table.py from docs/results/*/report.json -->\n"
END = "<!-- end of the results table -->\n"
SHIPPED = ["fast_windows28x5_5seeds"]  # the fast preset as it is in cifar_accel/configs/fast.yaml


def reports() -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in RESULTS.glob("*/report.json")}


def tables() -> dict[Path, str]:
    """Each page with a results table, and the table it holds."""
    kept = reports()
    return {
        REPO / "README.md": results_table({name: kept[name] for name in SHIPPED}),
        RESULTS / "README.md": results_table(kept, folder="."),
    }


def parts(page: Path) -> tuple[str, str, str]:
    """The page's text before its table, the table, and the text after it."""
    before, rest = page.read_text().split(BEGIN)
    table, after = rest.split(END)
    return before, table, after


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # --help, and no arguments
    for page, table in tables().items():
        before, _, after = parts(page)
        page.write_text(before + BEGIN + table + END + after)
        print(f"wrote the results table of {page.relative_to(REPO)}")
