"""``recompile dump TARGET``: the IR after a stage, as text or DOT, or the generated source.

TARGET is ``path/to/file.py:Qual.Name`` or ``package.module:Qual.Name``. The
object may be a compiled function or a plain function (compiled on the spot);
a method is built for the class named in its qualname.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

from .api import CompiledFunction, function
from .errors import CompileError
from .passes.pipeline import FINAL, STAGES


def _load_module(spec):
    if spec.endswith(".py") or os.sep in spec or "/" in spec:
        path = os.path.abspath(spec)
        if not os.path.exists(path):
            raise SystemExit(f"recompile dump: no such file: {spec}")
        name = "_recompile_dump_" + os.path.splitext(os.path.basename(path))[0]
        sys.path.insert(0, os.path.dirname(path))
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        module_spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(spec)
    except ImportError as exc:
        raise SystemExit(f"recompile dump: cannot import {spec}: {exc}") from None


def resolve(target):
    """(CompiledFunction, owner class or None) named by TARGET."""
    if ":" not in target:
        raise SystemExit(f"recompile dump: expected FILE.py:QUALNAME or module:QUALNAME, got {target!r}")
    module_part, qualname = target.rsplit(":", 1)
    obj = _load_module(module_part)
    owner = None
    for part in qualname.split("."):
        try:
            value = obj.__dict__[part] if isinstance(obj, type) and part in obj.__dict__ else getattr(obj, part)
        except AttributeError:
            raise SystemExit(f"recompile dump: {module_part} has no {qualname!r}") from None
        owner = obj if isinstance(obj, type) else None
        obj = value
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if not isinstance(obj, CompiledFunction):
        if not callable(obj) or not hasattr(obj, "__code__"):
            raise SystemExit(f"recompile dump: {qualname} is not a function")
        obj = function(obj)
    return obj, owner


def main(argv=None):
    parser = argparse.ArgumentParser(prog="recompile", description="Inspect what recompile makes of a function.")
    sub = parser.add_subparsers(dest="command", required=True)
    dump = sub.add_parser("dump", help="print the IR after a stage, or the generated Python source")
    dump.add_argument("target", help="FILE.py:QUALNAME or package.module:QUALNAME")
    dump.add_argument("--stage", choices=STAGES, default=FINAL, help="the pass after which to print the IR")
    dump.add_argument("--format", choices=("text", "dot"), default="text", help="text, or Graphviz DOT")
    dump.add_argument("--source", action="store_true", help="print the generated Python source instead of the IR")
    dump.add_argument("--instances", action="store_true",
                      help="mark each op with how batched code runs it for a group of instances: once, batched, "
                           "per instance (with why), or by type")
    dump.add_argument("--shared", nargs="+", default=["self"], metavar="PARAM",
                      help="with --instances: the parameters every instance shares (default: self; add the "
                           "tree of a forest given with in_dims=None)")
    args = parser.parse_args(argv)
    try:
        fn, owner = resolve(args.target)
        if args.source:
            sys.stdout.write(fn.source(owner=owner))
        else:
            instances = args.shared if args.instances else None
            if instances is not None and args.format != "text":
                parser.error("--instances marks the text dump; it has no DOT form")
            sys.stdout.write(fn.dump(stage=args.stage, format=args.format, owner=owner, instances=instances))
    except CompileError as exc:
        print(f"recompile dump: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. piped into head
        sys.stderr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
