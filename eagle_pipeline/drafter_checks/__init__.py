"""Checks that a drafter folder is what vLLM loads: shapes, config, vLLM's own loader, acceptance parity.

`verify_drafter` returns `{"ok": bool, "checks": {"shapes", "config", "vllm_load", "vllm_logits", "parity"}}`, each
check with `ok` (bool) and `detail` (docs/contracts.md, stage 05's verify.json); `print_table` shows it.

One module per check, named as it is (config_checks: `config`; dflash: a DFlash folder's `shapes` and `vllm_logits`),
all_checks the five in order, table the results for the terminal; what a folder should hold is
eagle_pipeline.drafter's. vLLM work runs in fresh subprocesses (subprocess_json, cli; docs/engines.md, "Drafter check
jobs").
"""

from eagle_pipeline.drafter_checks.all_checks import CHECK_NAMES, verify_drafter
from eagle_pipeline.drafter_checks.table import format_table, print_table

__all__ = ["CHECK_NAMES", "format_table", "print_table", "verify_drafter"]
