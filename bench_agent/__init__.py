"""bench_agent: multi-turn agent workloads replayed against SGLang servers (vanilla or sgl_sparse).

    python -m bench_agent generate --config bench_agent/configs/swe_agent.toml --out trace.jsonl
    python -m bench_agent replay --url http://127.0.0.1:30000 --trace trace.jsonl --tokenizer MODEL_DIR
    python -m bench_agent compare --model-path MODEL_DIR --trace trace.jsonl --sparse-method snapkv ...
"""
