"""One batch-size probe of `max_batch_size`, in a process of its own.

`python -m tfrecompute.check._probe FOLDER BATCH_SIZE` loads `FOLDER/model.keras`
(compiled), `FOLDER/sample.pkl` and `FOLDER/options.json`, makes a verified
plan at the batch size and prints it as one JSON line (NOTE [ Probing batch
sizes in fresh processes ] in `tfrecompute.check.max_batch`).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import traceback


def main(folder: str, batch_size: str) -> None:
    from tfrecompute.startup import count_cpu_memory

    count_cpu_memory()  # a probe measures (NOTE [ Counting CPU memory ])
    import keras

    import tfrecompute.layers  # registers RecomputeBlock for loading
    from tfrecompute.check.max_batch import probe_batch

    del tfrecompute
    model = keras.models.load_model(os.path.join(folder, "model.keras"))
    with open(os.path.join(folder, "sample.pkl"), "rb") as f:
        sample = pickle.load(f)
    with open(os.path.join(folder, "options.json")) as f:
        options = json.load(f)
    try:
        found = probe_batch(model, sample, int(batch_size), options)
    except Exception as error:  # reported to the parent as one JSON line, traceback on stderr
        traceback.print_exc()
        sys.stdout.write(json.dumps({"error": type(error).__name__, "message": str(error)}) + "\n")
        sys.exit(3)
    sys.stdout.write(
        json.dumps(
            {
                "fits": found.fits,
                "peak_bytes": found.peak_bytes,
                "segments": [list(s) for s in found.segments],
                "selective": list(found.selective),
                "strategy": found.strategy,
            }
        )
        + "\n"
    )


if __name__ == "__main__":
    main(*sys.argv[1:3])
