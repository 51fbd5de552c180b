"""Training configs, big_vision style: `configs/<family>.py` holds `get_config(arg)` for one model
family (its variants) on top of `common.base`, which builds every key at its default from the
schema (diffpipe_jax/schema.py, and the family's `model_keys`). Run one with `python -m diffpipe_jax --config <this folder>/<family>.py[:variant]`
(in a checkout: `python main.py --config configs/<family>.py[:variant]`; `configs/` links here).
They ship in the package, so that a config file of one's own can start from them."""
