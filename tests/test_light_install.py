"""The core package imports without torch, so a backend can enqueue jobs with a light install."""

import pkgutil
import subprocess
import sys

import rqbatcher

# Every module of the core, found on disk, so that a new one is covered without naming it here.
CORE_MODULES = sorted(m.name for m in pkgutil.walk_packages(rqbatcher.__path__, "rqbatcher.")
                      if m.name != "rqbatcher.__main__")


def test_core_imports_without_torch():
    code = ("import sys\n"
            "sys.modules['torch'] = None  # any 'import torch' now raises ImportError\n"
            "sys.modules['transformers'] = None\n"
            + "".join(f"import {m}\n" for m in CORE_MODULES)
            + "import rqbatcher.cli; rqbatcher.cli.main(['--help'], standalone_mode=False)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_issue_one_liner():
    code = "import rqbatcher.client, rqbatcher.workers.scheduler, sys; assert 'torch' not in sys.modules"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_the_cli_runs_without_the_server_extra_and_serve_says_what_is_missing():
    code = ("import sys\n"
            "for name in ('starlette', 'uvicorn', 'python_multipart'):\n"
            "    sys.modules[name] = None\n"
            "import rqbatcher.cli\n"
            "rqbatcher.cli.main(['--help'], standalone_mode=False)\n"
            "rqbatcher.cli.main(['serve'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    (line,) = out.stderr.strip().splitlines()
    assert out.returncode == 1 and line.startswith("Error: `batcher serve` needs the server extra (pip install "
                                                   "'rqbatcher[server]'): import of ")
