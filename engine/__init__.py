"""The engine core: token ids in, token ids and figures out.

``engine.core.Engine`` runs every sequence (admission, KV slots, one packed target pass per
model per iteration, propose -> verify -> accept -> rollback -> observe); the server reaches
it through ``engine.client`` (the engine in a process of its own, ``engine.process``, or on
a thread); tests, the workshop and the benchmarks use ``Engine`` directly, in process.
"""
