"""Server check of CacheGenConnector in vLLM's OpenAI server, run by
tests/vllm_connector/test_vllm_server.py in a subprocess. Writes a JSON report the test asserts on.

Steps: start a KV store server (loopback) and `python -m vllm.entrypoints.openai.api_server`
with our connector on 127.0.0.1 and a free port (the recipe of docs/vllm-connector.md);
store a context (a chat request whose kv_transfer_params ask the connector to save the
prompt's KV with the cachegen codec: the entry is indexed by its 256-token prefix chain);
send a chat request with another question and a completion request (the chat-templated
context as text, then other text), both with kv_transfer_params {"mode": "cachegen"} and
no context key (prefix matching); stop the server with SIGINT; then run the same two
prompts (token ids from the tokenizer's chat template) through an offline engine
(third_party.vllm.engine.make_llm, same connector configuration) and record both outputs.

Paper: CacheGen (Liu et al., SIGCOMM 2024) section 7 (a serving engine that loads a
reused context's encoded KV); prefix matching as LMCache's chunk hash chain.

Run: .venv/bin/python tests/helpers/vllm_server_check.py --out report.json [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
MODEL_ID = "SmolLM2-135M-Instruct"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 300.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    """Poll GET url until HTTP 200 (the server answers) or the process exits; seconds."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} during start-up")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)  # waiting for a local process to start, not emulating a network
    raise RuntimeError(f"the server did not answer {url} within {timeout_s:.0f} s")


def server_command(model_dir: str, port: int, extra: dict[str, Any], max_model_len: int) -> list[str]:
    """The documented recipe (docs/vllm-connector.md), on loopback."""
    kv = {"kv_connector": "CacheGenConnector",
          "kv_connector_module_path": "third_party.vllm.cachegen_connector",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": extra}
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--served-model-name", MODEL_ID, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "bfloat16", "--max-model-len", str(max_model_len), "--enforce-eager",
            "--no-enable-prefix-caching", "--max-num-batched-tokens", str(max_model_len),
            "--kv-transfer-config", json.dumps(kv)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tests/helpers/vllm_server_check.py", description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True, help="HF model folder (bf16)")
    ap.add_argument("--out", required=True, help="JSON report path")
    ap.add_argument("--context-tokens", type=int, default=1200)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--start-timeout", type=float, default=420.0)
    ap.add_argument("--ttft-repeats", type=int, default=10,
                    help="chat requests (1 output token) timed right after the save: the "
                    "first is the first load after start")
    ap.add_argument("--keep-workdir", action="store_true")
    ap.add_argument("--stop-signal", choices=["INT", "TERM"], default="INT",
                    help="signal that stops the server (Ctrl-C = INT, systemd/docker = TERM)")
    ap.add_argument("--shutdown-timeout", type=int, default=None,
                    help="pass --shutdown-timeout N to the server (vLLM's drain time)")
    a = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from kv_extraction_hf.prompts import build_prompt
    from streaming.store import start_store_server

    tok = AutoTokenizer.from_pretrained(a.model_dir)
    p = build_prompt("needle", tok, a.context_tokens, seed=1, index=0)
    ctx_text = p.context_text
    questions = {"save": "Summarize the text above in one sentence.",
                 "chat": p.question_text.strip(),
                 "completion": "What is the passcode? The passcode is"}
    msgs = {k: [{"role": "user", "content": ctx_text + "\n\n" + q}] for k, q in questions.items()}
    # the server renders the chat template to text, then tokenizes it without adding
    # special tokens; a completion prompt is tokenized with them (none for this model)
    chat_text = tok.apply_chat_template(msgs["chat"], add_generation_prompt=True, tokenize=False)
    chat_ids = list(tok(chat_text, add_special_tokens=False)["input_ids"])
    completion_text = tok.apply_chat_template(msgs["completion"], tokenize=False,
                                              add_generation_prompt=False)
    completion_ids = list(tok(completion_text)["input_ids"])
    report: dict[str, Any] = {"context_tokens": len(p.context_ids), "answer": p.answer,
                              "server": {}, "offline": {}, "prompt_ids": {
                                  "chat": len(chat_ids), "completion": len(completion_ids)}}
    work = Path(tempfile.mkdtemp(prefix="cg_vllm_server_"))
    stats = work / "stats.jsonl"
    log_path = work / "server.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        x for x in (str(REPO), os.environ.get("PYTHONPATH", "")) if x),
        VLLM_CPU_NUM_OF_RESERVED_CPU="1", VLLM_CPU_KVCACHE_SPACE="1")
    max_len = 4096
    with start_store_server(work / "store") as srv:
        extra = {"stores": {"main": f"{srv.host}:{srv.port}"}, "prefix_match": "params",
                 "allow_client_save": True, "model_id": MODEL_ID, "stats_path": str(stats)}
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        with open(log_path, "w") as log:
            cmd = server_command(a.model_dir, port, extra, max_len)
            if a.shutdown_timeout is not None:
                cmd += ["--shutdown-timeout", str(a.shutdown_timeout)]
            report["server_command"] = cmd
            proc = subprocess.Popen(cmd, cwd=REPO,
                                    env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                report["start_s"] = wait_healthy(f"{base}/health", proc, a.start_timeout)
                body = {"model": MODEL_ID, "max_tokens": a.max_tokens, "temperature": 0.0}
                t0 = time.perf_counter()
                _post(f"{base}/v1/chat/completions", dict(body, messages=msgs["save"], max_tokens=1,
                      kv_transfer_params={"save": {"source": "store", "codec": "cachegen",
                                                   "chunk_tokens": 256}, "stats_tag": "save"}))
                report["server"]["save_request_s"] = time.perf_counter() - t0
                # first load after start vs later ones: wall time of a 1-token request
                # (= time to first token + HTTP round trip on loopback)
                report["server"]["ttft_s"] = []
                for i in range(a.ttft_repeats):
                    t0 = time.perf_counter()
                    _post(f"{base}/v1/chat/completions", dict(body, messages=msgs["chat"],
                          max_tokens=1, kv_transfer_params={"mode": "cachegen",
                                                            "stats_tag": f"ttft-{i}"}))
                    report["server"]["ttft_s"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                r = _post(f"{base}/v1/chat/completions", dict(body, messages=msgs["chat"],
                          kv_transfer_params={"mode": "cachegen", "stats_tag": "chat"}))
                report["server"]["chat_s"] = time.perf_counter() - t0
                report["server"]["chat"] = r["choices"][0]["message"]["content"]
                t0 = time.perf_counter()
                r = _post(f"{base}/v1/completions", dict(body, prompt=completion_text,
                          kv_transfer_params={"mode": "cachegen", "stats_tag": "completion"}))
                report["server"]["completion_s"] = time.perf_counter() - t0
                report["server"]["completion"] = r["choices"][0]["text"]
                # tenants: a context saved under cache_salt "tenant-a" (the unsalted
                # entry of the same context is already stored) is loaded by tenant A and
                # by nobody else: tenant B's request finds neither A's entry nor the
                # unsalted one (the partition enters keys and the prefix index)
                ten_msgs = [{"role": "user", "content": ctx_text + "\n\nWho wrote the text above?"}]
                for tag, salt, kvp in (
                        ("tenant-a-save", "tenant-a", {"save": {"source": "store", "codec": "cachegen",
                                                                "chunk_tokens": 256}}),
                        ("tenant-b", "tenant-b", {"mode": "cachegen"}),
                        ("tenant-a", "tenant-a", {"mode": "cachegen"})):
                    r = _post(f"{base}/v1/chat/completions", dict(body, messages=ten_msgs, max_tokens=1,
                              cache_salt=salt, kv_transfer_params=dict(kvp, stats_tag=tag)))
                    report["server"][f"{tag}_http_ok"] = bool(r.get("choices"))
                # prompt_logprobs makes vLLM drop the external hit; the
                # connector still leaves one record (a miss saying why)
                r = _post(f"{base}/v1/completions", dict(body, prompt=completion_text,
                          max_tokens=1, prompt_logprobs=1,
                          kv_transfer_params={"mode": "cachegen",
                                              "stats_tag": "prompt_logprobs"}))
                report["server"]["prompt_logprobs_http_ok"] = bool(r.get("choices"))
                # a client trying an escape: rejected, plain prefill, HTTP 200
                r = _post(f"{base}/v1/completions", dict(body, prompt=completion_text, max_tokens=1,
                          kv_transfer_params={"source": "local", "source_dir": "/etc",
                                              "context_key": "passwd", "stats_tag": "escape"}))
                report["server"]["escape_http_ok"] = bool(r.get("choices"))
            finally:
                t0 = time.perf_counter()
                proc.send_signal(getattr(signal, "SIG" + a.stop_signal))
                try:
                    report["server_exit_code"] = proc.wait(timeout=90)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    report["server_exit_code"] = "killed after 90 s"
                report["stop_s"] = time.perf_counter() - t0
        text = log_path.read_text(errors="replace")
        report["log_engine_dead"] = "EngineDeadError" in text
        report["log_load_lines"] = [ln for ln in text.splitlines() if "KV load " in ln]
        report["log_miss_lines"] = [ln for ln in text.splitlines() if "KV miss " in ln]
        report["log_tail"] = text[-3000:]
        report["stats"] = [json.loads(x) for x in stats.read_text().splitlines()] \
            if stats.exists() else []
        n_server = len(report["stats"])
        # the same prompts offline, same connector configuration
        from third_party.vllm.engine import make_llm, run_one, shutdown_llm

        llm = make_llm(a.model_dir, extra, max_model_len=max_len)
        try:
            for name, ids in (("chat", chat_ids), ("completion", completion_ids)):
                toks, ttft, _ = run_one(llm, ids, a.max_tokens,
                                        {"mode": "cachegen", "stats_tag": f"offline-{name}"})
                report["offline"][name] = tok.decode(toks, skip_special_tokens=True)
                report["offline"][f"{name}_ttft_s"] = ttft
        finally:
            shutdown_llm(llm)
        report["offline_stats"] = [json.loads(x) for x in stats.read_text().splitlines()][n_server:]
    Path(a.out).write_text(json.dumps(report, indent=1, default=str))
    if not a.keep_workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
