"""The answer suite: RULER-kind needle retrieval (single, multi-key, multi-value) at lengths
1K-16K and depths 10-90%, several questions per context, answered from lossless and from
each codec's decoded KV; accuracy and answer agreement with lossless (Wilson 95% CIs) and
McNemar's exact paired test of each codec's correctness against lossless.

What it measures: whether compressing the KV cache changes the answers of a retrieval task
the lossless model gets right (CacheGen section 7.1 measures accuracy on LongChat / TriviaQA
/ NarrativeQA; RULER, arXiv:2404.06654, gives the needle kinds). Each context is prefilled
once and its KV coded once per codec; every question of the context is answered from that KV
(the lossless answer by greedy generation, each codec's by
``kv_extraction_hf.inject.answer_from_kv``: the same ids as greedy generation, cheaper where
they agree). Contexts come from ``kv_extraction_hf.prompts.ruler`` (a distinct haystack and
needle draw per cell). A request is one question; n per codec/level is the number of questions.
With ``--longchat FILE`` the CacheGen artifact's LongChat rows (LongEval topic retrieval, Li et
al. 2023; read from the file given, never committed) are asked at full length after the RULER
cells: kind ``longchat``, one question per row, scored as LongEval scores them
(``evaluation.retrieval_accuracy`` against the first label), an answer agreeing with the
lossless one when both name the same labels (``evaluation.metrics.stated_topics``); a row
longer than the model's context is cut in the middle (recorded).

    python -m bench.answer_suite --model qwen2.5-coder-1.5b --contexts 6 --out /tmp/suite.json
    python -m bench.answer_suite --quick          # a smoke run: 1K tokens, one context per kind
    python -m bench.answer_suite --lossless-only --contexts 2 --lengths 1024   # the model's own score
    python -m bench.answer_suite --model qwen2.5-coder-1.5b --longchat ../shared/data/cachegen-artifact/longchat.jsonl
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Callable, Optional, Sequence

from cachegen_common import flags

DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384)
# questions per (length, context index) over the three kinds: 1 + 4 + 2 = 7; 6 contexts per kind
# and length at 5 lengths give 210 requests per codec/level (n >= 200)
DEFAULT_CONTEXTS = 6
DEFAULT_CODECS = "cachegen:1;cachegen-ref:0;kvtc:4,5;quant8;raw"


def suite_cells(kinds: Sequence[str], lengths: Sequence[int], contexts: int) -> list[tuple[str, int, int]]:
    """The (kind, context_tokens, index) cells: every kind at every length, ``contexts`` each
    (index i has depth ``DEPTHS[i % 5]``: five consecutive indices cover 10-90%)."""
    return [(kind, length, i) for length in lengths for kind in kinds for i in range(contexts)]


def run_suite(bundle, pairs: list[tuple[str, Optional[int]]], cells: Sequence[tuple[str, int, int]],
              seed: int = 0, haystack=None, haystack_name: str = "offline", answer_bundle=None,
              configs: Optional[dict] = None, log: Callable[[str], None] = print,
              done: Optional[dict] = None, on_context: Optional[Callable[[str, list], None]] = None,
              saved_only: bool = False, extra_contexts: Sequence = ()) -> list[dict]:
    """Per-question records of the suite.

    ``bundle``: the model whose KV is coded (engine dtype); ``answer_bundle``: the model that
    answers (e.g. float32; None = ``bundle``), given the KV cast exactly to its dtype.
    ``pairs``: (codec, level) to measure; ``configs``: codec -> encode config (kvtc's
    calibration). Each record: kind, context_tokens, index, depth, key, answers, seconds
    (prefill per context, split over its questions), ``lossless`` {text, ids, correct} and
    ``codecs`` {label: {text, ids, correct, agrees, token_agrees, path}}; ``agrees``: the
    numbers stated equal the lossless answer's (``evaluation.metrics.answer.stated_values``). Raises
    ExtractionError (a context that does not fit) and the codec's errors.

    Resuming: ``done`` maps :func:`context_hash` (the context's and its questions' token ids)
    to that context's records from an earlier run of the same model, codecs and answering
    dtype; such a context is taken from ``done`` and not measured again. ``on_context(hash,
    records)`` is called after each measured context (to save the state).

    ``extra_contexts``: contexts measured after the cells (:func:`longchat_contexts`: kind
    ``longchat``, ``length`` None in their records, scored by ``retrieval_accuracy`` against
    the first answer, agreement by ``stated_topics`` over all answers)."""
    import itertools

    import codec as codec_api
    from codec.level_table import label as codec_label
    from kv_extraction_hf.extract import prefill_kv
    from kv_extraction_hf.inject import answer_from_kv, generate_from_kv_margin, teacher_forcing_margin
    from kv_extraction_hf.prompts.ruler import suite_contexts

    ab = answer_bundle if answer_bundle is not None else bundle
    adt = next(ab.model.parameters()).dtype
    margin = teacher_forcing_margin(adt)
    records = []
    t0 = time.perf_counter()
    every = list(cells) + [(x.kind, None, x.meta.get("row", i)) for i, x in enumerate(extra_contexts)]
    contexts = itertools.chain(suite_contexts(bundle.tokenizer, cells, seed, haystack, haystack_name),
                               extra_contexts)

    for c, ctx in enumerate(contexts):
        kind, length, index = every[c]
        h = context_hash(ctx)
        if done and h in done:
            records.extend(done[h])
            log(f"  context {c + 1}/{len(every)} ({kind}, {len(ctx.context_ids)} tokens) from the saved state")
            continue
        if saved_only:
            log(f"  context {c + 1}/{len(every)} ({kind}) not measured yet: left out")
            continue
        first = len(records)
        t = time.perf_counter()
        k, v = prefill_kv(bundle, ctx.context_ids)
        prefill_s = time.perf_counter() - t
        decoded = {}
        for name, level in pairs:
            k2, v2 = codec_api.decode_kv(codec_api.encode_kv(k, v, codec=name, level=level,
                                                             config=(configs or {}).get(name)))
            decoded[codec_label(name, level)] = (k2.to(k.dtype).to(adt), v2.to(v.dtype).to(adt))
        k_ab, v_ab = k.to(adt), v.to(adt)
        for q in ctx.questions:
            ref_ids, _ = generate_from_kv_margin(ab, k_ab, v_ab, ctx.context_ids, q.question_ids, q.max_new_tokens)
            ref_text = bundle.tokenizer.decode(ref_ids, skip_special_tokens=True)
            rec = {"kind": kind, "context_tokens": len(ctx.context_ids), "length": length, "index": index,
                   "redraw": ctx.meta["redraw"],
                   "depth": q.depth, "key": q.key, "answers": q.answers,
                   "prefill_s": prefill_s / len(ctx.questions),
                   "lossless": {"text": ref_text, "ids": ref_ids,
                                "correct": score_answer(kind, ref_text, None, q.answers)[0]},
                   "codecs": {}}
            if kind == "longchat":
                rec["truncated_from_tokens"] = ctx.meta.get("truncated_from_tokens")
            for label, (k2, v2) in decoded.items():
                got = answer_from_kv(ab, k2, v2, ctx.context_ids, q.question_ids, ref_ids, q.max_new_tokens,
                                     min_margin=margin)
                text = bundle.tokenizer.decode(got["ids"], skip_special_tokens=True)
                correct, agrees = score_answer(kind, text, ref_text, q.answers)
                rec["codecs"][label] = {"text": text, "ids": got["ids"], "path": got["path"],
                                        "correct": correct, "agrees": agrees,
                                        "token_agrees": got["ids"] == ref_ids}
            records.append(rec)
        del decoded, k_ab, v_ab
        if on_context is not None:
            on_context(h, records[first:])
        log(f"  context {c + 1}/{len(every)} ({kind}, {len(ctx.context_ids)} tokens, {len(ctx.questions)} "
            f"questions) done, {time.perf_counter() - t0:.0f} s")
    return records


def longchat_contexts(tokenizer, path: str, rows: Optional[int] = None,
                      max_prompt_tokens: Optional[int] = None) -> list:
    """The LongChat rows of ``path`` (the CacheGen artifact's ``longchat.jsonl``: ``test_id``,
    ``prompt``, ``label``) as answer-suite contexts of kind ``longchat``, in file order, the
    first ``rows`` (None: all): each row's whole conversation as the context (the task
    ``longchat`` prompt of ``kv_extraction_hf.prompts``, the chat template applied), its
    question, every label as ``answers`` (the first is the gold topic) and LongChat's
    budget of 32 new tokens. A context longer than ``max_prompt_tokens`` (the model's
    context) less the question and budget is cut in the middle (LongBench's rule) and its
    meta records ``truncated_from_tokens``. Raises ExtractionError for a missing or malformed
    file, or ``rows`` < 1."""
    from kv_extraction_hf.errors import ExtractionError
    from kv_extraction_hf.prompts import build_prompt
    from kv_extraction_hf.prompts.ruler import SuiteContext, SuiteQuestion

    if rows is not None and rows < 1:
        raise ExtractionError(f"--longchat-rows must be >= 1, got {rows}")
    from kv_extraction_hf.datasets_loaders import load_user_data

    n = len(load_user_data("longchat", path))
    out = []
    for i in range(n if rows is None else min(rows, n)):
        p = build_prompt("longchat", tokenizer, 1 << 20, index=i, data_path=path,
                         max_prompt_tokens=max_prompt_tokens)
        q = SuiteQuestion(question_ids=list(p.question_ids), answers=list(p.answers), key=str(p.meta["row_id"]),
                          depth=None, max_new_tokens=p.max_new_tokens)
        out.append(SuiteContext(name=f"longchat-{p.meta['row_id']}", kind="longchat",
                                context_ids=list(p.context_ids), questions=[q],
                                meta={"row": i, "row_id": p.meta["row_id"], "redraw": 0, "source": str(path),
                                      "truncated_from_tokens": p.meta.get("truncated_from_tokens")}))
    return out


def score_answer(kind: str, text: str, ref_text: Optional[str], answers: Sequence[str]) -> tuple[bool, Optional[bool]]:
    """(correct, agrees with the lossless answer ``ref_text``; None when ``ref_text`` is None,
    i.e. for the lossless answer itself). RULER kinds: every gold value stated
    (``evaluation.all_values_match``), agreement when the same numbers are stated
    (``evaluation.metrics.stated_values``); ``longchat``: LongEval's ``retrieval_accuracy``
    against the first answer, agreement when the same answers (labels) are named
    (``evaluation.metrics.stated_topics``). Raises ValueError for non-str texts."""
    from evaluation.metrics import all_values_match, retrieval_accuracy, stated_topics, stated_values

    if kind == "longchat":
        return (retrieval_accuracy(text, answers[0]),
                None if ref_text is None else stated_topics(text, answers) == stated_topics(ref_text, answers))
    return (all_values_match(text, answers),
            None if ref_text is None else stated_values(text) == stated_values(ref_text))


def rescore(doc: dict) -> dict:
    """``doc`` (an answer-suite file) with every record's ``correct`` and ``agrees`` scored
    again from its stored answer texts by :func:`score_answer` (the scorers of this
    version), the rows recomputed, and ``rescored`` {``utc``, ``changed`` (verdicts that
    differ from the file's)}. Answers are not generated again: the texts are what the run
    measured. Raises ValueError for a file without records."""
    import copy
    import datetime

    recs = doc.get("records")
    if not isinstance(recs, list) or not recs:
        raise ValueError("the answer-suite file has no records to score")
    out = copy.deepcopy(doc)
    changed = 0
    labels = list(dict.fromkeys(r["codec"] for r in doc.get("rows") or [] if r.get("codec") != "lossless"))
    for r in out["records"]:
        ref = r["lossless"]["text"]
        ok = score_answer(r["kind"], ref, None, r["answers"])[0]
        changed += ok != r["lossless"]["correct"]
        r["lossless"]["correct"] = ok
        for label, g in r["codecs"].items():
            correct, agrees = score_answer(r["kind"], g["text"], ref, r["answers"])
            changed += (correct != g["correct"]) + (agrees != g["agrees"])
            g["correct"], g["agrees"] = correct, agrees
            if label not in labels:
                labels.append(label)
    out["rows"] = suite_rows(out["records"], labels)
    out["rescored"] = {"utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                       "changed": changed}
    return out


def context_hash(ctx) -> str:
    """sha256 (hex) of a suite context's token ids and its questions' token ids and generation
    budgets: what a saved record set must match to be reused."""
    import hashlib
    import json

    doc = [list(map(int, ctx.context_ids)),
           [[list(map(int, q.question_ids)), int(q.max_new_tokens)] for q in ctx.questions]]
    return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()


def suite_rows(records: list[dict], labels: Sequence[str]) -> list[dict]:
    """Rows per group (``all``, each kind, each length) and codec label: n, accuracy,
    agreement and token agreement with Wilson 95% CIs, and McNemar's exact test of the
    codec's correctness against lossless on the same questions (``mcnemar``: b = lossless
    right and codec wrong, c = the reverse, p two-sided). The ``lossless`` row has accuracy only."""
    from evaluation.stats import mcnemar_exact, wilson_ci

    def share(hits, n):
        return hits / n, list(wilson_ci(hits, n))

    groups = [("all", records)]
    groups += [(f"kind={k}", [r for r in records if r["kind"] == k]) for k in dict.fromkeys(r["kind"] for r in records)]
    groups += [(f"length={n}", [r for r in records if r["length"] == n])
               for n in sorted({r["length"] for r in records if r["length"] is not None})]
    rows = []
    for group, recs in groups:
        if not recs:
            continue
        n = len(recs)
        ok = sum(r["lossless"]["correct"] for r in recs)
        acc, acc_ci = share(ok, n)
        rows.append({"group": group, "codec": "lossless", "n": n, "accuracy": acc, "accuracy_ci": acc_ci})
        for label in labels:
            got = [(r["lossless"]["correct"], r["codecs"][label]) for r in recs if label in r["codecs"]]
            if not got:
                continue
            m = len(got)
            b = sum(ref and not g["correct"] for ref, g in got)
            c = sum(g["correct"] and not ref for ref, g in got)
            acc, acc_ci = share(sum(g["correct"] for _, g in got), m)
            agr, agr_ci = share(sum(g["agrees"] for _, g in got), m)
            tok, tok_ci = share(sum(g["token_agrees"] for _, g in got), m)
            rows.append({"group": group, "codec": label, "n": m, "accuracy": acc, "accuracy_ci": acc_ci,
                         "agreement": agr, "agreement_ci": agr_ci, "token_agreement": tok,
                         "token_agreement_ci": tok_ci, "mcnemar": {"b": b, "c": c, "p": mcnemar_exact(b, c)}})
    return rows


def print_rows(rows: list[dict], out=None) -> None:
    """The rows as a table (one line per group and codec)."""
    out = out or sys.stdout
    print(f"{'group':<16} {'codec':<14} {'n':>4}  {'accuracy [95% CI]':<24} {'agreement [95% CI]':<24} "
          f"{'McNemar b/c p':<16}", file=out)
    for r in rows:
        acc = f"{r['accuracy']:.3f} [{r['accuracy_ci'][0]:.3f}, {r['accuracy_ci'][1]:.3f}]"
        agr = (f"{r['agreement']:.3f} [{r['agreement_ci'][0]:.3f}, {r['agreement_ci'][1]:.3f}]"
               if "agreement" in r else "-")
        mc = f"{r['mcnemar']['b']}/{r['mcnemar']['c']} {r['mcnemar']['p']:.3g}" if "mcnemar" in r else "-"
        print(f"{r['group']:<16} {r['codec']:<14} {r['n']:>4}  {acc:<24} {agr:<24} {mc:<16}", file=out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.answer_suite", description=__doc__.split("\n")[0])
    flags.add_model(p)
    flags.add_quick(p, help="a smoke run: 1024 tokens, one context per kind, cachegen:1 and raw")
    flags.add_seed(p)
    flags.add_out(p, type=str, help="write the records and rows as JSON (atomically)")
    flags.add_data_path(p, help="WikiText-2 (a folder with wiki.test.raw / test.txt, or the file) for the "
                                "haystack; default: the offline natural sentences of the Python docs")
    p.add_argument("--kinds", default="single,multikey,multivalue", help="comma-separated (default %(default)s)")
    p.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)),
                   help="context lengths, tokens, comma-separated (default %(default)s)")
    p.add_argument("--contexts", type=int, default=DEFAULT_CONTEXTS,
                   help="contexts per kind and length (default %(default)s)")
    p.add_argument("--codecs", default=DEFAULT_CODECS, help="codecs/levels, bench.quality's syntax "
                   "(default %(default)s)")
    p.add_argument("--longchat", metavar="FILE", default=None,
                   help="also ask the LongChat rows of FILE (the CacheGen artifact's longchat.jsonl) at full "
                        "length, one question each, after the RULER cells")
    p.add_argument("--longchat-rows", type=int, default=None, metavar="N",
                   help="only the first N rows of --longchat (default: all)")
    p.add_argument("--lossless-only", action="store_true", help="answer from lossless KV only")
    p.add_argument("--rescore", action="store_true",
                   help="measure nothing: score the answers stored in --out again with this version's scorers "
                        "(correct, agreement), recompute its rows and write it back")
    p.add_argument("--answer-dtype", choices=("float32", "model"), default="float32",
                   help="activations of the answering model (default float32; the KV stays the model's dtype)")
    p.add_argument("--no-resume", action="store_true",
                   help="measure every context again: discard the records a stopped run left in <out>.partial "
                        "(by default, with --out, each finished context is saved there and a rerun of the same "
                        "model, codecs, seed and haystack reuses the contexts it has, also from a run with "
                        "fewer --contexts or --lengths)")
    p.add_argument("--report-partial", action="store_true",
                   help="measure nothing: write --out from the contexts a stopped run saved in <out>.partial "
                        "(the file is marked partial, n = the questions measured; the state is kept, so the "
                        "run can still be resumed)")
    return p


def _haystack(data_path: Optional[str]):
    """(sentences, name) of the haystack: WikiText-2 test from ``data_path`` or offline."""
    from pathlib import Path

    from kv_extraction_hf.datasets_loaders import load_wikitext2
    from kv_extraction_hf.errors import ExtractionError
    from kv_extraction_hf.prompts.ruler import haystack_sentences

    if data_path is None:
        return None, "offline: Python reference prose (pydoc_data.topics)"
    path = Path(data_path)
    if path.is_dir():
        found = [path / n for n in ("wiki.test.raw", "test.txt") if (path / n).is_file()]
        if not found:
            raise ExtractionError(f"--data-path {path}: no wiki.test.raw or test.txt in the folder")
        path = found[0]
    return haystack_sentences(load_wikitext2(str(path))), f"WikiText-2 test ({path.name})"


def _resume(args, bundle, answer_dtype: str, spec: str, cal: Optional[dict], haystack_name: str):
    """(saved records by context hash, the callback saving each new context, the state path)
    of a run with ``--out``; (None, None, None) without one. The state is named by the model,
    answering dtype, codecs, kvtc calibration, seed and haystack (``bench.quality.checkpoint``);
    one of other settings is an ExtractionError (one line)."""
    from pathlib import Path

    from bench.quality.checkpoint import CheckpointMismatch, load_doc, partial_path, run_key, save_doc
    from kv_extraction_hf.errors import ExtractionError

    if not args.out:
        return None, None, None
    state = partial_path(Path(args.out))
    if args.no_resume and not args.report_partial:
        state.unlink(missing_ok=True)
    key = run_key({"suite": "answer_suite", "model": bundle.info.weights_hash,
                   "answer_dtype": answer_dtype,
                   "codecs": [] if args.lossless_only else spec, "kvtc_calibration": (cal or {}).get("hash"),
                   "seed": args.seed, "haystack": haystack_name})
    try:
        doc = load_doc(state, key)
    except CheckpointMismatch as exc:
        raise ExtractionError(f"{exc}: pass --no-resume to start over, or another --out") from None
    saved = dict((doc or {}).get("contexts", {}))
    if saved:
        print(f"resuming: {len(saved)} contexts saved in {state}")

    def on_context(h: str, recs: list) -> None:
        saved[h] = recs
        save_doc(state, key, {"contexts": saved})

    return saved, on_context, state


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI; exit 2 with one line for bad input (ExtractionError / ValueError of the flags)."""
    from kv_extraction_hf.errors import ExtractionError, run_cli

    args = build_parser().parse_args(argv)

    def run_rescore() -> None:
        import json
        from pathlib import Path

        from cachegen_common.files import atomic_write_json

        if not args.out:
            raise ExtractionError("--rescore reads and rewrites --out FILE: give --out")
        path = Path(args.out)
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ExtractionError(f"--rescore: cannot read {path}: {exc}") from None
        if not isinstance(doc, dict) or doc.get("kind") != "answer_suite":
            raise ExtractionError(f"--rescore: {path} is not an answer-suite file")
        try:
            new = rescore(doc)
        except (ValueError, KeyError, TypeError) as exc:
            raise ExtractionError(f"--rescore: {path}: {exc}") from None
        print_rows(new["rows"])
        atomic_write_json(path, new)
        print(f"rescored {path}: {new['rescored']['changed']} verdicts changed")

    if args.rescore:
        return run_cli(run_rescore)

    def run() -> None:
        from bench.quality.cli import environment
        from bench.quality.kvtc_setup import prepare_kvtc
        from bench.quality.text import parse_codec_spec
        from cachegen_common.files import atomic_write_json
        from codec.level_table import label as codec_label
        from kv_extraction_hf.model import load_model
        from kv_extraction_hf.prompts.ruler import KINDS

        kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
        bad = [k for k in kinds if k not in KINDS]
        try:
            lengths = [int(x) for x in args.lengths.split(",")]
        except ValueError:
            raise ExtractionError("--lengths must be comma-separated integers") from None
        if bad or not kinds or args.contexts < 1 or min(lengths) < 256:
            raise ExtractionError(f"--kinds from {', '.join(KINDS)}; --contexts >= 1; --lengths >= 256 "
                                  f"(got kinds {kinds}, contexts {args.contexts}, lengths {lengths})")
        if args.quick:
            lengths, contexts, spec = [1024], 1, "cachegen:1;raw"
        else:
            contexts, spec = args.contexts, args.codecs
        try:
            pairs = [] if args.lossless_only else parse_codec_spec(spec)
        except ValueError as exc:
            raise ExtractionError(f"--codecs: {exc}") from None
        haystack, hname = _haystack(args.data_path)
        if args.report_partial and not args.out:
            raise ExtractionError("--report-partial reads <out>.partial: give --out")
        bundle = load_model(args.model, log=lambda m: print(m, file=sys.stderr))
        ab = bundle
        if args.answer_dtype == "float32" and bundle.info.dtype != "float32" and not args.report_partial:
            ab = load_model(args.model, dtype="float32", log=lambda m: None)
        answer_dtype = "torch.float32" if args.answer_dtype == "float32" else str(next(bundle.model.parameters()).dtype)
        configs, cal = {}, None
        if any(n == "kvtc" for n, _ in pairs):
            from codec.kvtc import KvtcConfig

            cal = prepare_kvtc(bundle, None, log=lambda m: print(m, file=sys.stderr))
            configs["kvtc"] = KvtcConfig(calibration=cal["hash"])
        cells = suite_cells(kinds, lengths, contexts)
        extra = []
        if args.longchat_rows is not None and not args.longchat:
            raise ExtractionError("--longchat-rows needs --longchat FILE")
        if args.longchat:
            extra = longchat_contexts(bundle.tokenizer, args.longchat, args.longchat_rows,
                                      getattr(bundle.model.config, "max_position_embeddings", None))
        print(f"answer suite: {len(cells)} contexts ({', '.join(kinds)} x {lengths} x {contexts})"
              + (f" + {len(extra)} LongChat rows" if extra else "")
              + f", {len(pairs)} codec/levels, haystack {hname}; model {bundle.info.model_id}")
        done, on_context, state = _resume(args, bundle, answer_dtype, spec, cal, hname)
        if args.report_partial and not done:
            raise ExtractionError(f"--report-partial: no saved contexts of these settings in {state}")
        t0 = time.perf_counter()
        records = run_suite(bundle, pairs, cells, args.seed, haystack, hname, ab, configs,
                            log=lambda m: print(m, flush=True), done=done,
                            on_context=None if args.report_partial else on_context, saved_only=args.report_partial,
                            extra_contexts=extra)
        wall = time.perf_counter() - t0
        labels = [codec_label(n, lv) for n, lv in pairs]
        rows = suite_rows(records, labels)
        print()
        print_rows(rows)
        ctx_tokens = {(r["kind"], r["length"], r["index"]): r["context_tokens"] for r in records}
        per_1k = (sum(r["prefill_s"] for r in records) / sum(ctx_tokens.values()) * 1000) if records else math.nan
        measured = len(ctx_tokens)   # contexts with records (all of them unless --report-partial)
        print(f"\n{len(records)} questions from {measured} of {len(cells) + len(extra)} contexts in {wall:.0f} s "
              f"(prefill ~{per_1k:.2f} s per 1K tokens, bundle dtype {bundle.info.dtype})")
        if args.out:
            atomic_write_json(args.out, {
                "kind": "answer_suite",
                "command": " ".join(["python -m bench.answer_suite"] + list(argv or sys.argv[1:])),
                **({"partial": {"contexts_measured": measured, "contexts": len(cells) + len(extra),
                                "state": str(state)}} if args.report_partial else {}),
                "model": {"id": bundle.info.model_id, "weights_hash": bundle.info.weights_hash,
                          "dtype": bundle.info.dtype, "answer_dtype": answer_dtype},
                "environment": environment(), "config": {
                    "kinds": kinds, "lengths": lengths, "contexts": contexts, "seed": args.seed, "codecs": spec,
                    "longchat": None if not extra else {
                        "path": str(args.longchat), "rows": len(extra),
                        "truncated": sum(x.meta["truncated_from_tokens"] is not None for x in extra),
                        "scorer": "evaluation.retrieval_accuracy vs the first label (LongEval)",
                        "agreement": "the same labels named (evaluation.metrics.stated_topics)"},
                    "haystack": hname, "kvtc_calibration": cal, "ci": "Wilson 95%",
                    "paired_test": "McNemar exact (binomial), two-sided, vs lossless",
                    "agreement": "the numbers stated equal the lossless answer's "
                                 "(evaluation.metrics.answer.stated_values)",
                    "scorer": "evaluation.metrics.answer.all_values_match (RULER string_match_all)"},
                "rows": rows, "records": records, "wall_s": wall})
            print(f"wrote {args.out}")
            if state is not None and not args.report_partial:
                state.unlink(missing_ok=True)     # every record is in --out now

    return run_cli(run)


if __name__ == "__main__":
    sys.exit(main())
