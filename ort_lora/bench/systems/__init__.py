"""One runner per benchmarked system. Each runs in its own worker process (worker.py):

    run(spec: RunSpec, workload: Workload) -> (list[RequestTimes], extra: dict)

`extra` holds system-specific measurements (e.g. ort-lora's host time per step).
"""

RUNNERS = {
    "ort-lora": "ort_lora.bench.systems.ort_lora_engine",
    "ort-lora-http": "ort_lora.bench.systems.http_server",
    "transformers": "ort_lora.bench.systems.hf_peft",
    "genai": "ort_lora.bench.systems.genai",
    "genai-multilora": "ort_lora.bench.systems.genai",
    "vllm": "ort_lora.bench.systems.vllm_peer",
    "vllm-http": "ort_lora.bench.systems.vllm_peer",
    "optimum": "ort_lora.bench.systems.optimum_peer",
    "ort-lora-ray": "ort_lora.bench.systems.ray_cluster",
    "llama-cpp": "ort_lora.bench.systems.llama_cpp",
}
# chat traces (bench/prefix.py), where a system needs a runner of its own
CHAT_RUNNERS = {"ort-lora": "ort_lora.bench.systems.ort_lora_chat"}
