"""Adapters that run a converted module's step inside the trainers people already use.

They hold no mixed-precision logic of their own: they convert with ``autocastfx.convert``, train with
``autocastfx.train_step`` (its ``after_forward`` where the trainer's own code calls the model) and keep the
step's state in the trainer's checkpoints. Import the one you need; neither is imported by ``import autocastfx``:

- ``autocastfx.integrations.hf``: ``Trainer``, a drop-in ``transformers.Trainer``;
- ``autocastfx.integrations.lightning``: ``MixedPrecision``, a Lightning precision plugin.
"""
