"""Inference engines. Each is imported from its own module, so no heavy import happens here."""
