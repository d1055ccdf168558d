"""The errors a conversion raises, and the one-line form of any error its messages quote."""
from __future__ import annotations

import traceback


class CaptureError(RuntimeError):
    """Neither symbolic tracing nor torch.export could capture the model."""


def one_line(e: BaseException) -> str:
    """The first line of an error as Python prints it, cut to 300 characters."""
    lines = [ln for ln in "".join(traceback.format_exception_only(type(e), e)).splitlines() if ln.strip()]
    text = lines[0] if lines else type(e).__name__
    return text if len(text) < 300 else text[:297] + "..."
