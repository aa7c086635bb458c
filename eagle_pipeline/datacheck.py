"""Checks that stage 02's dataset and its hidden-state files are in step before training reads them.

Every file: present, a readable safetensors header, data size equal to what the header promises (a torn
copy is shorter), shape [seq, n_aux+1, H], token ids equal to the dataset row. Values (NaN/inf) are read
in full when the data is small and for a fixed sample of files when it is not: reading 0.8 TB to start a
training run would cost longer than the run's first epoch.
"""

from __future__ import annotations

import random
from pathlib import Path

from eagle_pipeline.errors import BadInput
from eagle_pipeline.samples import SAMPLES_DIR, check_sample_file, sample_files, sample_path

FULL_VALUE_CHECK_BYTES = 4 * 10**9
SAMPLED_FILES = 64


def check_training_data(data_dir: Path, num_states: int, hidden_size: int, seed: int = 0) -> int:
    """Check the stage 02 output under data_dir; returns the number of rows."""
    from datasets import load_from_disk

    data = load_from_disk(str(data_dir)).with_format(None)
    samples_dir = data_dir / SAMPLES_DIR
    files = sample_files(samples_dir)
    if len(files) != len(data):
        raise BadInput(f"{samples_dir}: {len(files)} hidden-state files for {len(data)} dataset rows: "
                       f"dataset and hidden-state files are out of step; rerun stage 02")
    total = sum(f.stat().st_size for f in files.values())
    full = total <= FULL_VALUE_CHECK_BYTES
    sampled = set(range(len(data))) if full else set(random.Random(seed).sample(range(len(data)),
                                                                                min(SAMPLED_FILES, len(data))))
    from tqdm import tqdm

    for row, ids in enumerate(tqdm(data["input_ids"], desc="check training data", unit="file", leave=False)):
        check_sample_file(sample_path(samples_dir, row), ids, num_states, hidden_size, values=row in sampled)
    return len(data)
