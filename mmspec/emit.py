"""The speculative loop's output bookkeeping (`_Emitter`, used by `mmspec.engine`): which
tokens a step emits, EOS and `max_new_tokens`, which rows stay active, the commit info for
target and drafter. On the CPU, where a host read costs no more than an operation, the work
after the step's one sync runs in plain Python (`_emit_host`: a third of the tensor operations;
3-5% less time per VLM request at batch 1 and 4 on a 2-core EPYC VM) and the output grows as
Python lists; elsewhere the tensor version keeps the work on the device until that sync.
"""

from __future__ import annotations

import torch

from mmspec.types import CommitInfo, Verdict


def _non_finite(which: str) -> ValueError:
    """The error of a step whose `which` ("target" / "drafter") distribution was NaN or inf."""
    return ValueError(f"non-finite probabilities (NaN or inf) in this step's {which} distribution; check the "
                      "model's dtype and inputs (the output would be silently wrong)")


class _Emitter:
    """Output buffer and per-row progress: which tokens a step emits, EOS and length limits,
    which rows are still active."""

    def __init__(self, B: int, max_new_tokens: int, eos: list[int], pad_token_id: int, device):
        self.max_new = max_new_tokens
        self.eos = eos
        self.eos_t = torch.tensor(eos, dtype=torch.long, device=device)
        self.buf = torch.full((B, max_new_tokens + 1), pad_token_id, dtype=torch.long, device=device)
        self.trash = max_new_tokens  # column that absorbs writes past a row's end
        self.written = torch.ones(B, dtype=torch.long, device=device)  # the first token, from prefill
        self.rows_dev = torch.arange(B, device=device)
        self.rows_host = list(range(B))  # input row of each active row
        self.new_tokens = [1] * B
        self.written_host = [1] * B  # `written` on the host (kept by every path)
        self.eos_set = frozenset(eos)
        self.pad = pad_token_id
        self.out: list[list[int]] = [[] for _ in range(B)]  # the host path's output, per input row
        # On the CPU a step's bookkeeping runs on the host after its one sync (`_emit_host`):
        # the same results as the tensor version in about a third of the operations. Elsewhere
        # the tensor version keeps the work on the device until that sync.
        self.on_host = torch.device(device).type == "cpu"
        self._zero_info: dict[int, tuple] = {}

    def first(self, roots: torch.Tensor) -> list[int]:
        """Write the prefill token; returns the active rows that go on."""
        self.buf[:, 0] = roots
        self.out = [[t] for t in roots.tolist()]  # SYNC: once after prefill
        ended = [t in self.eos_set for t in (r[0] for r in self.out)]
        return [i for i, e in enumerate(ended) if not e and self.max_new > 1]

    def emit(
        self, tokens: torch.Tensor, verdict: Verdict, finite: torch.Tensor, chain: bool = False
    ) -> tuple[CommitInfo, list[int], list[int], list[int]]:
        """Record one step: returns (commit info, accepted counts, emitted counts, rows that go on).
        `finite` [2] bool: the target's and the drafter's distributions were finite (checked
        within the step's one sync). `chain`: the draft was a chain (its path is 0..N)."""
        if self.on_host:
            return self._emit_host(tokens, verdict, finite, chain)
        Ba, N1 = tokens.shape
        N = N1 - 1
        device = tokens.device
        n, path = verdict.num_accepted, verdict.path
        local = torch.arange(Ba, device=device)
        # Emitted this step: the accepted path's tokens, then the recovered / bonus token.
        emitted = torch.cat([tokens.gather(1, path[:, 1:]), tokens.new_zeros(Ba, 1)], 1)  # [Ba, N+1]
        emitted[local, n] = verdict.next_tokens
        j = torch.arange(N + 1, device=device).unsqueeze(0)
        count = n + 1
        if self.eos:
            hit = torch.isin(emitted, self.eos_t) & (j < count.unsqueeze(1))
            first = torch.where(hit.any(1), hit.long().argmax(1), torch.full_like(count, N + 1))
            count = torch.minimum(count, first + 1)
        count = torch.minimum(count, self.max_new - self.written)
        pos = torch.where(j < count.unsqueeze(1), self.written.unsqueeze(1) + j, torch.full_like(j, self.trash))
        self.buf[self.rows_dev.unsqueeze(1).expand_as(pos), pos] = emitted
        self.written = self.written + count
        parts = [n, count, self.written, finite.long().min().expand(Ba)] + ([hit.any(1).long()] if self.eos else [])
        host = torch.stack(parts).tolist()  # SYNC: the one per step (accepted counts, ends, finiteness)
        if Ba and not host[3][0]:
            raise _non_finite("target" if not bool(finite[0]) else "drafter")
        host = host[:3] + host[4:]
        n_host, count_host, written_host = host[0], host[1], host[2]
        self.written_host = written_host
        ended = host[3] if self.eos else [0] * Ba
        for r, c in zip(self.rows_host, count_host):
            self.new_tokens[r] += c
        accepted = torch.where(j[:, :N] < n.unsqueeze(1), emitted[:, :N], torch.full_like(emitted[:, :N], -1))
        info = CommitInfo(
            path=path, num_accepted=n, accepted_tokens=accepted, next_tokens=verdict.next_tokens,
            num_accepted_list=n_host,
        )
        keep = [i for i in range(Ba) if not ended[i] and written_host[i] < self.max_new]
        return info, n_host, count_host, keep

    def _emit_host(self, tokens: torch.Tensor, verdict: Verdict, finite: torch.Tensor, chain: bool
                   ) -> tuple[CommitInfo, list[int], list[int], list[int]]:
        """`emit` with the bookkeeping on the host (CPU tensors): one `.tolist()` of the accepted
        counts, next tokens and the drafted tokens along each row's path, then plain Python per
        row; the output grows as Python lists (`sequences` makes the tensor once)."""
        Ba, N1 = tokens.shape
        N = N1 - 1
        n, path = verdict.num_accepted, verdict.path
        drafted = tokens[:, 1:] if chain else tokens.gather(1, path[:, 1:])  # [Ba, N] the tokens along each row's path
        next_tokens = verdict.next_tokens
        host = torch.cat([n.unsqueeze(1), next_tokens.unsqueeze(1) if next_tokens.dtype == drafted.dtype
                          else next_tokens.unsqueeze(1).to(drafted.dtype), drafted], 1).tolist()  # SYNC: the one per step
        if Ba and not all(finite):  # a pair of host bools (the loop on the CPU) or a [2] bool tensor
            raise _non_finite("target" if not bool(finite[0]) else "drafter")
        eos, max_new = self.eos_set, self.max_new
        n_host, count_host, keep, accepted = [], [], [], []
        written = self.written_host
        for i, row in enumerate(host):
            a = row[0]
            path_tokens = row[2:2 + a]
            out = path_tokens + [row[1]]  # accepted drafts, then the recovered / bonus token
            ended = False
            if eos:
                for j, t in enumerate(out):
                    if t in eos:
                        out, ended = out[: j + 1], True
                        break
            w = written[i]
            count = min(len(out), max_new - w)
            r = self.rows_host[i]
            self.out[r] += out[:count]
            written[i] = w + count
            self.new_tokens[r] += count
            n_host.append(a)
            count_host.append(count)
            accepted.append(path_tokens + [-1] * (N - a))
            if not ended and w + count < max_new:
                keep.append(i)
        info = CommitInfo(
            path=path, num_accepted=n, accepted_tokens=torch.tensor(accepted, dtype=torch.long).view(Ba, N),
            next_tokens=verdict.next_tokens, num_accepted_list=n_host,
        )
        return info, n_host, count_host, keep

    def emit_root(self, next_tokens: torch.Tensor, finite: torch.Tensor) -> tuple[CommitInfo, list[int], list[int], list[int]]:
        """`emit` for a step that verified the roots alone (K = 0): one token per row."""
        Ba = next_tokens.shape[0]
        if self.on_host:
            return self._emit_root_host(next_tokens, finite)
        # Active rows have written < max_new (finished rows were dropped), so each takes its token.
        self.buf[self.rows_dev, self.written] = next_tokens
        self.written = self.written + 1
        parts = [self.written, finite.long().expand(Ba)]
        if self.eos:
            parts.append(torch.isin(next_tokens, self.eos_t).long())
        host = torch.stack(parts).tolist()  # SYNC: the one per step
        if Ba and not host[1][0]:
            raise _non_finite("target")
        written_host = self.written_host = host[0]
        ended = host[2] if self.eos else [0] * Ba
        for r in self.rows_host:
            self.new_tokens[r] += 1
        zeros = torch.zeros(Ba, dtype=torch.long, device=next_tokens.device)
        info = CommitInfo(
            path=zeros.unsqueeze(1), num_accepted=zeros, accepted_tokens=zeros.new_empty(Ba, 0),
            next_tokens=next_tokens, num_accepted_list=[0] * Ba,
        )
        keep = [i for i in range(Ba) if not ended[i] and written_host[i] < self.max_new]
        return info, [0] * Ba, [1] * Ba, keep

    def _emit_root_host(self, next_tokens: torch.Tensor, finite: torch.Tensor):
        """`emit_root` on the host (CPU tensors)."""
        Ba = next_tokens.shape[0]
        tokens = next_tokens.tolist()  # SYNC: the one per step
        if Ba and not bool(finite):
            raise _non_finite("target")
        eos, max_new = self.eos_set, self.max_new
        written = self.written_host = [w + 1 for w in self.written_host]
        out = self.out
        for r, t in zip(self.rows_host, tokens):
            self.new_tokens[r] += 1
            out[r].append(t)
        keep = [i for i in range(Ba) if tokens[i] not in eos and written[i] < max_new]
        zero = self._zero_info.get(Ba)
        if zero is None:  # the K = 0 commit info of Ba rows, built once (never written to)
            zeros = torch.zeros(Ba, dtype=torch.long, device=next_tokens.device)
            zero = self._zero_info[Ba] = (zeros.unsqueeze(1), zeros, zeros.new_empty(Ba, 0))
        info = CommitInfo(path=zero[0], num_accepted=zero[1], accepted_tokens=zero[2], next_tokens=next_tokens,
                          num_accepted_list=[0] * Ba)
        return info, [0] * Ba, [1] * Ba, keep

    def select(self, keep: list[int]) -> torch.Tensor:
        idx = torch.tensor(keep, dtype=torch.long, device=self.buf.device)
        if not self.on_host:  # (the host path keeps these on the host)
            self.written, self.rows_dev = self.written[idx], self.rows_dev[idx]
        self.rows_host = [self.rows_host[i] for i in keep]
        self.written_host = [self.written_host[i] for i in keep]
        return idx

    def sequences(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.on_host:
            width = max(self.new_tokens)
            new = torch.tensor([row + [self.pad] * (width - len(row)) for row in self.out], dtype=torch.long)
            return torch.cat([input_ids, new.to(input_ids.device)], 1)
        return torch.cat([input_ids, self.buf[:, : max(self.new_tokens)]], 1)
