"""A model's operating points for quality targets, fitted once and cached: ``python -m
bench.operating_points --target lmcache near-lossless kl:0.02``.

Fits (on first use; loads after) the model's operating-point table on the calibration text
(``kv_extraction_hf.calibrate.operating_points.resolve_points`` with
``TARGET_FIT_SETTINGS``, the table ``run_benchmarks.py --target`` uses) and prints each
target's level per codec with its calibration KL [95% CI], n and the hashes. This is how a
table gets into the cache for the vLLM connector's extra config "target", which reads it
but never fits one (docs/vllm-connector.md). A target no level meets: one ``error:`` line
naming the closest level, exit 2.
"""
from __future__ import annotations

import argparse
import sys

from cachegen_common import flags
from cachegen_common.cli import exit_status


class TargetError(ValueError):
    """A bad target, codec or model, or a target no level meets (one line)."""


def build_parser() -> argparse.ArgumentParser:
    """The command's flags."""
    p = argparse.ArgumentParser(prog="python -m bench.operating_points", description=__doc__.split("\n\n")[0])
    flags.add_model(p)
    p.add_argument("--target", nargs="+", default=["lmcache"], metavar="NAME",
                   help="near-lossless, lmcache or kl:X (KL bound in nats/token); default lmcache")
    p.add_argument("--codecs", nargs="+", default=["cachegen", "kvtc"], choices=["cachegen", "kvtc"],
                   help="codecs to resolve (default cachegen kvtc; kvtc fits its default calibration on first use)")
    flags.add_out(p, help="also write the points and the table hash as JSON here")
    return p


def resolve(model, targets, codecs, log=print) -> dict:
    """``{"table": sha256, "settings", "text", "points": [OperatingPoint record, ...]}`` of
    every target on ``model`` (a ``--model`` spec, or a loaded ``ModelBundle``). Raises
    TargetError (one line) on a bad target, a model that cannot be loaded, or a target no
    level meets."""
    from bench.quality.targets import resolve_target
    from codec import operating_points as op
    from codec.errors import CodecError
    from kv_extraction_hf.errors import ExtractionError
    from kv_extraction_hf.model import load_model

    try:
        parsed = [op.parse_target(t) for t in targets]
        bundle = model if hasattr(model, "info") else load_model(model, log=log)
        configs = {}
        if "kvtc" in codecs:
            from codec import kvtc
            from kv_extraction_hf.calibrate import calibration_provenance, default_calibration

            rec = calibration_provenance(kvtc.load_calibration(default_calibration(bundle, log=log)), "default")
            configs["kvtc"] = kvtc.KvtcConfig(calibration=rec["hash"])
        out = {"points": []}
        for t in parsed:
            table, points = resolve_target(bundle, t, codecs, configs, log=log)
            out.update(table=table["hash"], settings=table["settings"], text=table["text"])
            out["points"].extend(p.record() for p in points.values())
    except (ExtractionError, ValueError, CodecError) as exc:   # TargetUnmet is a ValueError
        raise TargetError(" ".join(str(exc).split())) from None
    return out


def main(argv=None) -> int:
    """Parse, resolve, print one line per point; exit 2 on bad input or an unmet target."""
    args = build_parser().parse_args(argv)

    def body():
        doc = resolve(args.model, args.target, args.codecs)
        print(f"operating-point table {doc['table']} (text {doc['text']['source']}, sha256 "
              f"{doc['text']['sha256'][:12]})")
        for p in doc["points"]:
            print(f"{p['target']:<14} {p['codec']:<9} level {p['level']}  {p['ratio']:.2f}x  calibration KL "
                  f"{p['kl']:.4g} [{p['kl_ci'][0]:.4g}, {p['kl_ci'][1]:.4g}] n={p['n']}  top-1 {p['top1']:.3f}  "
                  f"point {p['hash'][:16]}")
        if args.out:
            from cachegen_common.files import atomic_write_json

            atomic_write_json(args.out, doc)
            print(f"wrote {args.out}")

    return exit_status(body, (TargetError,))


if __name__ == "__main__":
    sys.exit(main())
