"""Plots are an optional extra, 'plots' (``pip install -e ".[plots]"`` in a checkout): matplotlib."""

from __future__ import annotations

from types import ModuleType

MISSING = "matplotlib is not installed (pip install matplotlib: the 'plots' extra), so no PNG was written"


def pyplot() -> ModuleType | None:
    """matplotlib.pyplot on the file-only Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
