"""Attention and KV-cache ops.

Keep this file free of side effects and of a `__version__`: transformers probes a top-level
package named `kernels` (Hugging Face's kernel hub) and reads its version.
"""
