"""Servers and clusters started for a test or a benchmark run: servers.py (ServerThread: an
app in a thread; ServeProcess: `ort-lora serve` as a process; free_port), ray_cluster.py
(LocalRayCluster: a throwaway local Ray head with `ort-lora serve --ray`)."""
