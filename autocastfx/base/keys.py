"""The keys autocastfx writes into ``node.meta`` and ``gm.meta``: every one named here, once.

``gm.meta["autocastfx"]`` (``CONVERTED``) holds the :class:`autocastfx.ConvertInfo` of a converted module; the
others are the passes' notes to one another, each written by one pass and read by the ones named beside it.
"""

CONVERTED = "autocastfx"                           # gm.meta: the ConvertInfo of a module made by convert();
                                                   # node.meta: the node's rewrite.Decision (spelled "autocastfx")

# node.meta
INFO = "autocastfx_info"                           # TensorInfo of the value (propagate; read by every pass)
FLOPS = "autocastfx_flops"                         # FLOPs of the op, counted once (flops; padding, report)
LAYOUT = "autocastfx_layout"                       # why a layout-changing node was inserted (layout)
INLINED_FROM = "autocastfx_inlined_from"           # the wrapped function an inlined node came from (inline)
UPCAST = "autocastfx_upcast"                       # the model's own cast to float32, kept (rewrite; plan: float32)

# gm.meta
BLOCK = "autocastfx_block"                         # a converted block: name, inputs' dtypes, whence its plan
PROPAGATED = "autocastfx_propagate"                # "fake" or "real (...)": how shapes were found (propagate)
OUTPUT_TYPE = "autocastfx_output_type"             # the model's output class, rebuilt at the end (trace; rewrite)
SAVED_MODE = "autocastfx_saved_mode"               # a module autocastfx.load made: the mode of its program
PROGRAMS = "autocastfx_programs"                   # one graph per mode (core.modes.Programs; converted.module.install)
SHARD = "autocastfx_shard"                         # what shard() did to a unit (sharding)
OTHER_CALLS = "autocastfx_other_calls"             # conversions for calls of another structure (converted.calls)
PACKED = "autocastfx_packed"                       # a layer converted for packed sequences: its sizes (tree.packed)

# a held module's __dict__
MIRROR = "_autocastfx_mirror"                      # the model's module of its name, weakly: takes its modes
                                                   # (converted.state.StateGuard; converted.module._Held.train)
