"""A small continuous-batching engine on kvpool: the reference for how to use the pool.

``python -m kvpool demo --help`` runs it; ``model``, ``attention``, ``engine`` and
``requests`` are the pieces an engine developer would copy.
"""
