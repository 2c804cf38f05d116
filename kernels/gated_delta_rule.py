"""The gated delta rule (Gated DeltaNet, Qwen3-Next's linear attention) in torch: a per-token reference, a batched
one-token decode step, and a chunked form for prefill. There is no Triton kernel for it yet; CUDA runs these too.

Per value head, with state ``S [dk, dv]`` (fp32), decay ``g_t <= 0`` (log space) and write strength ``beta_t``:

    S_t = exp(g_t) * S_{t-1}
    u_t = beta_t * (v_t - S_tᵀ k_t)
    S_t = S_t + k_t u_tᵀ
    o_t = S_tᵀ q_t

``q`` and ``k`` are L2-normalised here (eps 1e-6) and ``q`` is scaled by ``dk ** -0.5``, as Qwen3-Next does. Query/key
heads are shared by ``hv // hk`` consecutive value heads. Inputs: ``q, k [T, hk, dk]``, ``v [T, hv, dv]``,
``g, beta [T, hv]``; the state is ``[hv, dk, dv]`` for one sequence or ``[B, hv, dk, dv]`` for a decode batch.
Outputs are fp32.
"""
from __future__ import annotations

import torch


def _prepare(q: torch.Tensor, k: torch.Tensor, hv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32, L2-normalised, ``q`` scaled, heads repeated to the value heads: ``[..., hv, dk]`` each."""
    q, k = q.float(), k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    rep = hv // k.shape[-2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    return q, k


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: one sequence, token by token. Returns ``(o [T, hv, dv], final state)``."""
    q, k = _prepare(q, k, v.shape[-2])
    v, g, beta = v.float(), g.float(), beta.float()
    s = state.float().clone()
    out = []
    for t in range(v.shape[0]):
        s = s * g[t].exp()[:, None, None]
        u = beta[t, :, None] * (v[t] - torch.einsum("hkv,hk->hv", s, k[t]))
        s = s + k[t, :, :, None] * u[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(out) if out else v.new_zeros(v.shape), s


def decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of ``B`` sequences: ``q, k [B, hk, dk]``, ``v [B, hv, dv]``, ``g, beta [B, hv]``,
    ``state [B, hv, dk, dv]`` (finite). Returns ``(o [B, hv, dv], new states)``; ``g = -inf`` makes a row start
    from a zero state, whatever ``state`` holds for it.

    The old state is read once (q and k against it in one matmul) and the new one written once:
    ``o = e^g qS + (q.k) u`` with ``u = beta (v - e^g kS)``, ``S' = e^g S + k uᵀ``."""
    q, k = _prepare(q, k, v.shape[-2])
    b, hv, dk, dv = state.shape
    decay = g.float().exp()[..., None]  # [B, hv, 1]
    read = decay[..., None] * (torch.stack((q, k), dim=-2) @ state.float())  # [B, hv, 2, dv]
    u = beta.float()[..., None] * (v.float() - read[..., 1, :])
    o = read[..., 0, :] + (q * k).sum(-1, keepdim=True) * u
    s = state.float() * decay[..., None]
    s.view(b * hv, dk, dv).baddbmm_(k.reshape(b * hv, dk, 1), u.reshape(b * hv, 1, dv))
    return o, s


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """`recurrent` for one sequence in blocks of ``chunk`` tokens: inside a block the delta-rule writes are solved
    as one unit-lower-triangular system, so the Python loop runs ``T / chunk`` times.

    Within a block starting from state ``S0``, with ``c_t`` the cumulative log decay and ``D[t, s] = exp(c_t - c_s)``
    (``s <= t``): the writes ``U`` solve ``(I + tril(beta_t D[t, s] k_t.k_s, -1)) U = beta * (V - exp(c) * K S0)``;
    then ``o_t = exp(c_t) q_t S0 + sum_{s<=t} D[t, s] (q_t.k_s) u_s`` and
    ``S = exp(c_last) S0 + sum_s exp(c_last - c_s) k_s u_sᵀ``."""
    n = v.shape[0]
    q, k = _prepare(q, k, v.shape[-2])
    v, g, beta = v.float(), g.float(), beta.float()
    s = state.float()
    pad = -n % chunk
    if pad:  # zero keys, values and decays: padded tokens write nothing and do not decay the state
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    nc = (n + pad) // chunk
    # [hv, nc, chunk, d]
    q, k, v = (x.reshape(nc, chunk, *x.shape[1:]).permute(2, 0, 1, 3) for x in (q, k, v))
    g, beta = (x.reshape(nc, chunk, -1).permute(2, 0, 1) for x in (g, beta))
    c = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [hv, nc, C, C]
    kk = (k @ k.transpose(-1, -2)) * decay
    system = torch.eye(chunk, device=v.device) + (beta[..., :, None] * kk).tril(-1)
    qk = (q @ k.transpose(-1, -2)) * decay
    bv = beta[..., None] * v
    bk = (beta * c.exp())[..., None] * k
    # U = A^-1 (bV - bK S0): solve for both right-hand sides once, then combine per block with its S0
    solved_v = torch.linalg.solve_triangular(system, bv, upper=False, unitriangular=True)
    solved_k = torch.linalg.solve_triangular(system, bk, upper=False, unitriangular=True)
    q_decayed = q * c.exp()[..., None]
    k_to_end = k * (c[..., -1:] - c).exp()[..., None]
    block_decay = c[..., -1].exp()[..., None, None]
    out = torch.empty_like(v)
    for i in range(nc):
        u = solved_v[:, i] - solved_k[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + qk[:, i] @ u
        s = s * block_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ u
    return out.permute(1, 2, 0, 3).reshape(nc * chunk, -1, v.shape[-1])[:n], s
