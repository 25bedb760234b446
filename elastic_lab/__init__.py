"""The lab: what runs the experiments around the `elastic_attention` package, which never imports it.

    smollm2.py  the real model: GGUF reader, tokenizer, real-text tasks, `python -m elastic_lab.smollm2`
    bench.py    kernel and router-step timings against SDPA and FlexAttention
    report.py   tables and plots of train_router.py's runs
    probe.py    where SmolLM2's residual stream tells a prompt's need for far retrieval
    runs.py     train_router.py's run machinery: run folders, stop signals, torchrun, CUDA-graph steps
"""
