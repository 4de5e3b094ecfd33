"""Plots are an optional extra, 'plots' (``pip install -e ".[plots]"`` in a checkout): matplotlib."""

from __future__ import annotations

import functools
import warnings
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


@functools.cache
def _draws(text: str) -> bool:
    """Whether the fonts matplotlib finds here draw every character of ``text`` (where one is missing, it draws an
    empty box and warns on stderr)."""
    from matplotlib.backends.backend_agg import RendererAgg
    from matplotlib.font_manager import FontProperties

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        RendererAgg(1, 1, 72).get_text_width_height_descent(text, FontProperties(), ismath=False)
    return not any("missing from font" in str(warning.message) for warning in caught)


def figure_text(text: str) -> str:
    """``text`` as a figure shows it: a '$' as itself rather than the start of math, and each character that no
    font here draws (CJK on a machine without a CJK font) as '?'."""
    text = text if _draws(text) else "".join(c if _draws(c) else "?" for c in text)
    return text.replace("$", r"\$")


def class_labels(class_names: list[str]) -> list[str]:
    """The class names as a figure labels them: a name that the fonts here cannot draw whole becomes its class
    number, '#3' (the printed tables and metrics.json keep every name)."""
    return [figure_text(name) if _draws(name) else f"#{index}" for index, name in enumerate(class_names)]
