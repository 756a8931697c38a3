"""The model-side statistics a KVTC calibration weights its fit with: per-channel output
sensitivity (measure_sensitivity), the attention modules' query energy (query_energy), the
output-projection Gram (output_gram) and the whitening metric built from them
(metric_from_stats). Part of kv_extraction_hf.calibrate (its face exports these names).
"""

from __future__ import annotations

import contextlib
import time

import torch

from kv_extraction_hf.errors import ExtractionError


@torch.inference_mode()
def measure_sensitivity(bundle, k: torch.Tensor, v: torch.Tensor, ids: list[int],
                        continuation: int = 32, rel_noise: float = 0.05,
                        sink_tokens: int = 4, batch: int = 12, log=print):
    """Per-(K/V, layer) sensitivity of the model's next-token distribution to KV error.

    For each (K/V, layer) in turn, white Gaussian noise of variance ``rel_noise`` x that
    (K/V, layer)'s mean per-channel variance is added to the context KV (all tokens but
    the sinks) and the KL divergence of the next-token distributions over the last
    ``continuation`` tokens of ``ids`` is measured. k, v: [L, T, H, D], the prefill KV of
    ``ids`` (T = len(ids)). Returns float64 [2, L]: KL (nats) per unit of absolute
    noise variance per element; KVTC's water level of a (K/V, layer) is made inversely
    proportional to it (minimising the first-order KL, which is linear in the error
    variance). ceil(2L / ``batch``) batched passes of ``continuation`` tokens, each of
    ``batch`` noisy caches (one perturbed (K/V, layer) each) plus the clean cache as entry
    0: every KL is measured against the clean logits of its own forward pass.

    The passes run with FLOAT32 activations (a float32 copy of a bf16/fp16 model: the same
    weights, exactly; the noisy KV is rounded to the KV dtype first, as a codec's decoded
    KV is): with bf16 activations the forward's own rounding (unit roundoff 2^-8) adds a
    KL of ~1e-3 nats on the default model, as large as some layers' probe KL, and that
    rounding depends on the matmul kernels, which depend on the batch (on an AMX Xeon
    oneDNN's bf16 GEMMs of 8 and of 2 rows differ; the measured sensitivities moved by up
    to 119%). In float32 (2^-24, 2^16 times finer) that term is negligible and
    the probe KL moves only by the cross term 2 r / d (rounding shift r, probe shift d): the result depends on the batch and on the CPU's kernel family by float32
    rounding only (measured <= 3.2e-3 relative on an AMX Xeon; tests/extraction/test_kvtc_calibrate.py
    bounds it at 1e-2). Memory: a
    float32 copy of the weights while it runs (0.5 GB for the default model).
    The noise is drawn in the same order whatever the batch.
    """
    import copy

    import numpy as np
    from transformers import DynamicCache


    if batch < 1:
        raise ExtractionError("sensitivity batch must be >= 1")
    T = k.shape[1] - continuation
    if T <= sink_tokens + 1:
        raise ExtractionError("sensitivity window too short")
    cont = ids[T:]
    kc, vc = k[:, :T], v[:, :T]
    cont_ids = torch.as_tensor(cont, dtype=torch.long).reshape(1, -1)
    cfg = bundle.model.config
    model = bundle.model
    if next(model.parameters()).dtype != torch.float32:
        model = copy.deepcopy(model).float()

    gen = torch.Generator().manual_seed(0)
    L = k.shape[0]
    out = np.zeros((2, L))
    probes = [(kv, layer) for kv in range(2) for layer in range(L)]
    # clean cache in the model's layout [1, H, T, D] per layer
    # (float32: exact widening of the KV dtype)
    clean = [(kc[layer].transpose(0, 1).unsqueeze(0).float(),
              vc[layer].transpose(0, 1).unsqueeze(0).float()) for layer in range(L)]
    t0 = time.perf_counter()
    for start in range(0, len(probes), batch):
        group = probes[start:start + batch]
        B = len(group) + 1               # entry 0: the clean cache (this pass's reference)
        noisy, scale = {}, []
        for kv, layer in group:          # same draw order as one probe per pass
            xl = (kc, vc)[kv][layer, sink_tokens:].float()
            var = float(xl.reshape(xl.shape[0], -1).var(0).mean())
            noise = torch.randn(xl.shape, generator=gen) * (rel_noise * var) ** 0.5
            # [H, T-s, D], rounded to the KV dtype, then widened exactly
            noisy[(kv, layer)] = (xl + noise).to(kc.dtype).float().transpose(0, 1)
            scale.append(rel_noise * var)
        try:
            cache = DynamicCache(config=cfg)
        except TypeError:  # older transformers: no config argument
            cache = DynamicCache()
        for layer in range(L):
            kb = clean[layer][0].expand(B, -1, -1, -1).clone()
            vb = clean[layer][1].expand(B, -1, -1, -1).clone()
            for b, (kv, ly) in enumerate(group, start=1):
                if ly == layer:
                    (kb, vb)[kv][b, :, sink_tokens:] = noisy[(kv, ly)]
            cache.update(kb, vb, layer)
        with torch.inference_mode():
            logits = model(input_ids=cont_ids.expand(B, -1), past_key_values=cache,
                           use_cache=True).logits.float()
        ref = torch.log_softmax(logits[0], -1)
        pref = ref.exp()
        for b, (kv, layer) in enumerate(group, start=1):
            lq = torch.log_softmax(logits[b], -1)
            out[kv, layer] = float((pref * (ref - lq)).sum(-1).mean()) / scale[b - 1]
        log(f"[calibrate] sensitivity: {start + B - 1}/{len(probes)} (K/V, layer) probes "
            f"({time.perf_counter() - t0:.1f} s)")
    return out


def attn_modules(bundle) -> list:
    """The self-attention module of each decoder layer (llama-style ``model.model.layers[i]
    .self_attn`` with ``q_proj`` / ``o_proj``); raises ExtractionError otherwise."""
    layers = getattr(getattr(bundle.model, "model", None), "layers", None)
    mods = [getattr(ly, "self_attn", None) for ly in (layers or [])]
    if not mods or any(m is None or not hasattr(m, "q_proj") or not hasattr(m, "o_proj")
                       for m in mods):
        raise ExtractionError("model has no llama-style q_proj / o_proj attention: use "
                              "--metric none")
    return mods


class query_energy(contextlib.AbstractContextManager):
    """Context manager that records the mean squared query, per layer and channel, of
    every forward pass run inside it (forward hooks on each layer's ``q_proj``).
    ``result()``: float64 [L, Hq * D] (Hq query heads), E[q^2] over all tokens seen."""

    def __init__(self, bundle):
        self.mods = attn_modules(bundle)
        self.sum = None
        self.count = 0
        self.handles = []

    def __enter__(self):
        import numpy as np

        self.sum = np.zeros((len(self.mods), self.mods[0].q_proj.out_features))

        def hook(i):
            def f(_m, _inp, out):
                q = out.detach().float().reshape(-1, out.shape[-1])
                self.sum[i] += (q * q).sum(0).double().numpy()
                if i == 0:
                    self.count += q.shape[0]
            return f
        self.handles = [m.q_proj.register_forward_hook(hook(i)) for i, m in enumerate(self.mods)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False

    def result(self):
        if not self.count:
            raise ExtractionError("no query seen by query_energy")
        return self.sum / self.count


def output_gram(bundle):
    """Gram matrices of each layer's attention output projection per query head:
    float64 [L, Hq, D, D], W_o[:, g D:(g+1) D]^T W_o[:, g D:(g+1) D] (what an error in
    query head g's attention output costs in the residual stream, squared norm)."""
    import numpy as np

    mods = attn_modules(bundle)
    cfg = bundle.model.config
    Hq = cfg.num_attention_heads
    out = []
    for m in mods:
        w = m.o_proj.weight.detach().double()                 # [hidden, Hq * D]
        D = w.shape[1] // Hq
        wh = w.reshape(w.shape[0], Hq, D).permute(1, 0, 2)    # [Hq, hidden, D]
        out.append((wh.transpose(1, 2) @ wh).numpy())
    return np.stack(out)


def metric_from_stats(qe, wo, bundle, pre_rope: bool = True):
    """KVTC's per-head distortion metrics (``codec.kvtc.fit_calibration(metric=)``) from the
    query energy ``qe`` float [L, Hq * D] (``query_energy``) and the output projection's
    Gram matrices ``wo`` float [L, Hq, D, D] (``output_gram``).

    Keys: the attention logit error of query q for a key error e is q . e (up to the
    1/sqrt(D) scale), so E[(q . e)^2] = e^T E[q q^T] e, summed over the query heads that
    share the KV head (grouped-query attention, HF ``repeat_kv`` order). Only the diagonal
    is kept; with keys decorrelated before RoPE (``pre_rope``) the relative rotation
    between query and key mixes each rotate-half pair (j, j + D/2), so both channels of a
    pair get the pair's mean energy. Values: an error e in a value row moves the attention
    output by (attention weight) x e and the layer output by W_o e, so the metric is the sum
    of ``wo`` over the group. Returns (metric_k, metric_v), float64 [L, H, D, D] each."""
    import numpy as np

    cfg = bundle.model.config
    Hq = cfg.num_attention_heads
    H = getattr(cfg, "num_key_value_heads", None) or Hq
    L = qe.shape[0]
    D = qe.shape[1] // Hq
    G = Hq // H
    e = np.asarray(qe, np.float64).reshape(L, Hq, D)
    if pre_rope:
        e = 0.5 * (e + np.roll(e, D // 2, axis=-1))
    ek = e.reshape(L, H, G, D).sum(2)                                   # [L, H, D]
    mk = np.zeros((L, H, D, D))
    idx = np.arange(D)
    mk[:, :, idx, idx] = ek
    mv = np.asarray(wo, np.float64).reshape(L, H, G, D, D).sum(2)
    return mk, mv
