"""The size measures of issues 31 and 46: long functions, classes and files in the package.

A function's length is its ``ast`` span, ``end_lineno - lineno + 1`` of the ``def`` (or
``async def``) node, decorators not counted, nested functions counted on their own as well
as inside their parent; a class's likewise (its ``class`` node, nested classes counted on
their own too). A file's length is its number of lines (``str.splitlines``). Only ``*.py``
files under the package directory (default ``parcompile/``) are read.

It prints the functions over ``--function-lines`` (default 80) lines, longest first, the
classes over ``--class-lines`` (default 300), then the files over ``--file-lines`` (default
800) lines, then the three counts; ties are sorted by path and line so the output is
deterministic.

Run: ``python benchmarks/code_size.py [--root parcompile] [--function-lines 80]
[--class-lines 300] [--file-lines 800]``.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path


def measure(root: Path, function_lines: int, file_lines: int, class_lines: int = 300):
    """Return ``(long_functions, long_files, long_classes)`` for the ``*.py`` files under ``root``.

    ``long_functions`` is a list of ``(lines, path, lineno, qualified_name)`` with
    ``lines > function_lines``, ``long_classes`` the same with ``lines > class_lines``;
    ``long_files`` a list of ``(lines, path)`` with ``lines > file_lines``; each sorted
    longest first, then by path and line. Paths are relative to ``root``'s parent. A file
    that does not parse raises ``SyntaxError``.
    """
    long_functions = []
    long_classes = []
    long_files = []
    base = root.parent
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(base).as_posix()
        n = len(text.splitlines())
        if n > file_lines:
            long_files.append((n, rel))
        tree = ast.parse(text, filename=str(path))

        def walk(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = prefix + child.name
                    span = child.end_lineno - child.lineno + 1
                    if span > function_lines:
                        long_functions.append((span, rel, child.lineno, name))
                    walk(child, name + ".")
                elif isinstance(child, ast.ClassDef):
                    span = child.end_lineno - child.lineno + 1
                    if span > class_lines:
                        long_classes.append((span, rel, child.lineno, prefix + child.name))
                    walk(child, prefix + child.name + ".")
                else:
                    walk(child, prefix)

        walk(tree, "")
    long_functions.sort(key=lambda t: (-t[0], t[1], t[2]))
    long_classes.sort(key=lambda t: (-t[0], t[1], t[2]))
    long_files.sort(key=lambda t: (-t[0], t[1]))
    return long_functions, long_files, long_classes


def main(argv=None) -> int:
    """Print the long functions, classes and files; exit status 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent / "parcompile"))
    ap.add_argument("--function-lines", type=int, default=80)
    ap.add_argument("--class-lines", type=int, default=300)
    ap.add_argument("--file-lines", type=int, default=800)
    args = ap.parse_args(argv)
    funcs, files, classes = measure(Path(args.root), args.function_lines, args.file_lines, args.class_lines)
    print(f"functions over {args.function_lines} lines:")
    for span, rel, lineno, name in funcs:
        print(f"  {span:5d}  {rel}:{lineno}  {name}")
    print(f"classes over {args.class_lines} lines:")
    for span, rel, lineno, name in classes:
        print(f"  {span:5d}  {rel}:{lineno}  {name}")
    print(f"files over {args.file_lines} lines:")
    for n, rel in files:
        print(f"  {n:5d}  {rel}")
    print(f"total: {len(funcs)} functions over {args.function_lines} lines, "
          f"{len(classes)} classes over {args.class_lines} lines, "
          f"{len(files)} files over {args.file_lines} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
