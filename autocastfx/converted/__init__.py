"""The converted module: its class and runtime (module.py), its calls (calls.py), and the guards on the model
state its programs read (state.py)."""
