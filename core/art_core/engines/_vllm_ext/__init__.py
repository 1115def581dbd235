"""Code that runs inside the vLLM server's worker processes, not in ours.

The folder is put on the vLLM subprocess's ``PYTHONPATH`` (and nothing else of art_core), so
``art_vllm_merge`` imports there as a top-level module; it needs only torch, safetensors and vllm, which
vLLM's own venv has.
"""
