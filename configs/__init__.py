"""Training configs, big_vision style: `configs/<family>.py` holds `get_config(arg)` for one model
family (its `model` section and variants) on top of `common.base`, which builds every
model-agnostic key. Run one with `python main.py --config configs/<family>.py[:variant]`."""
