"""workflows: a Ray-based, end-to-end ML workflow platform."""

__version__ = "0.1.0"
