// The chunked KDA algorithm on one chunk (at most kChunk steps) of one value head, written once
// for both backends: the CPU kernel runs it with a one-member team, the CUDA kernels with a team
// of the threads of a block. Arrays are row-major with the leading dimensions given below; they
// may live anywhere the team can read (host memory, shared or global memory).
//
// Per chunk with start state S0 [K,V], normalised q, k [L,K], v [L,V], beta [L] and G [L,K] the
// cumulative log-decay inside the chunk (G_t = g_0 + ... + g_t), the recurrence of
// reference/kda.py unrolls to (E_ts = exp(G_t - G_s) <= 1 for s <= t, never exp of a positive
// number, so strongly decaying gates cannot overflow):
//   A_ts   = sum_c k_t k_s E_ts   (s < t)        Aqk_ts = sum_c q_t k_s E_ts   (s <= t)
//   (I + diag(beta) A) [W | Ut] = diag(beta) [k exp(G) | v]                (forward substitution)
//   Qg = q exp(G),  Kd = k exp(G_last - G),  gC = exp(G_last)
//   U = Ut - W S0,  O = scale (Qg S0 + Aqk U),  S1 = diag(gC) S0 + Kd^T U.
// The backward differentiates exactly these steps (chunk_bwd below).
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define KDA_HD __host__ __device__ __forceinline__
#else
#define KDA_HD inline
#endif

namespace kda_dsa_ops::kda {

constexpr int kChunk = 64;  // steps per chunk; A, Aqk and their gradients have leading dimension kChunk

// The CPU kernel's team: one member, nothing to wait for.
struct SerialTeam {
  KDA_HD int rank() const { return 0; }
  KDA_HD int size() const { return 1; }
  KDA_HD void sync() const {}
};

KDA_HD float exp_of(float x) { return expf(x); }
KDA_HD double exp_of(double x) { return exp(x); }

// Sizes of one chunk's working set.
struct ChunkDims {
  int L;  // steps in this chunk (1..kChunk)
  int K;  // key width
  int V;  // value width (or the width of the value tile a state step works on)
};

// The cumulative log-decay G = hi + lo of a chunk, [L,K] each. The sum is carried exactly
// (two-sum), so that G_t - G_s is accurate to its own size: a plain fp32 running sum would put
// an error of |G| * 6e-8 (|G| reaches 1e4) into every exp(G_t - G_s).
template <typename T>
struct Gates {
  const T* hi;
  const T* lo;
  KDA_HD T diff(int a, int b) const { return (hi[a] - hi[b]) + (lo[a] - lo[b]); }
  KDA_HD T exp_diff(int a, int b) const { return exp_of(diff(a, b)); }
  KDA_HD T exp_at(int a) const { return exp_of(hi[a]) * exp_of(lo[a]); }
};

// G.hi in place over g ([L,K]), G.lo into lo.
template <typename T, typename Team>
KDA_HD void chunk_cumsum(const Team& tm, ChunkDims d, T* G, T* lo) {
  for (int c = tm.rank(); c < d.K; c += tm.size()) {
    T hi = 0, err = 0;
    for (int t = 0; t < d.L; ++t) {
      const T x = G[t * d.K + c], s = hi + x, xb = s - hi;
      err += (hi - (s - xb)) + (x - xb);
      hi = s;
      G[t * d.K + c] = hi;
      lo[t * d.K + c] = err;
    }
  }
  tm.sync();
}

// Everything of a chunk that does not depend on the state.
// In: q, k [L,K]; G (chunk_cumsum); v [L,V]; beta [L]. Out: A, Aqk [L,kChunk]; W, Qg, Kd [L,K]; Ut [L,V]; gC [K].
template <typename T, typename Team>
KDA_HD void chunk_intra(const Team& tm, ChunkDims d, const T* q, const T* k, Gates<T> G, const T* v, const T* beta,
                        T* A, T* Aqk, T* W, T* Ut, T* Qg, T* Kd, T* gC) {
  const int L = d.L, K = d.K, V = d.V;
  for (int i = tm.rank(); i < L * L; i += tm.size()) {
    const int t = i / L, s = i % L;
    T a = 0, b = 0;
    if (s <= t) {
      for (int c = 0; c < K; ++c) {
        const T e = G.exp_diff(t * K + c, s * K + c) * k[s * K + c];
        a += k[t * K + c] * e;
        b += q[t * K + c] * e;
      }
    }
    A[t * kChunk + s] = s < t ? a : T(0);
    Aqk[t * kChunk + s] = b;
  }
  for (int i = tm.rank(); i < L * K; i += tm.size()) {
    const int c = i % K;
    Qg[i] = q[i] * G.exp_at(i);
    Kd[i] = k[i] * G.exp_diff((L - 1) * K + c, i);
  }
  for (int c = tm.rank(); c < K; c += tm.size()) gC[c] = G.exp_at((L - 1) * K + c);
  tm.sync();
  // (I + diag(beta) A) Y = diag(beta) X, one column of [W | Ut] per member: Y_t = beta_t (X_t - sum_s<t A_ts Y_s).
  for (int col = tm.rank(); col < K + V; col += tm.size()) {
    const bool is_w = col < K;
    const int ld = is_w ? K : V, j = is_w ? col : col - K;
    T* Y = is_w ? W : Ut;
    for (int t = 0; t < L; ++t) {
      T acc = is_w ? k[t * K + j] * G.exp_at(t * K + j) : v[t * V + j];
      for (int s = 0; s < t; ++s) acc -= A[t * kChunk + s] * Y[s * ld + j];
      Y[t * ld + j] = beta[t] * acc;
    }
  }
  tm.sync();
}

// One chunk of state passing over a tile of Vt state columns (S [K,Vt] with leading dim ldS;
// Ut, O, U rows with leading dims ldU, ldO, Vt). Writes O (skip with nullptr) and advances S.
template <typename T, typename Team>
KDA_HD void chunk_state_fwd(const Team& tm, ChunkDims d, T scale, const T* W, const T* Ut, int ldU, const T* Qg,
                            const T* Kd, const T* Aqk, const T* gC, T* S, int ldS, T* U, T* O, int ldO) {
  const int L = d.L, K = d.K, Vt = d.V;
  for (int i = tm.rank(); i < L * Vt; i += tm.size()) {
    const int t = i / Vt, j = i % Vt;
    T acc = Ut[t * ldU + j];
    for (int c = 0; c < K; ++c) acc -= W[t * K + c] * S[c * ldS + j];
    U[i] = acc;
  }
  tm.sync();
  if (O != nullptr) {
    for (int i = tm.rank(); i < L * Vt; i += tm.size()) {
      const int t = i / Vt, j = i % Vt;
      T acc = 0;
      for (int c = 0; c < K; ++c) acc += Qg[t * K + c] * S[c * ldS + j];
      for (int s = 0; s <= t; ++s) acc += Aqk[t * kChunk + s] * U[s * Vt + j];
      O[t * ldO + j] = scale * acc;
    }
    tm.sync();
  }
  for (int i = tm.rank(); i < K * Vt; i += tm.size()) {
    const int c = i / Vt, j = i % Vt;
    T acc = gC[c] * S[c * ldS + j];
    for (int t = 0; t < L; ++t) acc += Kd[t * K + c] * U[t * Vt + j];
    S[c * ldS + j] = acc;
  }
  tm.sync();
}

// One chunk of the state gradient, backwards, over a tile of Vt columns: dS holds dS1 (the
// gradient of the chunk's end state) on entry and dS0 on exit. dO [L,Vt] (leading dim ldO);
// dU [L,Vt] is scratch.
template <typename T, typename Team>
KDA_HD void chunk_state_bwd(const Team& tm, ChunkDims d, T scale, const T* W, const T* Qg, const T* Kd,
                            const T* Aqk, const T* gC, const T* dO, int ldO, T* dS, int ldS, T* dU) {
  const int L = d.L, K = d.K, Vt = d.V;
  for (int i = tm.rank(); i < L * Vt; i += tm.size()) {
    const int t = i / Vt, j = i % Vt;
    T acc = 0;
    for (int r = t; r < L; ++r) acc += Aqk[r * kChunk + t] * dO[r * ldO + j];
    acc *= scale;
    for (int c = 0; c < K; ++c) acc += Kd[t * K + c] * dS[c * ldS + j];
    dU[i] = acc;
  }
  tm.sync();
  for (int i = tm.rank(); i < K * Vt; i += tm.size()) {
    const int c = i / Vt, j = i % Vt;
    T qo = 0, wu = 0;
    for (int t = 0; t < L; ++t) {
      qo += Qg[t * K + c] * dO[t * ldO + j];
      wu += W[t * K + c] * dU[t * Vt + j];
    }
    dS[c * ldS + j] = scale * qo + gC[c] * dS[c * ldS + j] - wu;
  }
  tm.sync();
}

// Scratch of chunk_bwd, each [L, width] row-major.
template <typename T>
struct ChunkBwdScratch {
  T* U;     // [L,V]  U = Ut - W S0
  T* dU;    // [L,V]
  T* ZW;    // [L,K]  gradient of W, then the back-substituted Z of its columns
  T* ZU;    // [L,V]  the same for Ut
  T* dAqk;  // [L,kChunk]
  T* dA;    // [L,kChunk]
};

// Gradients of one chunk given its start state S0 [K,V], the gradient dS1 [K,V] of its end
// state and dO [L,V] (leading dim ldO). Intra-chunk quantities as from chunk_intra (A filled).
// Writes dq, dk (w.r.t. the normalised q, k), dg [L,K], dv [L,V] (leading dim ldv), dbeta [L].
template <typename T, typename Team>
KDA_HD void chunk_bwd(const Team& tm, ChunkDims d, T scale, const T* q, const T* k, Gates<T> G, const T* v,
                      const T* beta, const T* A, const T* Aqk, const T* W, const T* Ut, const T* Qg, const T* Kd,
                      const T* gC, const T* S0, const T* dS1, const T* dO, int ldO, ChunkBwdScratch<T> sc, T* dq,
                      T* dk, T* dg, T* dv, int ldv, T* dbeta) {
  const int L = d.L, K = d.K, V = d.V;
  // U and dU = scale Aqk^T dO + Kd dS1.
  for (int i = tm.rank(); i < L * V; i += tm.size()) {
    const int t = i / V, j = i % V;
    T u = Ut[i], du = 0;
    for (int c = 0; c < K; ++c) {
      u -= W[t * K + c] * S0[c * V + j];
      du += Kd[t * K + c] * dS1[c * V + j];
    }
    T ao = 0;
    for (int r = t; r < L; ++r) ao += Aqk[r * kChunk + t] * dO[r * ldO + j];
    sc.U[i] = u;
    sc.dU[i] = du + scale * ao;
  }
  tm.sync();
  // Terms through Qg, Kd and W (reductions over V); dg collects dG for now.
  for (int i = tm.rank(); i < L * K; i += tm.size()) {
    const int t = i / K, c = i % K;
    T dqg = 0, dkd = 0, dw = 0;
    for (int j = 0; j < V; ++j) {
      dqg += S0[c * V + j] * dO[t * ldO + j];
      dkd += sc.U[t * V + j] * dS1[c * V + j];
      dw -= sc.dU[t * V + j] * S0[c * V + j];
    }
    dqg *= scale;
    const T eg = G.exp_at(i);
    dq[i] = dqg * eg;
    dk[i] = dkd * G.exp_diff((L - 1) * K + c, i);
    dg[i] = dqg * Qg[i] - dkd * Kd[i];
    sc.ZW[i] = dw;
  }
  for (int i = tm.rank(); i < L * V; i += tm.size()) sc.ZU[i] = sc.dU[i];
  for (int i = tm.rank(); i < L * L; i += tm.size()) {
    const int t = i / L, s = i % L;
    T acc = 0;
    if (s <= t) {
      for (int j = 0; j < V; ++j) acc += dO[t * ldO + j] * sc.U[s * V + j];
    }
    sc.dAqk[t * kChunk + s] = scale * acc;
  }
  tm.sync();
  // Back substitution through (I + diag(beta) A): Z_t = dY_t - sum_{s>t} beta_s A_st Z_s.
  for (int col = tm.rank(); col < K + V; col += tm.size()) {
    const bool is_w = col < K;
    const int ld = is_w ? K : V, j = is_w ? col : col - K;
    T* Z = is_w ? sc.ZW : sc.ZU;
    for (int t = L - 1; t >= 0; --t) {
      T acc = Z[t * ld + j];
      for (int s = t + 1; s < L; ++s) acc -= beta[s] * A[s * kChunk + t] * Z[s * ld + j];
      Z[t * ld + j] = acc;
    }
  }
  tm.sync();
  // dM_ts = -(Z_t . Y_s) for s < t; dA = diag(beta) dM.
  for (int i = tm.rank(); i < L * L; i += tm.size()) {
    const int t = i / L, s = i % L;
    T acc = 0;
    if (s < t) {
      for (int c = 0; c < K; ++c) acc -= sc.ZW[t * K + c] * W[s * K + c];
      for (int j = 0; j < V; ++j) acc -= sc.ZU[t * V + j] * Ut[s * V + j];
    }
    sc.dA[t * kChunk + s] = acc;  // dM for now; scaled by beta_t below, after dbeta has read it
  }
  tm.sync();
  for (int t = tm.rank(); t < L; t += tm.size()) {
    T acc = 0;
    for (int c = 0; c < K; ++c) acc += sc.ZW[t * K + c] * k[t * K + c] * G.exp_at(t * K + c);
    for (int j = 0; j < V; ++j) acc += sc.ZU[t * V + j] * v[t * V + j];
    for (int s = 0; s < t; ++s) acc += sc.dA[t * kChunk + s] * A[t * kChunk + s];
    dbeta[t] = acc;
  }
  for (int i = tm.rank(); i < L * V; i += tm.size()) dv[(i / V) * ldv + i % V] = beta[i / V] * sc.ZU[i];
  tm.sync();
  for (int i = tm.rank(); i < L * L; i += tm.size()) {
    const int t = i / L, s = i % L;
    sc.dA[t * kChunk + s] *= beta[t];
  }
  tm.sync();
  // Through A and Aqk (pairs), and k exp(G) (the W columns), per element (t, c).
  for (int i = tm.rank(); i < L * K; i += tm.size()) {
    const int t = i / K, c = i % K;
    const T kt = k[i], qt = q[i];
    T p_row_a = 0, p_row_q = 0, p_col = 0;  // sum_s<t dA_ts k_s E, sum_s<=t dAqk_ts k_s E, column terms
    for (int s = 0; s <= t; ++s) {
      const T e = G.exp_diff(i, s * K + c) * k[s * K + c];
      p_row_a += sc.dA[t * kChunk + s] * e;
      p_row_q += sc.dAqk[t * kChunk + s] * e;
    }
    for (int r = t; r < L; ++r) {
      const T e = G.exp_diff(r * K + c, i);
      p_col += (sc.dA[r * kChunk + t] * k[r * K + c] + sc.dAqk[r * kChunk + t] * q[r * K + c]) * e;
    }
    const T eg = G.exp_at(i), zw = beta[t] * sc.ZW[i];
    dq[i] += p_row_q;
    dk[i] += p_row_a + p_col + zw * eg;
    dg[i] += kt * p_row_a + qt * p_row_q - kt * p_col + zw * kt * eg;
  }
  tm.sync();
  // dG of the last step also carries Kd's and gC's dependence on G_last: sum_j dS1 * S1 with
  // S1 = diag(gC) S0 + Kd^T U the chunk's end state. Then dg = reverse cumulative sum of dG.
  for (int c = tm.rank(); c < K; c += tm.size()) {
    T last = 0;
    for (int j = 0; j < V; ++j) {
      T s1 = gC[c] * S0[c * V + j];
      for (int t = 0; t < L; ++t) s1 += Kd[t * K + c] * sc.U[t * V + j];
      last += dS1[c * V + j] * s1;
    }
    T run = last;
    for (int t = L - 1; t >= 0; --t) {
      run += dg[t * K + c];
      dg[t * K + c] = run;
    }
  }
  tm.sync();
}

}  // namespace kda_dsa_ops::kda
