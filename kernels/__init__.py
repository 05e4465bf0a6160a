"""Attention, KV-cache and linear ops (installed as `rqbatcher.kernels`).

From a checkout whose root is on `sys.path` (`python -m rqbatcher` or pytest run there), this folder can also be
found by the name `kernels`, which belongs to Hugging Face's kernel hub: transformers imports that whenever it is
installed. Imported by that name, this module hands the name over to the installed distribution.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout])
    if _spec is not None:
        _installed = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _installed
        _spec.loader.exec_module(_installed)
