"""EAGLE-3 speculative decoding with tree attention, end to end: the built-in target and
draft (examples/assets) or any Llama-family checkpoint with an EAGLE-3 draft.

    python examples/eagle3_verify.py                   # built-in target + draft, CPU, no network
    python examples/eagle3_verify.py --check           # also assert output == plain greedy decoding
    python examples/eagle3_verify.py --target meta-llama/Llama-3.1-8B-Instruct \\
        --draft yuhuili/EAGLE3-LLaMA3.1-Instruct-8B --device cuda --dtype bfloat16

The command line itself is torch_tree_attn/speculative/cli.py (importable, so the tests call its
pieces); --help describes every flag. The built-in weights are read from examples/assets
beside this file, or from $TORCH_TREE_ATTN_ASSETS.
"""
import time

PROCESS_START = time.perf_counter()  # before the imports: "process start" for the cold-start figure

import os  # noqa: E402
import sys  # noqa: E402

# Run from a checkout without an install: the package is the directory above.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from torch_tree_attn.speculative.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(process_start=PROCESS_START))
