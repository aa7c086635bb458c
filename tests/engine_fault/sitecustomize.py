"""A fault planted in the serving engine alone, for tests/test_diagnosis.py: put this folder on PYTHONPATH
through a run's `env:` and set EAGLE_TEST_ENGINE_FAULT=fc_noise, and every Python process the run starts
that imports vLLM's EAGLE-3 drafter (`vllm/model_executor/models/llama_eagle3.py`) feeds the drafter's `fc`
noise of the states' scale instead of the target's states (`Eagle3LlamaForCausalLM.combine_hidden_states`).
The drafter folder, the target and the offline replay are untouched: only the engine computes the drafter
wrongly, as vLLM's FLASHINFER_MLA backend with an fp8 KV cache is reported to on SM120 in builds that enable it
there (docs/engines.md). Any other
value of the variable (an engine variant's `env`) plants nothing.
"""

import importlib.abc
import importlib.util
import os
import sys

VARIABLE = "EAGLE_TEST_ENGINE_FAULT"
DRAFTER_MODULE = "vllm.model_executor.models.llama_eagle3"


def _plant(module) -> None:
    drafter = module.Eagle3LlamaForCausalLM
    combine = drafter.combine_hidden_states

    def combine_hidden_states(self, hidden_states):
        import torch

        generator = torch.Generator().manual_seed(int(hidden_states.shape[0]))
        noise = torch.randn(tuple(hidden_states.shape), generator=generator)
        return combine(self, (noise * hidden_states.float().std().cpu()).to(hidden_states))

    drafter.combine_hidden_states = combine_hidden_states


class _PlantOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != DRAFTER_MODULE:
            return None
        sys.meta_path.remove(self)  # find the real module, then wrap its loading
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        exec_module = spec.loader.exec_module

        def exec_and_plant(module):
            exec_module(module)
            _plant(module)

        spec.loader.exec_module = exec_and_plant
        return spec


if os.environ.get(VARIABLE) == "fc_noise":
    sys.meta_path.insert(0, _PlantOnImport())
