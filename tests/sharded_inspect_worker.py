"""Run under torchrun (2 ranks, gloo): the inspector and init_from=hf on an FSDP2-sharded model.

Each rank shards the same model with fully_shard, loads Hugging Face weights into its shards,
then samples and computes attention maps; test_inspect.py checks every rank got what one plain
process gets. Writes rank{r}.pt into argv[1]; argv[2] is the Hugging Face directory.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from dtrain.config import InspectConfig, PrecisionConfig  # noqa: E402
from dtrain.data.tokenizer import ByteTokenizer  # noqa: E402
from dtrain.dist import DistEnv  # noqa: E402
from dtrain.hf import load_hf_into  # noqa: E402
from dtrain.model import ModelConfig, build_model  # noqa: E402
from dtrain.precision import build_precision  # noqa: E402
from dtrain.reporting.inspector import Inspector, is_sharded  # noqa: E402

# Shared with the test: the same model and the same inspect settings on both sides.
MODEL = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, vocab_size=320)
INSPECT = InspectConfig(prompts=["def ", "x = "], max_new_tokens=6, attention_max_tokens=12)


class _Strategy:  # the two things the inspector asks of a strategy
    def __init__(self, module, precision):
        self.module, self.precision = module, precision

    def unwrapped(self):
        return self.module


def run(model, env) -> dict:
    strategy = _Strategy(model, build_precision(PrecisionConfig(), env.device))
    inspector = Inspector(INSPECT, strategy, ByteTokenizer(), writer=None, env=env)
    texts = inspector.sample_texts(model)
    _, weights = inspector.attention_weights(model)
    return {"texts": texts, "weights": [w.detach() for w in weights]}


def main(out_dir: Path, hf_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    env = DistEnv(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"))
    model = build_model(MODEL, "cpu", seed=99)  # other weights than the HF directory's
    for layer in model.layers.values():
        fully_shard(layer)
    fully_shard(model)
    assert is_sharded(model)
    load_hf_into(model, hf_dir)
    torch.save(run(model, env), out_dir / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
