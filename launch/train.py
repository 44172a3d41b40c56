"""Launch a training run:  python launch/train.py [overrides]  or  torchrun ... launch/train.py

Hydra composes conf/train.yaml with the overrides; dtrain.config turns it into dataclasses and
dtrain.train.run trains. Bad input gets one line on stderr and exit code 2: the overrides are
checked (composed and validated) before Hydra creates or touches the run dir, and the run dir
is locked for this run (dtrain/reliability/rundir.py) before Hydra writes into it; a run refused
before its first step leaves the run dir as it found it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from dtrain.config import CONF_DIR, register_config_bases  # noqa: E402
from dtrain.errors import FaultError, UserError, fail  # noqa: E402
from dtrain.reliability.rundir import acquire as acquire_run_dir  # noqa: E402
from dtrain.reliability.rundir import undo_refused  # noqa: E402
from dtrain.run.preflight import check_overrides  # noqa: E402

register_config_bases()  # the schema defaults that conf/ files extend


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="train")
def main(dcfg: DictConfig) -> None:
    from dtrain.config import from_dictconfig
    from dtrain.train import run

    try:
        run(from_dictconfig(dcfg))
    except FaultError as e:
        fail(e, rank0_only=not e.every_rank)
    except UserError as e:
        undo_refused()  # Hydra's .hydra/ and the lock included: the run dir as it was
        fail(e, rank0_only=not getattr(e, "every_rank", False))


if __name__ == "__main__":
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    try:
        cfg = check_overrides(sys.argv[1:])
        if cfg is not None:  # held until this process exits: one run per run dir
            if not any(a.lstrip("+").startswith("hydra.run.dir=") for a in sys.argv[1:]):
                sys.argv.append(f"hydra.run.dir={cfg.run_dir}")  # Hydra's dir: this one
            acquire_run_dir(cfg.run_dir)
    except UserError as e:
        fail(e, rank0_only=not getattr(e, "every_rank", False))
    main()
