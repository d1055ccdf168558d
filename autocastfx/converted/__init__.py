"""The converted module: its class and runtime (module.py), and the calls it was converted for (calls.py)."""
