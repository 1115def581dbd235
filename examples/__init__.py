"""Runnable agents that learn: ``python -m examples.<name> --help`` (see examples/README.md)."""
