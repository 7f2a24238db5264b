"""Model folders on disk: where Salience keeps its files, atomic folder builds, converting the
default model, and what a folder says (shape, fingerprint, architecture).

The bottom layer: imports nothing else of core.
"""
