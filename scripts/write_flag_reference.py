"""Write docs/flags.md, the flag reference, from the config's field metadata.

python scripts/write_flag_reference.py
"""

import argparse
from pathlib import Path

from cifar_accel.config import flag_reference

if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # --help, and no arguments
    path = Path(__file__).resolve().parents[1] / "docs" / "flags.md"
    path.write_text(flag_reference())
    print(f"wrote {path}")
