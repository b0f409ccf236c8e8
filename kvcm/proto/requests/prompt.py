"""The fields a request names its blocks by: ``block_keys``, or a prompt's ``token_ids`` (hashed
by the server with the instance's block size) with the prompt's extra keys — one declaration
for the data plane's requests and the engine tier's queries alike."""

from __future__ import annotations

import msgspec

from kvcm.proto.extra_keys import CacheSalt, ExtraKeys, LoraName, MmFeatures
from kvcm.proto.schema import Keys, RequestBase, Tokens

__all__ = ["PromptRequest"]


# msgspec.Struct named again only so that linters see a Struct (its defaults are copied, not shared).
class PromptRequest(RequestBase, msgspec.Struct, kw_only=True):
    """A request naming blocks by ``block_keys``, or by a prompt's ``token_ids``."""

    block_keys: Keys = []
    token_ids: Tokens = []
    # A prompt's extra keys (docs/engines.md#keys-block-sizes-namespaces), mixed into the keys of
    # its token_ids: per block as vLLM sends them (extra_keys), or what vLLM's rule derives them
    # from (mm_features). lora_name is the adapter's namespace: it enters the keys of token_ids,
    # and names the adapter whose engine blocks a match counts.
    extra_keys: ExtraKeys | None = None
    mm_features: MmFeatures | None = None
    lora_name: LoraName | None = None
    cache_salt: CacheSalt | None = None
