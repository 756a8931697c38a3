"""First vs tenth decode of one chunk in a FRESH process, with and without the connector's
warm-up (the first load must be as fast as the tenth).

Paper: CacheGen (Liu et al., SIGCOMM 2024) section 5 pipelines decoding with transfer; a
first decode 50x slower than the rest breaks the pipeline's budget. The warm-up is
third_party.vllm.warmup.warm_up_codecs (run by the vLLM connector at start).

Run: python -m bench.warmup [--codec cachegen] [--layers 30] [--tokens 256] [--repeats 2]
Prints one line per fresh process: mode, warm-up seconds, 1st / 10th / median decode seconds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cachegen_common import flags

REPO = Path(__file__).resolve().parents[1]


def _child(path: str, warm: bool) -> dict:
    """Runs in a fresh process: optional warm-up, then 10 decodes of the chunk at `path`."""
    t0 = time.perf_counter()
    import codec

    out = {"mode": "warm-up" if warm else "no warm-up", "import_s": time.perf_counter() - t0,
           "warmup_s": 0.0}
    if warm:
        from third_party.vllm.warmup import warm_up_codecs

        out["warmup_s"] = warm_up_codecs()["total_s"]
    data = Path(path).read_bytes()
    ts = []
    for _ in range(10):
        t0 = time.perf_counter()
        codec.decode_kv(data)
        ts.append(time.perf_counter() - t0)
    out.update(first_s=ts[0], tenth_s=ts[9], median_s=sorted(ts)[5])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.warmup", description=__doc__.split("\n")[0])
    ap.add_argument("--codec", default="cachegen")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=256)
    flags.add_repeats(ap, default=2, help="fresh processes per mode, count (default 2)")
    ap.add_argument("--child", nargs=2, metavar=("CHUNK", "WARM"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.child[0], a.child[1] == "1")))
        return 0
    if a.layers < 1 or a.tokens < 1 or a.repeats < 1:
        print("error: --layers, --tokens and --repeats must be >= 1", file=sys.stderr)
        return 2
    import torch

    import codec

    g = torch.Generator().manual_seed(0)
    k = torch.randn(a.layers, a.tokens, 3, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(a.layers, a.tokens, 3, 64, generator=g).to(torch.bfloat16)
    try:
        data = codec.encode_kv(k, v, codec=a.codec)
    except (ValueError, codec.CodecError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "chunk.bin"
        path.write_bytes(data)
        for _ in range(a.repeats):
            for warm in ("0", "1"):
                r = subprocess.run([sys.executable, "-m", "bench.warmup", "--child", str(path), warm],
                                   cwd=REPO, capture_output=True, text=True, timeout=600)
                if r.returncode != 0:
                    print(f"error: child failed: {r.stderr.strip()[-500:]}", file=sys.stderr)
                    return 1
                m = json.loads(r.stdout.strip().splitlines()[-1])
                print(f"{m['mode']:>10}: warm-up {m['warmup_s']:.2f} s, 1st decode "
                      f"{m['first_s']:.3f} s, 10th {m['tenth_s']:.3f} s, median "
                      f"{m['median_s']:.3f} s ({a.codec}, {a.layers} layers x {a.tokens} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
