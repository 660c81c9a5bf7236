"""KV reuse, the way vLLM + LMCache do it: an in-process L1 and the sidecar behind it.

`hashing` builds the prefix-chained chunk hashes and LMCache keys, `layout` converts
between the model's per-layer KV and LMCache's `KV_2LTD` payloads, `l1` is the hot LRU,
`sidecar` talks to the KV sidecar (with a circuit breaker and a background storer), and
`manager` puts them together: the longest cached prefix of a request, and storing its KV.
"""
