"""IR -> Python source (printed with astor) -> code objects, with lines mapped to the user's file."""

from .emit import generate  # noqa: F401
