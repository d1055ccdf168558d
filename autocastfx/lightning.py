"""``autocastfx.lightning.MixedPrecision``: the Lightning precision plugin of ``autocastfx.integrations.lightning``,
under a shorter name (``import autocastfx.lightning``; it needs Lightning: ``pip install 'autocastfx[lightning]'``)."""
from .integrations.lightning import MixedPrecision

__all__ = ["MixedPrecision"]
