"""Ending a chain draft at the end of the answer.

A chain drafter that has drafted an end-of-sequence token in every row has nothing useful left
to draft this step: a drafted token after a row's EOS is kept only if the EOS is accepted, and
then the row ends there and the token is dropped. Drafting on costs drafter forwards and widens
the verify forward for nothing; on short answers (a VQA answer of 2-3 tokens against chains of
K = 5) that waste is most of the step. So the chain drafters (`ModelDrafter`,
`EagleHeadDrafter`, `ViSpecDrafter`) stop once every row has drafted a stop token; the loop
tells them the stop tokens (its `eos_token_id`) through `set_stop_tokens` before each request.

Lossless: the verified draft is a prefix of the one the drafter would have drafted, and the
acceptance of the tokens cut off could not change any emitted token (see above), so greedy
outputs are identical and sampled ones distributed as before.

The check reads one boolean on the host per drafted token. On the CPU that is a few
microseconds against a drafter forward's hundreds; on other devices it would add a host sync
per drafted token, so the chain runs to its full length there (no stop).
"""

from __future__ import annotations

import torch


class ChainStop:
    """Stop tokens of the current request and the per-row "has drafted one" flags of a chain."""

    def __init__(self):
        self.ids: torch.Tensor | None = None

    def set(self, token_ids) -> None:
        """The loop's stop tokens (a list of ints; empty or None: never stop early)."""
        ids = sorted({int(t) for t in token_ids}) if token_ids else []
        self.ids = torch.tensor(ids, dtype=torch.long) if ids else None

    def begin(self, batch: int, device: torch.device) -> torch.Tensor | None:
        """Flags for a new chain ([B] bool, all False), or None when no early stop applies."""
        if self.ids is None or torch.device(device).type != "cpu":
            return None
        return torch.zeros(batch, dtype=torch.bool, device=device)

    def every_row_ended(self, flags: torch.Tensor | None, drafted: torch.Tensor) -> bool:
        """Mark the rows whose draft `drafted` [B] is a stop token; True once every row has one."""
        if flags is None:
            return False
        flags |= torch.isin(drafted, self.ids)
        return bool(flags.all())  # SYNC: CPU only (see the module docstring)
