"""RoRoPE and FreqFold: concentrate the keys' positional information in a few rope pairs.

ALGORITHMS.md, TransMLA 1-2. Notation: g KV heads, d head_dim, H query heads, F the fold.
Pair i of key head j is the complex number z_j,i = k_j[i] + 1j*k_j[i + d/2] (rotate-half layout);
RoPE at position t multiplies it by exp(1j*w_i*t) and a score is sum Re(q conj(k)).

Pair space: the g*d/2 complex coordinates p = j*(d/2) + i, the order of the replicated shared rope
key (replicate.rope_pair_rows). A fold group a pools the F adjacent frequencies aF..aF+F-1 of all g
heads: g*F coordinates (j, k) -> p = j*(d/2) + aF + k. RoRoPE is F = 1.

Per group, an orthogonal U_a (PCA, uncentred, float64, descending) rotates the coordinates into
components m = a*g*F + c: z'_c = sum_p U_a[p, c] z_p, the same map on the keys and on the
slot-placed queries. "real" (published): U_a real, the PCA of C_a = E[Re z Re z^T + Im z Im z^T], the
same rotation on real and imaginary parts. "unitary" (ours): U_a complex unitary, the PCA of the
Hermitian E[conj(z) z^T]; it sees the phase between heads that the real C_a averages away, so the
leading components hold more key energy (a real U_a is the special case). Either way, for F = 1 the
map multiplies each frequency's coordinates by a matrix, and every such matrix commutes with the
scalar exp(1j*w_i*t): every score is unchanged (exact; sum_c q'_c conj(k'_c) = q^T conj(k) for unitary U). A subset of components is kept as rope pairs of
the shared key, each with one frequency; the others lose RoPE and become NoPE dims (the
approximation). For F > 1 a kept component mixes F frequencies but rotates with one (approximate).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..lowrank import principal_basis
from ..replicate import rope_pair_rows

SELECTIONS = ("uniform", "score", "grid")
ROTATIONS = ("real", "unitary")
FREQUENCY_RULES = ("published", "weighted")


# --------------------------------------------------------------------------------------------
# Second moments in pair space
# --------------------------------------------------------------------------------------------


def pair_second_moment(moment: torch.Tensor, num_heads: int, head_dim: int, hermitian: bool = False) -> torch.Tensor:
    """C[p, p'] = E[Re z_p Re z_p' + Im z_p Im z_p'] from E[k k^T] of `num_heads` rotate-half heads;
    hermitian: E[conj(z_p) z_p'] (complex; its real part is C), what the unitary rotation needs.

    moment [num_heads*d, num_heads*d] (head-major rows, as k_proj) -> [num_heads*d/2, num_heads*d/2].
    Both are RoPE-invariant: the rotation by exp(1j*w*t) is unitary on each pair.
    """
    rows = rope_pair_rows(num_heads, head_dim)
    half = rows.numel() // 2
    re, im = rows[:half], rows[half:]
    m = moment.double()
    real = m[re][:, re] + m[im][:, im]  # [n*d/2, n*d/2]
    if not hermitian:
        return real
    # conj(z) z^T = (a - ib)(a + ib)^T = a a^T + b b^T + i (a b^T - b a^T)
    return torch.complex(real, m[re][:, im] - m[im][:, re])


def query_pair_moment(query_moments: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Pair-space second moment E[conj(q_p) q_p'] of the slot-placed queries, summed over each group's heads.

    query_moments [g, d, d]: sum over the query heads of group j of E[q_h q_h^T] (un-rotated).
    A slot-placed query lives in its group's slot only, so the result is block-diagonal over
    heads: [g*d/2, g*d/2] complex (pair space; as pair_second_moment's hermitian form). Used only
    to score components (never for exactness).
    """
    half = head_dim // 2
    out = query_moments.new_zeros(num_kv_heads * half, num_kv_heads * half, dtype=torch.complex128)
    for j in range(num_kv_heads):
        m = query_moments[j].double()  # [d, d]
        a, b = slice(0, half), slice(half, head_dim)
        out[j * half : (j + 1) * half, j * half : (j + 1) * half] = torch.complex(m[a, a] + m[b, b], m[a, b] - m[b, a])
    return out


def group_pairs(num_kv_heads: int, head_dim: int, fold: int, group: int) -> torch.Tensor:
    """Pair-space coordinates of fold group `group`, in (head j, frequency k) order: [g*F]."""
    half = head_dim // 2
    j = torch.arange(num_kv_heads)[:, None]
    k = torch.arange(fold)[None, :]
    return (j * half + group * fold + k).reshape(-1)


def check_fold(fold: int, head_dim: int) -> None:
    half = head_dim // 2
    if fold < 1 or half % fold:
        raise ValueError(f"freqfold must divide head_dim/2 = {half}, got {fold}")


# --------------------------------------------------------------------------------------------
# The rotation (RoRoPE for F = 1, FreqFold for F > 1)
# --------------------------------------------------------------------------------------------


@dataclass
class RopeRotation:
    """One orthogonal basis per fold group; components m = a*g*F + c, c by descending energy."""

    num_kv_heads: int
    head_dim: int
    fold: int
    basis: torch.Tensor  # [G, g*F, g*F] float64 or complex128, columns = components; rows (j, k) as group_pairs
    energy: torch.Tensor  # [G, g*F] key energy E|z'_c|^2 of each component (eigenvalues)

    @property
    def num_groups(self) -> int:
        return self.basis.shape[0]

    @property
    def group_width(self) -> int:
        return self.basis.shape[1]

    @property
    def unitary(self) -> bool:
        return self.basis.is_complex()

    def matrix(self) -> torch.Tensor:
        """T [g*d/2 components, g*d/2 pairs], orthogonal (real) or unitary (complex): z' = T z."""
        n = self.num_kv_heads * self.head_dim // 2
        t = torch.zeros(n, n, dtype=self.basis.dtype)
        w = self.group_width
        for a in range(self.num_groups):
            cols = group_pairs(self.num_kv_heads, self.head_dim, self.fold, a)
            t[a * w : (a + 1) * w, cols] = self.basis[a].T  # rows = components of group a
        return t

    def component_group(self) -> torch.Tensor:
        """Fold group of every component: [g*d/2]."""
        return torch.arange(self.num_groups).repeat_interleave(self.group_width)

    def frequency_weights(self) -> torch.Tensor:
        """[g*d/2, F]: how much of component m lies on each frequency k of its group (rows sum to 1)."""
        g, f = self.num_kv_heads, self.fold
        w = self.basis.abs().pow(2).view(self.num_groups, g, f, self.group_width).sum(1)  # [G, F, gF]
        return w.transpose(1, 2).reshape(-1, f)


def rorope(key_pair_moment: torch.Tensor, num_kv_heads: int, head_dim: int, fold: int = 1) -> RopeRotation:
    """PCA of the key pairs across KV heads, per fold group of `fold` adjacent frequencies.

    key_pair_moment [g*d/2, g*d/2] from pair_second_moment (E[k k^T] of the un-rotated keys): real
    gives the published real rotation, hermitian (complex) the unitary one.
    """
    check_fold(fold, head_dim)
    groups = head_dim // 2 // fold
    bases, energies = [], []
    for a in range(groups):
        idx = group_pairs(num_kv_heads, head_dim, fold, a)
        moment = key_pair_moment if key_pair_moment.is_complex() else key_pair_moment.double()
        c_a = moment[idx][:, idx]  # [gF, gF]: E[Re z Re z^T + Im z Im z^T] or E[conj(z) z^T]
        basis, energy = principal_basis(c_a)  # descending; damping would not change the basis
        bases.append(basis)
        energies.append(energy)
    return RopeRotation(num_kv_heads, head_dim, fold, torch.stack(bases), torch.stack(energies))


# --------------------------------------------------------------------------------------------
# Which components stay rope, and at which frequency
# --------------------------------------------------------------------------------------------


def mean_cos(inv_freq: torch.Tensor, context: int) -> torch.Tensor:
    """E_Delta cos(w*Delta) over the relative distances of all causal pairs of a `context`-token
    window, P(Delta) proportional to (context - Delta), Delta = 0..context-1."""
    delta = torch.arange(context, dtype=torch.float64)
    weight = (context - delta) / (context * (context + 1) / 2)  # [L], sums to 1
    return (torch.cos(inv_freq.double()[:, None] * delta[None]) * weight).sum(-1)


def component_scores(
    rotation: RopeRotation, query_pair: torch.Tensor, inv_freq: torch.Tensor, context: int = 512
) -> torch.Tensor:
    """How much each component's score would change if it lost RoPE: [g*d/2].

    E|q'_m|^2 * E|z'_m|^2 * E_Delta|exp(1j*w_m*Delta) - 1|^2, with w_m the component's
    energy-weighted frequency (the MHA2MLA 2-norm idea, made frequency-aware: slow pairs barely
    rotate within the context, so they lose little as NoPE).
    """
    t = rotation.matrix().to(torch.complex128)  # [n, n]
    # E|q'_m|^2 = sum_pq t_mp conj(t_mq) E[q_p conj(q_q)], and query_pair holds E[conj(q_p) q_q]
    q_energy = torch.einsum("mp,pq,mq->m", t.conj(), query_pair.to(torch.complex128), t).real  # [n]
    k_energy = rotation.energy.reshape(-1)
    w = weighted_frequencies(rotation, inv_freq)
    sensitivity = 2.0 - 2.0 * mean_cos(w, context)
    return q_energy.clamp_min(0) * k_energy * sensitivity


def select_components(
    rotation: RopeRotation, num_pairs: int, rule: str = "uniform", scores: torch.Tensor | None = None
) -> torch.Tensor:
    """Component indices kept as rope pairs (ascending), num_pairs = r/2 of them.

    uniform (published TransMLA): the top num_pairs/G components of every fold group by key energy.
    score: the num_pairs components with the largest `scores`, wherever they are.
    grid: one component per fold group (num_pairs = G), the one with the largest `scores` (key
      energy without scores). With F = d/r and the published frequencies every layer then rotates
      at the same grid w_(aF) = theta^(-2a/r): the shape DeepSeek engines run (one rope for all layers).
    """
    n = rotation.num_groups * rotation.group_width
    if not 0 <= num_pairs <= n:
        raise ValueError(f"{num_pairs} rope pairs do not fit {n} key pairs")
    if rule == "uniform":
        groups = rotation.num_groups
        if num_pairs % groups:
            raise ValueError(
                f"freqfold {rotation.fold} makes {groups} groups; {num_pairs} rope pairs are not a multiple "
                f"(published TransMLA keeps the same count per group: choose r so that r/2 divides evenly)"
            )
        per = num_pairs // groups
        base = torch.arange(groups)[:, None] * rotation.group_width
        return (base + torch.arange(per)[None, :]).reshape(-1)
    if rule == "grid":
        groups, w = rotation.num_groups, rotation.group_width
        if num_pairs != groups:
            raise ValueError(
                f"a shared rope grid keeps one pair per fold group: {num_pairs} rope pairs need freqfold "
                f"{rotation.head_dim // (2 * num_pairs)}, got {rotation.fold} ({groups} groups)"
            )
        ranking = rotation.energy if scores is None else scores.view(groups, w)
        return torch.arange(groups) * w + ranking.argmax(dim=1)
    if rule == "score":
        if scores is None:
            raise ValueError("score selection needs component scores")
        return torch.sort(torch.topk(scores, num_pairs).indices).values
    raise ValueError(f"rope selection must be one of {', '.join(SELECTIONS)}, got {rule!r}")


def weighted_frequencies(rotation: RopeRotation, inv_freq: torch.Tensor) -> torch.Tensor:
    """Every component's frequency as the weighted mean of its group's frequencies: [g*d/2]."""
    f = rotation.fold
    group_freq = inv_freq.double().view(rotation.num_groups, f)  # [G, F]
    group = rotation.component_group()
    return (rotation.frequency_weights() * group_freq[group]).sum(-1)


def kept_frequencies(
    rotation: RopeRotation, kept: torch.Tensor, inv_freq: torch.Tensor, rule: str = "published"
) -> torch.Tensor:
    """Inverse frequency of each kept component: [len(kept)] (float32, as the model stores it).

    published: in a group keeping k components (by rank b = 0..k-1), the b-th rotates at
      w_(aF + floor(b*F/k)) — TransMLA's w_(aF), w_(aF+c), ... with c = F/k. Exact for F = 1.
    weighted: the component's energy-weighted mean frequency (also exact for F = 1).
    """
    if rule == "weighted":
        return weighted_frequencies(rotation, inv_freq)[kept].float()
    if rule != "published":
        raise ValueError(f"frequency rule must be one of {', '.join(FREQUENCY_RULES)}, got {rule!r}")
    f, w = rotation.fold, rotation.group_width
    out = []
    group_of = kept // w
    for m in kept.tolist():
        a = m // w
        same = kept[group_of == a]
        b = int((same < m).sum())  # rank among the group's kept components
        out.append(inv_freq[a * f + (b * f) // len(same)])
    return torch.stack(out).float() if out else inv_freq.new_zeros(0)


# --------------------------------------------------------------------------------------------
# The partial-RoPE layer (rotation applied, components split into rope and NoPE)
# --------------------------------------------------------------------------------------------


@dataclass
class PartialRope:
    """A layer after RoRoPE/FreqFold and the rope/NoPE split, before the low-rank step.

    All maps act on the augmented input [x; 1] (last column = bias).
    Head h (group j) scores RoPE(q_rope[h]) . RoPE(k_rope) + q_h . (nope_to_head[j] @ k_nope),
    with q_h the source query head, unchanged. nope_to_head[j] maps the NoPE components back to
    head j's (un-rotated) key coordinates: the rows of T^T that belong to head j.
    """

    k_rope: torch.Tensor  # [r, D+1] rotate-half: real parts of the kept components, then imaginary
    q_rope: torch.Tensor  # [H, r, D+1]
    k_nope: torch.Tensor  # [g*d - r, D+1] real parts of the other components, then imaginary
    nope_to_head: torch.Tensor  # [g, d, g*d - r]
    inv_freq: torch.Tensor  # [r/2]


def split_rope(
    wq: torch.Tensor,
    wk: torch.Tensor,
    num_heads: int,
    rotation: RopeRotation,
    kept: torch.Tensor,
    inv_freq: torch.Tensor,
    nope_scale: torch.Tensor | None = None,
) -> PartialRope:
    """Apply the rotation to keys and slot-placed queries and split rope from NoPE components.

    wq [H*d, D+1], wk [g*d, D+1] augmented (with_bias_column). kept: component indices (rope, in
    this order), inv_freq [len(kept)] their frequencies. nope_scale [g*d/2] optional factor on each
    NoPE component's score (1 = plain NoPE, the published choice).
    With every component kept (F = 1, published frequencies) the scores equal the source's.
    """
    g, d = rotation.num_kv_heads, rotation.head_dim
    half, n = d // 2, rotation.num_kv_heads * d // 2
    group = num_heads // g
    t = rotation.matrix().to(torch.complex128)  # [n, n]
    dtype = torch.float64
    rows = rope_pair_rows(g, d)

    def apply(m: torch.Tensor, re: torch.Tensor, im: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (m (re + i im)): real and imaginary parts, m complex, re/im real
        return m.real @ re - m.imag @ im, m.imag @ re + m.real @ im

    k_re, k_im = apply(t, wk.double()[rows[:n]], wk.double()[rows[n:]])  # [n, D+1] each: z' = T z
    mask = torch.zeros(n, dtype=torch.bool)
    mask[kept] = True
    nope = torch.arange(n)[~mask]
    q = wq.double().view(num_heads, d, -1)
    q_rope = []
    for h in range(num_heads):
        t_j = t[:, (h // group) * half : (h // group + 1) * half]  # [n, d/2] slot of group j
        q_re, q_im = apply(t_j, q[h, :half], q[h, half:])  # [n, D+1] rotated slot-placed query
        q_rope.append(torch.cat((q_re[kept], q_im[kept])))  # [r, D+1]
    # Head j's key = T^H z' (T unitary) restricted to its slot; keep the NoPE columns (real, then
    # imaginary): the real form [[Re B, -Im B], [Im B, Re B]] of B = (T^H)[slot j, NoPE].
    to_head = torch.zeros(g, d, 2 * nope.numel(), dtype=dtype)
    for j in range(g):
        back = t[nope][:, j * half : (j + 1) * half].mH  # [d/2, |N|]
        to_head[j, :half, : nope.numel()] = back.real
        to_head[j, :half, nope.numel() :] = -back.imag
        to_head[j, half:, : nope.numel()] = back.imag
        to_head[j, half:, nope.numel() :] = back.real
    # The NoPE factor goes on the key side, so that the low-rank step sees what the scores use.
    scale = torch.ones(n, dtype=dtype) if nope_scale is None else nope_scale.double()
    s_nope = scale[nope][:, None]  # [|N|, 1]
    return PartialRope(
        k_rope=torch.cat((k_re[kept], k_im[kept])),
        q_rope=torch.stack(q_rope),
        k_nope=torch.cat((k_re[nope] * s_nope, k_im[nope] * s_nope)),
        nope_to_head=to_head,
        inv_freq=inv_freq.float(),
    )


# --------------------------------------------------------------------------------------------
# A cheap, stated criterion for FreqFold: the expected attention-logit error
# --------------------------------------------------------------------------------------------


def logit_error(
    rotation: RopeRotation,
    kept: torch.Tensor,
    kept_inv_freq: torch.Tensor,
    inv_freq: torch.Tensor,
    key_moment: torch.Tensor,
    query_moments: torch.Tensor,
    context: int = 512,
    nope_scale: torch.Tensor | None = None,
) -> float:
    """E over query/key tokens and causal distances of (converted logit - source logit)^2.

    Per fold group a, in the real coordinates [Re; Im] of its g*F pairs, a score is
    q^T M(Delta) k with M = [[cos, sin], [-sin, cos]]: for the source, diagonal at the pair
    frequencies; converted, R diag(...) R^T with R = blockdiag(U_a, U_a), kept components at their
    assigned frequency, NoPE components cos = nope_scale (1 = plain NoPE), sin = 0. With query and
    key tokens independent, E[(q^T E k)^2] = tr(E^T C_q E C_k). Groups are treated as
    uncorrelated (cross-frequency terms average out over Delta); Delta weighted as in mean_cos.

    E(Delta) = sum_t c_t(Delta) X_t over a few fixed matrices X_t (one cos and one sin term per
    source frequency and per component), so the error is sum_{t,s} E_Delta[c_t c_s] tr(X_t^T C_q X_s C_k):
    no per-Delta matrices.

    key_moment [g*d, g*d] = E[k k^T]; query_moments [g, d, d] = per-group sums of E[q_h q_h^T].
    """
    g, d, f = rotation.num_kv_heads, rotation.head_dim, rotation.fold
    half, w = d // 2, rotation.group_width
    n = g * half
    delta = torch.arange(context, dtype=torch.float64)
    pw = (context - delta) / (context * (context + 1) / 2)  # [L] P(Delta)
    rows = rope_pair_rows(g, d)
    km = key_moment.double()[rows][:, rows]  # [2n, 2n] real-stacked [Re; Im] in pair space
    qm = torch.zeros(2 * n, 2 * n, dtype=torch.float64)
    for j in range(g):
        m = query_moments[j].double()
        for si in range(2):
            for sj in range(2):
                block = m[si * half : (si + 1) * half, sj * half : (sj + 1) * half]
                qm[si * n + j * half : si * n + (j + 1) * half, sj * n + j * half : sj * n + (j + 1) * half] = block
    kept_freq = torch.zeros(n, dtype=torch.float64)
    is_kept = torch.zeros(n, dtype=torch.bool)
    is_kept[kept] = True
    kept_freq[kept] = kept_inv_freq.double()
    scale = torch.ones(n, dtype=torch.float64) if nope_scale is None else nope_scale.double()
    zero = torch.zeros(context, dtype=torch.float64)
    total = 0.0
    for a in range(rotation.num_groups):
        idx = group_pairs(g, d, f, a)
        idx2 = torch.cat((idx, idx + n))  # [2gF] real then imaginary coordinates
        c_k, c_q = km[idx2][:, idx2], qm[idx2][:, idx2]
        u = rotation.basis[a].to(torch.complex128)  # [gF, gF] columns = components
        # projectors: source frequency k (its g coordinates), converted component c: z'_c = u_c^T z
        # contributes conj(q'_c) z'_c = q^H P_c z with P_c = conj(u_c) u_c^T (u_c u_c^T when real)
        eye = torch.eye(w, dtype=torch.complex128)
        src_proj = [torch.diag(eye[torch.arange(g) * f + k].sum(0)) for k in range(f)]  # [gF, gF] each
        comp_proj = [torch.outer(u[:, c].conj(), u[:, c]) for c in range(w)]
        mats, coefs = [], []
        for k, p in enumerate(src_proj):
            wk = inv_freq.double()[a * f + k]
            mats += [p, p]
            coefs += [torch.cos(wk * delta), torch.sin(wk * delta)]
        for c, p in enumerate(comp_proj):
            m_c = a * w + c
            mats += [p, p]
            if is_kept[m_c]:
                coefs += [-torch.cos(kept_freq[m_c] * delta), -torch.sin(kept_freq[m_c] * delta)]
            else:
                coefs += [-scale[m_c] * torch.ones(context, dtype=torch.float64), zero]
        x = []
        for i, p in enumerate(mats):
            # the real form [[Re M, -Im M], [Im M, Re M]] on [Re; Im] of M = P (cos term) or -iP (sin
            # term): for a real P, [[P, 0], [0, P]] and [[0, P], [-P, 0]]
            m = p if i % 2 == 0 else -1j * p
            x.append(torch.cat((torch.cat((m.real, -m.imag), 1), torch.cat((m.imag, m.real), 1))))
        xs = torch.stack(x)  # [T, 2gF, 2gF]
        ys = c_q @ xs @ c_k  # [T, 2gF, 2gF]
        traces = xs.flatten(1) @ ys.flatten(1).T  # [T, T]: tr(X_t^T C_q X_s C_k)
        cf = torch.stack(coefs)  # [T, L]
        weights = (cf * pw) @ cf.T  # [T, T]: E_Delta[c_t c_s]
        total += float((weights * traces).sum())
    return total


def nope_scales(rotation: RopeRotation, inv_freq: torch.Tensor, context: int = 512) -> torch.Tensor:
    """Least-squares factor for each component's score once it loses RoPE: E_Delta cos(w_m*Delta).

    A NoPE'd pair contributes Re(q conj(z)) * beta instead of Re(q conj(z) exp(1j*w*Delta));
    beta = E cos(w*Delta) minimises the expected squared difference (1 for slow pairs, ~0 for fast
    ones, whose rotation averages out). [g*d/2]
    """
    return mean_cos(weighted_frequencies(rotation, inv_freq), context)


__all__ = [
    "FREQUENCY_RULES",
    "PartialRope",
    "ROTATIONS",
    "RopeRotation",
    "SELECTIONS",
    "check_fold",
    "component_scores",
    "kept_frequencies",
    "logit_error",
    "mean_cos",
    "nope_scales",
    "pair_second_moment",
    "query_pair_moment",
    "rorope",
    "select_components",
    "split_rope",
    "weighted_frequencies",
]
