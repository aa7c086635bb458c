"""One capture round trip through speculators' own code, as its online dataset makes it
(`ArrowDataset._generate_hidden_states_once`), for the states stage 04 needs outside training: each capture
server's probe and the kept validation rows (eagle_pipeline/online/endpoints.py, kept.py)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle_pipeline.online.settings import OnlineTraining

if TYPE_CHECKING:
    import torch


def transfer_for(online: OnlineTraining, samples_dir: Path) -> Any:
    """The hs_connectors transfer that speculators' backend of the same name builds for a trainer."""
    from hs_connectors import FileTransfer, FP8Transfer, MooncakeTransfer
    from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig

    if online.transfer != "mooncake":
        return {"file": FileTransfer, "fp8": FP8Transfer}[online.transfer](Path(samples_dir))
    store = MooncakeHiddenStatesStore(MooncakeStoreConfig.from_dict(online.mooncake))
    return MooncakeTransfer(store)


class CaptureClient:
    """Hidden states of token id sequences from one capture server."""

    def __init__(self, endpoint: str, model: str, transfer: Any):
        import openai

        self.endpoint, self.model, self.transfer = endpoint, model, transfer
        self._client = openai.OpenAI(base_url=endpoint, api_key="EMPTY", max_retries=0)
        self._setup = False

    def capture(self, input_ids: list[int]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """`hidden_states` [seq, n_aux + 1, H] and `token_ids` [seq] of one sequence, and the server's
        `kv_transfer_params` for it (which say which connector delivered them)."""
        from speculators.data_generation.offline import check_hidden_states
        from speculators.data_generation.vllm_client import generate_hidden_states

        if not self._setup:
            self.transfer.setup()
            self._setup = True
        ids = [int(i) for i in input_ids]
        handle, params = generate_hidden_states(self._client, self.model, {"input_ids": ids},
                                                timeout=120.0, max_retries=0)  # one try: stage 04 names the server
        try:
            sample = self.transfer.get_generated(params)
            if sample is None:
                raise RuntimeError(f"{self.endpoint}: the states of request {handle} were not where the server said "
                                   f"({params}); is its storage path shared with this host?")
            check_hidden_states(sample, ids)
            return {"hidden_states": sample["hidden_states"], "token_ids": sample["token_ids"].long()}, params
        finally:
            with contextlib.suppress(FileNotFoundError):  # a file the server never wrote
                self.transfer.delete(handle)
