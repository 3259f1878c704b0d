"""Adapters that put octlm's attention inside other libraries' models.

Each adapter is its own module and imports its library only when imported itself, so
``import octlm`` never needs an optional dependency.
"""
