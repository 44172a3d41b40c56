"""Batches for every rank, cut from fixed-length blocks so that resume and sharding are exact.

Sequence k of a run (k counts sequences over all ranks since step 0) is a pure function of k and
the seed: epoch = k // n_blocks picks a permutation seeded by (seed, epoch), and k % n_blocks a
block in it. A step consumes the global batch [consumed, consumed + G); rank r's micro-step m
takes G/accum/world consecutive sequences of it. So:
  * every sequence is read by exactly one rank, none twice, none skipped;
  * the position is one integer (`consumed`), saved in checkpoints;
  * resuming with another world size (same or different global batch) continues exactly.
"""

from __future__ import annotations

import torch

from dtrain.errors import DataError


class TokenBlocks:
    """Blocks of seq_len + 1 tokens (inputs and shifted targets) packed from one token stream."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, what: str = "corpus"):
        self.tokens = tokens
        self.seq_len = seq_len
        self.n_blocks = (tokens.numel() - 1) // seq_len
        if self.n_blocks < 1:
            raise DataError(
                f"the {what} has {tokens.numel()} tokens, fewer than one block of "
                f"trainer.seq_len+1={seq_len + 1}; use more data or a shorter seq_len"
            )

    def get(self, block_ids: torch.Tensor) -> torch.Tensor:
        starts = block_ids * self.seq_len
        offsets = torch.arange(self.seq_len + 1)
        return self.tokens[starts[:, None] + offsets[None, :]].long()  # (B, T+1)


class SyntheticBlocks:
    """Uniform random tokens, generated on the device: for benchmarks that exclude data cost."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, device: torch.device):
        self.vocab_size, self.seq_len, self.seed, self.device = vocab_size, seq_len, seed, device
        self.n_blocks = 1 << 40  # effectively endless; the index still seeds each block
        self._gen = torch.Generator(device=device)

    def get(self, block_ids: torch.Tensor) -> torch.Tensor:
        # One draw per batch seeded by its first block id: deterministic, one kernel launch.
        self._gen.manual_seed(self.seed * 1_000_003 + int(block_ids[0]))
        n = block_ids.numel()
        return torch.randint(
            0, self.vocab_size, (n, self.seq_len + 1), generator=self._gen, device=self.device
        )


class BatchStream:
    """This rank's micro-batches, step after step, over a TokenBlocks/SyntheticBlocks source."""

    def __init__(
        self,
        blocks,
        *,
        micro_batch_size: int,
        grad_accum_steps: int,
        rank: int,
        world_size: int,
        seed: int,
        device: torch.device,
        shuffle: bool = True,
    ):
        self.blocks, self.micro, self.accum = blocks, micro_batch_size, grad_accum_steps
        self.rank, self.world, self.seed, self.device = rank, world_size, seed, device
        self.shuffle = shuffle and isinstance(blocks, TokenBlocks)
        self.consumed = 0  # sequences consumed by all ranks, before the next step
        self._perm_epoch, self._perm = -1, None

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.world

    def _block_ids(self, seq_ids: torch.Tensor) -> torch.Tensor:
        if not self.shuffle:
            return seq_ids % self.blocks.n_blocks
        n = self.blocks.n_blocks
        epochs, pos = seq_ids // n, seq_ids % n
        out = torch.empty_like(seq_ids)
        for e in epochs.unique().tolist():
            if e != self._perm_epoch:  # one permutation per epoch, seeded by (seed, epoch)
                g = torch.Generator().manual_seed(self.seed * 7919 + e)
                self._perm, self._perm_epoch = torch.randperm(n, generator=g), e
            sel = epochs == e
            out[sel] = self._perm[pos[sel]]
        return out

    def micro_batch_ids(self, micro_step: int, consumed: int | None = None) -> torch.Tensor:
        """Global sequence ids of this rank's micro-step of the step starting at `consumed`."""
        base = self.consumed if consumed is None else consumed
        start = base + micro_step * self.micro * self.world + self.rank * self.micro
        return torch.arange(start, start + self.micro)

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The accum micro-batches (x, y) of this rank for the next step; advances the stream."""
        out = []
        for m in range(self.accum):
            blk = self.blocks.get(self._block_ids(self.micro_batch_ids(m)))
            out.append(self._to_device(blk))
        self.consumed += self.global_batch
        return out

    def _to_device(self, blk: torch.Tensor):
        if blk.device != self.device:
            if self.device.type == "cuda":
                blk = blk.pin_memory().to(self.device, non_blocking=True)
            else:
                blk = blk.to(self.device)
        return blk[:, :-1], blk[:, 1:]

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "seq_len": self.blocks.seq_len}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seq_len") != self.blocks.seq_len:
            raise DataError(
                f"the checkpoint's data position is in blocks of seq_len={state.get('seq_len')}, "
                f"this run uses {self.blocks.seq_len}; resume with the same trainer.seq_len"
            )
        self.consumed = int(state["consumed"])


def eval_batches(
    blocks, *, micro_batch_size: int, steps: int, rank: int, world_size: int, device: torch.device
):
    """The same held-out batches at every eval, split across ranks."""
    stream = BatchStream(
        blocks,
        micro_batch_size=micro_batch_size,
        grad_accum_steps=1,
        rank=rank,
        world_size=world_size,
        seed=0,
        device=device,
        shuffle=False,
    )
    for _ in range(steps):
        (xy,) = stream.next_step()
        yield xy
