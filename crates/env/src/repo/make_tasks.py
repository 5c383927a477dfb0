# composer-env make-tasks scanner: prints JSON describing the repository in the working
# directory: top-level functions and public methods of top-level classes of non-test modules
# (with their body's line range), each
# non-test module's public API (for module-deletion tasks) and the test functions of test
# modules (with their line range and the names they reference).
import ast
import json
import os


def is_test_file(rel):
    base = os.path.basename(rel)
    return base.startswith("test_") or "/tests/" in "/" + rel


def api_of(tree):
    api = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kw = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
            sig = "%s %s(%s)" % (kw, node.name, ast.unparse(node.args))
            if node.returns is not None:
                sig += " -> " + ast.unparse(node.returns)
        elif isinstance(node, ast.ClassDef):
            bases = ", ".join(ast.unparse(b) for b in node.bases + node.keywords)
            sig = "class %s(%s)" % (node.name, bases) if bases else "class " + node.name
        else:
            continue
        if node.name.startswith("_"):
            continue
        api.append({"name": node.name, "signature": sig,
                    "doc": ast.get_docstring(node) or ""})
    return api


def defs(tree):
    """Public top-level functions, and public methods of public top-level classes, as
    (node, class name or "")."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            yield node, ""
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef) and not sub.name.startswith("_"):
                    yield sub, node.name


def main():
    functions, tests, headers, modules = [], [], {}, []
    for dirpath, dirnames, filenames in os.walk("."):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, fn), ".").replace(os.sep, "/")
            src = open(rel, encoding="utf-8").read()
            tree = ast.parse(src, rel)
            if is_test_file(rel):
                header = []
                for node in tree.body:
                    start = (node.decorator_list[0].lineno if getattr(node, "decorator_list", None)
                             else node.lineno)
                    if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                        refs = set()
                        for sub in ast.walk(node):
                            if isinstance(sub, ast.Name):
                                refs.add(sub.id)
                            elif isinstance(sub, ast.Attribute):
                                refs.add(sub.attr)
                        tests.append({"file": rel, "name": node.name, "start": start,
                                      "end": node.end_lineno, "refs": sorted(refs)})
                    else:
                        header.append([start, node.end_lineno])
                headers[rel] = header
                continue
            if os.path.basename(rel) != "__init__.py":
                modules.append({"file": rel, "doc": ast.get_docstring(tree) or "",
                                "api": api_of(tree)})
            for node, owner in defs(tree):
                body = node.body
                doc = ast.get_docstring(node)
                if doc is not None and len(body) > 1:
                    body = body[1:]
                elif doc is not None:
                    continue
                if body[0].lineno <= node.lineno or body[0].col_offset == 0:
                    continue
                indent = body[0].col_offset
                name = owner + "." + node.name if owner else node.name
                functions.append({"file": rel, "name": name, "doc": doc or "",
                                  "body_start": body[0].lineno, "body_end": body[-1].end_lineno,
                                  "indent": indent})
    print(json.dumps({"functions": functions, "tests": tests, "headers": headers,
                      "modules": modules}))


main()
