"""The wire layer: one module per protocol, used by the gateway, the replica client, the metrics
scraper, the simulator and the benchmarks alike.

* :mod:`replicas.wire.http1` -- the lean HTTP/1.1 keep-alive pool the gateway proxies through;
* :mod:`replicas.wire.sse` -- the incremental Server-Sent Events decoder (every reader of a
  token stream);
* :mod:`replicas.wire.prom` -- Prometheus text: parsing (``prometheus_client``'s parser), the one
  histogram type, and exposition;
* :mod:`replicas.wire.kv_events` -- vLLM's KV-cache events: ZMQ PUB/replay framing, the msgpack
  event shapes, vLLM's block hashes, the simulator's publisher and the gateway's subscriber.

Nothing else in the project splits SSE, parses or writes Prometheus text, frames HTTP, or speaks
the KV-event protocol.
"""
