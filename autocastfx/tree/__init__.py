"""Converting a model as a tree of parts: blocks as modules of their own, or piecewise around the model's Python."""
