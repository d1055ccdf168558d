"""Adapters that run autocastfx's step inside existing trainers, with no mixed-precision logic of their own; neither
is imported by ``import autocastfx``: ``autocastfx.integrations.hf.Trainer`` (a drop-in ``transformers.Trainer``)
and ``autocastfx.integrations.lightning.MixedPrecision`` (a Lightning precision plugin).
"""
