"""The shape of the code, checked: module sizes, one-way imports with no circles, the seams between the folders
(DESIGN.md section 2), one CLI door into workers/, RQ's internals in one adapter, the scheduler as the only writer
of a sequence's state, and one meaning per file name."""

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Each checkout folder and the import name it installs under, as setup.py maps them
FOLDERS = {"batcher": "rqbatcher", "workers": "rqbatcher.workers", "kernels": "rqbatcher.kernels"}
CORE, WORKERS, KERNELS = FOLDERS.values()
MAX_LINES = 400
MAX_WORKER_LINES = 300  # the worker's own modules: its loop and the state each piece owns
JOB_WORKER = "rqbatcher.workers.job_worker"
WORKER_MODULES = ("worker", "in_flight", "admission", "job_ends", "leases", "stream_writer", "stats_publisher")
RQ_ADAPTER = "rqbatcher.jobs.rq_adapter"
BENCH = "rqbatcher.workers.bench"
BENCH_DOOR = "rqbatcher.workers.entrypoints"  # the one module that imports `batcher bench`, and only lazily
BENCHMARKS = ROOT / "benchmarks"
CHECKOUT_ONLY = {"benchmarks", "tests"}  # folders the wheel leaves out: they import the package, never the reverse
RQ_INTERNALS = re.compile(r"_job_registry\b|\bFailedJobRegistry\b|intermediate_queue|\bclean_registries\b|"
                          r"_handle_success|_handle_failure|\bjob\._result\b|_stop_requested")
SEQUENCE_WRITERS = ("rqbatcher.workers.scheduler.scheduler", "rqbatcher.workers.scheduler.sequence")
# The loose core modules (and tools/): the vocabulary every folder may import, importing nothing above it
BASE = "base"
BASE_MODULES = {"rqbatcher", "schema", "sampling_params", "service_class", "errors", "config", "constraints",
                "logit_bias", "response_format", "reasoning", "answer_reader", "tools",
                "data"}  # data: the bundled sample requests, no code
# DESIGN.md section 2, one way only: cli -> gateway -> client -> batches/webhooks -> jobs -> schema; openai -> schema;
# workers.job_worker -> workers.engine (its api only); workers.engine -> workers.scheduler, workers.model -> kernels.
# Each folder of rqbatcher and rqbatcher.workers (a loose module counts as its own) and the folders it may import
# besides itself and the base. The cli sits on top (its one door into workers/ is the entry points); the gateway is
# just below it, the HTTP side of the client's job service.
MAY_IMPORT = {
    "__main__": {"cli"},
    "cli": {"gateway", "client", "batches", "webhooks", "jobs", "openai", "workers.entrypoints"},
    # stored responses are kept by the gateway; anthropic_messages is Anthropic's wire format, as openai is OpenAI's
    "gateway": {"client", "batches", "webhooks", "jobs", "openai", "anthropic_messages"},
    "client": {"batches", "webhooks", "jobs"},
    "batches": {"webhooks", "jobs", "openai"},  # a batch's lines are OpenAI's batch format
    "webhooks": {"jobs"},
    "jobs": set(),
    "openai": set(),
    "anthropic_messages": set(),
    "workers": set(),
    "workers.entrypoints": {"client", "jobs", "workers.bench", "workers.demo", "workers.embedded_redis",
                            "workers.engine", "workers.job_worker", "workers.offline"},
    "workers.job_worker": {"jobs", "batches", "webhooks", "workers.engine"},  # batch lines and webhook events end
    "workers.engine": {"workers.scheduler", "workers.model"},
    "workers.model": {"workers.scheduler", "kernels"},  # the runner executes the scheduler's step plan
    "workers.scheduler": set(),
    "workers.bench": {"client", "jobs", "workers.engine", "workers.job_worker", "workers.model"},
    "workers.demo": {"client", "openai", "workers.engine", "workers.job_worker"},
    "workers.embedded_redis": {"jobs"},
    "workers.offline": {"openai", "workers.engine"},
    "kernels": set(),
}
DUNDER = re.compile(r"^__\w+__$")
END_MODULE = "rqbatcher.jobs.ends"
END_WRITES = re.compile(r"(?<!def )\b(success_on|failure_on|charge_on|record_outcome_on|announce_response_end_on)\(")


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            name = ".".join((package, *path.relative_to(ROOT / folder).with_suffix("").parts)).removesuffix(".__init__")
            found[name] = path
    return found


def imports(path: Path, known: dict[str, Path] | None = None, top_level: bool = False) -> set[str]:
    """The modules `path` imports anywhere (lazily and under TYPE_CHECKING too), or at its top level alone; the
    project's modules where `known` is given, else every top-level package it names."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in (tree.body if top_level else ast.walk(tree)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & (known or {}).keys()
            found |= submodules or {node.module}  # `from package import module` imports the module
    if known is None:
        return {name.partition(".")[0] for name in found}
    return {name for name in found if name in known}


def in_folder(name: str, folder: str) -> bool:
    return name == folder or name.startswith(folder + ".")


def folder_of(name: str) -> str:
    """The checkout folder (batcher, workers, kernels) that module `name` lives in."""
    return next(f for f, package in sorted(FOLDERS.items(), key=lambda i: -len(i[1])) if in_folder(name, package))


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def test_no_module_passes_its_size():
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    assert {n: s for n, s in sizes.items() if s > MAX_LINES} == {}
    worker = {n: s for n, s in sizes.items() if n.removeprefix(JOB_WORKER + ".") in WORKER_MODULES}
    assert len(worker) == len(WORKER_MODULES) and max(worker.values()) < MAX_WORKER_LINES, worker


def test_imports_go_one_way_without_circles_and_the_cli_has_one_door_into_workers():
    known, edges = modules(), graph()
    assert [n for n in edges if folder_of(n) == "batcher" and any(folder_of(t) == "workers" for t in edges[n])] == [
        "rqbatcher.cli.engine_commands"]
    assert edges["rqbatcher.cli.engine_commands"] & {n for n in known if folder_of(n) == "workers"} == {
        "rqbatcher.workers.entrypoints"}
    assert not [n for n in edges
                if folder_of(n) == "kernels" and edges[n] - {m for m in known if folder_of(m) == "kernels"}]
    cycle = _a_cycle(edges)
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


def _crossings(source: str, forbidden: tuple[str, ...], third_party: tuple[str, ...] = ()) -> dict[str, set[str]]:
    """Each module of folder `source` that imports a module of a `forbidden` folder or a `third_party` package."""
    known, edges, found = modules(), graph(), {}
    for name in edges:
        if in_folder(name, source):
            bad = {t for t in edges[name] if any(in_folder(t, f) for f in forbidden)}
            bad |= imports(known[name]) & set(third_party)
            if bad:
                found[name] = bad
    return found


def seam_of(name: str) -> str:
    """The folder of MAY_IMPORT that module `name` belongs to, or BASE."""
    parts = name.split(".")
    if in_folder(name, KERNELS):
        return "kernels"
    if in_folder(name, WORKERS):
        return ".".join(parts[1:3])
    return BASE if parts[:2][-1] in BASE_MODULES else parts[1]


def test_folders_import_one_way_as_the_design_draws():
    crossings: dict[str, set[str]] = {}
    for name, targets in graph().items():
        seam = seam_of(name)
        allowed = {seam, BASE} | MAY_IMPORT.get(seam, set()) if seam != BASE else {BASE}
        for target in targets:
            if seam_of(target) not in allowed:
                crossings.setdefault(name, set()).add(target)
    assert {seam_of(n) for n in modules()} - {BASE} <= MAY_IMPORT.keys(), "place every new folder in MAY_IMPORT"
    assert crossings == {}


def test_no_module_uses_another_modules_private_name():
    """`from rqbatcher.x import _name`, or `x._name` where x names a project module: a private name is its module's
    own (a dunder is no private name)."""
    known, uses = modules(), {}
    for name, path in known.items():
        tree, aliases = ast.parse(path.read_text()), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in known and node.module != name:
                private = {a.name for a in node.names if a.name.startswith("_") and not DUNDER.match(a.name)}
                uses.setdefault(name, set()).update(f"{node.module}.{n}" for n in private)
                aliases |= {a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in known}
            elif isinstance(node, ast.Import):
                aliases |= {a.asname for a in node.names if a.asname and a.name in known}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not DUNDER.match(node.attr)):
                uses.setdefault(name, set()).add(f"{node.value.id}.{node.attr}")
    assert {name: found for name, found in uses.items() if found} == {}


def test_a_jobs_end_is_written_in_one_module():
    """RQ's record of an execution's end, the job's outcome (batch line, counts, feed), the fairness charge and the
    webhook event are queued by the end module alone, whoever records the end."""
    writers = {name for name, path in modules().items() if END_WRITES.search(path.read_text())}
    assert writers == {END_MODULE}


def test_the_scheduler_never_sees_redis_nor_the_job_system():
    forbidden = ("rqbatcher.jobs", "rqbatcher.batches", "rqbatcher.client")
    assert _crossings("rqbatcher.workers.scheduler", forbidden, ("redis", "rq")) == {}


def test_the_job_system_does_not_import_the_scheduler():
    assert _crossings("rqbatcher.jobs", ("rqbatcher.workers.scheduler",)) == {}


def test_the_model_imports_neither_the_engine_nor_the_job_worker():
    assert _crossings("rqbatcher.workers.model", ("rqbatcher.workers.engine", JOB_WORKER)) == {}


def test_the_engine_imports_neither_redis_rq_nor_the_job_worker():
    assert _crossings("rqbatcher.workers.engine", (JOB_WORKER, "rqbatcher.jobs"), ("redis", "rq")) == {}


def test_the_job_worker_imports_neither_torch_nor_the_model_and_only_the_engines_api():
    engine_but_api = tuple(n for n in modules() if in_folder(n, "rqbatcher.workers.engine") and n not in (
        "rqbatcher.workers.engine", "rqbatcher.workers.engine.api"))
    assert _crossings(JOB_WORKER, ("rqbatcher.workers.model", *engine_but_api), ("torch", "transformers")) == {}


def test_the_bench_is_imported_lazily_by_its_entry_point_alone():
    known = modules()
    importers = {name for name, targets in graph().items() if any(in_folder(t, BENCH) for t in targets)
                 and not in_folder(name, BENCH)}
    assert importers == {BENCH_DOOR}
    at_import = {t for t in imports(known[BENCH_DOOR], known, top_level=True) if in_folder(t, BENCH)}
    assert at_import == set(), "`batcher worker` must not load the bench harness"


def test_the_package_never_imports_the_benchmarks_or_the_tests():
    """benchmarks/ and tests/ (the fake engine among them) are not in the wheel: nothing in it may need them."""
    importers = {name: found for name, path in modules().items() if (found := imports(path) & CHECKOUT_ONLY)}
    assert importers == {}


def test_a_file_name_means_one_thing():
    """No two modules or packages share a name, but a package and its main module (`workers.engine.engine`)."""
    names: dict[str, set[str]] = {}
    for name in modules():
        parent, _, leaf = name.rpartition(".")
        if parent and leaf != "__main__":
            names.setdefault(leaf, set()).add(parent if parent.endswith("." + leaf) else name)
    assert {leaf: where for leaf, where in names.items() if len(where) > 1} == {}


def test_rq_internals_and_registries_are_used_in_the_adapter_alone():
    users = {name for name, path in modules().items() if RQ_INTERNALS.search(path.read_text())}
    assert users == {RQ_ADAPTER}
    rq_importers = {name for name, path in modules().items()
                    if re.search(r"^\s*(from rq[. ]|import rq\b)", path.read_text(), re.M)}
    worker = {n for n in rq_importers if folder_of(n) == "workers"}
    assert worker == set(), "the worker takes RQ from the adapter"


def test_only_the_scheduler_writes_a_sequences_state():
    """No module that handles sequences, but the scheduler (and the sequence's own), assigns or grows in place a
    field that `Sequence` has, on anything but `self`."""
    fields = {node.target.id for node in ast.walk(ast.parse((ROOT / "workers/scheduler/sequence.py").read_text()))
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


def test_every_benchmark_imports():
    """benchmarks/ runs from a checkout and no test reaches most of it: a rename in the package cannot break it
    silently."""
    failures = {}
    for name in sorted(f"benchmarks.{path.stem}" for path in BENCHMARKS.glob("*.py") if path.stem != "__init__"):
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001  (every failure is reported, by module)
            failures[name] = f"{type(exc).__name__}: {exc}"
    assert failures == {}
