"""Adapters that put a ``KVPool`` under other people's model code.

Each submodule imports its framework itself, so ``import kvpool`` never needs one:
``kvpool.integrations.transformers`` needs ``pip install 'kvpool[hf]'``.
"""
