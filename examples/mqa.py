"""MQA inference as in oneDNN's mqa example: one K/V head shared by every query head (5D GQA with H_kv = 1).

    python examples/mqa.py [--dtype bf16]
"""
import argparse

import gqa

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="f32")
    gqa.main(parser.parse_args().dtype, hq=16, hkv=1, title="mqa")
