"""Checks that a drafter folder is what vLLM loads: shapes, config, vLLM's own loader, acceptance parity.

`verify_drafter` returns `{"ok": bool, "checks": {"shapes", "config", "vllm_load", "vllm_logits", "parity"}}`, each
check with `ok` (bool) and `detail` (docs/contracts.md, stage 05's verify.json); `print_table` shows it.

One module per job (what a folder should hold is eagle_pipeline.drafter's):
- shapes: the `shapes` check, against the config, the d2t/t2d map and a reference drafter.
- config_checks: the `config` check, against the target, transformers' parse and vLLM's view.
- vllm_load: vLLM's config view and its real `load_weights` (the `vllm_load` check).
- vllm_logits: vLLM's own MLA drafter class run on the CPU against the checkpoint (the `vllm_logits` check).
- parity: the `parity` check, accepted tokens per draft position with two drafter folders.
- subprocess_json, cli: vLLM work runs in fresh subprocesses (`python -m eagle_pipeline.drafter_checks.cli`),
  because vLLM starts engine processes and keeps process-global state that must not leak into the caller.
- all_checks: the five in order; table: the results for the terminal.
"""

from eagle_pipeline.drafter_checks.all_checks import CHECK_NAMES, verify_drafter
from eagle_pipeline.drafter_checks.table import format_table, print_table

__all__ = ["CHECK_NAMES", "format_table", "print_table", "verify_drafter"]
