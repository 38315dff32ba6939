"""tgc: a compiler for tensor programs whose axes are named edges."""

__version__ = "0.1.0"
