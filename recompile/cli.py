"""``recompile dump TARGET``: the IR after a stage, as text or DOT (or drawn by Graphviz), or the generated source.

TARGET is ``path/to/file.py:Qual.Name`` or ``package.module:Qual.Name``. The
object may be a compiled function or a plain function (compiled on the spot);
a method is built for the class named in its qualname.

The file or module is imported, not run: its ``if __name__ == "__main__":``
block is skipped, though the rest of its top level runs. What that prints goes
to stderr, and it sees no command-line arguments, so that a script's argument
parsing neither breaks nor reads the dump's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import sys

from .api import CompiledFunction, function
from .errors import CompileError
from .graphviz import FORMATS as IMAGE_FORMATS
from .graphviz import GraphvizError, find_dot, render
from .passes.pipeline import FINAL, STAGES


@contextlib.contextmanager
def _imported_quietly(spec):
    """While importing the target: no arguments for it to parse, its prints on stderr, its exit an error."""
    argv = sys.argv
    sys.argv = [spec]
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    except SystemExit as exc:
        raise SystemExit(f"recompile dump: importing {spec} ended the program (exit status {exc.code}): its top "
                         f"level calls sys.exit, or parses arguments (it is given none); put that under "
                         f"`if __name__ == \"__main__\":`") from None
    finally:
        sys.argv = argv


def _load_module(spec):
    if spec.endswith(".py") or os.sep in spec or "/" in spec:
        path = os.path.abspath(spec)
        if not os.path.exists(path):
            raise SystemExit(f"recompile dump: no such file: {spec}")
        # a name other than "__main__": the file's main block does not run
        name = "_recompile_dump_" + os.path.splitext(os.path.basename(path))[0]
        sys.path.insert(0, os.path.dirname(path))
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        with _imported_quietly(spec):
            module_spec.loader.exec_module(module)
        return module
    try:
        with _imported_quietly(spec):
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
    dump = sub.add_parser(
        "dump", help="print the IR after a stage, or the generated Python source",
        description="Print the IR of a function after a stage, or its generated Python source. The target's file "
                    "or module is imported, not run as a script: its `if __name__ == \"__main__\":` block is "
                    "skipped, but the rest of its top level runs (its prints go to stderr).")
    dump.add_argument("target", help="FILE.py:QUALNAME or package.module:QUALNAME")
    dump.add_argument("--stage", choices=STAGES, default=FINAL, help="the pass after which to print the IR")
    dump.add_argument("--format", choices=("text", "dot") + IMAGE_FORMATS, default="text",
                      help="text, Graphviz DOT, or the DOT drawn as png or svg (needs Graphviz's `dot`)")
    dump.add_argument("-o", "--output", metavar="PATH", help="write to PATH instead of stdout")
    dump.add_argument("--source", action="store_true", help="print the generated Python source instead of the IR")
    dump.add_argument("--instances", action="store_true",
                      help="mark each op with how batched code runs it for a group of instances: once, batched, "
                           "per instance (with why), or by type")
    dump.add_argument("--shared", nargs="+", default=["self"], metavar="PARAM",
                      help="with --instances: the parameters every instance shares (default: self; add the "
                           "tree of a forest given with in_dims=None)")
    args = parser.parse_args(argv)
    instances = args.shared if args.instances else None
    if instances is not None and args.format != "text":
        parser.error("--instances marks the text dump; it has no DOT form")
    if args.format == "png" and not args.source and args.output is None and sys.stdout.isatty():
        parser.error("--format png writes an image: give -o PATH, or redirect stdout to a file")
    try:
        if args.format in IMAGE_FORMATS and not args.source:
            find_dot(args.format)  # before the import, which may take long
        fn, owner = resolve(args.target)
        if args.source:
            out = fn.source(owner=owner)
        elif args.format in IMAGE_FORMATS:
            out = render(fn.dump(stage=args.stage, format="dot", owner=owner), args.format)
        else:
            out = fn.dump(stage=args.stage, format=args.format, owner=owner, instances=instances)
        _write(out, args.output)
    except (CompileError, GraphvizError) as exc:
        print(f"recompile dump: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. piped into head
        sys.stderr.close()
    return 0


def _write(out, path):
    if path is not None:
        with open(path, "wb" if isinstance(out, bytes) else "w") as f:
            f.write(out)
    elif isinstance(out, bytes):
        sys.stdout.flush()
        sys.stdout.buffer.write(out)
        sys.stdout.buffer.flush()
    else:
        sys.stdout.write(out)


if __name__ == "__main__":
    sys.exit(main())
