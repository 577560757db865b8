"""SGLang as colo's rollout engine, and colo's sender for it: the registry's ``sglang`` entry
(:data:`colo.engine.ENGINES`).

- :mod:`colo.engine.sglang.engine`: :class:`SglangEngine` (SGLang's server or an in-process
  ``sglang.Engine`` behind colo's engine protocol) and :class:`SglangModel` (what colo checks
  a sync against before any request), the request bodies colo posts;
- :mod:`colo.engine.sglang.payload`: SGLang's flattened bucket as a payload, written without
  SGLang, and colo's allow-listed reader of it;
- :mod:`colo.engine.sglang.transport`: :class:`SglangTransport`, the transport ``sglang``;
- :mod:`colo.engine.sglang.start`: how ``colo demo`` and ``colo bench`` start SGLang.

Written against SGLang 0.5.23 and checked against its own code from its wheel, never run
against a live SGLang (``docs/sglang.md``). Importing this package imports no SGLang.
"""

from colo.engine.sglang.engine import (LOAD_FORMAT, SELECTOR, SGLANG_VERSION, TAGS, TRANSPORT, SglangEngine,
                                       SglangModel, begin_request, checksum_request,
                                       continue_request, end_request, generate_request, pause_request,
                                       probe_request, release_request, resume_request, update_request,
                                       version_request)
from colo.engine.sglang.payload import (META_CLASS, bucket_metadata, bucket_views, decode_payload,
                                        serialize_payload)
from colo.engine.sglang.transport import SglangTransport

__all__ = ["LOAD_FORMAT", "META_CLASS", "SELECTOR", "SGLANG_VERSION", "TAGS", "TRANSPORT", "SglangEngine",
           "SglangModel", "SglangTransport", "begin_request", "bucket_metadata", "bucket_views", "checksum_request",
           "continue_request", "decode_payload", "end_request", "generate_request", "pause_request",
           "probe_request", "release_request", "resume_request", "serialize_payload", "update_request",
           "version_request"]
