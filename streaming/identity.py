"""Identity of a stored KV entry: what made its bytes (model, tokenizer, dtype, shape, codec
config), and the one check every reader runs before using an entry.

Paper: CacheGen section 5 stores a context's encoded KV for reuse; reuse is only correct
for the same model and the same codec configuration (LMCache's cache key likewise carries
the model name, world size and KV dtype, `lmcache/utils.py: CacheEngineKey`). This module
is the harness's single definition of that identity: the store key (streaming.store
`entry_key`) hashes all of it, the manifest of every entry (store server, Redis, local
folder) repeats it, and every reader - the store client, the Redis client, the local-folder
source, the HF engine path and the vLLM connector - calls `check_entry(expected, found)`
and treats any mismatch as a miss with the returned reason, never as data.

No model, codec or network import here: the fields are strings and ints. Helpers that
hash a model folder (`folder_weights_hash`, `folder_tokenizer_hash`) read files only;
`codec_identity` imports the codec lazily. Not runnable.

The record is in streaming.identity_entry, the reader's check in streaming.identity_check,
the field sources (model folder, codec) in streaming.identity_sources; this module
re-exports their public names under the documented path streaming.identity.
"""

from __future__ import annotations

from streaming.identity_check import check_entry, merge_expected  # noqa: F401  (re-exported)
from streaming.identity_entry import (  # noqa: F401  (re-exported)
    IDENTITY_FORMAT,
    TOKENIZER_FILES,
    EntryIdentity,
)
from streaming.identity_sources import (  # noqa: F401  (re-exported)
    codec_config_hash,
    codec_identity,
    codec_version,
    folder_tokenizer_hash,
    folder_weights_hash,
    model_identity,
)
