"""vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`, the same flags) with its engine core
in one process below it: `python -m eagle_pipeline.serve.api_server FLAGS`.

`VllmServer` starts the server through here where vLLM's engine runs its one worker itself
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set by `eagle_pipeline.engine.engine_env` on a CPU host without tensor
parallelism). Two patches go in before vLLM's own entry point runs, both for the engine core that the API
server then starts: it is forked instead of spawned (patches/vllm_server_fork.py), so it does not import
vLLM again, and as a fork it holds every module the API server loaded, so its worker's kernel scan must
pass over llvmlite, which vLLM loads with Kimi-K2.5's model class (patches/vllm_kernel_rebind.py).
"""

from __future__ import annotations

import runpy

VLLM_ENTRY_POINT = "vllm.entrypoints.openai.api_server"

if __name__ == "__main__":
    from patches import vllm_kernel_rebind, vllm_server_fork

    vllm_kernel_rebind.apply()
    vllm_server_fork.apply()
    runpy.run_module(VLLM_ENTRY_POINT, run_name="__main__", alter_sys=True)
