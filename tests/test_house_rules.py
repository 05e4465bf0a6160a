"""The shape of the code, checked: module sizes, one-way imports with no circles, one CLI door into workers/, RQ's
internals in one adapter, and the scheduler as the only writer of a sequence's state."""

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("batcher", "workers", "kernels")
MAX_LINES = 400
MAX_WORKER_LINES = 300  # the worker's own modules: its loop and the state each piece owns
WORKER_MODULES = ("worker", "in_flight", "admission", "job_ends", "leases", "streams", "stats_publisher")
RQ_ADAPTER = "batcher.rq_adapter"
RQ_INTERNALS = re.compile(r"_job_registry\b|\bFailedJobRegistry\b|intermediate_queue|\bclean_registries\b|"
                          r"_handle_success|_handle_failure|\bjob\._result\b|_stop_requested")
SEQUENCE_WRITERS = ("batcher.scheduler", "batcher.sequence")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            found[name] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `path` imports anywhere (lazily and under TYPE_CHECKING too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & known.keys()
            found |= submodules or {node.module}  # `from package import module` imports the module
    return {name for name in found if name in known}


def test_no_module_passes_its_size():
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    assert {n: s for n, s in sizes.items() if s > MAX_LINES} == {}
    worker = {n: s for n, s in sizes.items() if n.removeprefix("workers.") in WORKER_MODULES}
    assert len(worker) == len(WORKER_MODULES) and max(worker.values()) < MAX_WORKER_LINES, worker


def test_imports_go_one_way_without_circles_and_the_cli_has_one_door_into_workers():
    known = modules()
    graph = {name: imports(path, known) - {name} for name, path in known.items()}
    assert [n for n in graph if n.startswith("batcher") and any(t.startswith("workers") for t in graph[n])] == [
        "batcher.cli.engine_commands"]
    assert graph["batcher.cli.engine_commands"] & {n for n in known if n.startswith("workers")} == {
        "workers.entrypoints"}
    assert not [n for n in graph if n.startswith("kernels") and graph[n] - {m for m in known if m.startswith("kernels")}]
    cycle = _a_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def _a_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_rq_internals_and_registries_are_used_in_the_adapter_alone():
    users = {name for name, path in modules().items() if RQ_INTERNALS.search(path.read_text())}
    assert users == {RQ_ADAPTER}
    rq_importers = {name for name, path in modules().items()
                    if re.search(r"^\s*(from rq[. ]|import rq\b)", path.read_text(), re.M)}
    worker = {n for n in rq_importers if n.startswith("workers") and not n.startswith("workers.bench")}
    assert worker == set(), "the worker takes RQ from the adapter"


def test_only_the_scheduler_writes_a_sequences_state():
    """No module that handles sequences, but the scheduler (and the sequence's own), assigns or grows in place a
    field that `Sequence` has, on anything but `self`."""
    fields = {node.target.id for node in ast.walk(ast.parse((ROOT / "batcher/sequence.py").read_text()))
              if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    mutators = {"append", "extend", "clear", "pop", "insert", "remove"}

    def written(node: ast.AST) -> list[ast.Attribute]:
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            return [t for t in flat if isinstance(t, ast.Attribute)]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in mutators:
            return [node.func.value] if isinstance(node.func.value, ast.Attribute) else []
        return []

    known, writers = modules(), {}
    for name, path in known.items():
        if name in SEQUENCE_WRITERS or not imports(path, known) & set(SEQUENCE_WRITERS):
            continue  # the writers themselves, and modules that never hold a sequence
        for node in ast.walk(ast.parse(path.read_text())):
            for target in written(node):
                owner = target.value
                if target.attr in fields and not (isinstance(owner, ast.Name) and owner.id == "self"):
                    writers.setdefault(name, []).append(f"line {target.lineno}: .{target.attr}")
    assert writers == {}


def test_every_module_imports():
    """A module no test reaches (a bench, an entry point) still imports: a rename elsewhere cannot break it silently."""
    failures = {}
    for name in sorted(modules()):
        if name.endswith("__main__"):
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001  (every failure is reported, by module)
            failures[name] = f"{type(exc).__name__}: {exc}"
    assert failures == {}
