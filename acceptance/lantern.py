"""LANTERN relaxed acceptance for VQ image tokens (Jang et al., arXiv 2410.03355, and
LANTERN++, arXiv 2502.06352; public code: github.com/jadohu/LANTERN, `evaluate_posterior`).

Image tokens of a VQ model have many near-interchangeable codes, so the target p is flat and
exact verification rejects good drafts. LANTERN lends a draft x the target mass of its
latent neighbours (docs/algorithms.md section 2):

    NN[x]  = codebook entries sorted by L2 distance to entry x (x excluded)
    c_j    = sum_{i<=j} p(NN[x, i]),  j = 1..k                  (cumulative neighbour mass)
    J      = largest j with c_j <= bound, 0 if none
    bound  = delta                   (LANTERN, TVD budget per candidate)
           = (lam - 1) * p(x)        (LANTERN++, so that p~(x) <= lam * p(x))
    p~(x)  = p(x) + c_J
    accept x with probability min(1, p~(x) / q(x))              (q(x) = 1 for one-hot drafts)

Moving the mass c_J of x's J nearest neighbours onto x changes p by a total variation of
exactly c_J <= bound; `distortion` reports it per candidate and `neighbour_mass` exposes both
c_J (the mass moved between latent neighbours) and J.

Rejection (a sibling in a tree, or the first rejection of a chain):
- one-hot drafts: zero p on x and on its J nearest neighbours (the mass x borrowed), then
  renormalise, p itself if nothing is left (alpha rounded just below 1). This is exact speculative sampling against the
  relaxed distribution p~ (x holds p(x) + c_J, its J neighbours 0), so the step's output
  follows p~, at TVD c_J from p. `zero_neighbours="k"` zeroes all k searched neighbours
  instead whenever x borrowed mass (c_J > 0), as the public code does (it zeroes
  `nearest_latents[x, :k+1]`).
- sampled drafts: zero x's J (or k) nearest neighbours in q, renormalise q, then
  `p <- norm(max(p - q, 0))` (public code, sampled-tree branch).

Neighbour lists are computed once per codebook (L2-normalised first by default, as LlamaGen
normalises its codebook at use time; the public `generate_codebook.py` uses raw embeddings,
pass `normalize=False` for that), row-chunked so that no V x V float matrix is ever held,
and stored as int16 (V <= 32768) or int32 indices in a module-level cache keyed by the
codebook tensor's storage, shape, dtype, device and version (the entry keeps the codebook alive,
so that its address cannot be reused by another one).

Limits: lossy; `delta=0`, `lam=1` or `k=0` give exact speculative sampling. With `delta` a draft
the target gives probability 0 (one top-k / top-p removed) can be accepted on its neighbours'
mass, as in the published rule (counted in the distortion); with `lam` it cannot. `k=1000` costs
a gather of B*K*1000 target probabilities per verification. `distortion` (c_J) is the step's
whole shift from p only for one-hot drafts with the default `zero_neighbours="bound"`: with
`zero_neighbours="k"` the residual also drops the neighbours that lent nothing, and with sampled
drafts the over-acceptance of other tokens adds to it, so there it is a lower bound (measured
gaps up to 0.97 and 0.57 in total variation on adversarial rows; GSD's note is the same).
"""

from __future__ import annotations

import math

import torch

from .base import ChainRule
from .exact import capped_ratio
from mmspec.sampling import cached_arange, normalize, plain_number

# (data_ptr, shape, stride, dtype, device, version, normalize) -> int index tensor [V, k_max]
_NEIGHBOUR_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # key -> (codebook, lists)
_CHUNK_ELEMENTS = 1 << 22  # distances held at once: at most ~4M floats (16 MB)


def nearest_neighbours(codebook: torch.Tensor, k: int, *, normalize_codebook: bool = True) -> torch.Tensor:
    """codebook [V, D] -> NN [V, k] int16/int32: for each entry, the indices of the k closest
    other entries by L2 distance, nearest first. Computed in row chunks and cached (not for an
    inference tensor, whose in-place edits no version counter shows: computed at each call)."""
    from mmspec.versions import version_of  # (at call time: rules import only a few core modules)

    V = codebook.shape[0]
    version = version_of(codebook)
    key = (
        codebook.data_ptr(),
        tuple(codebook.shape),
        tuple(codebook.stride()),
        codebook.dtype,
        str(codebook.device),
        version,
        bool(normalize_codebook),
    )
    cached = _NEIGHBOUR_CACHE.get(key) if version is not None else None
    if cached is not None and cached[1].shape[1] >= k:
        return cached[1][:, :k]
    emb = codebook.detach().to(torch.float32)
    if normalize_codebook:
        emb = torch.nn.functional.normalize(emb, dim=-1)
    index_dtype = torch.int16 if V <= 32768 else torch.int32
    out = torch.empty(V, k, dtype=index_dtype, device=emb.device)
    if k > 0:
        # Centred first (distances do not change): codes sharing a large common offset lost
        # their neighbour order to cancellation in |a|^2 + |b|^2 - 2 a.b (float32).
        emb = emb - emb.mean(0)
        sq = (emb * emb).sum(-1)
        rows = max(1, _CHUNK_ELEMENTS // max(V, 1))
        for start in range(0, V, rows):
            stop = min(V, start + rows)
            # ||a - b||^2 = |a|^2 + |b|^2 - 2 a.b, one chunk of rows at a time.
            d2 = sq[start:stop, None] + sq[None, :] - 2.0 * emb[start:stop] @ emb.T
            d2[torch.arange(stop - start, device=emb.device), torch.arange(start, stop, device=emb.device)] = float("inf")
            out[start:stop] = torch.topk(d2, k, dim=-1, largest=False, sorted=True).indices.to(index_dtype)
    if version is None:
        return out
    if len(_NEIGHBOUR_CACHE) >= 8:  # a handful of codebooks per process at most
        _NEIGHBOUR_CACHE.pop(next(iter(_NEIGHBOUR_CACHE)))
    # The entry holds the codebook too: while it is cached its memory cannot be freed and reused by
    # another codebook of the same shape, whose key (address, shape, version 0) would then match and
    # get these lists (a fresh `detach()` view of the same codebook still hits: same storage).
    _NEIGHBOUR_CACHE[key] = (codebook.detach(), out)
    return out


class LanternAcceptance(ChainRule):
    """LANTERN (`delta`) or LANTERN++ (`lam`) relaxed speculative sampling over latent
    neighbours of a VQ codebook [V, D]. Give exactly one of `delta` and `lam`; with neither,
    LANTERN's default `delta=0.1` is used."""

    lossless = False
    name = "lantern"

    def __init__(
        self,
        codebook: torch.Tensor,
        k: int = 1000,
        delta: float | None = None,
        lam: float | None = None,
        *,
        normalize: bool = True,
        zero_neighbours: str = "bound",
    ) -> None:
        if not isinstance(codebook, torch.Tensor) or codebook.dim() != 2:
            raise ValueError(f"codebook must be a [V, D] tensor, got {getattr(codebook, 'shape', type(codebook))}")
        if not codebook.is_floating_point():
            raise ValueError(f"codebook must be a floating point embedding table, got dtype {codebook.dtype}")
        if not bool(torch.isfinite(codebook).all()):  # NaN distances made the neighbour lists arbitrary
            raise ValueError("codebook holds NaN or inf entries; pass the VQ codebook's finite embeddings")
        if not isinstance(normalize, bool):  # "no" is truthy
            raise TypeError(f"normalize must be True or False, got {normalize!r}")
        V = codebook.shape[0]
        k, delta, lam = plain_number(k), plain_number(delta), plain_number(lam)
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"k must be an int >= 0 (number of neighbours searched), got {k!r}")
        if k > V - 1:
            raise ValueError(f"k={k} exceeds V-1={V - 1} neighbours in the codebook; lower k")
        if delta is not None and lam is not None:
            raise ValueError("give only one of delta (LANTERN) and lam (LANTERN++), not both")
        if delta is None and lam is None:
            delta = 0.1
        if delta is not None and (isinstance(delta, bool) or not isinstance(delta, (int, float))
                                  or not (0.0 <= float(delta) <= 1.0)):
            raise ValueError(f"delta must be a total-variation budget in [0, 1], got {delta!r}")
        if lam is not None and (isinstance(lam, bool) or not isinstance(lam, (int, float))
                                or not (1.0 <= float(lam) < math.inf)):  # NaN passed `lam < 1`
            raise ValueError(f"lam must be a finite number >= 1 (p~(x) <= lam * p(x)), got {lam!r}")
        if zero_neighbours not in ("bound", "k"):
            raise ValueError(f"zero_neighbours must be 'bound' (the J borrowed neighbours) or 'k', got {zero_neighbours!r}")
        self.k = k
        self.delta = None if delta is None else float(delta)
        self.lam = None if lam is None else float(lam)
        self.zero_neighbours = zero_neighbours
        self.vocab_size = V
        self.neighbours = nearest_neighbours(codebook, k, normalize_codebook=normalize)  # [V, k]

    def _neighbour_ids(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        nn = self.neighbours
        if nn.device != device:
            nn = nn.to(device)
            self.neighbours = nn
        return nn[x].long()  # [M, k]

    def _relax(self, x: torch.Tensor, p: torch.Tensor):
        """-> (p(x) [M], c_J [M], J [M] long, neighbour ids [M, k], neighbour probs [M, k])."""
        V = p.shape[-1]
        if V != self.vocab_size:
            raise ValueError(f"p has V={V} entries but the codebook has {self.vocab_size}")
        px = p.gather(-1, x.unsqueeze(-1)).squeeze(-1)
        ids = self._neighbour_ids(x, p.device)
        pn = p.gather(-1, ids)  # [M, k]
        if self.k == 0:
            return px, torch.zeros_like(px), torch.zeros_like(x), ids, pn
        c = pn.cumsum(-1)  # c_j, non-decreasing in j
        within = c <= (self.delta if self.delta is not None else ((self.lam - 1.0) * px).unsqueeze(-1))
        J = within.sum(-1)  # {j : c_j <= bound} is a prefix since c is sorted
        # c_J = c_{J-1}, the largest c_j within the bound (c >= 0: 0 when there is none).
        c_J = torch.where(within, c, 0.0).amax(-1)
        return px, c_J, J, ids, pn

    def neighbour_mass(self, x: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M], p [M, V] -> (c_J [M]: target mass moved from x's latent neighbours onto x,
        J [M]: how many neighbours lent it)."""
        _, c_J, J, _, _ = self._relax(x, p)
        return c_J, J

    def relaxed_probability(self, x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """x [M], p [M, V] -> p~(x) = p(x) + c_J [M]."""
        px, c_J, _, _, _ = self._relax(x, p)
        return px + c_J

    def accept_probability(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
        return self.accept_and_distortion(x, p, q)[0]

    def accept_and_distortion(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(alpha, c_J) from one neighbour search (the loop needs both every step)."""
        px, c_J, _, _, _ = self._relax(x, p)
        return self._alpha(px + c_J, x, p, q), c_J

    @staticmethod
    def _alpha(p_relaxed: torch.Tensor, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
        pt = p_relaxed.clamp(max=1.0)
        if q is None:
            return pt
        return capped_ratio(pt, q.gather(-1, x.unsqueeze(-1)).squeeze(-1))

    def _zero_mask(self, c_J: torch.Tensor, J: torch.Tensor, ids: torch.Tensor, pn: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """keep [M, V]: 0 on the neighbours that lent mass: those of the first J with p > 0
        (a neighbour that lent nothing is not consumed, which keeps delta=0 exact with
        sampled drafts), or all k searched ones when x borrowed anything ("k" mode)."""
        j = cached_arange(0, ids.shape[-1], 1, ids.device)
        if self.zero_neighbours == "bound":
            lent = (j.unsqueeze(0) < J.unsqueeze(-1)) & (pn > 0)
        else:
            lent = (c_J > 0).unsqueeze(-1).expand(-1, ids.shape[-1])
        keep = torch.ones_like(like)
        return keep.scatter(-1, ids, (~lent).to(like.dtype))  # neighbour ids are distinct per row

    def residual(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
        _, c_J, J, ids, pn = self._relax(x, p)
        keep = self._zero_mask(c_J, J, ids, pn, p)
        if q is None:
            weights = (p * keep).scatter(-1, x.unsqueeze(-1), 0.0)
            # Empty only when x and its lent neighbours held all of p (alpha rounded just below 1):
            # fall back to p, never to uniform (which drew tokens top-k / top-p had cut).
            return normalize(weights, p)
        q_relaxed = normalize(q * keep, q)
        return normalize((p - q_relaxed).clamp_min(0.0), p)

    def distortion(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
        _, c_J, _, _, _ = self._relax(x, p)
        return c_J


def lantern_k(codebook_size: int) -> int:
    """LANTERN's default neighbourhood for a codebook of V codes: its k = 1000 latent neighbours
    of LlamaGen's 16384 codes (6.1%), kept as a fraction (k = 1000 for V = 16384, 31 for the
    testbed's 512). Taken whole instead (min(1000, V - 1) = 511 of 512), delta = 0.1 lets a
    draft borrow mass from codes that look nothing like it and the testbed's images lost their
    class (judge 22% vs 70% plain: benchmarks/results/imagegen_cpu.json as of commit 7489e91, since
    overwritten by later runs)."""
    return max(1, min(codebook_size - 1, round(codebook_size * 1000 / 16384)))
