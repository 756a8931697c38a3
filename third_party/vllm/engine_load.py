"""The engine's load as the adaptive policy's input: prompt tokens queued ahead of a load.

The connector's scheduler side (third_party.vllm.scheduler) sees every request vLLM's
scheduler adds (``on_new_request``, in arrival order) and frees (``request_finished``);
when a load is allocated it counts the prefill the requests ahead of it have left
(:func:`engine_queue_tokens`) and puts it into the load's policy object as
``engine_queue_tokens`` (streaming.adapt.params.PolicyInputs), which charges that queue, at
the measured prefill speed, to every plan that leaves tokens to prefill. Extra config
``engine_load`` (default true) turns it off. No vLLM import; not runnable by itself.
"""

from __future__ import annotations

from typing import Any, Iterable


def engine_queue_tokens(requests: Iterable[Any], request_id: str) -> int:
    """Prompt tokens that the requests ahead of ``request_id`` have yet to prefill.

    ``requests``: vLLM Requests in arrival order (the order vLLM's scheduler called
    on_new_request); those before ``request_id`` (all of them when it is not among them)
    that are not finished count max(0, num_prompt_tokens - num_computed_tokens) each (vLLM
    0.32 v1/request.py; a request's num_computed_tokens includes its local prefix hits and
    external KV once it is admitted, and a preemption resets it to 0). vLLM's scheduler
    serves waiting requests first come first served and running ones before admitting more,
    so these tokens are prefilled before the ones this request leaves to prefill. Decode
    work is not counted. Pure; returns an int >= 0."""
    total = 0
    for r in requests:
        if getattr(r, "request_id", None) == request_id:
            break
        done = getattr(r, "is_finished", None)
        if callable(done) and done():
            continue
        n = getattr(r, "num_prompt_tokens", None)
        if n is None:
            n = len(getattr(r, "prompt_token_ids", None) or [])
        total += max(0, int(n) - int(getattr(r, "num_computed_tokens", 0) or 0))
    return total


class EngineLoad:
    """The scheduler side's view of the engine's requests (on when ``enabled``, extra
    config "engine_load"): ``add`` on vLLM's on_new_request, ``mark`` when a load is
    allocated (the queue is taken then), ``policy`` to put it into the load's policy
    object, ``forget`` on request_finished."""

    def __init__(self, enabled: bool = True):
        self.enabled = bool(enabled)
        self.arrivals: dict[str, Any] = {}   # request id -> vLLM Request, arrival order
        self.queued: dict[str, int] = {}     # request id -> engine_queue_tokens at its allocation

    def add(self, request: Any) -> None:
        if self.enabled:
            self.arrivals[request.request_id] = request

    def mark(self, request: Any) -> int:
        """Take ``request``'s engine_queue_tokens now (0 when off) and keep it; returns it."""
        q = engine_queue_tokens(self.arrivals.values(), request.request_id) if self.enabled else 0
        self.queued[request.request_id] = q
        return q

    def policy(self, policy: Any, request_id: str) -> Any:
        """A copy of a load's policy object (a dict) with ``engine_queue_tokens`` set to the
        marked value (0 if never marked), replacing any value the request gave; anything
        else, or with the input off, unchanged."""
        if not self.enabled or not isinstance(policy, dict):
            return policy
        return {**policy, "engine_queue_tokens": self.queued.get(request_id, 0)}

    def forget(self, request_id: str) -> None:
        self.arrivals.pop(request_id, None)
        self.queued.pop(request_id, None)
