"""Source -> IR: parsing (parse), refusing what is outside the subset (validate),
canonicalisation of jumps and for-loops (canonicalize), conversion (convert)."""

from .convert import convert  # noqa: F401
from .parse import ParsedFunction, parse_function  # noqa: F401
from .validate import validate  # noqa: F401
