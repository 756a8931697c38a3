"""Streaming stage of the CacheGen harness: shaped link, KV store, streaming + adaptation.

Paper: CacheGen (Liu et al., SIGCOMM 2024), section 5 (streaming and adaptation).
Modules (imported lazily; importing this package starts nothing):
  link      -- ShapedLink: real TCP through netns+veth+tc tbf (root) or a userspace token bucket
  protocol  -- length-prefixed frames of the KV store protocol
  backends  -- open_backend(url); re-exports StoreBackend, LocalFolderBackend (folder_backend)
  store     -- context keys, manifests, KVStoreServer, StoreClient, start_store_server
  client    -- stream_load: pipelined fetch + decode with text fallback
  adapt     -- AdaptivePolicy: per-chunk level choice from measured throughput and an SLO
  traces    -- bandwidth traces (constant, step, CacheGen artifact jsonl), apply_trace
Measurements of this stage live in the bench package: python -m bench.linkcheck (goodput),
python -m bench.streaming pipeline|adapt, python -m bench.redis. See docs/streaming.md.
"""
