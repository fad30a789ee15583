"""`ort-lora serve --ray`: the same OpenAI server over engine replicas on a Ray cluster
(docs/SCALE_OUT.md). serve.py builds the application; client.py is the ingress's engine
(EngineClient) that streams from replicas; replica.py the replica around one engine;
directory.py the cluster's adapter names and ids; residency.py which adapters a replica
holds; stream.py the deltas between them; metrics.py the cluster's /metrics; config.py the
settings. Imports no Ray at import time: Ray is an optional dependency."""
