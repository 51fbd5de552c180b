"""The package's import graph: no module imports one that imports it back, at module level or
inside a function (a cycle hidden in a function still ties the two modules together)."""
import ast
import glob
import os

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "diffpipe_jax")


def module_name(path: str) -> str:
  name = os.path.relpath(path, os.path.dirname(PACKAGE))[:-len(".py")].replace(os.sep, ".")
  return name[:-len(".__init__")] if name.endswith(".__init__") else name


def imported(path: str, modules) -> set:
  """The package's modules that the file imports anywhere in it (not its own parents)."""
  name = module_name(path)
  package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
  found = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [base] * bool(base))
      targets = [base] + [f"{base}.{a.name}" for a in node.names]
    else:
      continue
    for target in targets:
      while target and target not in modules:
        target = target.rpartition(".")[0]
      if target and target != name and not name.startswith(target + "."):
        found.add(target)
  return found


def test_the_package_imports_without_a_cycle():
  paths = {module_name(p): p for p in glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True)}
  graph = {m: imported(p, paths) for m, p in paths.items()}
  assert "diffpipe_jax.train" in graph["diffpipe_jax.__main__"]  # the walk finds imports
  done, path = set(), []

  def visit(m):  # depth first; a module met again on the current path closes a cycle
    if m in path:
      raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
    if m not in done:
      path.append(m)
      for n in sorted(graph[m]):
        visit(n)
      path.pop()
      done.add(m)

  for m in sorted(graph):
    visit(m)
