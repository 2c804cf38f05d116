"""The gated delta rule (Gated DeltaNet, Qwen3-Next's linear attention) in torch: a per-token reference, a batched
one-token decode step, and a chunked form for prefill (whose walk across blocks can run in the Triton scan,
`ember.kernels.gated_delta_scan`). The Triton decode kernel is `ember.kernels.gated_delta_decode`.

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


_GROUP_MATRICES = 256
"""How many (sequence, head, block) ``chunk x chunk`` systems `chunked` builds and solves together."""


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
            state: torch.Tensor, chunk: int = 64, scan_kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`recurrent` in blocks of ``chunk`` tokens: inside a block the delta-rule writes are solved as one
    unit-lower-triangular system, so the Python loop runs ``T / chunk`` times. For one sequence (shapes as in the
    module docstring) or a batch of them (a leading ``B`` on every input, state ``[B, hv, dk, dv]``; shorter
    sequences padded at the end with zero ``q, k, v, g, beta``, which leaves their state as it was). With
    ``scan_kernel`` the walk across blocks is one Triton launch per group of blocks (`ember.kernels.gated_delta_scan`,
    blocks of 16 or 32 tokens, tf32 dots on a GPU) instead of a Python loop of small launches.

    Within a block starting from state ``S0``, with ``c_t`` the cumulative log decay and ``D[t, s] = exp(c_t - c_s)``
    (``s <= t``): the writes ``U`` solve ``(I + tril(beta_t D[t, s] k_t.k_s, -1)) U = beta * (V - exp(c) * K S0)``;
    then ``o_t = exp(c_t) q_t S0 + sum_{s<=t} D[t, s] (q_t.k_s) u_s`` and
    ``S = exp(c_last) S0 + sum_s exp(c_last - c_s) k_s u_sᵀ``."""
    if v.dim() == 3:
        out, s = chunked(*(x.unsqueeze(0) for x in (q, k, v, g, beta, state)), chunk=chunk, scan_kernel=scan_kernel)
        return out[0], s[0]
    if scan_kernel:
        from ember.kernels.gated_delta_scan import MAX_CHUNK, scan

        chunk = 16 if chunk <= 16 else MAX_CHUNK
    b, n = v.shape[:2]
    q, k = _prepare(q, k, v.shape[-2])
    v, g, beta = v.float(), g.float(), beta.float()
    s = state.float()
    pad = -n % chunk
    if pad:  # zero keys, values and decays: padded tokens write nothing and do not decay the state
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    nc = (n + pad) // chunk
    # [B, hv, nc, chunk, d] and [B, hv, nc, chunk]
    q, k, v = (x.reshape(b, nc, chunk, *x.shape[2:]).permute(0, 3, 1, 2, 4) for x in (q, k, v))
    g, beta = (x.reshape(b, nc, chunk, -1).permute(0, 3, 1, 2) for x in (g, beta))
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    eye = torch.eye(chunk, device=v.device)
    out = torch.empty_like(v)
    group = max(1, _GROUP_MATRICES // (b * v.shape[1]))
    for g0 in range(0, nc, group):  # a few blocks' intra-block terms at a time: a bounded working set
        blocks = slice(g0, min(nc, g0 + group))
        qb, kb, vb, bb = q[:, :, blocks], k[:, :, blocks], v[:, :, blocks], beta[:, :, blocks]
        c = g[:, :, blocks].cumsum(-1)
        decay = (c[..., :, None] - c[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [B, hv, G, C, C]
        system = eye + (bb[..., :, None] * (kb @ kb.transpose(-1, -2)) * decay).tril(-1)
        qk = (qb @ kb.transpose(-1, -2)) * decay
        # U = A^-1 (bV - bK S0): solve for both right-hand sides once, then combine per block with its S0
        solved_v = torch.linalg.solve_triangular(system, bb[..., None] * vb, upper=False, unitriangular=True)
        solved_k = torch.linalg.solve_triangular(system, (bb * c.exp())[..., None] * kb, upper=False,
                                                 unitriangular=True)
        q_decayed = qb * c.exp()[..., None]
        k_to_end = kb * (c[..., -1:] - c).exp()[..., None]
        if scan_kernel:
            out[:, :, blocks], s = scan(solved_v, solved_k, q_decayed, qk, k_to_end, c[..., -1].exp(), s)
            continue
        block_decay = c[..., -1].exp()[..., None, None]
        for i in range(c.shape[2]):
            u = solved_v[:, :, i] - solved_k[:, :, i] @ s
            out[:, :, g0 + i] = q_decayed[:, :, i] @ s + qk[:, :, i] @ u
            s = s * block_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    return out.permute(0, 2, 3, 1, 4).reshape(b, nc * chunk, -1, v.shape[-1])[:, :n], s
