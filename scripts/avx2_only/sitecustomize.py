"""Loaded by every Python process started under scripts/as_avx2_only.sh (this folder is put first on
PYTHONPATH): torch then reports a CPU without AVX-512 or AMX.

vLLM's CPU build picks its compiled kernels by asking torch what the CPU has (vllm/platforms/cpu.py
`import_kernels`: `_C` with AVX-512 and bf16, `_C_AVX512`, or `_C_AVX2`), and so do its attention, MoE and
linear-layer choices. ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA (set by the script) hold torch's and
oneDNN's own kernels back, but not these questions, which read the CPU's flags directly. Answering them
here, as soon as `torch.cpu` is imported, makes every process take the path an AVX2-only CPU takes.
"""

import importlib.abc
import importlib.machinery
import sys

WITHHELD = ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
            "_is_amx_tile_supported", "_is_amx_fp16_supported")


def _absent() -> bool:
    return False


class _HoldTorchCpuToAvx2(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.cpu":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            for question in WITHHELD:
                if hasattr(module, question):
                    setattr(module, question, _absent)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _HoldTorchCpuToAvx2())
