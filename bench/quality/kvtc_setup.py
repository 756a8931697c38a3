"""The kvtc calibration the rows of a quality run (and of the answer suite) encode with:
the model's default calibration, a user's calibration file, or one fitted per layer group
on a named text. Part of bench.quality (the command is bench.quality.cli)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from bench.quality.config import QualityError

__all__ = ["prepare_kvtc", "prepare_kvtc_groups"]


def prepare_kvtc(bundle, data_path: Optional[str], log: Callable[[str], None] = print,
                 user=None, user_path: Optional[Path] = None) -> dict:
    """The calibration the kvtc rows encode with (the caller passes its ``hash`` to every
    kvtc encode, ``KvtcConfig``): ``bundle``'s model's default calibration
    (``kv_extraction_hf.calibrate.default_calibration``: the default calibration text, the
    standard library's docstring prose, never the WikiText-2 test split evaluated here;
    fitted once, then cached; the same calibration as ``run_benchmarks.py``'s), or
    ``user``, a loaded ``codec.kvtc.KvtcCalibration`` (``--kvtc-calibration``). Both are
    registered so their chunks decode. Returns a record (``path_name``, ``sha256`` of the
    artifact file, ``hash`` = the calibration hash the chunks' headers name, ``source``,
    ``group_layers``, ``text`` = the calibration text's source, description, sha256) or
    ``{"error": ...}``; a failure only means the kvtc rows are skipped. ``data_path`` is
    not used for the calibration (kept for callers)."""
    from kv_extraction_hf.calibrate import calibration_provenance

    if user is not None:
        from codec import kvtc
        from kv_extraction_hf.model.fetch import sha256_file

        if (user.num_layers, user.num_heads, user.head_dim) != (
                bundle.info.num_layers, bundle.info.num_kv_heads, bundle.info.head_dim):
            raise QualityError(f"--kvtc-calibration {user.hash[:16]} is for L={user.num_layers}, "
                               f"H={user.num_heads}, D={user.head_dim}, not this model")
        kvtc.register_calibration(user)
        return {"path_name": Path(user_path).name, "sha256": sha256_file(user_path),
                **calibration_provenance(user, "--kvtc-calibration"),
                "data": user.meta.get("data", "")}
    try:
        from kv_extraction_hf.calibrate import default_calibration
        from kv_extraction_hf.model.fetch import sha256_file

        path = default_calibration(bundle, log=lambda m: None)
        from codec import kvtc

        cal = kvtc.get_calibration(Path(path).stem)
        return {"path_name": Path(path).name, "sha256": sha256_file(path),
                **calibration_provenance(cal, "default")}
    except Exception as exc:  # noqa: BLE001 - kvtc is optional here
        reason = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        log(f"kvtc calibration unavailable ({reason}): kvtc rows will be skipped")
        return {"error": reason}


def prepare_kvtc_groups(bundle, windows, text_path: Optional[Path]) -> tuple[Any, dict]:
    """(config, record) of the kvtc rows when each layer group gets its own calibration
    (window storage, ``windows`` one int or None per layer) or when the calibration is
    fitted on ``text_path`` (``--kvtc-calibration-data``; ``windows`` None = one group of
    every layer). config: ``{layers: KvtcConfig}`` for ``codec.window`` (a plain
    ``KvtcConfig`` for one group); record: ``calibrate_groups.groups_record``. Raises
    QualityError when the calibration cannot be fitted (a named text must be usable)."""
    from kv_extraction_hf.calibrate.groups import group_calibrations, groups_record
    from kv_extraction_hf.errors import ExtractionError
    from codec.kvtc import KvtcConfig

    ws = windows if windows is not None else [None] * bundle.info.num_layers
    try:
        hashes = group_calibrations(bundle, ws, str(text_path) if text_path else None, log=lambda m: print(m, flush=True))
    except (ExtractionError, OSError) as exc:
        raise QualityError(f"kvtc calibration: {exc}") from None
    rec = groups_record(hashes, "--kvtc-calibration-data" if text_path else "default (per layer group)")
    if windows is None:
        (h,) = hashes.values()
        return KvtcConfig(calibration=h), dict(rec, hash=h)
    return {g: KvtcConfig(calibration=h) for g, h in hashes.items()}, rec
