"""Every sample stage 04 trains or validates on gets the flat-row test of eagle_pipeline/state_meaning.py as it
is read. Targets speculators 0.9.0.

Stage 02 checks what its states mean on a spread of samples, and stage 04 reads the values of every file before
training only while the data is small (eagle_pipeline/datacheck.py). A file whose slot was zeroed after that (a
copy gone wrong, a tool that rewrote it) would train for epochs without a word. The test is a comparison per
token row: nothing beside a training step. speculators' offline dataset reads each sample file once per epoch in
`ArrowDataset._get_raw_data`; `apply()` has `create_train_val_loaders` build `CheckedArrowDataset`, a subclass
that lives here, so that the spawned DataLoader workers, which unpickle the dataset, get it by name (as
patches/speculators_capture_stop.py does for its guard). The first flat row raises `FlatSampleStates`, a
BadInput naming the file and the fix; torch re-raises a worker's error in its rank with the worker's traceback
around the message, which the exception strips again.

Only samples read from stage 02's files are checked (`--on-missing raise`, the offline mode): an online run's
states are checked by speculators as they arrive and by the capture servers' probe.
"""

from __future__ import annotations

from pathlib import Path

from speculators.train.data import ArrowDataset

from eagle_pipeline.errors import BadInput
from patches.speculators_cpu import check_version, require_unchanged_sources

UPSTREAM_SOURCE_SHA256: dict[str, str] = {
    # Subclassed: returns the sample as {"hidden_states": [seq, n_aux * H], "verifier_last_hidden_states": [seq, H]}.
    "speculators.train.data:ArrowDataset._get_raw_data":
        "e2e0e17b1a7a8c0b5745efbc5f00b2ac71181c8467d4d7a2e02a411802794045",
    # Builds both datasets from the module-level name `ArrowDataset`, which apply() rebinds.
    "speculators.train.dataloader:create_train_val_loaders":
        "87846102b7cbe09d9162eb3cda1d3632625f4f60a7f964976537e038da553371",
    # Spawned DataLoader workers (multiprocessing_context="spawn"): the dataset is pickled, its class by name.
    "speculators.train.dataloader:_setup_dataloader":
        "f36f57dcd0db19aff63be92146f057d07030daded42b2a771a1af4a4e591f488",
}


class FlatSampleStates(BadInput):
    """A sample with a row that is all zero or constant in some slot."""

    def __init__(self, message: str):
        # torch's re-raise in the rank: "Caught FlatSampleStates in DataLoader worker ... Traceback ...
        # patches.speculators_sample_check.FlatSampleStates: <message>"
        marker = f"{type(self).__name__}: "
        if "Traceback" in message and marker in message:
            message = message.rsplit(marker, 1)[1].strip()
        super().__init__(message)


class CheckedArrowDataset(ArrowDataset):
    """speculators' dataset, with the flat-row test on every sample it reads from a file."""

    def _get_raw_data(self, index: int):
        sample = super()._get_raw_data(index)
        if self.on_missing != "raise" or not isinstance(sample, dict):
            return sample
        from eagle_pipeline.samples import RECAPTURE_SAMPLE, flat_row_problem

        last = sample["verifier_last_hidden_states"]
        aux = sample["hidden_states"]
        states = aux.reshape(aux.shape[0], -1, last.shape[-1])
        problem = flat_row_problem(_with_final(states, last))
        if problem:
            file_idx = self._map_to_file_idx(index)
            folder = getattr(self.transfer, "hidden_states_path", None)
            where = Path(folder) / f"hs_{file_idx}.safetensors" if folder else f"hidden-state sample {file_idx}"
            raise FlatSampleStates(f"{where}: {problem}: a real layer's states never are, so stage 04 stopped at "
                                   f"this sample rather than train on it; {RECAPTURE_SAMPLE}")
        return sample


def _with_final(aux, last):
    import torch

    return torch.cat([aux, last.unsqueeze(1)], dim=1)


def apply() -> None:
    """Idempotent; refuses another speculators or changed sources."""
    check_version()
    require_unchanged_sources(UPSTREAM_SOURCE_SHA256, "patches/speculators_sample_check.py")
    from speculators.train import dataloader

    dataloader.ArrowDataset = CheckedArrowDataset
