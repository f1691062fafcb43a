"""The ``lax.scan`` simulator of a KV pool on the Zipf multimodal workload (or a trace file):
``simulate`` runs it, ``policies`` holds its pool policies and their registry."""
